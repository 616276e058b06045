"""The references ``bench.pipeline`` measures the pipeline against, on the same ranges.

Each is what a path could do at best, or what it did before moestream: a raw read of the
ranges (O_DIRECT or from the page cache), a pinned copy of one GiB (the link's rate), each
resident path's own copy rate from the registered mapping, kvikio's reads, the naive
synchronous path with no cache, the decoder's compute with no I/O; and, around each timed
round, the host's and the bus's own speed, so a slow round tells where it was slow.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from bench.cpus import workload_ms
from moestream.gpu.backend import Backend, aligned_host_array
from moestream.pipeline.foundation.files import ModelFile, locate
from moestream.pipeline.foundation.table import ExpertTable
from moestream.pipeline.foundation.trace import Trace
from moestream.stages.layout import aligned_cover, iter_chunks
from moestream.stages.mapping import ModelMapping

__all__ = ["compute_only_tps", "kvikio_gbps", "leading_ranges", "naive_tps", "pinned_h2d_gbps",
           "raw_read_gbps", "slice_h2d_gbps", "with_references"]

GB = 1e9


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


def leading_ranges(ranges: Sequence[tuple[int, int]], nbytes: int) -> list[tuple[int, int]]:
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


HOST_REFERENCE_MISSES = 50_000
"""``bench.cpus``'s workload timed around each warm-miss round: ~20 ms of the cache-like
Python the host-bound shapes spend their tokens on (tuple keys, an LRU's moves)."""


H2D_REFERENCE_BYTES = 256 << 20
"""The pinned copy timed around each warm-miss round on a GPU (~5 ms at 50 GB/s)."""


def with_references(run_round: Callable[[], dict[str, Any]], gpu: bool) -> dict[str, Any]:
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
