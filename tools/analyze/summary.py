"""The run summary of ``tools.analyze``: its headline figures, as a table or side by side.

``summarize`` reduces a run log to its headline figures (decode rate, latency percentiles,
hits, where the bytes came from, the time split, the mode's time, verification); one run's
summary is printed as a two-column table followed by the log's notes and the time split
(``moestream.tools.analyze.time_report``), several runs as one comparison table with the
change of each against the first. The command line (``moestream.tools.analyze.cli``) chooses
which.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from moestream.pipeline.runlog.records import RunLog
from moestream.tools.analyze.intervals import STAGE_COLUMNS
from moestream.tools.analyze.report_text import GB, MB, Value, ratio, size_text, text_table
from moestream.tools.analyze.time_report import PART_LABELS, TimeReport, time_report

__all__ = [
    "NO_SPLIT",
    "Summary",
    "compare_table",
    "log_notes",
    "summarize",
    "summary_table",
    "time_json",
]

Summary = dict[str, Value]
"""Metric name -> value for one run; keys as in ``_ROWS`` plus ``mode_s.<mode>``."""

NO_SPLIT = "no time breakdown in this log (schema 1: tokens carry no time)"
"""What stands in for the time split of a log whose tokens carry no time."""


def _fmt(digits: int) -> Callable[[Value], str]:
    def render(value: Value) -> str:
        if isinstance(value, bool | str):
            return str(value)
        if isinstance(value, int):
            return f"{value:,}"
        assert value is not None
        return f"{value:,.{digits}f}"

    return render


def _size(value: Value) -> str:
    """A figure in GB (10^9 B, as the JSON and CSV keep it) in the binary unit it reaches,
    so that a small model's budget does not print as 0.00."""
    if isinstance(value, bool | str) or value is None:
        return str(value)
    return size_text(round(value * GB))


_ROWS: tuple[tuple[str, str, Callable[[Value], str]], ...] = (
    ("tokens", "tokens", _fmt(0)),
    ("tokens_per_s", "decode tokens/s (token wall_ms)", _fmt(3)),
    ("run_end_tokens_per_s", "decode tokens/s (run_end)", _fmt(3)),
    ("latency_p50_ms", "token latency p50, ms", _fmt(2)),
    ("latency_p95_ms", "token latency p95, ms", _fmt(2)),
    ("latency_p99_ms", "token latency p99, ms", _fmt(2)),
    ("hit_rate", "cache hit rate", _fmt(4)),
    ("hits", "hits", _fmt(0)),
    ("misses", "misses", _fmt(0)),
    ("evictions", "evictions", _fmt(0)),
    ("cache_mb_per_token", "device cache MB/token", _fmt(2)),
    ("file_mb_per_token", "file read MB/token", _fmt(2)),
    ("page_cache_mb_per_token", "  from page cache MB/token", _fmt(2)),
    ("storage_mb_per_token", "storage MB/token (process reads)", _fmt(2)),
    ("storage_gbps", "storage GB/s during decode", _fmt(3)),
    ("stall_share", "stall share of token time", _fmt(3)),
    ("bound", "bound (largest part of token time)", _fmt(0)),
    ("wall_ms_per_token", "wall ms/token", _fmt(2)),
    *((f"time_{p}_ms", f"  {label}, ms/token", _fmt(2)) for p, label in PART_LABELS.items()),
    ("read_ms", "read ms/token (busy, all workers)", _fmt(2)),
    ("stage_ms", "stage ms/token (busy, all workers)", _fmt(2)),
    ("upload_ms", "upload ms/token (busy, all workers)", _fmt(2)),
    ("install_ms", "install ms/token (busy)", _fmt(2)),
    ("stall_ms", "stall ms/token", _fmt(2)),
    ("compute_ms", "compute ms/token", _fmt(2)),
    ("switches", "mode switches", _fmt(0)),
    ("decisions", "controller decisions", _fmt(0)),
    ("prefetch_accuracy", "prefetch accuracy", _fmt(3)),
    ("prefetch_wasted_mb_per_token", "prefetch wasted MB/token", _fmt(2)),
    ("peak_device_gb", "peak device (run_end)", _size),
    ("budget_gb", "budget", _size),
    ("verified", "verified", _fmt(0)),
    ("mismatches", "mismatches", _fmt(0)),
    ("exit", "exit", _fmt(0)),
    ("lines_skipped", "log lines skipped", _fmt(0)),
    ("unknown_fields", "unknown fields seen", _fmt(0)),
    ("problems", "consistency problems", _fmt(0)),
)


def summarize(run: RunLog) -> Summary:
    """The run's headline figures (see ``_ROWS`` for names and meanings)."""
    cols = run.tokens
    n = len(cols)
    wall = cols["wall_ms"]
    wall_total = cols.total("wall_ms")
    hits, misses = cols.total("hits"), cols.total("misses")
    file_b, cache_b, storage_b = (cols.total(k) for k in ("file_bytes", "cache_bytes",
                                                          "storage_bytes"))
    finite = wall[np.isfinite(wall)]  # a copy: partitioned in place, not copied again
    pct = (np.percentile(finite, [50, 95, 99], overwrite_input=True) if finite.size
           else [None] * 3)
    end = run.end
    summary: Summary = {
        "log": run.name,
        "tokens": n,
        "tokens_per_s": ratio(n * 1000.0, wall_total),
        "run_end_tokens_per_s": end.tokens_per_s if end else None,
        "latency_p50_ms": None if pct[0] is None else float(pct[0]),
        "latency_p95_ms": None if pct[1] is None else float(pct[1]),
        "latency_p99_ms": None if pct[2] is None else float(pct[2]),
        "hit_rate": ratio(hits, hits + misses),
        "hits": int(hits),
        "misses": int(misses),
        "evictions": int(cols.total("evictions")),
        "cache_mb_per_token": ratio(cache_b / MB, n),
        "file_mb_per_token": ratio(file_b / MB, n),
        "page_cache_mb_per_token": ratio(max(file_b - storage_b, 0.0) / MB, n),
        "storage_mb_per_token": ratio(storage_b / MB, n),
        "storage_gbps": ratio(storage_b / GB, wall_total / 1000.0),
        "stall_share": ratio(cols.total("stall_ms"), wall_total),
    }
    summary.update(_time_figures(run))
    summary.update(_run_figures(run))
    return summary


def _time_figures(run: RunLog) -> Summary:
    """The time split per token, the stages' busy time per token and each mode's seconds."""
    cols = run.tokens
    n = len(cols)
    split = time_report(run)
    out: Summary = {
        "bound": split.bound if split else None,
        "wall_ms_per_token": split.wall_ms_per_token if split else None,
    }
    for part in PART_LABELS:
        out[f"time_{part}_ms"] = split.parts_ms_per_token[part] if split else None
    for stage in STAGE_COLUMNS:
        out[stage] = ratio(cols.total(stage), n)
    wall = cols["wall_ms"]
    for mode in cols.mode_names:
        out[f"mode_s.{mode}"] = float(np.nansum(wall[cols.mode_mask(mode)])) / 1000.0
    return out


def _run_figures(run: RunLog) -> Summary:
    """The controller's, the prefetcher's and the run end's figures, and the log's health."""
    cols = run.tokens
    n = len(cols)
    end = run.end
    predicted = cols.total("prefetch_predicted") if "prefetch_predicted" in cols else 0.0
    return {
        "switches": len(run.switches),
        "decisions": len(run.decisions),
        "prefetch_accuracy": ratio(cols.total("prefetch_correct"), predicted)
        if predicted else None,
        "prefetch_wasted_mb_per_token": ratio(cols.total("prefetch_wasted_bytes") / MB, n)
        if "prefetch_wasted_bytes" in cols else None,
        "peak_device_gb": end.peak_device_bytes / GB
        if end and end.peak_device_bytes is not None else None,
        "budget_gb": run.header.budget_bytes / GB
        if run.header and run.header.budget_bytes is not None else None,
        "verified": end.verified if end else None,
        "mismatches": end.mismatches if end else None,
        "exit": end.exit if end else "no run_end (killed?)",
        "lines_skipped": run.counts.skipped,
        "unknown_fields": sum(run.counts.unknown_fields.values()),
        "problems": len(run.problems),
    }


def _row_specs(summaries: Sequence[Summary]) -> list[tuple[str, str, Callable[[Value], str]]]:
    """``_ROWS`` with one "time in mode" row per mode seen, after the stage rows."""
    modes = sorted({k for s in summaries for k in s if k.startswith("mode_s.")})
    specs = list(_ROWS)
    at = next(i for i, (key, _, _) in enumerate(specs) if key == "switches")
    specs[at:at] = [(m, f"time in {m.split('.', 1)[1]} mode, s", _fmt(2)) for m in modes]
    return specs


def summary_table(summary: Summary, run: RunLog | None = None) -> str:
    """One run's summary as an aligned two-column table; with ``run``, the skipped-line
    detail and the time split (``moestream.tools.analyze.time_report``) follow."""
    rows = [["metric", str(summary["log"])]]
    for key, label, render in _row_specs([summary]):
        if key.startswith("time_"):
            continue  # the time split follows as its own table, with shares
        value = summary.get(key)
        rows.append([label, "-" if value is None else render(value)])
    text = text_table(rows)
    if run is not None:
        text += log_notes(run) + "\n" + _time_text(time_report(run))
    return text


def log_notes(run: RunLog) -> str:
    """What the reader noticed in the log (lines skipped, unknown events and fields,
    consistency problems), one indented line each; empty for a clean log."""
    counts = run.counts
    notes = []
    if counts.skipped or counts.blank:
        detail = {k: v for k, v in counts.as_dict().items()
                  if k in ("blank", "truncated", "malformed", "out_of_range", "other_schema",
                           "after_second_run") and v}
        if counts.unknown_events:
            detail["unknown events"] = sum(counts.unknown_events.values())
        notes.append("lines: " + ", ".join(f"{k} {v}" for k, v in detail.items()))
    if counts.unknown_events:
        notes.append("unknown events: " + ", ".join(
            f"{k} x{v}" for k, v in counts.unknown_events.most_common()))
    if counts.unknown_fields:
        notes.append("unknown fields: " + ", ".join(
            f"{k} x{v}" for k, v in counts.unknown_fields.most_common(8)))
    if counts.missing_fields:
        notes.append("missing fields: " + ", ".join(
            f"{k} x{v}" for k, v in counts.missing_fields.most_common(8)))
    notes.extend(f"problem: {p}" for p in run.problems)
    return "".join(f"  {note}\n" for note in notes)


def _change(before: Value, after: Value,
            render: Callable[[Value], str] | None = None) -> tuple[str, str]:
    """(delta, percent change) of two values, as text ('-' when not numeric); the delta
    by ``render`` with its sign, where given (a size in its unit)."""
    numeric = (int, float)
    if (isinstance(before, bool) or isinstance(after, bool)
            or not isinstance(before, numeric) or not isinstance(after, numeric)):
        return ("-", "-") if before == after else ("changed", "-")
    delta = float(after) - float(before)
    pct = f"{100.0 * delta / abs(before):+.1f}%" if before else "-"
    if render is not None:
        return f"{'-' if delta < 0 else '+'}{render(abs(delta))}", pct
    return f"{delta:+,.4g}", pct


def compare_table(summaries: Sequence[Summary]) -> str:
    """Side-by-side table of several runs; deltas of each later run against the first.

    With two runs the columns are before, after, delta and change; with more, every run and
    then the percent change of each later run against the first.
    """
    names = [str(s["log"]) for s in summaries]
    pair = len(summaries) == 2
    header = ["metric", *names]
    header += ["delta", "change"] if pair else [f"{name} vs {names[0]}" for name in names[1:]]
    rows = [header]
    for key, label, render in _row_specs(summaries):
        values = [s.get(key) for s in summaries]
        row = [label] + ["-" if v is None else render(v) for v in values]
        changes = [_change(values[0], v, render if render is _size else None)
                   for v in values[1:]]
        row += list(changes[0]) if pair else [pct for _, pct in changes]
        rows.append(row)
    return text_table(rows)


def _time_text(split: TimeReport | None) -> str:
    """The time split table and the verdict, or why there is none."""
    return split.table() if split is not None else f"{NO_SPLIT}\n"


def time_json(split: TimeReport | None) -> dict[str, Any]:
    """The time split's keys of a run's JSON entry (null for a schema-1 log)."""
    if split is not None:
        return split.as_json()
    return {"wall_ms_per_token": None, "time_breakdown_ms_per_token": None,
            "time_breakdown_shares": None, "bound": None, "bound_by_mode": None,
            "verdict": None, "lower_bound": None}
