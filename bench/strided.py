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


def _batcher() -> tuple[str, Callable[[Sequence[int], Sequence[int], Sequence[int], int],
                                      int]] | None:
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


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.strided",
                                description=__doc__.split("\n")[0] if __doc__ else None)
    p.add_argument("--dir", type=Path, default=Path("."), help="where the scratch file goes")
    p.add_argument("--window-mib", type=int, default=256)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    require_gpu("bench.strided")
    import cupy as cp

    rt = cp.cuda.runtime
    h2d = rt.memcpyHostToDevice
    nbytes, window = 1 << 30, args.window_mib * MIB
    path = args.dir / "moestream-strided-probe.bin"
    result: dict[str, Any] = {**provenance("bench.strided", argv), "window_bytes": window}
    with scratch_mapping(path, nbytes) as (_fd, addr, mapping):
        stream = CudaStream()
        dst = cp.empty(nbytes // 2, dtype=cp.uint8)
        raw = stream.raw.ptr
        tensor = nbytes // _ROWS // MIB * MIB  # three "tensors" one after the other
        for at in range(0, nbytes, window):
            rt.hostRegister(addr + at, min(window, nbytes - at), _READ_ONLY)
        # a strided copy with its rows in different registrations
        row, e = 2 * MIB, 5
        want = np.concatenate([mapping[r * tensor + e * row : r * tensor + (e + 1) * row]
                               for r in range(_ROWS)])
        try:
            rt.memcpy2DAsync(dst.data.ptr, row, addr + e * row, tensor, row, _ROWS, h2d, raw)
            stream.synchronize()
            same = bool(np.array_equal(cp.asnumpy(dst[: _ROWS * row]), want))
            result["strided_across_windows"] = {"accepted": True, "bytes_right": same}
        except Exception as exc:  # the driver's refusal is the finding
            result["strided_across_windows"] = {"accepted": False, "error": str(exc)}
        found = _batcher()
        result["batched_api"] = found[0] if found else None
        batched: dict[str, dict[str, float | str]] = {}
        for mib in (0.5, 1, 2, 3):
            row = int(mib * MIB)
            # experts none of whose slices straddles two windows (one copy each must not)
            chosen = [e for e in range(min(tensor // row, dst.size // (_ROWS * row)))
                      if all((r * tensor + e * row) // window
                             == (r * tensor + (e + 1) * row - 1) // window for r in range(_ROWS))]
            experts = len(chosen)
            moved = experts * _ROWS * row
            srcs = [[addr + r * tensor + e * row for r in range(_ROWS)] for e in chosen]
            dsts = [[dst.data.ptr + (i * _ROWS + r) * row for r in range(_ROWS)]
                    for i in range(experts)]

            def one_each(srcs: list[list[int]] = srcs, dsts: list[list[int]] = dsts,
                         row: int = row) -> None:
                for s3, d3 in zip(srcs, dsts, strict=True):
                    for s, d in zip(s3, d3, strict=True):
                        rt.memcpyAsync(d, s, row, h2d, raw)

            entry: dict[str, float | str] = {"1d": _timed(stream, moved, one_each)}
            if found is not None:
                call = found[1]
                for per in (1, 10):  # experts a call
                    groups = [([d for d3 in dsts[g : g + per] for d in d3],
                               [s for s3 in srcs[g : g + per] for s in s3])
                              for g in range(0, experts, per)]

                    def batch(groups: list[tuple[list[int], list[int]]] = groups,
                              row: int = row, call: Any = call) -> None:
                        for d, s in groups:
                            status = call(d, s, [row] * len(d), raw)
                            if status:
                                raise RuntimeError(f"cuMemcpyBatchAsync: CUresult {status}")

                    try:
                        entry[f"batched_{per}"] = _timed(stream, moved, batch)
                    except RuntimeError as exc:
                        entry[f"batched_{per}"] = str(exc)
                e, i = chosen[-1], experts - 1
                want = np.concatenate([mapping[r * tensor + e * row : r * tensor + (e + 1) * row]
                                       for r in range(_ROWS)])
                got = cp.asnumpy(dst[i * _ROWS * row : (i + 1) * _ROWS * row])
                entry["batched_bytes_right"] = str(bool(np.array_equal(got, want)))
            batched[f"{mib:g}MiB_x{_ROWS}"] = entry
        result["by_row"] = batched
        for at in range(0, nbytes, window):
            rt.hostUnregister(addr + at)
        # one registration over the whole span: the strided copy's own rate, for comparison
        rt.hostRegister(addr, nbytes, _READ_ONLY)
        for mib in (0.5, 1, 2, 3):
            row = int(mib * MIB)
            experts = min(tensor // row, dst.size // (_ROWS * row))

            def strided(row: int = row, experts: int = experts) -> None:
                for e in range(experts):
                    rt.memcpy2DAsync(dst.data.ptr + e * _ROWS * row, row, addr + e * row, tensor,
                                     row, _ROWS, h2d, raw)

            batched[f"{mib:g}MiB_x{_ROWS}"]["2d_one_registration"] = _timed(
                stream, experts * _ROWS * row, strided)
        rt.hostUnregister(addr)
    report(args.out, result)
    return 0


if __name__ == "__main__":
    exit_with("python -m bench.strided", main)
