"""What the warm-up CLI acts on: byte ranges of a model file chosen by layer, expert, part
or a past run's expert use.

``build_selection`` turns the options (``--layers``, ``--experts``, ``--non-routed``,
``--hot LOG --max-bytes SIZE``) into named parts of ``ByteRange`` in warm order;
``read_hot_log`` counts how often a run log used each expert, for ``--hot``. Index lists
stay ranges (``IndexRanges``) until checked against the model, so ``--layers
0-99999999999`` is refused at once instead of expanded.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from moestream.pipeline.foundation.errors import TraceError, UsageError
from moestream.pipeline.foundation.inputs import JSONDepthError, load_json_bounded, open_input
from moestream.pipeline.foundation.table import ByteRange, ExpertTable
from moestream.stages.residency import coalesce, file_ranges

__all__ = [
    "HotLog",
    "IndexRanges",
    "Selection",
    "build_selection",
    "header_range",
    "non_routed_ranges",
    "parse_index_list",
    "read_hot_log",
]


@dataclass(frozen=True, slots=True)
class IndexRanges:
    """An index list as written (``0,3-5``): inclusive ranges, expanded only by ``indices``,
    once their bound is known.

    Attributes:
        text: the list as given, for messages.
        ranges: ``(first, last)`` pairs, ``first <= last``.
    """

    text: str
    ranges: tuple[tuple[int, int], ...]

    def indices(self, upper: int, what: str, known: str) -> list[int]:
        """The indices, sorted and unique, after checking that each is below ``upper``.

        Args:
            upper: the first index out of range.
            what: what an index names (``layer``, ``expert``), for the message.
            known: what the model has, for the message.

        Raises:
            UsageError: an index at or above ``upper`` (nothing was expanded).
        """
        top = max(last for _, last in self.ranges)
        if top >= upper:
            raise UsageError(f"{what} {top} in {self.text!r} is out of range: {known}")
        return sorted({i for first, last in self.ranges for i in range(first, last + 1)})


def parse_index_list(text: str) -> IndexRanges:
    """The ranges of an index list such as ``0,3-5`` (``IndexRanges.indices`` expands them).

    Raises:
        UsageError: not a list of indices and ranges.
    """
    ranges: list[tuple[int, int]] = []
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if match is None:
            raise UsageError(f"not an index list: {text!r} (example: 0,3-5)")
        lo = int(match.group(1))
        hi = int(match.group(2)) if match.group(2) is not None else lo
        if hi < lo:
            raise UsageError(f"empty range {part.strip()!r} in {text!r}")
        ranges.append((lo, hi))
    return IndexRanges(text, tuple(ranges))


# --- the run log's expert use ------------------------------------------------------------------


@dataclass
class HotLog:
    """Expert use counted from a moestream run log."""

    counts: Counter[tuple[int, int]] = field(default_factory=Counter)
    tokens: int = 0
    skipped_lines: int = 0

    def hottest(self) -> list[tuple[int, int]]:
        """Used experts, most used first (ties by layer, then expert)."""
        return sorted(self.counts, key=lambda key: (-self.counts[key], key))


def _check_starts_a_run(path: Path) -> None:
    """Refuse early, with one line, a file whose first event is not ``run_start``."""
    from moestream.pipeline.runlog.read import log_lines  # only --hot needs it; keep start-up short

    try:
        with open_input(path) as f:  # a FIFO or a device is refused, never waited on
            first = next((line for line in log_lines(f) if line is None or line.strip()), b"")
    except OSError as exc:
        raise TraceError(f"{path}: cannot read ({exc.strerror})") from None
    try:  # None: a first line longer than any log line
        event = load_json_bounded(first or b"", f"{path}:1")
    except JSONDepthError as exc:
        raise TraceError(f"{path}: not a moestream run log ({exc})") from None
    except ValueError:
        event = None
    if not isinstance(event, dict) or event.get("event") != "run_start":
        raise TraceError(f"{path}: not a moestream run log (it does not start with a "
                         "run_start event)")


def read_hot_log(path: Path, table: ExpertTable) -> HotLog:
    """Count how often each (layer, expert) was used in a run log of ``table``'s model.

    The log is read by ``pipeline.runlog.read`` (JSON only, tolerant of bad lines, which are
    counted): the ``run_start`` event's ``model.moe_layers`` orders the ``experts`` lists of
    the ``token`` events.

    Raises:
        TraceError: the file cannot be read, is not a moestream run log, or does not fit the
            model (a layer that is not a MoE layer of it, an expert id out of range).
    """
    from moestream.pipeline.runlog.read import read_log  # only --hot needs it; keep start-up short

    _check_starts_a_run(path)
    run = read_log(path)
    if run.header is None or not run.header.moe_layers:
        raise TraceError(f"{path}: not a moestream run log (no run_start event with "
                         "model.moe_layers)")
    moe_layers = list(run.header.moe_layers)
    unknown = sorted(set(moe_layers) - set(table.layers))
    if unknown:
        raise TraceError(f"{path}: log layers {unknown} are not MoE layers of {table.path} "
                         f"(it has {_compact(table.moe_layers)})")
    experts = run.tokens.experts  # (tokens, layers, width), -1 where nothing was logged
    hot = HotLog(tokens=int(experts.shape[0]), skipped_lines=run.counts.skipped)
    if experts.size == 0:
        return hot
    if experts.shape[1] != len(moe_layers):
        raise TraceError(f"{path}: token experts have {experts.shape[1]} layers, run_start "
                         f"lists {len(moe_layers)} MoE layers")
    for pos, layer in enumerate(moe_layers):
        ids = experts[:, pos, :]
        ids = ids[ids >= 0]
        n_experts = table.layers[layer].n_experts
        if ids.size and int(ids.max()) >= n_experts:
            raise TraceError(f"{path}: expert {int(ids.max())} of layer {layer} outside "
                             f"0..{n_experts - 1} ({table.path})")
        for expert, count in enumerate(np.bincount(ids, minlength=n_experts)):
            if count:
                hot.counts[(layer, expert)] = int(count)
    return hot


# --- selection ---------------------------------------------------------------------------------


@dataclass
class Selection:
    """What to act on: named parts in warm order (most wanted first).

    Attributes:
        parts: ``(name, ranges)``; ranges of one part are in the order to warm them.
        whole_file: True when nothing was selected, so the whole file is meant.
        hot_experts: experts taken from ``--hot``, hottest first.
    """

    parts: list[tuple[str, list[ByteRange]]]
    whole_file: bool = False
    hot_experts: list[tuple[int, int]] = field(default_factory=list)

    @property
    def ranges(self) -> list[ByteRange]:
        """Every range of every part, in warm order."""
        return [r for _, ranges in self.parts for r in ranges]

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in coalesce(self.ranges))


def header_range(table: ExpertTable) -> ByteRange:
    """The GGUF header, KV metadata and tensor infos: everything before the first tensor."""
    first = min(
        [t.offset for t in table.non_routed]
        + [min(layer.gate_offset, layer.down_offset) for layer in table.layers.values()]
    )
    return ByteRange(0, first)


def non_routed_ranges(table: ExpertTable) -> list[ByteRange]:
    """The header and every tensor that is not a routed expert, merged."""
    return coalesce([header_range(table), *table.non_routed])


def build_selection(
    table: ExpertTable,
    *,
    layers: Sequence[int] | IndexRanges | None = None,
    experts: Sequence[int] | IndexRanges | None = None,
    non_routed: bool = False,
    hot: HotLog | None = None,
    max_hot_bytes: int | None = None,
) -> Selection:
    """The byte ranges the options select, in warm order: non-routed, hot, then the grid.

    ``layers``/``experts`` select a grid (all MoE layers or all experts where one is None);
    ``hot`` adds used experts hottest first, at most ``max_hot_bytes`` of them. With nothing
    selected the whole file is meant.

    Raises:
        UsageError: a layer that is not a MoE layer, or an expert out of range.
    """
    if isinstance(layers, IndexRanges):
        layers = layers.indices(max(table.layers) + 1, "layer",
                                f"the model's MoE layers are {_compact(table.moe_layers)}")
    if isinstance(experts, IndexRanges):
        most = max(layer.n_experts for layer in table.layers.values())
        experts = experts.indices(most, "expert", f"its layers have at most {most} experts")
    parts: list[tuple[str, list[ByteRange]]] = []
    if non_routed:
        parts.append(("non-routed", non_routed_ranges(table)))
    taken: set[tuple[int, int]] = set()
    hot_keys: list[tuple[int, int]] = []
    if hot is not None:
        budget = max_hot_bytes if max_hot_bytes is not None else table.file_bytes
        used = 0
        for key in hot.hottest():
            size = table.expert_bytes(key[0])
            if used + size > budget:
                break
            used += size
            hot_keys.append(key)
        taken.update(hot_keys)
        parts.append(("hot", [r for key in hot_keys for r in table.slices(key).ranges]))
    if layers is not None or experts is not None:
        grid_layers = list(table.layers) if layers is None else list(layers)
        unknown = [x for x in grid_layers if x not in table.layers]
        if unknown:
            raise UsageError(f"layers {unknown} are not MoE layers (the model has "
                             f"{_compact(table.moe_layers)})")
        for index in grid_layers:
            n = table.layers[index].n_experts
            ids = list(range(n)) if experts is None else list(experts)
            bad = [e for e in ids if e >= n]
            if bad:
                raise UsageError(f"experts {bad} out of range: layer {index} has {n} experts")
            ranges = [r for e in ids if (index, e) not in taken
                      for r in table.slices((index, e)).ranges]
            parts.append((f"layer {index}", coalesce(ranges)))
    if not parts:
        return Selection([("file", file_ranges(table.files))],
                         whole_file=True)
    return Selection(parts, hot_experts=hot_keys)


def _compact(values: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``0-2,5``."""
    runs: list[list[int]] = []
    for v in sorted(values):
        if runs and runs[-1][1] == v - 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
