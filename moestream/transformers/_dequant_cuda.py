"""FP8 block dequantization of a batch of cached experts on a CUDA device, in one kernel a
matrix kind (CuPy), bitwise what torch's ops give.

torch's path stacks the experts' bytes (a copy, made through one DLPack import a matrix:
host time), then ``float32(w) * float32(scale)`` and ``.to(dtype)`` (four kernels, about 15
bytes of memory traffic a weight). This kernel reads each expert's FP8 bytes where the
cache holds them (a table of device addresses and expert ids, copied from pinned memory
without a wait) and its block scale, and writes the compute dtype straight into the grouped
product's stacked weights. It computes the same values: E4M3 decoded exactly (every E4M3
value is a float32), one IEEE float32 product, rounded to the output type by
round-to-nearest-even (BF16 by c10's rule, F16 by ``__float2half_rn``): ``torch.equal``
to the torch ops' (NaN codes give a NaN either way). Integer arithmetic is 32-bit per row
and column (a 64-bit division per weight made a first version slower than torch's ops).
Launched on torch's current stream: ordered with the model's kernels, no synchronization.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence
from typing import Any

import torch  # type: ignore[import-not-found, unused-ignore]

__all__ = ["CUDA_DTYPES", "available", "fp8_experts_cuda"]

_SOURCE = r"""
#include <cuda_fp16.h>

__device__ __forceinline__ float e4m3(unsigned char b) {
    int e = (b >> 3) & 15, m = b & 7;
    float v;
    if (e == 15 && m == 7) v = __int_as_float(0x7fc00000);
    else if (e == 0) v = ldexpf((float)m, -9);
    else v = ldexpf((float)(8 + m), e - 10);
    return (b & 128) ? -v : v;
}

__device__ __forceinline__ unsigned short to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}

#define KERNEL(NAME, OUT, STORE)                                                          \
extern "C" __global__ void NAME(const long long* table, const float* scales,             \
                                unsigned long long out_address, int n, int rows,         \
                                int cols, int sr, int sc, int bm, int bn,                \
                                long long out_stride) {                                  \
    OUT* out = (OUT*)out_address;                                                        \
    for (int row = blockIdx.y; row < n * rows; row += gridDim.y) {                       \
        int k = row / rows, r = row - k * rows;                                          \
        const unsigned char* w = (const unsigned char*)table[k] + (long long)r * cols;   \
        const float* s = scales + ((long long)table[n + k] * sr + r / bm) * sc;          \
        OUT* o = out + k * out_stride + (long long)r * cols;                             \
        for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < cols;                    \
             c += gridDim.x * blockDim.x) {                                              \
            float x = e4m3(w[c]) * s[c / bn];                                            \
            o[c] = STORE;                                                                \
        }                                                                                \
    }                                                                                    \
}

KERNEL(fp8_experts_bf16, unsigned short, to_bf16(x))
KERNEL(fp8_experts_f16, unsigned short, __half_as_ushort(__float2half_rn(x)))
KERNEL(fp8_experts_f32, float, x)
"""
_KERNELS = {torch.bfloat16: "fp8_experts_bf16", torch.float16: "fp8_experts_f16",
            torch.float32: "fp8_experts_f32"}
CUDA_DTYPES = frozenset(_KERNELS)
"""The output types the kernel writes."""
_THREADS = 256
_ROWS_AT_ONCE = 65535  # the grid's y limit; rows past it are strided over


@functools.cache
def available() -> bool:
    """Whether CuPy is here to compile and launch the kernel (with a CUDA device)."""
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


@functools.lru_cache(maxsize=64)
def _stream(pointer: int, device: int) -> Any:
    """torch's stream as CuPy's (made once a stream)."""
    import cupy

    with warnings.catch_warnings():  # its successor needs a protocol older torch lacks
        warnings.simplefilter("ignore", DeprecationWarning)
        return cupy.cuda.ExternalStream(pointer, device)


@functools.cache
def _module() -> Any:
    import cupy

    return cupy.RawModule(code=_SOURCE, options=("-std=c++14",))


def fp8_experts_cuda(addresses: Sequence[int], experts: Sequence[int], scales: Any,
                     out: Any, block: tuple[int, int]) -> None:
    """Dequantize ``len(addresses)`` FP8 matrices into ``out``.

    Args:
        addresses: each matrix's device address (``Matrix.ptr``), ``(rows, cols)`` bytes.
        experts: each matrix's expert, its row of ``scales``.
        scales: float32 ``(experts, ceil(rows / bm), ceil(cols / bn))`` on the device.
        out: ``(n, rows, cols)`` of a ``CUDA_DTYPES`` type, rows contiguous (a slice of
            the stacked gate_up is fine: any stride between matrices).
        block: ``(bm, bn)``.
    """
    import cupy

    n, rows, cols = out.shape
    if n == 0 or rows == 0 or cols == 0:
        return
    if out.stride(2) != 1 or out.stride(1) != cols:
        raise ValueError("the kernel writes rows of contiguous columns")
    device = out.device
    table = torch.tensor([*addresses, *experts], dtype=torch.int64, pin_memory=True)
    table = table.to(device, non_blocking=True)  # from pinned memory: queued, not waited
    _, sr, sc = scales.shape
    grid = (min(-(-cols // _THREADS), 8), min(n * rows, _ROWS_AT_ONCE))
    index = device.index or 0
    stream = _stream(torch.cuda.current_stream(device).cuda_stream, index)
    with cupy.cuda.Device(index), stream:
        _module().get_function(_KERNELS[out.dtype])(grid, (_THREADS,), (
            cupy.uint64(table.data_ptr()), cupy.uint64(scales.data_ptr()),
            cupy.uint64(out.data_ptr()), cupy.int32(n), cupy.int32(rows), cupy.int32(cols),
            cupy.int32(sr), cupy.int32(sc), cupy.int32(block[0]), cupy.int32(block[1]),
            cupy.int64(out.stride(0))))
