"""``moestream-analyze``: what a run did, token by token, and what it could have done.

A run log answers the questions the field reports on expert streaming kept asking by hand:
how fast decode went and how steady (latency percentiles), how often the cache hit, where
each token's expert bytes came from (device cache, page cache, storage), how much of a
token's time was spent waiting for I/O, how long each I/O mode was in force and why it
switched, and where each token's wall time went and what bounds the run
(``tools.analyze.time_report``). One log gives a summary table; several give a before/after
comparison; ``--csv`` gives per-interval rows in ds4-bench's column style for spreadsheets;
``--plot`` draws the same over time (``tools.analyze.plots``); ``--what-if`` replays the run's
accesses under other budgets and policies (``moestream.tools.analyze.whatif``, reported by
``moestream.tools.analyze.whatif_report``). A run over several devices also gets a per-device table
(``tools.analyze.device_report``): each device's hits, file bytes, stall, budget and peak, and
how evenly the file bytes were spread.

Usage::

    python -m tools.analyze LOG [LOG ...] [--csv FILE] [--plot DIR]
        [--what-if [--budgets LIST] [--target X] [--policies LIST] [--jobs N]]
        [--interval N] [--json] [--debug]

Columns and units are documented in docs/LOG_SCHEMA.md ("Derived CSV columns").
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import logging
import math
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import structlog

from moestream.pipeline.cli.common import closable_stdout, print_error
from moestream.pipeline.cli.interrupts import stoppable
from moestream.pipeline.foundation.errors import MoestreamError, UsageError
from moestream.pipeline.foundation.outputs import check_output, check_output_dir, write_atomic
from moestream.pipeline.runlog.read import read_log
from moestream.pipeline.runlog.records import RunLog
from moestream.tools.analyze.device_report import device_table, devices_json
from moestream.tools.analyze.intervals import CSV_COLUMNS, STAGE_COLUMNS, interval_rows
from moestream.tools.analyze.report_text import GB, MB, Value, ratio, text_table
from moestream.tools.analyze.time_report import PART_LABELS, TimeReport, time_report
from moestream.tools.analyze.whatif_replay import POLICIES
from moestream.tools.analyze.whatif_report import run_what_if, what_if_json, what_if_text

__all__ = ["Summary", "compare_table", "main", "summarize", "summary_table", "write_csv"]

Summary = dict[str, Value]
"""Metric name -> value for one run; keys as in ``_ROWS`` plus ``mode_s.<mode>``."""

CSV_INTERVAL = 32
"""Tokens per ``--csv`` row when ``--interval`` is not given."""


def _fmt(digits: int) -> Callable[[Value], str]:
    def render(value: Value) -> str:
        if isinstance(value, bool | str):
            return str(value)
        if isinstance(value, int):
            return f"{value:,}"
        assert value is not None
        return f"{value:,.{digits}f}"

    return render


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
    ("storage_mb_per_token", "storage MB/token (/proc/self/io)", _fmt(2)),
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
    ("peak_device_gb", "peak device GB (run_end)", _fmt(2)),
    ("budget_gb", "budget GB", _fmt(2)),
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
    split = time_report(run)
    summary["bound"] = split.bound if split else None
    summary["wall_ms_per_token"] = split.wall_ms_per_token if split else None
    for part in PART_LABELS:
        summary[f"time_{part}_ms"] = split.parts_ms_per_token[part] if split else None
    for stage in STAGE_COLUMNS:
        summary[stage] = ratio(cols.total(stage), n)
    for mode in cols.mode_names:
        summary[f"mode_s.{mode}"] = float(np.nansum(wall[cols.mode_mask(mode)])) / 1000.0
    predicted = cols.total("prefetch_predicted") if "prefetch_predicted" in cols else 0.0
    summary.update({
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
    })
    return summary


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
        text += _notes(run) + "\n" + _time_text(time_report(run))
    return text


def _notes(run: RunLog) -> str:
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


def _change(before: Value, after: Value) -> tuple[str, str]:
    """(delta, percent change) of two values, as text; '-' when not numeric."""
    numeric = (int, float)
    if (isinstance(before, bool) or isinstance(after, bool)
            or not isinstance(before, numeric) or not isinstance(after, numeric)):
        return ("-", "-") if before == after else ("changed", "-")
    delta = float(after) - float(before)
    pct = f"{100.0 * delta / abs(before):+.1f}%" if before else "-"
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
        changes = [_change(values[0], v) for v in values[1:]]
        row += list(changes[0]) if pair else [pct for _, pct in changes]
        rows.append(row)
    return text_table(rows)


def _csv_cell(value: Value) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def write_csv(path: Path, runs: Sequence[RunLog], interval: int) -> int:
    """Write the interval rows of every run to one CSV file; returns the number of rows."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    count = 0
    for run in runs:
        for row in interval_rows(run, interval):
            writer.writerow([_csv_cell(row[c]) for c in CSV_COLUMNS])
            count += 1
    write_atomic(path, buffer.getvalue(), what="--csv", make_parents=True)
    return count


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moestream-analyze",
        description="Summarize, compare, export and plot moestream run logs; replay what-if"
                    " cache simulations.")
    parser.add_argument("logs", nargs="+", type=Path, metavar="LOG", help="run log(s)")
    parser.add_argument("--csv", type=Path, metavar="FILE", help="write per-interval rows")
    parser.add_argument("--plot", type=Path, metavar="DIR", help="write PNG plots into DIR")
    parser.add_argument("--what-if", action="store_true",
                        help="replay the accesses under other budgets and policies")
    parser.add_argument("--budgets", metavar="LIST",
                        help="comma-separated budgets: sizes (20GiB, 11GB) or expert counts")
    parser.add_argument("--target", type=float, default=None, metavar="X",
                        help="hit rate whose smallest budget is reported (default 0.8)")
    parser.add_argument("--policies", metavar="LIST",
                        help=f"comma-separated, among {','.join(POLICIES)} (default all)")
    parser.add_argument("--jobs", type=int, default=None, metavar="N",
                        help="what-if worker processes (default: CPU count for long logs)")
    parser.add_argument("--interval", type=int, default=None, metavar="N",
                        help=f"tokens per CSV row and plot point (default: {CSV_INTERVAL} "
                             "per CSV row; plots choose from the run's length, >= 20 points)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument("--debug", action="store_true",
                        help="debug logging on stderr; tracebacks on errors")
    return parser


def _configure_logging(debug: bool) -> None:
    """Library events go to stderr so they never mix with the report on stdout."""
    if structlog.is_configured():
        return
    structlog.configure(
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.DEBUG if debug else logging.WARNING),
    )


def _check_outputs(args: argparse.Namespace) -> None:
    """--csv and --plot, checked before any log is read (``pipeline.foundation.outputs``)."""
    if args.csv:
        check_output(args.csv, what="--csv", make_parents=True)
    if args.plot:
        from moestream.tools.analyze.plots import (
            PLOT_FILES,  # matplotlib: only --plot pays its import
        )

        check_output_dir(args.plot, what="--plot")
        for name in PLOT_FILES:
            check_output(args.plot / name, what="--plot", make_parents=True)


def _run(args: argparse.Namespace) -> int:
    if not args.what_if and (args.budgets or args.target is not None or args.policies
                             or args.jobs is not None):
        raise UsageError("--budgets, --target, --policies and --jobs need --what-if")
    if args.interval is not None and args.interval < 1:
        raise UsageError(f"--interval must be >= 1, got {args.interval}")
    policies = [p.strip() for p in args.policies.split(",")] if args.policies else list(POLICIES)
    budgets = [b for b in args.budgets.split(",") if b.strip()] if args.budgets else None
    target = 0.8 if args.target is None else args.target
    if args.what_if:
        bad = [p for p in policies if p not in POLICIES]
        if bad:
            raise UsageError(f"unknown policy {bad[0]!r} (expected {', '.join(POLICIES)})")
        if not 0 < target <= 1:
            raise UsageError(f"--target must be in (0, 1], got {target}")
        if args.jobs is not None and args.jobs < 1:
            raise UsageError(f"--jobs must be >= 1, got {args.jobs}")
    _check_outputs(args)
    # the expert ids of every token (1 KB a token at 43 layers x top-6) only for the replay;
    # every token's columns only for the CSV, the plots and the replay: the summaries are
    # computed from sums kept as the log is read, and the latencies
    keep_columns = bool(args.csv or args.plot or args.what_if)
    runs = [read_log(path, experts=args.what_if, columns=keep_columns) for path in args.logs]
    summaries = [summarize(run) for run in runs]
    out = sys.stdout
    reports = []
    if args.what_if:
        reports = [run_what_if(run, budgets, target, policies, args.jobs) for run in runs]
    written: dict[str, Any] = {}
    if args.csv:
        written["csv_rows"] = write_csv(args.csv, runs, args.interval or CSV_INTERVAL)
        written["csv"] = str(args.csv)
    if args.plot:
        from moestream.tools.analyze.plots import write_plots

        written["plots"] = [str(p) for p in write_plots(runs, args.plot, args.interval)]
    splits = [time_report(run) for run in runs]
    if args.json:
        document: dict[str, Any] = {
            "runs": [{**s, "lines": run.counts.as_dict(), "problems": list(run.problems),
                      **devices_json(run), **_time_json(split)}
                     for s, run, split in zip(summaries, runs, splits, strict=True)],
            "what_if": [what_if_json(r, run) for r, run in zip(reports, runs, strict=False)],
            **written,
        }
        out.write(json.dumps(document, indent=2, default=_json_default) + "\n")
        return 0
    if len(runs) == 1:
        out.write(summary_table(summaries[0], runs[0]))
        devices = device_table(runs[0])
        if devices:
            out.write("\n" + devices)
    else:
        out.write(compare_table(summaries))
        for run, split in zip(runs, splits, strict=True):
            notes = _notes(run)
            if notes:
                out.write(f"{run.name}:\n{notes}")
            out.write(f"{run.name}: {split.verdict if split else _NO_SPLIT}\n")
        for run in runs:
            devices = device_table(run)
            if devices:
                out.write(f"\n{run.name}:\n{devices}")
    for report, run in zip(reports, runs, strict=False):
        out.write("\n" + what_if_text(run, report))
    if "csv" in written:
        out.write(f"\nwrote {written['csv_rows']} rows to {written['csv']}\n")
    for plot in written.get("plots", []):
        out.write(f"wrote {plot}\n")
    return 0


_NO_SPLIT = "no time breakdown in this log (schema 1: tokens carry no time)"


def _time_text(split: TimeReport | None) -> str:
    """The time split table and the verdict, or why there is none."""
    return split.table() if split is not None else f"{_NO_SPLIT}\n"


def _time_json(split: TimeReport | None) -> dict[str, Any]:
    """The time split's keys of a run's JSON entry (null for a schema-1 log)."""
    if split is not None:
        return split.as_json()
    return {"wall_ms_per_token": None, "time_breakdown_ms_per_token": None,
            "time_breakdown_shares": None, "bound": None, "bound_by_mode": None,
            "verdict": None, "lower_bound": None}


def _json_default(value: object) -> object:
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


@stoppable("moestream-analyze")  # SIGTERM, SIGHUP as SIGINT: partial outputs go
def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``moestream-analyze``; returns the exit status.

    Errors print one line on stderr (with a traceback only under ``--debug``) and return
    the error's exit code: 2 for a file that is not a moestream log, a bad option or an
    output that cannot be written. A reader that closes stdout early (``| head``) ends the
    report quietly, exit 0.
    """
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse has printed its usage line; keep main() returning
        return exc.code if isinstance(exc.code, int) else 2
    _configure_logging(args.debug)
    try:
        with closable_stdout():
            return _run(args)
    except MoestreamError as exc:
        if args.debug:
            traceback.print_exc()
        print_error("moestream-analyze: ", exc)
        return exc.exit_code
    return 0  # the reader of stdout went away (`| head`): nothing left to report to


if __name__ == "__main__":
    sys.exit(main())
