"""``python -m bench.strided``: can an expert's slices travel as one copy from the mapping?

Why: a GGUF file keeps a layer's experts in one tensor per matrix, so an expert is three
slices far apart, and the copy engines pay a fixed ~2.7 us per copy (``bench.register``'s
``h2d_by_piece_gbps``): at 0.5-2 MiB slices that is 5-15% of the link. ``bench.register``
found that one ``cudaMemcpy2DAsync`` per expert (the slices as the rows of one strided
copy) moves them as fast as one contiguous copy. Resident mode copies from a mapping
registered in windows, and an expert's slices lie in different windows. This measures, on
one resident file registered in ``--window-mib`` windows:

- ``strided_across_windows``: whether a strided copy whose rows lie in different
  registrations is accepted, and whether it moves the right bytes;
- ``batched``: ``cuMemcpyBatchAsync`` (driver API, CUDA 12.8+; any pointers, one call) for
  an expert's slices and for ten experts' at once, GB/s beside one copy per slice and (one
  registration over the whole span) one strided copy per expert; bytes checked.

CuPy only (a GPU machine). The result goes to ``--out`` with machine, commit and command.
"""

from __future__ import annotations

import argparse
import ctypes
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.kit import exit_with, require_gpu
from bench.record import provenance, report
from bench.register import scratch_mapping
from moestream.gpu.cuda import CudaStream

__all__ = ["main"]

GB = 1e9
MIB = 1 << 20
_READ_ONLY = 0x08
_ROWS = 3


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _Attributes(ctypes.Structure):
    """CUmemcpyAttributes: source access order, source and destination hints, flags."""

    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", _Location),
                ("dstLocHint", _Location), ("flags", ctypes.c_uint)]


_ORDER_STREAM, _LOCATION_DEVICE, _LOCATION_HOST = 1, 1, 2
_Batcher = tuple[str, Callable[[Sequence[int], Sequence[int], Sequence[int], int], int]]
"""A batched copy's name and ``call(dsts, srcs, sizes, stream) -> CUresult``."""


def _batcher() -> _Batcher | None:
    """The driver's batched copy as ``call(dsts, srcs, sizes, stream) -> CUresult``, or
    None where the driver has none (before CUDA 12.8)."""
    lib = ctypes.CDLL("libcuda.so.1")
    attrs = _Attributes(_ORDER_STREAM, _Location(_LOCATION_HOST, 0),
                        _Location(_LOCATION_DEVICE, 0), 0)
    index = (ctypes.c_size_t * 1)(0)
    for name, fail_index in (("cuMemcpyBatchAsync_v2", False), ("cuMemcpyBatchAsync", True)):
        fn = getattr(lib, name, None)
        if fn is None:
            continue

        def call(dsts: Sequence[int], srcs: Sequence[int], sizes: Sequence[int],
                 stream: int, fn: Any = fn, fail_index: bool = fail_index) -> int:
            n = len(dsts)
            args: list[Any] = [(ctypes.c_uint64 * n)(*dsts), (ctypes.c_uint64 * n)(*srcs),
                               (ctypes.c_size_t * n)(*sizes), ctypes.c_size_t(n),
                               ctypes.byref(attrs), index, ctypes.c_size_t(1)]
            if fail_index:
                args.append(ctypes.byref(ctypes.c_size_t(0)))
            args.append(ctypes.c_void_p(stream))
            return int(fn(*args))

        return name, call
    return None


def _timed(stream: CudaStream, nbytes: int, queue: Callable[[], None]) -> float:
    """GB/s of ``queue``'s copies, best of 3, one sync each."""
    best = 0.0
    for _ in range(3):
        t0 = time.perf_counter()
        queue()
        stream.synchronize()
        best = max(best, nbytes / (time.perf_counter() - t0) / GB)
    return round(best, 2)


@dataclass(frozen=True)
class _Probe:
    """The scratch mapping and the device side every measurement here shares."""

    cp: Any
    stream: CudaStream
    dst: Any  # device bytes the copies land in
    addr: int  # the mapping's address
    mapping: np.ndarray
    tensor: int  # bytes of each of the three "tensors", one after the other
    window: int

    @property
    def raw(self) -> int:
        return int(self.stream.raw.ptr)

    def copy_2d(self, dst: int, row: int, src: int) -> None:
        """One strided copy: ``_ROWS`` rows of ``row`` bytes, ``tensor`` bytes apart."""
        rt = self.cp.cuda.runtime
        rt.memcpy2DAsync(dst, row, src, self.tensor, row, _ROWS, rt.memcpyHostToDevice,
                         self.raw)

    def expert(self, e: int, row: int) -> np.ndarray:
        """Expert ``e``'s bytes at ``row``-byte slices, as the mapping holds them."""
        return np.concatenate([self.mapping[r * self.tensor + e * row
                                            : r * self.tensor + (e + 1) * row]
                               for r in range(_ROWS)])


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.strided",
                                description=__doc__.split("\n")[0] if __doc__ else None)
    p.add_argument("--dir", type=Path, default=Path("."), help="where the scratch file goes")
    p.add_argument("--window-mib", type=int, default=256)
    p.add_argument("--out", type=Path, required=True)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    require_gpu("bench.strided")
    import cupy as cp

    rt = cp.cuda.runtime
    nbytes, window = 1 << 30, args.window_mib * MIB
    path = args.dir / "moestream-strided-probe.bin"
    result: dict[str, Any] = {**provenance("bench.strided", argv), "window_bytes": window}
    with scratch_mapping(path, nbytes) as (_fd, addr, mapping):
        probe = _Probe(cp, CudaStream(), cp.empty(nbytes // 2, dtype=cp.uint8), addr, mapping,
                       nbytes // _ROWS // MIB * MIB, window)
        for at in range(0, nbytes, window):
            rt.hostRegister(addr + at, min(window, nbytes - at), _READ_ONLY)
        result["strided_across_windows"] = _across_windows(probe)
        found = _batcher()
        result["batched_api"] = found[0] if found else None
        batched = {f"{mib:g}MiB_x{_ROWS}": _by_row(probe, int(mib * MIB), found)
                   for mib in (0.5, 1, 2, 3)}
        result["by_row"] = batched
        for at in range(0, nbytes, window):
            rt.hostUnregister(addr + at)
        # one registration over the whole span: the strided copy's own rate, for comparison
        rt.hostRegister(addr, nbytes, _READ_ONLY)
        for mib in (0.5, 1, 2, 3):
            batched[f"{mib:g}MiB_x{_ROWS}"]["2d_one_registration"] = _one_registration(
                probe, int(mib * MIB))
        rt.hostUnregister(addr)
    report(args.out, result)
    return 0


def _across_windows(probe: _Probe) -> dict[str, Any]:
    """A strided copy with its rows in different registrations: accepted, bytes right?"""
    row, e = 2 * MIB, 5
    want = probe.expert(e, row)
    try:
        probe.copy_2d(probe.dst.data.ptr, row, probe.addr + e * row)
        probe.stream.synchronize()
        same = bool(np.array_equal(probe.cp.asnumpy(probe.dst[: _ROWS * row]), want))
        return {"accepted": True, "bytes_right": same}
    except Exception as exc:  # the driver's refusal is the finding
        return {"accepted": False, "error": str(exc)}


def _by_row(probe: _Probe, row: int, found: _Batcher | None) -> dict[str, float | str]:
    """Experts of ``row``-byte slices: one copy per slice (``1d``), and, where the driver
    has it, batched copies of one and ten experts a call, with their bytes checked."""
    rt, dst, tensor, window = probe.cp.cuda.runtime, probe.dst, probe.tensor, probe.window
    h2d, raw = rt.memcpyHostToDevice, probe.raw
    # experts none of whose slices straddles two windows (one copy each must not)
    chosen = [e for e in range(min(tensor // row, dst.size // (_ROWS * row)))
              if all((r * tensor + e * row) // window
                     == (r * tensor + (e + 1) * row - 1) // window for r in range(_ROWS))]
    experts = len(chosen)
    moved = experts * _ROWS * row
    srcs = [[probe.addr + r * tensor + e * row for r in range(_ROWS)] for e in chosen]
    dsts = [[dst.data.ptr + (i * _ROWS + r) * row for r in range(_ROWS)]
            for i in range(experts)]

    def one_each() -> None:
        for s3, d3 in zip(srcs, dsts, strict=True):
            for s, d in zip(s3, d3, strict=True):
                rt.memcpyAsync(d, s, row, h2d, raw)

    entry: dict[str, float | str] = {"1d": _timed(probe.stream, moved, one_each)}
    if found is None:
        return entry
    call = found[1]
    for per in (1, 10):  # experts a call
        groups = [([d for d3 in dsts[g : g + per] for d in d3],
                   [s for s3 in srcs[g : g + per] for s in s3])
                  for g in range(0, experts, per)]

        def batch(groups: list[tuple[list[int], list[int]]] = groups) -> None:
            for d, s in groups:
                status = call(d, s, [row] * len(d), raw)
                if status:
                    raise RuntimeError(f"cuMemcpyBatchAsync: CUresult {status}")

        try:
            entry[f"batched_{per}"] = _timed(probe.stream, moved, batch)
        except RuntimeError as exc:
            entry[f"batched_{per}"] = str(exc)
    e, i = chosen[-1], experts - 1
    got = probe.cp.asnumpy(dst[i * _ROWS * row : (i + 1) * _ROWS * row])
    entry["batched_bytes_right"] = str(bool(np.array_equal(got, probe.expert(e, row))))
    return entry


def _one_registration(probe: _Probe, row: int) -> float:
    """GB/s of one strided copy per expert, the whole span one registration."""
    experts = min(probe.tensor // row, probe.dst.size // (_ROWS * row))

    def strided() -> None:
        for e in range(experts):
            probe.copy_2d(probe.dst.data.ptr + e * _ROWS * row, row, probe.addr + e * row)

    return _timed(probe.stream, experts * _ROWS * row, strided)


if __name__ == "__main__":
    exit_with("python -m bench.strided", main)
