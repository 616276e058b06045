"""The warm-up CLI's residency report: what of a model file is in the page cache, per part.

``residency_report`` measures the file, its non-routed part and each MoE layer (optionally
each expert) against a ``Residency`` snapshot and returns a JSON-ready dict;
``format_report`` renders it as text, one line per part and a glyph per expert.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from moestream.pipeline.foundation.sizes import size_text
from moestream.pipeline.foundation.table import ExpertTable
from moestream.stages.residency import Residency
from moestream.tools.warmup.select import Selection, non_routed_ranges

__all__ = ["format_percent", "format_report", "residency_report"]


def format_percent(part: int, whole: int) -> str:
    """``part`` as a percentage of ``whole`` (100.0% of nothing), one decimal."""
    return f"{100.0 * part / whole:.1f}%" if whole else "100.0%"


def residency_report(
    table: ExpertTable,
    residency: Residency,
    *,
    selection: Selection | None = None,
    per_expert: bool = False,
) -> dict[str, Any]:
    """Resident bytes of the file, its non-routed part, each MoE layer (and each expert).

    With a selection that is not the whole file, layers outside ``selection`` are left out
    and its total is added under ``"selection"``.
    """
    shown = set(table.layers)
    if selection is not None and not selection.whole_file:
        named = {name for name, _ in selection.parts}
        grid = {int(n.split()[1]) for n in named if n.startswith("layer ")}
        shown = grid | {key[0] for key in selection.hot_experts}
    nr = non_routed_ranges(table)
    parts: list[dict[str, Any]] = [{
        "part": "non-routed",
        "bytes": sum(r.nbytes for r in nr),
        "resident_bytes": residency.resident_bytes(nr),
    }]
    for index, layer in table.layers.items():
        if index not in shown:
            continue
        ranges = [r for e in range(layer.n_experts) for r in layer.slices(e).ranges]
        each = residency.resident_bytes_each(ranges).reshape(layer.n_experts, 3).sum(axis=1)
        row: dict[str, Any] = {
            "part": f"layer {index}",
            "layer": index,
            "experts": layer.n_experts,
            "bytes": layer.n_experts * layer.expert_bytes,
            "resident_bytes": int(each.sum()),
            "experts_fully_resident": int((each == layer.expert_bytes).sum()),
        }
        if per_expert:
            row["expert_resident_bytes"] = [int(x) for x in each]
        parts.append(row)
    report: dict[str, Any] = {
        "path": str(table.path),
        "file_bytes": table.data_bytes,
        "resident_bytes": residency.file_resident_bytes,
        "expert_bytes": {str(i): layer.expert_bytes for i, layer in table.layers.items()},
        "parts": parts,
    }
    if selection is not None and not selection.whole_file:
        report["selection"] = {
            "bytes": selection.nbytes,
            "resident_bytes": residency.resident_bytes(selection.ranges),
        }
    return report


def _glyphs(each: Sequence[int], full: int) -> str:
    return "".join("#" if b >= full else ("+" if b else ".") for b in each)


def _row(name: str, resident: int, total: int) -> str:
    return (f"  {name:<28} {size_text(resident):>12} of {size_text(total):>12}  "
            f"{format_percent(resident, total):>6}")


def format_report(report: dict[str, Any]) -> str:
    """The report as text: one line per part, a glyph per expert with ``--per-expert``."""
    resident, file_bytes = report["resident_bytes"], report["file_bytes"]
    lines = [
        f"{report['path']}: {size_text(resident)} of {size_text(file_bytes)} "
        f"resident ({format_percent(resident, file_bytes)})"
    ]
    for part in report["parts"]:
        name = part["part"]
        if "experts" in part:
            name += f" ({part['experts_fully_resident']}/{part['experts']} experts)"
        lines.append(_row(name, part["resident_bytes"], part["bytes"]))
        if "expert_resident_bytes" in part:
            full = report["expert_bytes"][str(part["layer"])]
            glyphs = _glyphs(part["expert_resident_bytes"], full)
            for start in range(0, len(glyphs), 64):
                lines.append(f"    {start:>4}: {glyphs[start:start + 64]}")
    if "selection" in report:
        sel = report["selection"]
        lines.append(_row("selection", sel["resident_bytes"], sel["bytes"]))
    if any("expert_resident_bytes" in p for p in report["parts"]):
        lines.append("  (# resident, + partly, . not)")
    return "\n".join(lines)
