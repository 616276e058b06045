"""``python -m bench.pipeline``: the streaming pipeline against its limits, in one run.

Every figure is a ratio against references measured in the same run on the same file and
the same expert ranges, because these machines are noisy:

- raw O_DIRECT read of expert ranges at the pipeline's queue depth (cold), and the best
  such read over ``--odirect-threads`` thread counts (on their first 2 GiB);
- parallel page-cache read of the same ranges (warm);
- pinned host-to-device copy (one GiB in one copy: the link's rate);
- each resident path's own rate on the warm-miss sweep's bytes, from the registered
  mapping, back-to-back on one stream: the copy engines one batched copy per layer (one
  copy per range paid ~2.7 us a copy, which held 2 MiB copies at 0.93 x one GiB's on the
  H200, ``bench/results/dsv2-h200-6fff5dd/``), the gather kernel one launch per layer;
- kvikio ``CuFile.pread`` of the same ranges into device buffers, when kvikio is installed;
- a naive baseline: synchronous buffered read, pageable copy, no cache (what ds4's CUDA
  path did before its cache was fixed);
- the compute-only rate: the same per-layer kernels and syncs with no I/O at all;
- the warm-miss run (default path) and, on a GPU, the same on the copy engines, and the
  all-cached run with its compute-only reference, each pair alternating, are repeated
  ``--rounds`` times, and each figure is the median round's: one run of the same code
  swung 0.69-0.95 (warm misses) on the H200, so two paths are compared in one process;
  around each warm-miss round the host's own speed is timed too (``host_ref_ms``, a fixed
  Python workload on the loop's thread), and on a GPU a pinned copy's rate
  (``h2d_ref_gbps``): a slow round on a slow host or a slow bus tells itself apart;
- with ``--ab-verify N``, the same phases with verification on and off, alternating in one
  process: what verification costs, from medians, free of the drift between two runs.

Pipeline runs go through ``pipeline.cli.run.run`` with a log, and figures come from the log's
token events. Miss throughput uses a cyclic sweep over distinct experts with an LRU budget
of half the sweep, so every access in the second pass is a miss (LRU's cyclic worst case,
used on purpose) and window registration happens in the first pass; the later ``--passes``
are measured (three by default: one pass of 8 tokens was 0.2 s on the H200, too short to
tell two runs apart).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import platform
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import uvloop

from bench.copytimes import copy_timeline
from bench.cpus import workload_ms
from bench.kit import drop_caches, exit_with, make_resident
from bench.record import provenance, write_result
from moestream.gpu.backend import Backend, aligned_host_array
from moestream.gpu.selection import select_backend
from moestream.pipeline.cli.run import RunSummary, run
from moestream.pipeline.foundation.config import GATHER_BLOCKS, Budget, ComputeSpec, RunConfig
from moestream.pipeline.foundation.files import ModelFile, locate
from moestream.pipeline.foundation.table import ExpertTable, open_table
from moestream.pipeline.foundation.trace import Trace, save_trace
from moestream.stages.layout import aligned_cover, iter_chunks
from moestream.stages.mapping import ModelMapping

__all__ = ["Bench", "add_run_options", "main"]

GB = 1e9
MIB = 1 << 20


def sweep_trace(n_layers: int, n_experts: int, top_k: int, n_tokens: int, start: int) -> Trace:
    """Token t, layer l picks experts ``start + t*top_k .. +top_k`` (mod n): all distinct."""
    base = (start + np.arange(n_tokens)[:, None] * top_k + np.arange(top_k)[None, :]) % n_experts
    experts = np.broadcast_to(base[:, None, :], (n_tokens, n_layers, top_k)).astype(np.int32)
    weights = np.full(experts.shape, 1.0 / top_k, dtype=np.float32)
    return Trace(np.ascontiguousarray(experts), weights, n_experts, "sweep")


def expert_ranges(table: ExpertTable, trace: Trace) -> list[tuple[int, int]]:
    """(offset, nbytes) of every range of every expert the trace uses, once each."""
    seen: set[tuple[int, int]] = set()
    out: list[tuple[int, int]] = []
    for t in range(trace.n_tokens):
        for i, layer in enumerate(table.moe_layers):
            for e in trace.experts[t, i]:
                key = (layer, int(e))
                if key not in seen:
                    seen.add(key)
                    out.extend((r.offset, r.nbytes) for r in table.slices(key).ranges)
    return out


def _open_all(files: Sequence[ModelFile], flags: int) -> dict[int, int]:
    """A descriptor per file of the model, by its base in the model's address space."""
    fds: dict[int, int] = {}
    try:
        for f in files:
            fds[f.base] = os.open(f.path, os.O_RDONLY | flags)
    except BaseException:
        for fd in fds.values():
            os.close(fd)
        raise
    return fds


def _local(files: Sequence[ModelFile], offset: int) -> tuple[int, int]:
    """(base of the file holding ``offset``, the offset in that file)."""
    f = locate(files, offset)
    return f.base, offset - f.base


def raw_read_gbps(files: Sequence[ModelFile], ranges: Sequence[tuple[int, int]], threads: int,
                  chunk_bytes: int, direct: bool) -> float:
    """Read the ranges' aligned covers in chunks on ``threads`` threads, each from its own
    file (the model's address space is page-aligned per file); GB/s of range bytes."""
    fds = _open_all(files, os.O_DIRECT if direct else 0)
    jobs = [
        (*_local(files, start), n)
        for off, n in ranges
        for start, n in iter_chunks(*aligned_cover(off, n), chunk_bytes)
    ]
    buffers: dict[int, np.ndarray] = {}

    def read(job: tuple[int, int, int]) -> int:
        import threading

        ident = threading.get_ident()
        buf = buffers.get(ident)
        if buf is None:
            buf = buffers[ident] = aligned_host_array(chunk_bytes)
        base, local, n = job
        return os.preadv(fds[base], [buf[:n].data], local)

    try:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(read, jobs))
        elapsed = time.perf_counter() - t0
    finally:
        for fd in fds.values():
            os.close(fd)
    return sum(n for _, n in ranges) / elapsed / GB


def _leading(ranges: Sequence[tuple[int, int]], nbytes: int) -> list[tuple[int, int]]:
    """The first ranges, up to ``nbytes`` of them (at least one)."""
    out: list[tuple[int, int]] = []
    total = 0
    for r in ranges:
        if out and total + r[1] > nbytes:
            break
        out.append(r)
        total += r[1]
    return out


def pinned_h2d_gbps(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Pinned host -> device bandwidth (CuPy), median of ``repeats`` timed copies."""
    import cupy

    host = cupy.cuda.alloc_pinned_memory(nbytes)
    src = np.frombuffer(host, dtype=np.uint8, count=nbytes)
    src[:] = 1
    dst = cupy.cuda.Memory(nbytes)
    stream = cupy.cuda.Stream(non_blocking=True)
    times = []
    for _ in range(repeats + 1):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        cupy.cuda.runtime.memcpyAsync(dst.ptr, src.ctypes.data, nbytes,
                                      cupy.cuda.runtime.memcpyHostToDevice, stream.ptr)
        end.record(stream)
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end) / 1000.0)
    return nbytes / float(np.median(times[1:])) / GB


def slice_h2d_gbps(table: ExpertTable, backend: Backend, ranges: Sequence[tuple[int, int]],
                   gather: bool, repeats: int = 3) -> float:
    """The ranges copied from the model's registered mapping into one device buffer,
    back-to-back on one stream, a layer's worth (top-k experts' ranges) at a time: as one
    batched copy on the copy engines (``Backend.copy_h2d_batch``, the pieces split at
    registration windows), or with ``gather`` as one gather launch (the kernel's default SM
    budget, no digests), as resident mode's two paths queue them. GB/s, the best of
    ``repeats``: the path's own rate on exactly the bytes a warm-miss run moves. The file
    must be resident (its windows are registered as resident mode's are)."""
    import cupy

    from moestream.gpu.cuda import CudaStream
    from moestream.gpu.kernels import NO_FLIP, copy_rows, make_kernels

    with ModelMapping(table.files, backend) as mapping:
        mapping.register_resident_windows()
        if not all(mapping.is_registered(off, n) for off, n in ranges):
            raise RuntimeError("slice_h2d_gbps: the model's pages are not all resident")
        total = sum(n for _, n in ranges)
        dst = cupy.cuda.Memory(total)
        stream = CudaStream()
        kernels = make_kernels(backend.name)
        per_launch = table.top_k * len(table.slices((table.moe_layers[0], 0)).ranges)
        launches, batches, at = [], [], 0
        for i in range(0, len(ranges), per_launch):
            rows: list[int] = []
            copies: list[int] = []
            for off, n in ranges[i : i + per_launch]:
                rows += (mapping.address(off), dst.ptr + at, n, 0, NO_FLIP)
                for piece_at, piece_n in mapping.spans(off, n):
                    copies += (mapping.address(off + piece_at), dst.ptr + at + piece_at,
                               piece_n)
                at += n
            launches.append(copy_rows(rows))
            batches.append(np.array(copies, dtype=np.uint64).reshape(-1, 3).T.copy())
        best = 0.0
        with backend.activate():
            for _ in range(repeats):
                t0 = time.perf_counter()
                for launch, batch in zip(launches, batches, strict=True):
                    if gather:
                        kernels.gather(launch, stream)
                    else:
                        backend.copy_h2d_batch(batch, stream)
                stream.synchronize()
                best = max(best, total / (time.perf_counter() - t0) / GB)
        return best


def kvikio_gbps(files: Sequence[ModelFile], ranges: Sequence[tuple[int, int]],
                threads: int) -> float | None:
    """kvikio ``CuFile.pread`` of the ranges into device buffers, or None without kvikio."""
    try:
        import cupy
        import kvikio
        import kvikio.defaults
    except ImportError:
        return None
    kvikio.defaults.set({"num_threads": threads})
    largest = max(n for _, n in ranges)
    bufs = [cupy.empty(largest, dtype=cupy.uint8) for _ in range(threads)]
    handles = {f.base: kvikio.CuFile(f.path, "r") for f in files}
    t0 = time.perf_counter()
    try:
        futures = []
        for i, (off, n) in enumerate(ranges):
            base, local = _local(files, off)
            futures.append(handles[base].pread(bufs[i % threads][:n], n, local))
            if len(futures) >= threads:
                futures.pop(0).get()
        for fut in futures:
            fut.get()
    finally:
        for handle in handles.values():
            handle.close()
    cupy.cuda.runtime.deviceSynchronize()
    return sum(n for _, n in ranges) / (time.perf_counter() - t0) / GB


def naive_tps(table: ExpertTable, trace: Trace, tokens: int, layer_ms: float) -> float:
    """ds4's CUDA path before its cache fix: every selected expert read again on every use,
    synchronously with O_DIRECT (queue depth 1), copied from pageable memory, no cache."""
    import cupy

    from moestream.gpu.cuda import CudaStream
    from moestream.gpu.kernels import CudaKernels

    kernels = CudaKernels()
    stream = CudaStream()
    fds = _open_all(table.files, os.O_DIRECT)
    largest = max(aligned_cover(r.offset, r.nbytes)[1]
                  for r in table.slices((table.moe_layers[0], 0)).ranges)
    bounce = aligned_host_array(largest)
    try:
        t0 = time.perf_counter()
        for t in range(tokens):
            for i, layer in enumerate(table.moe_layers):
                for e in trace.experts[t % trace.n_tokens, i]:
                    dev = []
                    for r in table.slices((layer, int(e))).ranges:
                        start, length = aligned_cover(r.offset, r.nbytes)
                        base, local = _local(table.files, start)
                        os.preadv(fds[base], [bounce[:length].data], local)
                        skip = r.offset - start
                        pageable = np.array(bounce[skip : skip + r.nbytes])
                        dev.append(cupy.asarray(pageable))
                    kernels.busy(layer_ms / trace.top_k, dev[2], stream)
                stream.synchronize()
        return tokens / (time.perf_counter() - t0)
    finally:
        for fd in fds.values():
            os.close(fd)


def compute_only_tps(n_layers: int, top_k: int, layer_ms: float, tokens: int) -> float:
    """The decoder's kernels and per-layer syncs with every expert already there, no I/O."""
    import cupy

    from moestream.gpu.cuda import CudaStream
    from moestream.gpu.kernels import CudaKernels

    kernels = CudaKernels()
    stream = CudaStream()
    dummy = cupy.zeros(16, dtype=cupy.uint8)
    for warm in (True, False):
        t0 = time.perf_counter()
        for _ in range(2 if warm else tokens):
            for _ in range(n_layers):
                for _ in range(top_k):
                    kernels.busy(layer_ms / top_k, dummy, stream)
                stream.record().synchronize()
    return tokens / (time.perf_counter() - t0)


def token_events(log: Path) -> list[dict[str, Any]]:
    with log.open() as f:
        return [e for e in map(json.loads, f) if e.get("event") == "token"]


def window_rate(events: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Tokens/s, delivered GB/s and hit rate over a window of token events, and the
    median and longest token (a round of a few hundred ms moves with one slow token)."""
    walls = [e["wall_ms"] for e in events]
    wall_s = sum(walls) / 1000.0
    file_bytes = sum(e["file_bytes"] for e in events)
    hits = sum(e["hits"] for e in events)
    misses = sum(e["misses"] for e in events)
    return {
        "tokens": len(events),
        "tokens_per_s": len(events) / wall_s if wall_s else 0.0,
        "delivered_gbps": file_bytes / wall_s / GB if wall_s else 0.0,
        "hit_rate": hits / (hits + misses) if hits + misses else 0.0,
        "stall_ms_per_token": sum(e["stall_ms"] for e in events) / max(1, len(events)),
        "compute_ms_per_token": sum(e["compute_ms"] for e in events) / max(1, len(events)),
        "wall_ms_per_token": wall_s * 1000.0 / max(1, len(events)),
        "wall_ms_median": float(np.median(walls)) if walls else 0.0,
        "wall_ms_max": max(walls, default=0.0),
        "stall_ms_max": max((e["stall_ms"] for e in events), default=0.0),
        # the loop thread's CPU against its wall: near 1, it computes; well below, it waits
        # outside moestream's measured waits (a full launch queue, the GIL)
        "cpu_ms_per_token": sum(e.get("cpu_ms", 0.0) for e in events) / max(1, len(events)),
        "process_cpu_ms_per_token": sum(e.get("process_cpu_ms", 0.0) for e in events)
        / max(1, len(events)),
        # where the wall went (the token's ``time`` parts): ``host_ms`` against the waits
        # for the device (``compute_ms``, ``upload_ms``) says which side bounds a round
        "time_ms_per_token": {part: sum(e["time"][part] for e in events) / len(events)
                              for part in (events[0]["time"] if events else {})},
    }


class Bench:
    """Holds the model, the scratch directory and the common run options."""

    def __init__(self, args: argparse.Namespace, table: ExpertTable, scratch: Path) -> None:
        self.args = args
        self.table = table
        self.scratch = scratch
        self.runs: dict[str, Any] = {}

    def run(self, name: str, trace: Trace, tokens: int, *, mode: str, budget_bytes: int | None,
            layer_ms: float, policy: str = "lru", lookahead: int = 0, gather: bool = True,
            verify: bool | None = None) -> tuple[RunSummary, list[dict[str, Any]]]:
        trace_path = self.scratch / f"{name}.npz"
        save_trace(trace, trace_path)
        log = self.scratch / f"{name}.jsonl"
        cfg = RunConfig(
            model=self.table.path, tokens=tokens, trace=trace_path, mode=mode,  # type: ignore[arg-type]
            budget=Budget(nbytes=budget_bytes) if budget_bytes else None,
            compute=ComputeSpec("fixed", layer_ms), backend=self.args.backend,
            queue_depth=self.args.queue_depth, chunk_bytes=self.args.chunk_mib * MIB,
            staging_slots=self.args.staging_slots, upload_streams=self.args.streams,
            log=log, policy=policy, prefetch="oracle" if lookahead else "none",
            lookahead=lookahead, gather=gather, gather_blocks=self.args.gather_blocks,
            verify=not self.args.no_verify if verify is None else verify,
        )
        summary = uvloop.run(run(cfg))
        events = token_events(log)
        self.runs[name] = {
            "summary": summary.as_dict(),
            "budget_ok": summary.peak_device_bytes <= summary.budget_bytes,
        }
        return summary, events


def _phase(name: str, results: dict[str, Any], fn: Callable[[], Any]) -> Any:
    t0 = time.perf_counter()
    value = fn()
    print(f"  {name}: {value if not isinstance(value, float) else round(value, 3)} "
          f"({time.perf_counter() - t0:.1f} s)", flush=True)
    results[name] = value
    return value


def add_run_options(p: argparse.ArgumentParser) -> None:
    """The pipeline settings ``Bench.run`` reads from its arguments (every bench that runs
    the pipeline through ``Bench`` takes the same ones, with the same defaults)."""
    p.add_argument("--queue-depth", type=int, default=16)
    p.add_argument("--chunk-mib", type=int, default=1)
    p.add_argument("--staging-slots", type=int, default=32)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--gather-blocks", type=int, default=GATHER_BLOCKS,
                   help=f"the gather kernel's blocks per copy, at most ({GATHER_BLOCKS})")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.pipeline", description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, required=True, help="GGUF model or checkpoint directory")
    p.add_argument("--backend", default="auto")
    add_run_options(p)
    p.add_argument("--lookahead", type=int, default=4,
                   help="oracle prefetch depth for the miss-throughput runs (4)")
    p.add_argument("--sweep-tokens", type=int, default=8, help="tokens per sweep pass")
    p.add_argument("--passes", type=int, default=4,
                   help="sweep passes per miss run; all but the first are measured (4)")
    p.add_argument("--tokens", type=int, default=64, help="tokens for the cache-vs-naive runs")
    p.add_argument("--naive-tokens", type=int, default=16)
    p.add_argument("--layer-ms", type=float, default=0.57)
    p.add_argument("--hit50-experts", type=int, default=0,
                   help="budget in experts for ~50%% hits (default 2522 scaled to the layers)")
    p.add_argument("--out", type=Path,
                   help="result JSON (default bench/results/pipeline-HOST.json)")
    p.add_argument("--odirect-threads", type=lambda s: [int(x) for x in s.split(",")],
                   default=[4, 8, 16, 32, 64],
                   help="thread counts of the raw O_DIRECT sweep (the best is the cold reference)")
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds of the warm-miss run and of compute-only + all cached "
                        "(alternating); each figure is the median round's (3)")
    p.add_argument("--ab-verify", type=int, default=0, metavar="N",
                   help="N rounds of verification on and off, alternating, for the warm-miss "
                        "and all-cached phases: the cost of verification within one run")
    p.add_argument("--skip", default="", help="comma list of phases to skip: cold,warm,cache,all")
    p.add_argument("--copy-timeline", action="store_true",
                   help="on a GPU, time each warm-miss round's copies on the device too "
                        "(bench.copytimes: their rate while copying, the share of the span "
                        "they copied; two events a layer)")
    p.add_argument("--no-verify", action="store_true",
                   help="pipeline runs without verification (the cost of the default's)")
    return p


@dataclass
class _Setup:
    """What every phase of one ``main`` run shares: the model, the traces, the budget, and
    where the figures go (``results``, its references in ``ref``)."""

    args: argparse.Namespace
    table: ExpertTable
    backend: Backend
    bench: Bench
    sweep: Trace  # the miss sweep, passes of distinct experts
    ranges_other: list[tuple[int, int]]  # another sweep's ranges: the references read them
    sweep_budget: int  # half the sweep's experts: every access of a later pass misses
    calibrated: Trace  # ds4-flash's calibrated routing, for the cached phases
    results: dict[str, Any]
    ref: dict[str, Any]

    @property
    def gpu(self) -> bool:
        return self.backend.name == "cupy"

    @property
    def cyc(self) -> int:
        """Tokens of a sweep run: every pass after the first is measured."""
        return int(self.args.passes * self.args.sweep_tokens)

    def sweep_run(self, name: str, mode: str, **options: Any) -> dict[str, Any]:
        """A sweep run's rate over its measured passes."""
        _, ev = self.bench.run(name, self.sweep, self.cyc, mode=mode,
                               budget_bytes=self.sweep_budget, layer_ms=0.0, **options)
        return window_rate(ev[self.args.sweep_tokens:])


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    table = open_table(args.model)
    backend = select_backend(args.backend)
    n_layers, n_exp, k = len(table.layers), table.n_experts, table.top_k
    expert_bytes = next(iter(table.layers.values())).expert_bytes
    results: dict[str, Any] = {
        **provenance("bench.pipeline", argv, device=backend.device_name),
        "model": table.summary(),
        "settings": {k2: (str(v) if isinstance(v, Path) else v) for k2, v in vars(args).items()},
    }
    ref: dict[str, Any] = {}
    results["references"] = ref
    with tempfile.TemporaryDirectory(prefix="moestream-bench-") as tmp:
        from moestream.pipeline.proxy.synthetic import synthetic_trace

        other = sweep_trace(n_layers, n_exp, k, args.sweep_tokens, args.sweep_tokens * k)
        s = _Setup(
            args=args, table=table, backend=backend, bench=Bench(args, table, Path(tmp)),
            sweep=sweep_trace(n_layers, n_exp, k, args.sweep_tokens, 0),
            ranges_other=expert_ranges(table, other),
            sweep_budget=n_layers * k * args.sweep_tokens * expert_bytes // 2 + (64 << 20),
            calibrated=synthetic_trace("ds4-flash", args.tokens, seed=1, n_layers=n_layers,
                                       n_experts=n_exp, top_k=k),
            results=results, ref=ref)
        if "warm" not in skip:
            _warm(s)
        if "cold" not in skip:
            _cold(s)
        if "cache" not in skip and s.gpu:
            _cache_vs_naive(s, expert_bytes)
        if "all" not in skip and s.gpu:
            _all_cached(s)
        if args.ab_verify and "warm" not in skip:
            results["verify_ab"] = _verify_ab(s, with_cached=s.gpu and "all" not in skip)
        results["runs"] = s.bench.runs
    figures = _figures(results)
    results["figures"] = figures
    out = args.out or Path("bench/results") / f"pipeline-{platform.node()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_result(out, results)
    print("\nfigures:")
    for name, value in figures.items():
        print(f"  {name}: {value}")
    print(f"written: {out}")
    return 0


def _warm(s: _Setup) -> None:
    """The file in the page cache: the references, then the resident miss runs."""
    args, table, ref, results = s.args, s.table, s.ref, s.results
    print("warm (file in page cache):", flush=True)
    results["warm_file"] = _phase("make_resident", {}, lambda: make_resident(table.files))
    _phase("page_cache_read_gbps", ref, lambda: raw_read_gbps(
        table.files, s.ranges_other, args.queue_depth, args.chunk_mib * MIB, direct=False))
    if s.gpu:
        _phase("pinned_h2d_gbps", ref, pinned_h2d_gbps)
        moved = expert_ranges(table, s.sweep)
        for name, gather in (("slice_h2d_gbps", False), ("slice_gather_gbps", True)):
            _phase(name, ref, functools.partial(slice_h2d_gbps, table, s.backend, moved,
                                                gather))
        _phase("kvikio_warm_gbps", ref, lambda: kvikio_gbps(
            table.files, s.ranges_other, args.queue_depth))
    rate = s.sweep_run("resident_sweep", "resident")
    results["resident_miss_layer_by_layer"] = _phase(
        "resident_miss_layer_by_layer", {}, lambda: rate)
    # the default path's rounds, alternating on a GPU with the same on the copy
    # engines (``--no-gather``): the two compared in one process, round by round
    paths = {"resident_miss": True, **({"resident_miss_copy_engines": False}
                                       if s.gpu else {})}
    by_path: dict[str, list[dict[str, Any]]] = {name: [] for name in paths}
    for _ in range(args.rounds):
        for name, gather in paths.items():
            by_path[name].append(_with_references(
                functools.partial(_warm_round, s, name, gather), s.gpu))
    for name in paths:
        results[name] = _phase(name, {}, functools.partial(
            _median_round, by_path[name], "delivered_gbps"))


def _warm_round(s: _Setup, name: str, gather: bool) -> dict[str, Any]:
    """One warm-miss round (oracle prefetch), with its copies' device timeline if asked."""
    with (copy_timeline() if s.gpu and s.args.copy_timeline
          else contextlib.nullcontext()) as timeline:
        rate = s.sweep_run(name, "resident", lookahead=s.args.lookahead, gather=gather)
    measured = (s.cyc - s.args.sweep_tokens) / s.cyc  # the window's share of the calls
    return {**rate, **(timeline.summary(measured) if timeline is not None else {})}


def _cold(s: _Setup) -> None:
    """Caches dropped: the O_DIRECT references, then the direct miss runs."""
    args, table, ref, results = s.args, s.table, s.ref, s.results
    print("cold (caches dropped):", flush=True)
    drop_caches(table.files)
    _phase("odirect_read_gbps", ref, lambda: raw_read_gbps(
        table.files, s.ranges_other, args.queue_depth, args.chunk_mib * MIB, direct=True))
    # the best raw O_DIRECT read of these ranges over thread counts (on 2 GiB of them)
    part = _leading(s.ranges_other, 2 << 30)
    sweep_gbps = {}
    for threads in args.odirect_threads:
        drop_caches(table.files)
        sweep_gbps[threads] = raw_read_gbps(table.files, part, threads,
                                            args.chunk_mib * MIB, direct=True)
    best = max(sweep_gbps, key=lambda n: sweep_gbps[n])
    ref["odirect_threads_gbps"] = {str(n): round(v, 3) for n, v in sweep_gbps.items()}
    _phase("odirect_best_gbps", ref, lambda: sweep_gbps[best])
    ref["odirect_best_threads"] = best
    # the same ranges again: a storage layer below (a VM host's cache) shows here
    _phase("odirect_reread_gbps", ref, lambda: raw_read_gbps(
        table.files, s.ranges_other, args.queue_depth, args.chunk_mib * MIB, direct=True))
    if s.gpu:
        drop_caches(table.files)
        _phase("kvikio_cold_gbps", ref, lambda: kvikio_gbps(
            table.files, s.ranges_other, args.queue_depth))
    drop_caches(table.files)
    rate = s.sweep_run("direct_sweep", "direct")
    results["direct_miss_layer_by_layer"] = _phase(
        "direct_miss_layer_by_layer", {}, lambda: rate)
    drop_caches(table.files)
    rate = s.sweep_run("direct_sweep_ahead", "direct", lookahead=args.lookahead)
    results["direct_miss"] = _phase("direct_miss", {}, lambda: rate)


def _cache_vs_naive(s: _Setup, expert_bytes: int) -> None:
    """From a cold start in direct mode: the naive baseline, then the cache at ~50% hits."""
    args, table = s.args, s.table
    print("cache vs naive (cold start, direct mode):", flush=True)
    hit50 = args.hit50_experts or round(2522 * len(table.layers) / 43)
    drop_caches(table.files)
    _phase("naive_tps", s.ref, lambda: naive_tps(table, s.calibrated, args.naive_tokens,
                                                  args.layer_ms))
    drop_caches(table.files)
    _, ev = s.bench.run("cache_hit50", s.calibrated, args.tokens, mode="direct",
                        budget_bytes=hit50 * (expert_bytes + 1024), layer_ms=args.layer_ms)
    s.results["cache_hit50"] = _phase("cache_hit50", {}, lambda: window_rate(ev))


def _all_cached(s: _Setup) -> None:
    """Every expert cached (the second pass of a replayed trace) against compute only."""
    args, table = s.args, s.table
    print("all cached (second pass of a replayed trace):", flush=True)
    # the cold phases dropped the file's pages: without them the first round's
    # resident-mode run warmed 17 GB in the background beside its measured tokens
    # (H200, fine shape at 40b54b0: 12.7 s of reading and window registration)
    _phase("make_resident", {}, lambda: make_resident(table.files))
    # alternating, so drift between the two (clocks, the host) falls on both alike
    rounds = []
    for _ in range(args.rounds):
        reference = compute_only_tps(len(table.layers), table.top_k, args.layer_ms,
                                     args.tokens)
        _, ev = s.bench.run("all_cached", s.calibrated, 2 * args.tokens, mode="resident",
                            budget_bytes=None, layer_ms=args.layer_ms)
        rounds.append({**window_rate(ev[args.tokens:]), "compute_only_tps": reference})
        rounds[-1]["vs_compute_only"] = rounds[-1]["tokens_per_s"] / reference
    s.results["all_cached"] = _phase("all_cached", {},
                                     lambda: _median_round(rounds, "vs_compute_only"))
    s.ref["compute_only_tps"] = s.results["all_cached"]["compute_only_tps"]


def _verify_ab(s: _Setup, with_cached: bool) -> dict[str, Any]:
    """The warm-miss (and all-cached) phases with verification on and off, alternating:
    what verification costs, from medians, free of the drift between two runs."""
    args = s.args
    print(f"verification A/B ({args.ab_verify} rounds, on and off alternating):", flush=True)
    ab: dict[str, Any] = {}
    phases: dict[str, tuple[Callable[[bool], list[dict[str, Any]]], str]] = {
        "resident_miss": (lambda on: s.bench.run(
            "ab_sweep", s.sweep, s.cyc, mode="resident", budget_bytes=s.sweep_budget,
            layer_ms=0.0, lookahead=args.lookahead, verify=on)[1][args.sweep_tokens:],
            "delivered_gbps"),
    }
    if with_cached:
        phases["all_cached"] = (lambda on: s.bench.run(
            "ab_cached", s.calibrated, 2 * args.tokens, mode="resident",
            budget_bytes=None, layer_ms=args.layer_ms, verify=on)[1][args.tokens:],
            "tokens_per_s")
    for phase, (go, measure) in phases.items():
        rates: dict[str, list[float]] = {"on": [], "off": []}
        for _ in range(args.ab_verify):
            for on in (True, False):
                rates["on" if on else "off"].append(window_rate(go(on))[measure])
        on_med, off_med = (float(np.median(rates[k])) for k in ("on", "off"))
        cost = round(1 - on_med / off_med, 4) if off_med else None  # None: no misses
        ab[phase] = {"measure": measure, **rates, "median_on": on_med,
                     "median_off": off_med, "cost": cost}
        print(f"  {phase}: {measure} on {on_med:.3f} / off {off_med:.3f}: "
              + (f"verification costs {cost:.1%}" if cost is not None
                 else "nothing to compare"), flush=True)
    return ab


HOST_REFERENCE_MISSES = 50_000
"""``bench.cpus``'s workload timed around each warm-miss round: ~20 ms of the cache-like
Python the host-bound shapes spend their tokens on (tuple keys, an LRU's moves)."""


H2D_REFERENCE_BYTES = 256 << 20
"""The pinned copy timed around each warm-miss round on a GPU (~5 ms at 50 GB/s)."""


def _with_references(run_round: Callable[[], dict[str, Any]], gpu: bool) -> dict[str, Any]:
    """A round's result with ``host_ref_ms``: the same fixed Python timed on the loop's
    thread right before and right after it (their mean), and on a GPU ``h2d_ref_gbps``: a
    pinned host -> device copy timed the same way. Why: the small shapes' rounds of one
    process swing 35-51 GB/s with the loop thread busy throughout; a slow round whose host
    reference is slow too was a slow host (its CPU, a neighbour), one whose copy reference
    is slow was the transfer itself (the bus, the host's memory), one with neither slow was
    something in the run."""
    def references() -> tuple[float, float]:
        return (workload_ms(HOST_REFERENCE_MISSES),
                pinned_h2d_gbps(H2D_REFERENCE_BYTES, repeats=3) if gpu else 0.0)

    before = references()
    result = run_round()
    after = references()
    out = {**result, "host_ref_ms": round((before[0] + after[0]) / 2, 2)}
    if gpu:
        out["h2d_ref_gbps"] = round((before[1] + after[1]) / 2, 2)
    return out


def _median_round(rounds: Sequence[dict[str, Any]], key: str) -> dict[str, Any]:
    """The round whose ``key`` is the median (the lower one of an even count), with every
    round's ``key`` beside it: one slow round moves neither the figure nor its context."""
    chosen = sorted(rounds, key=lambda r: r[key])[(len(rounds) - 1) // 2]
    out = {**chosen, "rounds": [round(r[key], 4) for r in rounds]}
    if all("wall_ms_max" in r for r in rounds):  # token walls: (median, longest) per round
        out["rounds_wall_ms"] = [[round(r["wall_ms_median"], 2), round(r["wall_ms_max"], 2)]
                                 for r in rounds]
    for ref in ("host_ref_ms", "h2d_ref_gbps", "copy_device_gbps", "copy_busy_share"):
        if all(ref in r for r in rounds):
            out[f"rounds_{ref}"] = [r[ref] for r in rounds]
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def _figures(r: dict[str, Any]) -> dict[str, Any]:
    ref = r["references"]
    fig: dict[str, Any] = {}
    if "direct_miss" in r:
        fig["1_cold_direct_vs_odirect"] = _ratio(r["direct_miss"]["delivered_gbps"],
                                                 ref.get("odirect_read_gbps"))
        fig["1_cold_direct_vs_best_odirect"] = _ratio(r["direct_miss"]["delivered_gbps"],
                                                      ref.get("odirect_best_gbps"))
        fig["1_cold_direct_vs_odirect_reread"] = _ratio(r["direct_miss"]["delivered_gbps"],
                                                        ref.get("odirect_reread_gbps"))
        fig["1_cold_direct_vs_kvikio"] = _ratio(r["direct_miss"]["delivered_gbps"],
                                                ref.get("kvikio_cold_gbps"))
    if "resident_miss" in r:
        fig["2_warm_resident_vs_pinned_h2d"] = _ratio(r["resident_miss"]["delivered_gbps"],
                                                      ref.get("pinned_h2d_gbps"))
        fig["2_warm_resident_copy_engines_vs_pinned_h2d"] = _ratio(
            r.get("resident_miss_copy_engines", {}).get("delivered_gbps"),
            ref.get("pinned_h2d_gbps"))
        fig["2_warm_resident_vs_copy_engines"] = _ratio(
            r["resident_miss"]["delivered_gbps"],
            r.get("resident_miss_copy_engines", {}).get("delivered_gbps"))
        fig["2_warm_resident_vs_slice_h2d"] = _ratio(r["resident_miss"]["delivered_gbps"],
                                                     ref.get("slice_h2d_gbps"))
        fig["2_warm_resident_vs_slice_gather"] = _ratio(r["resident_miss"]["delivered_gbps"],
                                                        ref.get("slice_gather_gbps"))
        fig["2_warm_resident_vs_kvikio"] = _ratio(r["resident_miss"]["delivered_gbps"],
                                                  ref.get("kvikio_warm_gbps"))
        fig["2_warm_resident_vs_page_cache_read"] = _ratio(
            r["resident_miss"]["delivered_gbps"], ref.get("page_cache_read_gbps"))
    if "cache_hit50" in r:
        fig["3_cache_vs_naive_tps"] = _ratio(r["cache_hit50"]["tokens_per_s"],
                                             ref.get("naive_tps"))
        fig["3_hit_rate"] = round(r["cache_hit50"]["hit_rate"], 3)
    if "all_cached" in r:
        fig["4_all_cached_vs_compute_only"] = round(r["all_cached"]["vs_compute_only"], 3)
    for phase, ab in r.get("verify_ab", {}).items():
        fig[f"6_verify_cost_{phase}"] = ab["cost"]
    fig["5_budget_never_exceeded"] = all(run["budget_ok"] for run in r.get("runs", {}).values())
    return fig


if __name__ == "__main__":
    exit_with("python -m bench.pipeline", main)
