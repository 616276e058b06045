"""Benchmark command for the warm-up: our loader against ``vmtouch -t`` and ``cat``, cold.

Why: the warm-up is worth having only if it fills the page cache at least as fast as the
tools an operator would reach for. On one file, in one run, with the file's pages dropped
before every timed run (``posix_fadvise(DONTNEED)`` over the whole file, plus
``/proc/sys/vm/drop_caches`` where writable, then checked with ``mincore``), this times:

- ``moestream``: ``WarmEngine`` over the whole file, in process (the engine's speed);
- ``moestream_cli``: ``python -m tools.warmup FILE`` in a fresh process (what a user runs,
  interpreter start-up included, with Python's own files loaded again, untimed, after the
  drop; GGUF files only);
- ``vmtouch``: ``vmtouch -qt FILE``, when installed;
- ``cat``: ``cat FILE > /dev/null``;

each ``--runs`` times (median reported, with the CPU time each took), in an order rotated
and reversed every other round so no method always follows the same one. It then times
the residency report on the resident file. Disk throughput on shared machines swings run
to run: read the ratios, not the GB/s.

    python -m bench.warmup                    # generate a ~4 GiB GGUF, bench, delete
    python -m bench.warmup --file MODEL.gguf --runs 5

The result goes to ``bench/results/warmup-<host>.json`` with the machine, commit and command.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.record import provenance, write_result
from moestream.pipeline.cli.console import configure_console
from moestream.pipeline.foundation.errors import MoestreamError, UsageError
from moestream.pipeline.foundation.table import ByteRange, open_table
from moestream.stages.residency import Residency, evict
from moestream.stages.warm import WarmEngine

__all__ = ["drop_file_pages", "main", "make_bench_file"]

_REPO = Path(__file__).resolve().parent.parent
_DROP_CACHES = Path("/proc/sys/vm/drop_caches")


def _say(text: str) -> None:
    print(text, flush=True)


def _fs_type(path: Path) -> str | None:
    """The filesystem type ``path`` lives on, from /proc/mounts (longest mount prefix)."""
    target = os.path.realpath(path)
    best: tuple[int, str] | None = None
    try:
        with open("/proc/mounts") as f:
            for line in f:
                fields = line.split()
                if len(fields) < 3:
                    continue
                mount = fields[1]
                inside = target == mount or target.startswith(mount.rstrip("/") + "/")
                if inside and (best is None or len(mount) > best[0]):
                    best = (len(mount), fields[2])
    except OSError:
        return None
    return best[1] if best else None


def _scratch_dir(requested: Path | None) -> Path:
    """Where to write the generated file: on a disk, not in RAM (tmpfs cannot be dropped)."""
    if requested is not None:
        return requested
    tmp = Path(tempfile.gettempdir())
    return Path.cwd() if _fs_type(tmp) in ("tmpfs", "ramfs") else tmp


def make_bench_file(directory: Path, size_gib: float, *, random_bytes: bool) -> Path:
    """Write a ~``size_gib`` GiB file to bench on: a ds4-flash-q2 shaped GGUF, or random bytes.

    The GGUF has 6.75 MiB experts, at most 256 per layer, as many layers as the size needs.
    """
    target = int(size_gib * 2**30)
    if not random_bytes:
        from moestream.pipeline.makers.modelgen import spec_for, write_model

        expert_bytes = spec_for("ds4-flash-q2", layers=1, experts=1).expert_bytes
        layers = max(1, math.ceil(target / (256 * expert_bytes)))
        experts = max(1, round(target / (layers * expert_bytes)))
        path = directory / f"moestream-bench-warmup-{size_gib:g}g.gguf"
        return write_model(spec_for("ds4-flash-q2", layers=layers, experts=experts), path)
    path = directory / f"moestream-bench-warmup-{size_gib:g}g.bin"
    rng = np.random.default_rng(0)
    chunk = 64 << 20
    with open(path, "wb") as f:
        for offset in range(0, target, chunk):
            f.write(rng.integers(0, 256, min(chunk, target - offset), dtype=np.uint8).tobytes())
        f.flush()
        os.fsync(f.fileno())
    return path


def drop_file_pages(path: Path) -> tuple[float, bool]:
    """Drop ``path`` from the page cache.

    ``DONTNEED`` over the whole file, then ``drop_caches`` (clean page cache, system wide)
    where this process may write it.

    Returns:
        The fraction of the file still resident (about 0), and whether ``drop_caches`` was
        written.
    """
    evict(path)
    wrote = False
    if os.access(_DROP_CACHES, os.W_OK):
        try:
            _DROP_CACHES.write_text("1\n")
            wrote = True
        except OSError as exc:  # some containers refuse it even to root; DONTNEED already ran
            _say(f"  note: cannot write {_DROP_CACHES} ({exc.strerror}); DONTNEED only")
    return Residency.of_file(path).fraction, wrote


def _engine_warm(path: Path, threads: int | None) -> None:
    size = path.stat().st_size

    async def run() -> None:
        async with WarmEngine(path, threads=threads) as engine:
            await engine.warm([ByteRange(0, size)])

    asyncio.run(run())


def _command(argv: list[str]) -> Callable[[], None]:
    def run() -> None:
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                       cwd=_REPO)

    return run


def _is_gguf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


_Method = tuple[Callable[[], None] | None, Callable[[], None]]
"""(untimed preparation after the drop, the timed run)."""


def _methods(path: Path, threads: int | None, gguf: bool) -> dict[str, _Method]:
    methods: dict[str, _Method] = {
        "moestream": (None, lambda: _engine_warm(path, threads)),
    }
    if gguf:
        cli = [sys.executable, "-m", "tools.warmup", str(path)]
        if threads is not None:
            cli += ["--threads", str(threads)]
        # drop_caches also evicts the interpreter's and numpy's files; load them again
        # (untimed) so the CLI is timed as a user meets it, not after a cold boot.
        imports = _command([sys.executable, "-c", "import moestream.tools.warmup.cli"])
        methods["moestream_cli"] = (imports, _command(cli))
    vmtouch = shutil.which("vmtouch")
    if vmtouch is not None:
        methods["vmtouch"] = (None, _command([vmtouch, "-qt", str(path)]))
    methods["cat"] = (None, _command(["cat", str(path)]))
    return methods


def _cpu_seconds() -> float:
    """CPU time of this process and its waited-for children, user and system."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(
        resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _time_cold(
    path: Path, methods: dict[str, _Method], runs: int
) -> tuple[dict[str, dict[str, Any]], bool]:
    """Median-of-``runs`` cold timings per method; also whether every drop wrote drop_caches."""
    size = path.stat().st_size
    out: dict[str, dict[str, Any]] = {
        name: {"seconds": [], "cpu_s": [], "resident_before": [], "resident_after": []}
        for name in methods
    }
    names = list(methods)
    dropped_caches: list[bool] = []
    for round_ in range(runs):
        # Rotate, and reverse every other round, so each method follows different ones:
        # on VMs the storage is faster right after another read of the same file.
        order = names[round_ % len(names):] + names[: round_ % len(names)]
        if round_ % 2:
            order.reverse()
        for name in order:
            before, wrote = drop_file_pages(path)
            dropped_caches.append(wrote)
            if before > 0.01:
                raise UsageError(f"{path}: {before:.0%} of its pages stay resident after "
                                 "dropping them (tmpfs, or mapped/locked elsewhere?)")
            prepare, run = methods[name]
            if prepare is not None:
                prepare()
            cpu_before = _cpu_seconds()
            started = time.perf_counter()
            run()
            seconds = time.perf_counter() - started
            cpu = _cpu_seconds() - cpu_before
            after = Residency.of_file(path).fraction
            rec = out[name]
            rec["seconds"].append(round(seconds, 4))
            rec["cpu_s"].append(round(cpu, 3))
            rec["resident_before"].append(round(before, 4))
            rec["resident_after"].append(round(after, 4))
            _say(f"  round {round_ + 1}: {name:<14} {size / seconds / 1e9:6.2f} GB/s "
                 f"({seconds:.2f} s, CPU {cpu:.2f} s, resident after {after:.1%})")
    for rec in out.values():
        rec["median_s"] = statistics.median(rec["seconds"])
        rec["gb_per_s"] = round(size / rec["median_s"] / 1e9, 3)
        rec["cpu_median_s"] = statistics.median(rec["cpu_s"])
    return out, all(dropped_caches)


def _time_report(path: Path, gguf: bool, runs: int) -> dict[str, Any]:
    """Seconds for the residency report on the (now resident) file."""
    from moestream.tools.warmup.report import residency_report

    table = open_table(path) if gguf else None
    mincore_s, report_s, cli_s = [], [], []
    for _ in range(runs):
        started = time.perf_counter()
        residency = Residency.of_file(path)
        mincore_s.append(time.perf_counter() - started)
        if table is not None:
            residency_report(table, residency, per_expert=True)
            report_s.append(time.perf_counter() - started)
            started = time.perf_counter()
            _command([sys.executable, "-m", "tools.warmup", str(path), "--report", "--json",
                      "--per-expert"])()
            cli_s.append(time.perf_counter() - started)
    result: dict[str, Any] = {
        "resident_fraction": round(Residency.of_file(path).fraction, 4),
        "mincore_median_s": round(statistics.median(mincore_s), 4),
    }
    if report_s:
        result["report_median_s"] = round(statistics.median(report_s), 4)
        result["cli_report_median_s"] = round(statistics.median(cli_s), 4)
        result["cli_report_command"] = "python -m tools.warmup FILE --report --json --per-expert"
    size = path.stat().st_size
    result["mincore_s_per_30gb"] = round(result["mincore_median_s"] * 30e9 / size, 3)
    return result


def _ratios(cold: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Speed ratios (higher: ours faster) of each moestream method over each reference."""
    out: dict[str, float] = {}
    for ours in ("moestream", "moestream_cli"):
        for ref in ("vmtouch", "cat"):
            if ours in cold and ref in cold:
                out[f"{ours}_vs_{ref}"] = round(cold[ref]["median_s"] / cold[ours]["median_s"], 3)
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.warmup",
                                description=(__doc__ or "").split("\n")[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--file", type=Path, help="bench on this file (kept)")
    src.add_argument("--size-gib", type=float, default=4.0,
                     help="generate a file of about this size (default 4)")
    p.add_argument("--random", action="store_true",
                   help="generate random bytes instead of a GGUF (faster to make)")
    p.add_argument("--dir", type=Path, help="where to generate the file (default: temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the generated file")
    p.add_argument("--runs", type=int, default=3, help="timed runs per method (median)")
    p.add_argument("--threads", type=int, help="warm-up reader threads (default: engine's)")
    p.add_argument("--out", type=Path,
                   help="result JSON (default bench/results/warmup-<host>.json)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point; returns the exit code."""
    args = _parser().parse_args(argv)
    configure_console()
    if args.runs < 1:
        print("bench_warmup: error: --runs must be >= 1", file=sys.stderr)
        return 2
    generated: Path | None = None
    try:
        if args.file is not None:
            path = args.file
            if not path.is_file():
                raise UsageError(f"{path}: no such file")
        else:
            directory = _scratch_dir(args.dir)
            _say(f"writing a ~{args.size_gib:g} GiB {'random' if args.random else 'GGUF'} "
                 f"file in {directory} ...")
            started = time.perf_counter()
            path = generated = make_bench_file(directory, args.size_gib,
                                               random_bytes=args.random)
            _say(f"  {path} in {time.perf_counter() - started:.1f} s")
        gguf = _is_gguf(path)
        size = path.stat().st_size
        methods = _methods(path, args.threads, gguf)
        missing = [] if "vmtouch" in methods else ["vmtouch (not installed)"]
        _say(f"cold warm-up of {path} ({size / 2**30:.2f} GiB), {args.runs} runs each"
             + (f"; skipped: {', '.join(missing)}" if missing else ""))
        cold, drop_caches = _time_cold(path, methods, args.runs)
        report = _time_report(path, gguf, args.runs)
    except MoestreamError as exc:
        print(f"bench_warmup: error: {exc}", file=sys.stderr)
        return exc.exit_code
    finally:
        if generated is not None and not args.keep:
            generated.unlink(missing_ok=True)
    ratios = _ratios(cold)
    result = {
        "benchmark": "warmup",
        **provenance("bench.warmup", argv),
        "file": {"path": str(path), "bytes": size, "gguf": gguf,
                 "generated": generated is not None},
        "drop": {"fadvise_dontneed": True, "drop_caches": drop_caches},
        "runs": args.runs,
        "skipped": missing,
        "cold": cold,
        "ratios": ratios,
        "targets": {name: value >= 1.0 for name, value in ratios.items()
                    if name.startswith("moestream_vs_")},
        "report": report,
    }
    out = args.out or _REPO / "bench" / "results" / f"warmup-{socket.gethostname()}.json"
    write_result(out, result)
    _say("median GB/s: " + ", ".join(f"{n} {r['gb_per_s']:.2f}" for n, r in cold.items()))
    _say("ratios: " + ", ".join(f"{n} {v:.2f}x" for n, v in ratios.items()))
    _say(f"report on the resident file: mincore {report['mincore_median_s']:.3f} s"
         + (f", full report {report['report_median_s']:.3f} s, CLI "
            f"{report['cli_report_median_s']:.3f} s" if "report_median_s" in report else ""))
    _say(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
