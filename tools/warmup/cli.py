"""Warm, inspect, drop or pin a model's pages in the page cache, like vmtouch for GGUF files
and checkpoints (every shard).

Why: resident mode is only as good as the page cache behind it. Before a run (or on a
machine where RAM >= model) an operator wants the file, or just the non-routed tensors and
the hottest experts of a past run, loaded as fast as the disk allows; wants to see what is
resident per part of the model; and wants to drop or pin it for experiments. Everything the
kernel is asked goes through ``stages.residency`` (``stages.pagelock`` for ``--lock``) and
``stages.warm``, the engine the controller uses too.

    python -m tools.warmup MODEL                   # preload the whole file
    python -m tools.warmup MODEL --report --per-expert
    python -m tools.warmup MODEL --non-routed --hot run.jsonl --max-bytes 20GiB
    python -m tools.warmup MODEL --evict --layers 3-5
    python -m tools.warmup MODEL --lock            # hold until Ctrl-C / SIGTERM
    python -m tools.warmup MODEL --digests         # its digest manifest, for verification

The selection is built by ``tools.warmup.select``, the report by ``tools.warmup.report`` and
the RAM guard by ``tools.warmup.ram_guard``, the digest manifest by ``tools.warmup.digests``; this
module parses the options and acts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from moestream.pipeline.cli.common import UsageParser, closable_stdout, print_error
from moestream.pipeline.cli.console import configure_console
from moestream.pipeline.foundation.config import parse_size
from moestream.pipeline.foundation.errors import MoestreamError, UsageError
from moestream.pipeline.foundation.files import ModelFile, open_checked
from moestream.pipeline.foundation.sizes import size_text
from moestream.pipeline.foundation.table import ByteRange, ExpertTable, open_table
from moestream.stages.residency import (
    PageLock,
    Residency,
    coalesce,
    evict,
    file_ranges,
    lock_pages,
    ranges_by_file,
    resident_bytes_of,
)
from moestream.stages.warm import WarmEngine
from moestream.tools.warmup.early import EarlyRead
from moestream.tools.warmup.ram_guard import MemoryProbe, PsutilMemory, check_ram
from moestream.tools.warmup.report import (
    format_percent,
    format_report,
    residency_report,
)
from moestream.tools.warmup.select import (
    Selection,
    build_selection,
    parse_index_list,
    read_hot_log,
)

__all__ = ["PROG", "main"]

PROG = "moestream-warmup"


# --- actions -----------------------------------------------------------------------------------


def _warm(files: Sequence[ModelFile], ranges: list[ByteRange],
          threads: int | None) -> tuple[int, float]:
    """Load ``ranges`` with a progress bar on a terminal; returns bytes read and seconds."""
    total = sum(r.nbytes for r in ranges)
    progress: Callable[[int, int], None] | None = None
    bar: Any = None
    # tqdm's own rule (disable=None: no bar unless stderr is a terminal), checked before
    # importing it: its import is start-up time that a warm-up into a pipe or a log saves.
    if sys.stderr is not None and sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1000,
                   file=sys.stderr, desc="warming", dynamic_ncols=True)

        def progress(done: int, _total: int) -> None:
            bar.update(done - bar.n)

    async def run() -> tuple[int, float]:
        async with WarmEngine(files, threads=threads) as engine:
            result = await engine.warm(ranges, progress=progress)
        return result.bytes_read, result.seconds

    try:
        return asyncio.run(run())
    finally:
        if bar is not None:
            bar.close()


def _hold(lock: PageLock, out: Any) -> None:
    """Keep ``lock`` until SIGINT or SIGTERM."""
    signals = {signal.SIGINT, signal.SIGTERM}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        print(f"locked {size_text(lock.locked_bytes)} of {lock.name} in RAM; "
              "Ctrl-C or SIGTERM releases it", file=out, flush=True)
        received = signal.sigwait(signals)
        print(f"released ({signal.Signals(received).name})", file=out, flush=True)
    finally:
        lock.unlock()
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _parser() -> argparse.ArgumentParser:
    parser = UsageParser(
        prog=PROG,
        description="Preload, report, evict or lock a model file's pages in the page cache.",
    )
    parser.add_argument("model", type=Path, metavar="MODEL",
                        help="GGUF model file (any shard of a split one: the whole split), "
                        "checkpoint directory or .safetensors file")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--report", action="store_true", help="show what is resident, per part")
    mode.add_argument("--evict", action="store_true", help="drop the selection's pages")
    mode.add_argument("--lock", action="store_true",
                      help="mlock the selection and hold it until SIGINT/SIGTERM")
    mode.add_argument("--digests", action="store_true",
                      help="compute and store the file's digest manifest (verification of "
                      "files that record no digests), every expert")
    parser.add_argument("--per-expert", action="store_true", help="with --report: per expert")
    parser.add_argument("--json", action="store_true", help="with --report: JSON output")
    parser.add_argument("--layers", type=parse_index_list, metavar="LIST",
                        help="MoE layers to select, e.g. 0,3-5 (all experts unless --experts)")
    parser.add_argument("--experts", type=parse_index_list, metavar="LIST",
                        help="experts to select in each selected (or every) MoE layer")
    parser.add_argument("--non-routed", action="store_true",
                        help="select the header and every tensor that is not a routed expert")
    parser.add_argument("--hot", type=Path, metavar="LOG",
                        help="select the experts a moestream run log used, most used first")
    # parsed in _check_args, not by argparse: its one-line error names the limit, not the function
    parser.add_argument("--max-bytes", metavar="SIZE",
                        help="with --hot: at most this many bytes of hot experts (20GiB, 11GB)")
    parser.add_argument("--threads", type=int, metavar="N",
                        help="reader threads for warming or --digests")
    parser.add_argument("--force", action="store_true",
                        help="warm or lock even beyond available RAM minus the margin")
    parser.add_argument("--debug", action="store_true", help="log events and tracebacks")
    return parser


def _check_args(args: argparse.Namespace) -> int | None:
    """The options that go together, checked before the model is opened; the ``--max-bytes``
    limit in bytes (parsed here so that its one-line error names the limit)."""
    if (args.per_expert or args.json) and not args.report:
        raise UsageError("--per-expert and --json go with --report")
    if args.max_bytes is not None and args.hot is None:
        raise UsageError("--max-bytes goes with --hot")
    max_hot_bytes = parse_size(args.max_bytes) if args.max_bytes is not None else None
    if args.threads is not None and args.threads < 1:
        raise UsageError(f"--threads must be >= 1, not {args.threads}")
    selects = (args.layers, args.experts, args.hot, args.max_bytes)
    if args.digests and (any(x is not None for x in selects) or args.non_routed):
        raise UsageError("--digests covers every expert: it takes no selection")
    return max_hot_bytes


def _run(args: argparse.Namespace, memory: MemoryProbe, early: EarlyRead | None = None) -> int:
    max_hot_bytes = _check_args(args)
    table = open_table(args.model)
    if args.digests:
        from moestream.tools.warmup.digests import (
            compute_digests,  # only --digests: keep start-up short
        )

        return compute_digests(table, args.threads)
    hot = read_hot_log(args.hot, table) if args.hot is not None else None
    if hot is not None and hot.skipped_lines:
        print(f"{args.hot}: skipped {hot.skipped_lines} lines that carried no usable data",
              file=sys.stderr)
    selection = build_selection(table, layers=args.layers, experts=args.experts,
                                non_routed=args.non_routed, hot=hot,
                                max_hot_bytes=max_hot_bytes)
    if args.report:
        started = time.perf_counter()
        report = residency_report(table, Residency.of_files(table.files), selection=selection,
                                  per_expert=args.per_expert)
        report["seconds"] = round(time.perf_counter() - started, 4)
        print(json.dumps(report) if args.json else format_report(report))
        return 0
    if args.evict:
        return _evict(table, selection)
    # the head start reads on meanwhile (a refusal below stops it in main)
    missing = Residency.of_files(table.files).missing(selection.ranges)
    need = sum(r.nbytes for r in coalesce(missing))
    if not args.force:
        check_ram(need, memory, "lock" if args.lock else "warm")
    if args.lock:
        with _lock(table.path, table.files, coalesce(selection.ranges)) as lock:
            _hold(lock, sys.stdout)
        return 0
    return _warm_missing(table, selection, missing, args.threads, early)


def _evict(table: ExpertTable, selection: Selection) -> int:
    """Drop the selection's pages, file by file; say what left and what stays."""
    files = table.files
    union = coalesce(selection.ranges)
    [before] = resident_bytes_of(files, union)
    left = 0
    for f, local in ranges_by_file(files, union):
        fd = open_checked(f)
        try:
            left += evict(fd, local)
        finally:
            os.close(fd)
    [after] = resident_bytes_of(files, union)
    print(f"evicted {size_text(left)} of {table.path}: selection resident "
          f"{size_text(before)} -> {size_text(after)} of {size_text(selection.nbytes)}")
    return 0


def _warm_missing(table: ExpertTable, selection: Selection, missing: list[ByteRange],
                  threads: int | None, early: EarlyRead | None) -> int:
    """Load what of the selection is missing (less what the head start read); say what is
    resident now and how fast it was read."""
    files = table.files
    head_start = ""
    if early is not None:
        early_bytes = early.stop()
        missing = _past_early(files, missing, early, early_bytes)
        head_start = f"; the first {size_text(early_bytes)} during start-up"
    read_bytes, seconds = _warm(files, missing, threads) if missing else (0, 0.0)
    # counts only: cachestat, not a page map (0.1 s of the H200 host's warm-up was this check)
    union = coalesce(selection.ranges)
    resident, file_resident = resident_bytes_of(files, union, file_ranges(files))
    rate = f" ({read_bytes / seconds / 1e9:.2f} GB/s)" if seconds > 0 else ""
    file_pct = format_percent(file_resident, table.data_bytes)
    print(f"resident: {size_text(resident)} of {size_text(selection.nbytes)} selected "
          f"({format_percent(resident, selection.nbytes)}); file {file_pct}; "
          f"read {size_text(read_bytes)} in {seconds:.2f} s{rate}{head_start}")
    return 0


def _past_early(files: Sequence[ModelFile], ranges: list[ByteRange], early: EarlyRead,
                early_bytes: int) -> list[ByteRange]:
    """``ranges`` less the start of the model's first file that the head start read
    through (``early_bytes`` of it; the head start reads only that file)."""
    first = files[0]
    if (first.identity.dev, first.identity.ino) != early.file_id:
        return ranges  # replaced since: the engine reads (and the run reports) the new one
    start = first.base + early_bytes
    return [r if r.offset >= start else ByteRange(start, r.offset + r.nbytes - start)
            for r in ranges if r.offset + r.nbytes > start]


def _lock(path: Path, files: Sequence[ModelFile], ranges: list[ByteRange]) -> PageLock:
    """Lock ``ranges`` of every file of the model, each file opened against its identity."""
    locks: list[PageLock] = []
    try:
        for f, local in ranges_by_file(files, ranges):
            fd = open_checked(f)
            try:
                locks.append(lock_pages(fd, local))
            finally:
                os.close(fd)  # the locked mappings keep the pages
    except BaseException:
        for lock in locks:
            lock.unlock()
        raise
    return PageLock.joined(str(path), locks)


def main(argv: Sequence[str] | None = None, *, memory: MemoryProbe | None = None,
         early: EarlyRead | None = None) -> int:
    """Command line entry point; returns the exit code.

    Args:
        argv: arguments (``sys.argv[1:]`` when None).
        memory: where the RAM guard reads available memory (psutil when None).
        early: the head start of a plain warm-up (``moestream.tools.warmup.early``), stopped before
            the engine reads, or at the end.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    configure_console(debug=debug)
    try:
        with closable_stdout():
            return _run(_parser().parse_args(argv), memory or PsutilMemory(), early)
    except MoestreamError as exc:
        if debug:
            raise
        print_error(f"{PROG}: error: ", exc)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    finally:
        if early is not None:
            early.stop()
    return 0  # stdout's reader went away (`| head`): the rest of the report is dropped


if __name__ == "__main__":
    sys.exit(main())
