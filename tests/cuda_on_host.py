"""CUDA C kernels built for the host, for the tests that check their arithmetic and indexing
without a GPU: a few lines standing in for CUDA's built-ins, a macro that walks a grid block
by block and thread by thread, and the build (g++, no fused multiply-adds, as the kernels'
``_rn`` intrinsics forbid them on the device)."""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

BUILTINS = r"""
#include <cstring>
#define __global__
#define __device__
#define __forceinline__ inline
#define __align__(n) alignas(n)
#define __builtin_assume(x)
#define __shared__ static
struct uint4 { unsigned int x, y, z, w; };
struct uint2 { unsigned int x, y; };
struct dim3 { unsigned int x, y, z; };
static dim3 blockIdx, blockDim, gridDim, threadIdx;
static inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
static inline float __uint_as_float(unsigned i) { float f; memcpy(&f, &i, 4); return f; }
static inline unsigned __float_as_uint(float f) { unsigned i; memcpy(&i, &f, 4); return i; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
typedef _Float16 __half;
static inline __half __float2half_rn(float x) { return (_Float16)x; }
static inline unsigned short __half_as_ushort(__half h) {
    unsigned short u; memcpy(&u, &h, 2); return u;
}
#if defined(__SSE__)
#include <xmmintrin.h>
static inline unsigned flush_begin() {
    unsigned c = _mm_getcsr(); _mm_setcsr(c | 0x8040u); return c;
}
static inline void flush_end(unsigned c) { _mm_setcsr(c); }
#else
static inline unsigned flush_begin() { return 0; }
static inline void flush_end(unsigned) {}
#endif
"""
"""CUDA's built-ins the kernels use, for a host build (``flush_begin``/``flush_end`` set and
restore flush-to-zero, as a device build may run)."""

WALK = r"""
#define WALK(Y, CALL)                                                                     \
    gridDim.x = blocks; gridDim.y = Y; blockDim.x = threads;                              \
    for (unsigned y = 0; y < (unsigned)(Y); ++y)                                          \
        for (unsigned x = 0; x < (unsigned)blocks; ++x)                                   \
            for (unsigned t = 0; t < (unsigned)threads; ++t) {                            \
                blockIdx.x = x; blockIdx.y = y; threadIdx.x = t; CALL;                    \
            }
"""
"""``WALK(Y, CALL)``: ``CALL`` (a kernel) once per thread of a ``blocks`` x ``Y`` grid of
``threads`` threads, the names ``blocks`` and ``threads`` in scope."""


def build(source: str, where: Path) -> ctypes.CDLL | str:
    """``BUILTINS`` + ``source`` compiled into a shared library under ``where``: the library,
    or g++'s error text."""
    path = where / "kernels.cpp"
    path.write_text(BUILTINS + source.replace("#include <cuda_fp16.h>", ""))
    built = subprocess.run(["g++", "-std=c++17", "-O1", "-ffp-contract=off",
                            "-fno-strict-aliasing", "-w", "-shared", "-fPIC", str(path),
                            "-o", str(where / "kernels.so")], capture_output=True, text=True)
    if built.returncode:
        return built.stderr.strip()[:2000]
    return ctypes.CDLL(str(where / "kernels.so"))
