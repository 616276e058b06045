"""The decode kernels, on the host (numpy) and on CUDA (CuPy raw kernels).

Three kinds of work consume cached experts:
- ``digest``: reads every byte of a range and produces the two sums of
``pipeline.foundation.digest``
  (verification, and the ``--compute digest`` decoder);
- ``busy``: keeps the device busy for a fixed time (``--compute fixed:MS``), emulating an
  engine's per-layer compute;
- ``swiglu``: a real SwiGLU expert on a hidden state, for F16 experts.

Digest results are written into a results array and read back once per token, so the host
never waits per expert.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from gpu.backend import DeviceArray, DeviceBuffer, Kernels, Stream
from gpu.cuda import CudaDeviceBuffer, CudaStream
from gpu.host import HostDeviceBuffer
from pipeline.foundation.digest import mix_digests

__all__ = ["CudaKernels", "HostKernels", "make_kernels"]

_CUDA_SOURCE = r"""
extern "C" __global__ void digest3(const unsigned char* base,
                                   unsigned long long off0, unsigned long long n0,
                                   unsigned long long off1, unsigned long long n1,
                                   unsigned long long off2, unsigned long long n2,
                                   unsigned long long* out) {
    // blockIdx.y picks the matrix: out[2*y] += sum(w), out[2*y+1] += sum(w * (i + 1))
    unsigned long long off = blockIdx.y == 0 ? off0 : (blockIdx.y == 1 ? off1 : off2);
    unsigned long long nbytes = blockIdx.y == 0 ? n0 : (blockIdx.y == 1 ? n1 : n2);
    const unsigned char* data = base + off;
    unsigned long long n = nbytes / 4;
    const unsigned int* w = (const unsigned int*)data;
    unsigned long long s1 = 0, s2 = 0;
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
         i < n; i += stride) {
        unsigned long long v = w[i];
        s1 += v;
        s2 += v * (i + 1);
    }
    if (blockIdx.x == 0 && threadIdx.x == 0 && (nbytes & 3)) {
        unsigned long long v = 0;
        for (unsigned long long b = n * 4; b < nbytes; ++b)
            v |= ((unsigned long long)data[b]) << (8 * (b - n * 4));
        s1 += v;
        s2 += v * (n + 1);
    }
    for (int o = 16; o > 0; o >>= 1) {
        s1 += __shfl_down_sync(0xffffffffu, s1, o);
        s2 += __shfl_down_sync(0xffffffffu, s2, o);
    }
    if ((threadIdx.x & 31) == 0) {
        atomicAdd(&out[2 * blockIdx.y], s1);
        atomicAdd(&out[2 * blockIdx.y + 1], s2);
    }
}

extern "C" __global__ void busy_ns(unsigned long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < ns);
}
"""


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

    def _digest(self, data: npt.NDArray[np.uint8], results: npt.NDArray[np.uint64],
                row: int) -> None:
        tail = data.size % 4
        words = data[: data.size - tail].view("<u4").astype(np.uint64)
        weights = np.arange(1, words.size + 1, dtype=np.uint64)
        s1 = words.sum(dtype=np.uint64)
        s2 = (words * weights).sum(dtype=np.uint64)
        if tail:
            last = int.from_bytes(data[data.size - tail :].tobytes(), "little")
            s1 = s1 + np.uint64(last)
            s2 = s2 + np.uint64(last) * np.uint64(words.size + 1)
        results[row, 0] = s1
        results[row, 1] = s2

    def read_results(self, results: DeviceArray, n: int) -> list[int]:
        return mix_digests(results[:n])

    def busy(self, ms: float, buf: DeviceBuffer, stream: Stream) -> None:
        """Real CPU work on the expert's bytes for ``ms`` milliseconds (no sleeping)."""
        end = time.perf_counter() + ms / 1000.0
        data = _host_bytes(buf)
        words = data[: data.size - data.size % 8].view(np.uint64)
        acc = np.uint64(0)
        while time.perf_counter() < end:
            acc ^= np.bitwise_xor.reduce(words[:4096]) if words.size else acc

    def swiglu(self, x: DeviceArray, gate: DeviceArray, up: DeviceArray, down: DeviceArray,
               stream: Stream) -> DeviceArray:
        g = gate.astype(np.float32) @ x
        u = up.astype(np.float32) @ x
        return down.astype(np.float32) @ (g / (1.0 + np.exp(-g)) * u)

    def as_f16(self, data: DeviceArray, rows: int, cols: int) -> DeviceArray:
        return data.view(np.float16).reshape(rows, cols)

    def zeros(self, n: int) -> DeviceArray:
        return np.zeros(n, dtype=np.float32)


class CudaKernels:
    """CuPy raw kernels, queued on the given stream."""

    def __init__(self) -> None:
        import cupy

        self._cp = cupy
        module = cupy.RawModule(code=_CUDA_SOURCE)
        self._digest = module.get_function("digest3")
        self._busy = module.get_function("busy_ns")

    def new_results(self, n: int) -> DeviceArray:
        results = self._cp.zeros((n, 2), dtype=self._cp.uint64)
        # zeroed on the legacy stream, which non-blocking streams do not order with
        self._cp.cuda.Stream.null.synchronize()
        return results

    def digest3(self, buf: DeviceBuffer, ranges: Sequence[tuple[int, int]],
                results: DeviceArray, row: int, stream: Stream) -> None:
        """One launch for an expert's three matrices (blockIdx.y picks the range)."""
        ptr, raw = _cuda_parts(buf, stream)
        largest = max(n for _, n in ranges)
        blocks = max(1, min(256, (largest // 4 + 255) // 256))
        args = [np.uint64(v) for r in ranges for v in r]
        # rows ``row..row+2`` of the (n, 2) uint64 results by address, like ``base``: a
        # CuPy slice per expert costs microseconds of host time on every install
        out = np.uint64(results.data.ptr + row * 16)
        with raw:
            self._digest((blocks, 3), (256,), (np.uint64(ptr), *args, out))

    def read_results(self, results: DeviceArray, n: int) -> list[int]:
        host = self._cp.asnumpy(results[:n])
        return mix_digests(host)

    def busy(self, ms: float, buf: DeviceBuffer, stream: Stream) -> None:
        _, raw = _cuda_parts(None, stream)  # the device spins on its clock: buf is not read
        with raw:
            self._busy((1,), (1,), (np.uint64(int(ms * 1e6)),))

    def swiglu(self, x: DeviceArray, gate: DeviceArray, up: DeviceArray, down: DeviceArray,
               stream: Stream) -> DeviceArray:
        cp = self._cp
        _, raw = _cuda_parts(None, stream)
        with raw:
            g = gate.astype(cp.float32) @ x
            u = up.astype(cp.float32) @ x
            return down.astype(cp.float32) @ (g / (1.0 + cp.exp(-g)) * u)

    def as_f16(self, data: DeviceArray, rows: int, cols: int) -> DeviceArray:
        return data.view(self._cp.float16).reshape(rows, cols)

    def zeros(self, n: int) -> DeviceArray:
        return self._cp.zeros(n, dtype=self._cp.float32)


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


def make_kernels(backend_name: str) -> Kernels:
    """The kernels matching a backend's name."""
    return CudaKernels() if backend_name == "cupy" else HostKernels()
