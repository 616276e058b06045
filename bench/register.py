"""``python -m bench.register``: what registering a page-cache mapping with CUDA costs.

Why: resident mode copies experts straight from the registered file mapping (zero-copy,
about 4x a buffered page-cache read on the H200), but registering 34 GB takes time, and a
registration running beside decode may hold up its copies. This measures, on one resident
file in one run:

- ``register_gbps``: cudaHostRegister (read-only) throughput for each window size;
- ``h2d_registered_gbps`` / ``h2d_pinned_gbps``: copies from the registered mapping and from
  cudaHostAlloc'd memory;
- ``staged_gbps``: buffered ``preadv`` into pinned memory on ``--threads`` threads, then
  copied (the path a miss takes while its window is not registered);
- ``h2d_by_piece_gbps``: back-to-back copies of one GiB cut into pieces of each size, on
  1, 2 and 4 streams in turn, from the registered mapping and from pinned memory (one sync
  at the end): what a copy's own fixed cost takes from the link at experts' slice sizes;
- ``h2d_strided_gbps``: experts of three row-sized slices in three tensors (GGUF's layout)
  copied slice by slice, as one ``cudaMemcpy2DAsync`` each, and as one plain copy each:
  whether a strided copy pays the copy engines' per-copy cost once for the three;
- ``h2d_during_register_gbps``: copies from pinned memory on one thread while another
  thread registers windows (does registration stall uploads?), with the longest single
  copy's latency against the same copies with no registration running.

CuPy only (a GPU machine). The result goes to ``--out`` with machine, commit and command.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from bench.kit import exit_with, require_gpu
from bench.record import provenance, report
from moestream.gpu.cuda import CudaPinned, CudaStream
from moestream.stages.residency import libc

__all__ = ["main"]

GB = 1e9
MIB = 1 << 20
_READ_ONLY = 0x08


def _make_file(path: Path, nbytes: int) -> None:
    """Random-ish bytes written through the page cache (so the file ends up resident)."""
    block = np.random.default_rng(1).integers(0, 256, 64 * MIB, dtype=np.uint8).tobytes()
    with path.open("wb") as f:
        for _ in range(nbytes // len(block)):
            f.write(block)


@contextlib.contextmanager
def scratch_mapping(path: Path, nbytes: int) -> Iterator[tuple[int, int, np.ndarray]]:
    """A resident scratch file of ``nbytes`` (``_make_file``), mapped read-only:
    (descriptor, address, uint8 array over the mapping); unmapped, closed and deleted
    after, whatever happened."""
    _make_file(path, nbytes)
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.map_read(fd, 0, nbytes, str(path))
        try:
            yield fd, addr, np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(addr))
        finally:
            libc.munmap(addr, nbytes)
    finally:
        os.close(fd)
        path.unlink()


def _copies(cp: Any, src: np.ndarray, dst: Any, stream: CudaStream, piece: int,
            rounds: int) -> tuple[float, float]:
    """(GB/s, longest copy ms) of ``rounds`` passes of piece-sized copies of ``src``."""
    rt = cp.cuda.runtime
    longest = 0.0
    t0 = time.perf_counter()
    for _ in range(rounds):
        for at in range(0, src.size, piece):
            n = min(piece, src.size - at)
            t1 = time.perf_counter()
            rt.memcpyAsync(dst.data.ptr, src.ctypes.data + at, n, rt.memcpyHostToDevice,
                           stream.raw.ptr)
            stream.synchronize()
            longest = max(longest, time.perf_counter() - t1)
    return rounds * src.size / (time.perf_counter() - t0) / GB, longest * 1000.0


def _sweep(cp: Any, src: np.ndarray, dst: Any, pieces_mib: Sequence[float],
           streams: Sequence[CudaStream], window: int) -> dict[str, dict[str, float]]:
    """GB/s of ``src`` copied as back-to-back piece-sized copies, per piece size and per
    number of streams used in turn, timed from the first queue to one final sync (the best
    of 3). No piece crosses a multiple of ``window`` (CUDA rejects a copy spanning two
    registrations)."""
    rt = cp.cuda.runtime
    out: dict[str, dict[str, float]] = {}
    for mib in pieces_mib:
        piece = int(mib * MIB)
        starts = [at for at in range(0, src.size - piece + 1, piece)
                  if at // window == (at + piece - 1) // window]
        row: dict[str, float] = {}
        for n in (1, 2, 4):
            best = 0.0
            for _ in range(3):
                t0 = time.perf_counter()
                for i, at in enumerate(starts):
                    rt.memcpyAsync(dst.data.ptr + at, src.ctypes.data + at, piece,
                                   rt.memcpyHostToDevice, streams[i % n].raw.ptr)
                for s in streams[:n]:
                    s.synchronize()
                best = max(best, len(starts) * piece / (time.perf_counter() - t0) / GB)
            row[f"{n}_streams"] = round(best, 2)
        out[f"{mib:g}MiB"] = row
    return out


def _rows(cp: Any, src: np.ndarray, dst: Any, row_mib: Sequence[float], rows: int,
          stream: CudaStream) -> dict[str, dict[str, float]]:
    """GB/s of experts laid out as a GGUF file lays them out (``rows`` tensors one after
    the other, an expert one ``row``-byte slice of each) copied into contiguous slots: one
    copy per slice (``1d``, the pipeline's way), one ``cudaMemcpy2DAsync`` per expert (the
    slices as the rows of one strided copy, ``2d``), and the same bytes as one plain copy
    per expert (``contiguous``, the bound). Best of 3, one sync at the end. ``src`` is one
    allocation or one registration (a copy may not span two)."""
    rt = cp.cuda.runtime
    h2d, raw = rt.memcpyHostToDevice, stream.raw.ptr
    out: dict[str, dict[str, float]] = {}
    for mib in row_mib:
        row = int(mib * MIB)
        tensor = src.size // rows // row * row
        experts = min(tensor // row, dst.size // (row * rows))
        base, slots = src.ctypes.data, dst.data.ptr
        entry: dict[str, float] = {}
        for name in ("1d", "2d", "contiguous"):
            best = 0.0
            for _ in range(3):
                t0 = time.perf_counter()
                for e in range(experts):
                    slot, at = slots + e * rows * row, base + e * row
                    if name == "1d":
                        for r in range(rows):
                            rt.memcpyAsync(slot + r * row, at + r * tensor, row, h2d, raw)
                    elif name == "2d":
                        rt.memcpy2DAsync(slot, row, at, tensor, row, rows, h2d, raw)
                    else:
                        rt.memcpyAsync(slot, base + e * rows * row, rows * row, h2d, raw)
                stream.synchronize()
                best = max(best, experts * rows * row / (time.perf_counter() - t0) / GB)
            entry[name] = round(best, 2)
        out[f"{mib:g}MiB_x{rows}"] = entry
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.register",
                                description=__doc__.split("\n")[0])
    p.add_argument("--dir", type=Path, default=Path("."), help="where the scratch file goes")
    p.add_argument("--size-gib", type=float, default=8.0)
    p.add_argument("--threads", type=int, default=8, help="staged-read threads (8)")
    p.add_argument("--out", type=Path, required=True)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    require_gpu("bench.register")
    import cupy as cp

    path = args.dir / "moestream-register-probe.bin"
    nbytes = int(args.size_gib * (1 << 30)) // (64 * MIB) * (64 * MIB)
    result: dict[str, Any] = {**provenance("bench.register", argv), "file_bytes": nbytes}
    with scratch_mapping(path, nbytes) as (fd, _addr, mapping):
        stream = CudaStream()
        piece = 8 * MIB
        dst = cp.empty(piece, dtype=cp.uint8)
        sweep_dst = cp.empty(1 << 30, dtype=cp.uint8)
        streams = [stream, CudaStream(), CudaStream(), CudaStream()]
        sizes = (0.5, 1, 2, 3, 8, 64)
        by_piece = _registered(cp, mapping, dst, sweep_dst, sizes, streams, result)
        pinned = CudaPinned(1 << 30)
        pinned.array[:] = 1
        result["h2d_pinned_gbps"], quiet_ms = _copies(cp, pinned.array, dst, stream, piece, 4)
        by_piece["pinned"] = _sweep(cp, pinned.array, sweep_dst, sizes, streams, 1 << 30)
        result["h2d_by_piece_gbps"] = by_piece
        result["h2d_strided_gbps"] = _strided(cp, pinned.array, mapping, sweep_dst, stream)
        result["longest_copy_ms_quiet"] = quiet_ms
        result["staged_read_gbps"] = _staged_read_gbps(fd, pinned.array, nbytes, piece,
                                                       args.threads)
        _during_register(cp, mapping[2 << 30 : nbytes], pinned.array, dst, stream, piece,
                         result)
        pinned.close()
    report(args.out, result)
    return 0


def _registered(cp: Any, mapping: np.ndarray, dst: Any, sweep_dst: Any,
                sizes: Sequence[float], streams: Sequence[CudaStream],
                result: dict[str, Any]) -> dict[str, Any]:
    """Register the mapping's first 2 GiB in 64 MiB, then 256 MiB windows: the rate of
    each (``register_gbps``), copies from the registered bytes (``h2d_registered_gbps``,
    into ``result``) and, at 256 MiB, the by-piece sweep from them (returned)."""
    rt = cp.cuda.runtime
    stream, piece = streams[0], dst.size
    by_piece: dict[str, Any] = {}
    register: dict[str, float] = {}
    for window_mib in (64, 256):
        w = window_mib * MIB
        part = mapping[: 2 << 30]
        t0 = time.perf_counter()
        for at in range(0, part.size, w):
            rt.hostRegister(part.ctypes.data + at, w, _READ_ONLY)
        register[f"{window_mib}MiB"] = part.size / (time.perf_counter() - t0) / GB
        result["h2d_registered_gbps"] = _copies(cp, part[: 1 << 30], dst, stream, piece, 2)[0]
        if window_mib == 256:
            by_piece["registered"] = _sweep(cp, part[: 1 << 30], sweep_dst, sizes, streams, w)
        for at in range(0, part.size, w):
            rt.hostUnregister(part.ctypes.data + at)
    result["register_gbps"] = register
    return by_piece


def _strided(cp: Any, pinned: np.ndarray, mapping: np.ndarray, sweep_dst: Any,
             stream: CudaStream) -> dict[str, Any]:
    """An expert's three slices as one strided copy: from pinned memory, and from one
    registration of 1 GiB of the mapping (the strided copy spans the three tensors)."""
    rt = cp.cuda.runtime
    rows_mib = (0.5, 1, 2, 3)
    by_rows = {"pinned": _rows(cp, pinned, sweep_dst, rows_mib, 3, stream)}
    part = mapping[: 1 << 30]
    rt.hostRegister(part.ctypes.data, part.size, _READ_ONLY)
    try:
        by_rows["registered"] = _rows(cp, part, sweep_dst, rows_mib, 3, stream)
    finally:
        rt.hostUnregister(part.ctypes.data)
    return by_rows


def _staged_read_gbps(fd: int, pinned: np.ndarray, nbytes: int, piece: int,
                      threads: int) -> float:
    """Buffered reads of the file from 2 GiB on (up to 6 GiB) into pinned memory."""
    def staged(at: int) -> None:
        start = (at // piece) % ((1 << 30) // piece) * piece
        os.preadv(fd, [pinned[start : start + piece]], at)  # type: ignore[list-item]

    offsets = range(2 << 30, min(nbytes, 6 << 30), piece)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(staged, offsets))
    return len(offsets) * piece / (time.perf_counter() - t0) / GB


def _during_register(cp: Any, part: np.ndarray, pinned: np.ndarray, dst: Any,
                     stream: CudaStream, piece: int, result: dict[str, Any]) -> None:
    """Copies from pinned memory while another thread registers ``part`` in 256 MiB
    windows: both rates and the longest copy, into ``result``."""
    rt = cp.cuda.runtime
    w = 256 * MIB
    done = threading.Event()
    reg_s: list[float] = []

    def register_all() -> None:
        t1 = time.perf_counter()
        for at in range(0, part.size - w + 1, w):
            rt.hostRegister(part.ctypes.data + at, w, _READ_ONLY)
        reg_s.append(time.perf_counter() - t1)
        done.set()

    reg = threading.Thread(target=register_all)
    reg.start()
    gbps, busy_ms = _copies(cp, pinned, dst, stream, piece, 2)
    reg.join()
    result["h2d_during_register_gbps"] = gbps
    result["longest_copy_ms_during_register"] = busy_ms
    result["register_during_copies_gbps"] = part.size // w * w / reg_s[0] / GB
    for at in range(0, part.size - w + 1, w):
        rt.hostUnregister(part.ctypes.data + at)


if __name__ == "__main__":
    exit_with("python -m bench.register", main)
