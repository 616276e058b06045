"""What the benchmark commands share: cold and warm file states, and the cache budget.

Every benchmark compares runs against references measured on the same file in the same
state, so putting a file in a known state (nothing cached, or all of it resident) and
sizing the budget the same way belong in one place.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import uvloop

from moestream.pipeline.cli.console import configure_console
from moestream.pipeline.foundation.config import Budget, Mode
from moestream.pipeline.foundation.errors import MoestreamError, UsageError
from moestream.pipeline.foundation.files import ModelFile, model_files
from moestream.pipeline.foundation.table import ExpertTable
from moestream.stages.residency import Residency, file_ranges
from moestream.stages.warm import WarmEngine

__all__ = ["budget_for", "drop_caches", "exit_with", "make_resident", "median_ms",
           "merged_rounds", "parse_modes", "run_command"]


def drop_caches(model: Path | Sequence[ModelFile]) -> None:
    """Make the next read of the model (a file, or a table's files) come from storage."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:
        pass
    for file in model_files(model):
        fd = os.open(file.path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def make_resident(model: Path | Sequence[ModelFile]) -> dict[str, Any]:
    """Read the model's non-resident pages once, so a resident run starts warm.

    Returns what it read, how long it took and the resident share after.

    Raises:
        UsageError: the missing pages do not fit in available RAM minus a margin.
    """
    from moestream.tools.warmup.ram_guard import PsutilMemory, check_ram

    files = model_files(model)
    missing = Residency.of_files(files).missing(file_ranges(files))
    check_ram(sum(r.nbytes for r in missing), PsutilMemory(), "warm")

    async def warm() -> int:
        async with WarmEngine(files) as engine:
            return (await engine.warm(missing)).bytes_read

    t0 = time.perf_counter()
    read_bytes = uvloop.run(warm()) if missing else 0
    return {
        "read_bytes": read_bytes,
        "seconds": round(time.perf_counter() - t0, 3),
        "resident_share": round(Residency.of_files(files).fraction, 4),
    }


def budget_for(table: ExpertTable, share: float) -> Budget:
    """``share`` of each layer's experts (at least top-k), over all MoE layers: the report's
    16 GB card held ~15% of each layer's experts."""
    per_layer = max(table.top_k, round(share * table.n_experts))
    return Budget(experts=per_layer * len(table.layers))


def median_ms(work: Callable[[], Any], device: Any, *, repeats: int, skip: int) -> float:
    """The median milliseconds of ``repeats`` timed calls of ``work``, after ``skip`` untimed
    ones (first calls pay for compiles, allocations and caches).

    On a CUDA ``device`` (a ``torch.device``) each call sits between two torch CUDA events
    and is waited for, so the figure is the device's time for the work queued; elsewhere it
    is ``perf_counter``'s wall time around the call.
    """
    import torch

    for _ in range(skip):
        work()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start.record()
            work()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            began = time.perf_counter_ns()
            work()
            times.append((time.perf_counter_ns() - began) / 1e6)
    return float(statistics.median(times))


def merged_rounds(rounds: list[dict[str, dict[str, Any]]], keys: Sequence[str]
                  ) -> dict[str, dict[str, Any]]:
    """Runs measured in turns, a round at a time, as one report: each run's rounds kept
    under ``rounds``, each of ``keys`` the median of the rounds' values (each taken within
    its round, so a machine drifting over the process drifts under every run alike) with
    those values under ``<key>_rounds``, and ``same_tokens`` where every round had it."""
    merged: dict[str, dict[str, Any]] = {}
    for name in rounds[0]:
        each = [results[name] for results in rounds if name in results]
        out: dict[str, Any] = {"rounds": each}
        for key in keys:
            values = [r[key] for r in each if key in r]
            if values:
                out[key] = round(statistics.median(values), 3)
                out[f"{key}_rounds"] = values
        if any("same_tokens" in r for r in each):
            out["same_tokens"] = all(r.get("same_tokens", True) for r in each)
        merged[name] = out
    return merged


def parse_modes(text: str, option: str = "--modes") -> list[Mode]:
    """``direct,resident`` -> the I/O modes to bench (forced modes only, no ``auto``).

    Raises:
        UsageError: empty, or a name that is not ``direct`` or ``resident``.
    """
    modes = [m for m in text.split(",") if m]
    bad = [m for m in modes if m not in ("direct", "resident")]
    if not modes or bad:
        raise UsageError(f"{option} takes direct and/or resident, not {text!r}")
    return modes  # type: ignore[return-value]  # checked just above


def require_gpu(prog: str) -> None:
    """A GPU-only probe's first step: one line instead of an ImportError's traceback where
    CuPy or a CUDA device is missing.

    Raises:
        UsageError: no CUDA device can be used here (why, in a few words).
    """
    from moestream.gpu.cuda import unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        raise UsageError(f"{prog} needs a CUDA device ({reason})")


def exit_with(prog: str, main: Callable[[], int]) -> NoReturn:
    """Run a bench module as a command: exit with ``main``'s code, and turn a
    ``MoestreamError`` (bad input: a missing model, a refused option) into one line on
    stderr and its exit code instead of a traceback. ``main`` itself still raises, for
    callers and tests."""
    try:
        code = main()
    except MoestreamError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        code = exc.exit_code
    sys.exit(code)


def run_command(
    prog: str,
    parser: argparse.ArgumentParser,
    bench: Callable[[argparse.Namespace, list[str]], int],
    argv: Sequence[str] | None,
) -> int:
    """A bench command's entry point: parse, run, and turn a MoestreamError into one line
    and its exit code (2 for bad input), unless ``--debug`` asks for the traceback."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(args_list)
    configure_console(debug=args.debug)
    try:
        return bench(args, args_list)
    except MoestreamError as exc:
        if args.debug:
            raise
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return exc.exit_code
