"""The decode kernels, on the host (numpy) and on CUDA (CuPy raw kernels, their CUDA C in
``moestream.gpu.kernelsource``).

Three kinds of work consume cached experts:
- ``digest``: reads every byte of a range and produces the two sums of
``moestream.pipeline.foundation.digest``
  (verification, and the ``--compute digest`` decoder);
- ``busy``: keeps the device busy for a fixed time (``--compute fixed:MS``), emulating an
  engine's per-layer compute;
- ``swiglu``: a real SwiGLU expert on a hidden state, in float32: F16 experts (cast), or
  quantized ones dequantized (``moestream.gpu.dequant``; float32 already: no copy).

Digest results are written into a results array and read back once per token, so the host
never waits per expert.

One kind fills the cache: ``gather`` copies a layer's resident misses from the registered
file mapping in one launch, and digests each range as it writes it (``COPY_FIELDS``). Why a
kernel and not the copy engines: 2.5 MiB experts are 7.5 copies of 0.84 MiB each, and per-copy
launch and scheduling cost held ``cudaMemcpyAsync`` at 0.6-0.83 of one large pinned copy on
the H200; a kernel reading the device-mapped pages (``Backend.maps_host``) moves a
whole layer per launch, and the install digest rides along instead of re-reading the copy.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from moestream.gpu.backend import DeviceArray, DeviceBuffer, Kernels, Stream
from moestream.gpu.cuda import CudaDeviceBuffer, CudaStream
from moestream.gpu.host import HostDeviceBuffer
from moestream.gpu.kernelsource import CUDA_SOURCE
from moestream.pipeline.foundation.config import GATHER_BLOCKS
from moestream.pipeline.foundation.digest import mix_digests

__all__ = ["COPY_FIELDS", "GATHER_BLOCKS", "NO_FLIP", "CudaKernels", "HostKernels", "copy_rows",
           "make_kernels"]

COPY_FIELDS = 5
"""A ``gather`` row, uint64: source address (device-readable registered host memory),
destination device address, bytes, digest address (two uint64 sums, a results row as
``digest3`` fills; 0 for none), byte offset to invert (``NO_FLIP`` for none)."""
NO_FLIP = (1 << 64) - 1


def copy_rows(fields: Sequence[int]) -> npt.NDArray[np.uint64]:
    """``gather``'s (n, ``COPY_FIELDS``) array from its rows' fields, one row after another
    (a flat list converts in half the time of a list of row tuples)."""
    return np.array(fields, dtype=np.uint64).reshape(-1, COPY_FIELDS)


class HostKernels:
    """numpy versions; results land in host arrays at once."""

    def new_results(self, n: int) -> npt.NDArray[np.uint64]:
        return np.zeros((n, 2), dtype=np.uint64)

    def digest3(self, buf: DeviceBuffer, ranges: Sequence[tuple[int, int]],
                results: DeviceArray, row: int, stream: Stream) -> None:
        """Digest sums of three (offset, nbytes) ranges of a device buffer into 3 rows."""
        data = _host_bytes(buf)
        for m, (offset, nbytes) in enumerate(ranges):
            self._digest(data[offset : offset + nbytes], results, row + m)

    def digest_views(self, views: Sequence[DeviceArray], results: DeviceArray, row: int,
                     stream: Stream) -> None:
        for m, view in enumerate(views):
            self._digest(view, results, row + m)

    def _digest(self, data: npt.NDArray[np.uint8], results: npt.NDArray[np.uint64],
                row: int) -> None:
        # adds to the row, as the CUDA kernels' atomics do (rows start at zero)
        tail = data.size % 4
        words = data[: data.size - tail].view("<u4").astype(np.uint64)
        weights = np.arange(1, words.size + 1, dtype=np.uint64)
        s1 = words.sum(dtype=np.uint64)
        s2 = (words * weights).sum(dtype=np.uint64)
        if tail:
            last = int.from_bytes(data[data.size - tail :].tobytes(), "little")
            s1 = s1 + np.uint64(last)
            s2 = s2 + np.uint64(last) * np.uint64(words.size + 1)
        results[row, 0] += s1
        results[row, 1] += s2

    def read_results(self, results: DeviceArray, n: int) -> npt.NDArray[np.uint64]:
        return mix_digests(results[:n])

    def results_address(self, results: DeviceArray, row: int) -> int:
        return int(results.ctypes.data) + row * 16

    def gather(self, copies: npt.NDArray[np.uint64], stream: Stream) -> None:
        """The copies at once, by address (host memory stands in for both sides)."""
        for src, dst, nbytes, out, flip in copies.tolist():
            data = _at(dst, nbytes)
            data[:] = _at(src, nbytes)
            if flip != NO_FLIP:
                data[flip] ^= 0xFF
            if out:
                sums = _at(out, 16).view(np.uint64)
                self._digest(data, sums.reshape(1, 2), 0)

    def busy(self, ms: float, data: DeviceArray | None, stream: Stream) -> None:
        """Real CPU work on the expert's bytes for ``ms`` milliseconds (no sleeping)."""
        if data is None:
            raise TypeError("the host backend's busy work reads an expert's bytes")
        end = time.perf_counter() + ms / 1000.0
        words = data[: data.size - data.size % 8].view(np.uint64)
        acc = np.uint64(0)
        while time.perf_counter() < end:
            acc ^= np.bitwise_xor.reduce(words[:4096]) if words.size else acc

    def swiglu(self, x: DeviceArray, gate: DeviceArray, up: DeviceArray, down: DeviceArray,
               stream: Stream) -> DeviceArray:
        g = gate.astype(np.float32, copy=False) @ x
        u = up.astype(np.float32, copy=False) @ x
        # exp(-g) overflows to inf for a very negative g: g / inf is SiLU's limit there, 0
        with np.errstate(over="ignore"):
            silu = g / (1.0 + np.exp(-g))
        return down.astype(np.float32, copy=False) @ (silu * u)

    def as_f16(self, data: DeviceArray, rows: int, cols: int) -> DeviceArray:
        return data.view(np.float16).reshape(rows, cols)

    def zeros(self, n: int) -> DeviceArray:
        return np.zeros(n, dtype=np.float32)


class CudaKernels:
    """CuPy raw kernels, queued on the given stream."""

    def __init__(self, gather_blocks: int = GATHER_BLOCKS) -> None:
        import cupy

        self._cp = cupy
        module = cupy.RawModule(code=CUDA_SOURCE)
        self._digest = module.get_function("digest3")
        self._busy = module.get_function("busy_ns")
        self._gather = module.get_function("gather")
        self._rows = _CopySlots(_SLOTS, _SLOT_ROWS)
        self._gather_blocks = gather_blocks

    def new_results(self, n: int) -> DeviceArray:
        results = self._cp.zeros((n, 2), dtype=self._cp.uint64)
        # zeroed on the legacy stream, which non-blocking streams do not order with
        self._cp.cuda.Stream.null.synchronize()
        return results

    def digest3(self, buf: DeviceBuffer, ranges: Sequence[tuple[int, int]],
                results: DeviceArray, row: int, stream: Stream) -> None:
        """One launch for an expert's three matrices (blockIdx.y picks the range)."""
        ptr, raw = _cuda_parts(buf, stream)
        self._launch_digest(ptr, ranges, results, row, raw)

    def digest_views(self, views: Sequence[DeviceArray], results: DeviceArray, row: int,
                     stream: Stream) -> None:
        """``digest3`` from the lowest view's address, the others as offsets from it."""
        ptrs = [int(v.data.ptr) for v in views]
        base = min(ptrs)
        _, raw = _cuda_parts(None, stream)
        self._launch_digest(base, [(p - base, int(v.nbytes)) for p, v in zip(ptrs, views,
                                                                              strict=True)],
                            results, row, raw)

    def _launch_digest(self, base: int, ranges: Sequence[tuple[int, int]],
                       results: DeviceArray, row: int, raw_stream: Any) -> None:
        largest = max(n for _, n in ranges)
        blocks = max(1, min(256, (largest // 4 + 255) // 256))
        args = [np.uint64(v) for r in ranges for v in r]
        # rows ``row..row+2`` of the (n, 2) uint64 results by address, like ``base``: a
        # CuPy slice per expert costs microseconds of host time on every install
        out = np.uint64(results.data.ptr + row * 16)
        with raw_stream:
            self._digest((blocks, 3), (256,), (np.uint64(base), *args, out))

    def read_results(self, results: DeviceArray, n: int) -> npt.NDArray[np.uint64]:
        host = self._cp.asnumpy(results[:n])
        return mix_digests(host)

    def results_address(self, results: DeviceArray, row: int) -> int:
        return int(results.data.ptr) + row * 16

    def gather(self, copies: npt.NDArray[np.uint64], stream: Stream) -> None:
        """One launch per ``_SLOT_ROWS`` copies; the rows go through pinned slots the kernel
        reads in place (no copy of them, no allocation per launch)."""
        _, raw = _cuda_parts(None, stream)
        for start in range(0, len(copies), _SLOT_ROWS):
            part = copies[start : start + _SLOT_ROWS]
            slot, rows = self._rows.take()
            rows[: len(part)] = part
            largest = int(part[:, 2].max())
            blocks = max(1, min(self._gather_blocks, -(-largest // _GATHER_BYTES_PER_BLOCK)))
            with raw:
                self._gather((blocks, len(part)), (256,), (np.uint64(rows.ctypes.data),))
            self._rows.used(slot, raw)

    def busy(self, ms: float, data: DeviceArray | None, stream: Stream) -> None:
        _, raw = _cuda_parts(None, stream)  # the device spins on its clock: data is not read
        with raw:
            self._busy((1,), (1,), (np.uint64(int(ms * 1e6)),))

    def swiglu(self, x: DeviceArray, gate: DeviceArray, up: DeviceArray, down: DeviceArray,
               stream: Stream) -> DeviceArray:
        cp = self._cp
        _, raw = _cuda_parts(None, stream)
        with raw:
            g = gate.astype(cp.float32, copy=False) @ x
            u = up.astype(cp.float32, copy=False) @ x
            return down.astype(cp.float32, copy=False) @ (g / (1.0 + cp.exp(-g)) * u)

    def as_f16(self, data: DeviceArray, rows: int, cols: int) -> DeviceArray:
        return data.view(self._cp.float16).reshape(rows, cols)

    def zeros(self, n: int) -> DeviceArray:
        return self._cp.zeros(n, dtype=self._cp.float32)


_SLOTS = 64
_SLOT_ROWS = 256
_GATHER_BYTES_PER_BLOCK = 64 << 10


class _CopySlots:
    """Pinned rows for ``gather`` launches, reused in turn once the launch that read them ran.

    ``cudaHostAlloc`` memory is mapped for every device (unified addressing), so the kernel
    reads its rows from here; a slot is rewritten only after the event recorded behind its
    last launch (64 launches ago: long done, so the wait costs nothing but its check). The
    events are made once and recorded again, not made per launch.
    """

    def __init__(self, slots: int, rows: int) -> None:
        import cupy

        from moestream.gpu.cuda import CudaPinned

        self._pinned = CudaPinned(slots * rows * COPY_FIELDS * 8)
        self._rows = self._pinned.array.view(np.uint64).reshape(slots, rows, COPY_FIELDS)
        self._events = [cupy.cuda.Event(block=False, disable_timing=True) for _ in range(slots)]
        self._recorded = [False] * slots
        self._next = 0
        self._lock = threading.Lock()

    def take(self) -> tuple[int, npt.NDArray[np.uint64]]:
        with self._lock:
            slot = self._next
            self._next = (slot + 1) % len(self._events)
            recorded, self._recorded[slot] = self._recorded[slot], False
        if recorded:
            self._events[slot].synchronize()
        rows: npt.NDArray[np.uint64] = self._rows[slot]
        return slot, rows

    def used(self, slot: int, stream: Any) -> None:
        """Record ``slot``'s event on ``stream`` (a CuPy stream) right after its launch."""
        self._events[slot].record(stream)
        self._recorded[slot] = True


def _at(address: int, nbytes: int) -> npt.NDArray[np.uint8]:
    """A uint8 view of ``nbytes`` of host memory at ``address`` (the host kernels' pointers)."""
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(address))


def _host_bytes(buf: DeviceBuffer) -> npt.NDArray[np.uint8]:
    """The bytes of a host-backend device buffer (the host kernels run on nothing else)."""
    if not isinstance(buf, HostDeviceBuffer):
        raise TypeError(f"host kernels got a {type(buf).__name__}, not a host device buffer")
    return buf.array


def _cuda_parts(buf: DeviceBuffer | None, stream: Stream) -> tuple[int, Any]:
    """The device pointer of a CUDA buffer and the CuPy stream of a CUDA stream."""
    if not isinstance(stream, CudaStream) or not (
            buf is None or isinstance(buf, CudaDeviceBuffer)):
        raise TypeError(f"CUDA kernels got a {type(buf).__name__} on a {type(stream).__name__}")
    return (buf.ptr if buf is not None else 0), stream.raw


def make_kernels(backend_name: str, gather_blocks: int = GATHER_BLOCKS) -> Kernels:
    """The kernels matching a backend's name (``gather_blocks``: the gather's SM budget)."""
    return CudaKernels(gather_blocks) if backend_name == "cupy" else HostKernels()
