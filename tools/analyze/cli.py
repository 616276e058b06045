"""``moestream-analyze``: what a run did, token by token, and what it could have done.

A run log answers the questions the field reports on expert streaming kept asking by hand:
how fast decode went and how steady (latency percentiles), how often the cache hit, where
each token's expert bytes came from (device cache, page cache, storage), how much of a
token's time was spent waiting for I/O, how long each I/O mode was in force and why it
switched, and where each token's wall time went and what bounds the run
(``tools.analyze.time_report``). One log gives a summary table; several give a before/after
comparison (both ``tools.analyze.summary``); ``--csv`` gives per-interval rows in ds4-bench's
column style for spreadsheets; ``--plot`` draws the same over time (``tools.analyze.plots``);
``--what-if`` replays the run's accesses under other budgets and policies
(``moestream.tools.analyze.whatif``, reported by ``moestream.tools.analyze.whatif_report``). A
run over several devices also gets a per-device table (``tools.analyze.device_report``): each
device's hits, file bytes, stall, budget and peak, and how evenly the file bytes were spread.

Usage::

    python -m tools.analyze LOG [LOG ...] [--csv FILE] [--plot DIR]
        [--what-if [--budgets LIST] [--target X] [--policies LIST] [--jobs N]]
        [--interval N] [--json] [--debug]

Columns and units are documented in docs/LOG_SCHEMA.md ("Derived CSV columns").
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import structlog

from moestream.pipeline.cli.common import closable_stdout, print_error
from moestream.pipeline.cli.interrupts import stoppable
from moestream.pipeline.foundation.errors import MoestreamError, UsageError
from moestream.pipeline.foundation.outputs import check_output, check_output_dir
from moestream.pipeline.runlog.read import read_log
from moestream.pipeline.runlog.records import RunLog
from moestream.tools.analyze.device_report import device_table, devices_json
from moestream.tools.analyze.intervals import write_csv
from moestream.tools.analyze.summary import (
    NO_SPLIT,
    Summary,
    compare_table,
    log_notes,
    summarize,
    summary_table,
    time_json,
)
from moestream.tools.analyze.time_report import TimeReport, time_report
from moestream.tools.analyze.whatif import WhatIfReport
from moestream.tools.analyze.whatif_replay import POLICIES
from moestream.tools.analyze.whatif_report import run_what_if, what_if_json, what_if_text

__all__ = ["Summary", "compare_table", "main", "summarize", "summary_table", "write_csv"]

CSV_INTERVAL = 32
"""Tokens per ``--csv`` row when ``--interval`` is not given."""


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


def _check_args(args: argparse.Namespace) -> tuple[list[str], list[str] | None, float]:
    """The options checked together: the what-if's policies, budgets and target."""
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
    return policies, budgets, target


def _run(args: argparse.Namespace) -> int:
    policies, budgets, target = _check_args(args)
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
    written = _write_files(args, runs)
    splits = [time_report(run) for run in runs]
    if args.json:
        document: dict[str, Any] = {
            "runs": [{**s, "lines": run.counts.as_dict(), "problems": list(run.problems),
                      **devices_json(run), **time_json(split)}
                     for s, run, split in zip(summaries, runs, splits, strict=True)],
            "what_if": [what_if_json(r, run) for r, run in zip(reports, runs, strict=False)],
            **written,
        }
        out.write(json.dumps(document, indent=2, default=_json_default) + "\n")
        return 0
    _write_tables(out, summaries, runs, splits, reports)
    if "csv" in written:
        out.write(f"\nwrote {written['csv_rows']} rows to {written['csv']}\n")
    for plot in written.get("plots", []):
        out.write(f"wrote {plot}\n")
    return 0


def _write_files(args: argparse.Namespace, runs: Sequence[RunLog]) -> dict[str, Any]:
    """``--csv`` and ``--plot``; what was written, for the report."""
    written: dict[str, Any] = {}
    if args.csv:
        written["csv_rows"] = write_csv(args.csv, runs, args.interval or CSV_INTERVAL)
        written["csv"] = str(args.csv)
    if args.plot:
        from moestream.tools.analyze.plots import write_plots

        written["plots"] = [str(p) for p in write_plots(runs, args.plot, args.interval)]
    return written


def _write_tables(out: TextIO, summaries: Sequence[Summary], runs: Sequence[RunLog],
                  splits: Sequence[TimeReport | None],
                  reports: Sequence[WhatIfReport]) -> None:
    """The report as text: one run's table or the comparison, devices, what-ifs."""
    if len(runs) == 1:
        out.write(summary_table(summaries[0], runs[0]))
        devices = device_table(runs[0])
        if devices:
            out.write("\n" + devices)
    else:
        out.write(compare_table(summaries))
        for run, split in zip(runs, splits, strict=True):
            notes = log_notes(run)
            if notes:
                out.write(f"{run.name}:\n{notes}")
            out.write(f"{run.name}: {split.verdict if split else NO_SPLIT}\n")
        for run in runs:
            devices = device_table(run)
            if devices:
                out.write(f"\n{run.name}:\n{devices}")
    for report, run in zip(reports, runs, strict=False):
        out.write("\n" + what_if_text(run, report))


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
