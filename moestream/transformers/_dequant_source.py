"""The CUDA C of the quantized experts' dequantization kernels (``_dequant_cuda`` compiles
and launches them; kept apart so the source reads as one piece).

Every kernel reads one batch's *table* (int64, device memory): per matrix kind (gate, up,
down: ``blockIdx.y``) a block of parameters, then each kind's matrix addresses (where the
cache holds the expert's bytes), then the experts' ids (their rows of the scales). Every
kernel also takes a call's *slots* instead (a device tensor of expert ids, -1 for an empty
slot) and a layer's table of each expert's (gate, up, down) addresses: the experts a call
routes to are then named on the device, never read on the host (``WholeLayers``).
Their loads take the widest word the address allows (a matrix read in place from a file's
mapping may be 8-aligned only, and each load is then a PCIe read). A thread
turns one chunk into output values: 16 FP8 bytes of a row (or one, where the row, its block
width or the output does not allow 16), or one 32-value group of an FP4 row (16 bytes and
its one E8M0 scale). Index arithmetic is 64-bit once a chunk, never per value.

- FP8 (``fp8_experts_*``): E4M3 decoded exactly (every E4M3 value is an F16: by the
  hardware's conversion on sm_89 and later, else by its bits), widened to float32,
  times the block's float32 scale (one IEEE product), rounded to the output type: BF16 by
  c10's round-to-nearest-even (NaN 0x7fc0), F16 by ``__float2half_rn``.
- FP4 (``fp4_experts_*``): a byte is two E2M1 codes, the low nibble first; each value is
  looked up in a table of the output type's bits, 16 codes for each of the 256 scale bytes,
  made once by the torch path itself (so it is that path's value for that code and scale,
  whatever its arithmetic: DeepSeek-V4's ``e2m1 * e8m0``, gpt-oss's ``ldexp``), copied
  into each block's shared memory (a warp's 32 lookups hit scattered rows). MXFP4's
  bytes are rows of the untransposed matrices while gpt-oss keeps them transposed: the
  kernel writes the transpose, consecutive threads taking consecutive rows so that each
  store of a warp is contiguous.
- GGUF (``gguf_<type>_<out>``, :func:`gguf_source`, a module of its own): a table of
  ``GGUF_PARAMS`` a kind, then the kinds' matrix addresses; a thread turns the 32 values of
  one sub-block into the output type (a 16-byte store where the output allows), each
  value by the foundation's routine for its type (``ggml_values``: gguf-py's float32 bits)
  rounded once as above. One launch a type: a layer of ds4's mix is two.
"""

from __future__ import annotations

import functools

from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from moestream.pipeline.foundation.compute import DEQUANTIZED
from moestream.pipeline.foundation.ggml_values import value_source

__all__ = ["FP4_PARAMS", "FP8_PARAMS", "GGUF_GROUP", "GGUF_KERNELS", "GGUF_PARAMS", "SOURCE",
           "gguf_source"]

FP8_PARAMS = 8
"""int64 parameters of a kind in an FP8 table: out, out_stride, rows, cols, scales,
scale_rows, scale_cols, vec (bit 0: 16 bytes at once)."""
FP4_PARAMS = 10
"""int64 parameters of a kind in an FP4 table: out, out_stride, ld, transposed, rows,
groups, scales, scale_expert_stride, scale_row_stride, vec (bit 0: the output rows
16-aligned)."""

GGUF_PARAMS = 4
"""int64 parameters of a kind in a GGUF table: out, out_stride (values between experts),
values (a matrix's: whole groups of ``GGUF_GROUP``), vec (bit 0: 16-byte stores)."""

_PRELUDE = r"""
#include <cuda_fp16.h>

typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;

__device__ __forceinline__ float e4m3(u32 b) {
    u32 e = (b >> 3) & 15u, m = b & 7u;
    float v;
    if (e == 15u && m == 7u) v = __int_as_float(0x7fc00000);
    else if (e == 0u) v = (float)m * 0.001953125f;  /* m * 2^-9, exact */
    else v = __uint_as_float(((e + 120u) << 23) | (m << 20));
    return (b & 128u) ? -v : v;
}

__device__ __forceinline__ void e4m3x4(u32 word, float* v) {
    // the four E4M3 bytes of a word, the low byte first: on sm_89 and later by the
    // hardware's conversion to F16 (exact: every E4M3 value is an F16; a NaN stays a NaN),
    // two a conversion; elsewhere (and on the host) by the bits, as ``e4m3``
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    #pragma unroll
    for (int i = 0; i < 2; ++i) {
        u32 h;
        asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"((u16)(word >> (16 * i))));
        v[2 * i] = __half2float(__ushort_as_half((u16)h));
        v[2 * i + 1] = __half2float(__ushort_as_half((u16)(h >> 16)));
    }
#else
    for (int i = 0; i < 4; ++i) v[i] = e4m3((word >> (8 * i)) & 255u);
#endif
}

__device__ __forceinline__ void block_copy(void* to, const void* from, int words) {
    // ``words`` 16-byte words from ``from`` into a block's shared ``to``, every thread of
    // the block taking its share, then waiting for the others; a host walk runs a block's
    // threads one after another, so there each thread copies it all
    uint4* dst = (uint4*)to;
    const uint4* src = (const uint4*)from;
#if defined(__CUDA_ARCH__)
    for (int i = threadIdx.x; i < words; i += blockDim.x) dst[i] = src[i];
    __syncthreads();
#else
    for (int i = 0; i < words; ++i) dst[i] = src[i];
#endif
}

__device__ __forceinline__ u16 to_bf16(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (u16)(u >> 16);
}

#define STORE static __device__ __forceinline__
struct BF16 { typedef u16 T; STORE u16 put(float x) { return to_bf16(x); } };
struct F16 {
    typedef u16 T;
    STORE u16 put(float x) { return __half_as_ushort(__float2half_rn(x)); }
};
struct F32 { typedef float T; STORE float put(float x) { return x; } };

__device__ __forceinline__ i64 quot(i64 a, i64 b) {
    // a / b (both >= 0) by 32-bit division where both fit: a 64-bit division is a long
    // software routine on the device, and a thread divides once or twice a chunk
    return ((a | b) >> 31) ? a / b : (i64)((u32)a / (u32)b);
}

template <typename T, int N>
__device__ __forceinline__ void store_vec(T* to, const T* from) {
    const uint4* src = (const uint4*)from;
    uint4* dst = (uint4*)to;
    #pragma unroll
    for (int i = 0; i < (int)(N * sizeof(T) / 16); ++i) dst[i] = src[i];
}

__device__ __forceinline__ void load16(const unsigned char* w, u32* words) {
    // the widest loads the address allows: a matrix read in place from a file's mapping
    // may be 8-aligned only (safetensors), and there every load is a PCIe read
    unsigned long long at = (unsigned long long)w;
    if ((at & 15u) == 0) {
        uint4 b = *(const uint4*)w;
        words[0] = b.x; words[1] = b.y; words[2] = b.z; words[3] = b.w;
    } else if ((at & 7u) == 0) {
        uint2 a = *(const uint2*)w, b = *(const uint2*)(w + 8);
        words[0] = a.x; words[1] = a.y; words[2] = b.x; words[3] = b.y;
    } else {
        for (int i = 0; i < 4; ++i)
            words[i] = (u32)w[4 * i] | ((u32)w[4 * i + 1] << 8) | ((u32)w[4 * i + 2] << 16)
                       | ((u32)w[4 * i + 3] << 24);
    }
}

__device__ __forceinline__ bool matrix(const i64* table, int params, int kinds, int n, int kind,
                                       int k, const i64* slots, const i64* rows,
                                       const unsigned char** w, i64* expert) {
    // slot k's matrix of this kind and its expert (its row of the scales): from a batch's
    // table (after the kinds' parameters, each kind's addresses, then the experts), or by
    // ``slots`` from a layer's table of (gate, up, down) addresses, row slots[k] (-1: an
    // empty slot, nothing to write)
    if (slots) {
        i64 e = slots[k];
        if (e < 0) return false;
        *w = (const unsigned char*)rows[3 * e + kind];
        *expert = e;
    } else {
        *w = (const unsigned char*)table[kinds * params + kind * n + k];
        *expert = table[kinds * params + kinds * n + k];
    }
    return true;
}

"""

_QUANTIZED = r"""
template <class S>
__device__ void fp8_kind(const i64* table, int kinds, int n, const i64* slots, const i64* at,
                         int kind, int bm, int bn) {
    typedef typename S::T OUT;
    const i64* p = table + kind * 8;
    OUT* out = (OUT*)p[0];
    i64 ostride = p[1];
    int rows = (int)p[2], cols = (int)p[3];
    const float* scales = (const float*)p[4];
    int sr = (int)p[5], sc = (int)p[6], vec = (int)p[7] & 1;
    int width = vec ? 16 : 1, per_row = cols / width;
    i64 per_matrix = (i64)rows * per_row, chunks = per_matrix * n;
    for (i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x; t < chunks;
         t += (i64)gridDim.x * blockDim.x) {
        int k = (int)quot(t, per_matrix);
        i64 rem = t - k * per_matrix;
        int r = (int)quot(rem, per_row);
        int c = (int)(rem - (i64)r * per_row) * width;
        const unsigned char* w;
        i64 expert;
        if (!matrix(table, 8, kinds, n, kind, k, slots, at, &w, &expert)) continue;
        w += (i64)r * cols + c;
        float scale = scales[(expert * sr + r / bm) * sc + c / bn];
        OUT* o = out + k * ostride + (i64)r * cols + c;
        if (vec) {
            u32 words[4];
            load16(w, words);
            float values[16];
            #pragma unroll
            for (int i = 0; i < 4; ++i) e4m3x4(words[i], values + 4 * i);
            __align__(16) OUT vals[16];
            #pragma unroll
            for (int i = 0; i < 16; ++i) vals[i] = S::put(values[i] * scale);
            store_vec<OUT, 16>(o, vals);
        } else {
            o[0] = S::put(e4m3(w[0]) * scale);
        }
    }
}

template <typename OUT>
__device__ void fp4_kind(const i64* table, int kinds, int n, const i64* slots, const i64* at,
                         int kind, const OUT* global_lut) {
    // the table in the block's shared memory: each value is a load from it by its scale
    // and code, scattered across a warp, which the L1 cache serves a line at a time
    __align__(16) __shared__ OUT lut[256 * 16];
    block_copy(lut, global_lut, (int)(sizeof(lut) / 16));
    const i64* p = table + kind * 10;
    OUT* out = (OUT*)p[0];
    i64 ostride = p[1], ld = p[2];
    int transposed = (int)p[3], rows = (int)p[4], groups = (int)p[5];
    const unsigned char* scales = (const unsigned char*)p[6];
    i64 ses = p[7], srs = p[8];
    int out_aligned = (int)p[9] & 1;
    i64 per_matrix = (i64)rows * groups, chunks = per_matrix * n;
    for (i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x; t < chunks;
         t += (i64)gridDim.x * blockDim.x) {
        int k = (int)quot(t, per_matrix);
        i64 rem = t - k * per_matrix;
        int r, g;
        if (transposed) { g = (int)quot(rem, rows); r = (int)(rem - (i64)g * rows); }
        else { r = (int)quot(rem, groups); g = (int)(rem - (i64)r * groups); }
        const unsigned char* w;
        i64 expert;
        if (!matrix(table, 10, kinds, n, kind, k, slots, at, &w, &expert)) continue;
        w += ((i64)r * groups + g) * 16;
        const OUT* row = lut + 16 * (int)scales[expert * ses + r * srs + g];
        u32 words[4];
        load16(w, words);
        __align__(16) OUT vals[32];
        #pragma unroll
        for (int i = 0; i < 16; ++i) {
            u32 b = (words[i >> 2] >> (8 * (i & 3))) & 255u;
            vals[2 * i] = row[b & 15u];
            vals[2 * i + 1] = row[b >> 4];
        }
        OUT* o = out + k * ostride;
        if (transposed) {
            o += (i64)g * 32 * ld + r;
            #pragma unroll
            for (int i = 0; i < 32; ++i) o[i * ld] = vals[i];
        } else if (out_aligned) {
            store_vec<OUT, 32>(o + (i64)r * ld + g * 32, vals);
        } else {
            o += (i64)r * ld + g * 32;
            for (int i = 0; i < 32; ++i) o[i] = vals[i];
        }
    }
}

#define FP8_KERNEL(NAME, S)                                                               \
extern "C" __global__ void NAME(const i64* table, int kinds, int n, const i64* slots,      \
                                const i64* at, int bm, int bn) {                          \
    fp8_kind<S>(table, kinds, n, slots, at, blockIdx.y, bm, bn);                          \
}
FP8_KERNEL(fp8_experts_bf16, BF16)
FP8_KERNEL(fp8_experts_f16, F16)
FP8_KERNEL(fp8_experts_f32, F32)

extern "C" __global__ void fp4_experts_2(const i64* table, int kinds, int n, const i64* slots,
                                         const i64* at, const u16* lut) {
    fp4_kind<u16>(table, kinds, n, slots, at, blockIdx.y, lut);
}
extern "C" __global__ void fp4_experts_4(const i64* table, int kinds, int n, const i64* slots,
                                         const i64* at, const u32* lut) {
    fp4_kind<u32>(table, kinds, n, slots, at, blockIdx.y, lut);
}
"""
SOURCE = _PRELUDE + _QUANTIZED
"""The FP8, FP4 and MXFP4 kernels."""

GGUF_GROUP = 32
"""Values a thread of a GGUF kernel computes: a 32-value sub-block (every type's block is
whole sub-blocks of 32)."""
GGUF_KERNELS: dict[int, str] = {int(q): f"gguf_{q.name.lower()}" for q in sorted(DEQUANTIZED)}
"""Each GGUF type's kernel name, less the output's suffix (``_bf16``, ``_f16``, ``_f32``)."""

_GGUF_KIND = r"""
#define STAGED 1104  /* bytes: a warp's blocks of any type (Q8_0's 1088), 16-aligned around */

__device__ __forceinline__ void warp_copy(unsigned char* to, const unsigned char* from,
                                          int words) {
    // ``words`` 16-byte words into a warp's shared ``to``, each lane taking its share,
    // then waiting for the others; a host walk runs the threads one after another, so
    // there each thread copies them all
#if defined(__CUDA_ARCH__)
    for (int w = threadIdx.x & 31; w < words; w += 32)
        ((uint4*)to)[w] = ((const uint4*)from)[w];
    __syncwarp();
#else
    for (int w = 0; w < words; ++w) ((uint4*)to)[w] = ((const uint4*)from)[w];
#endif
}

template <class S, int G, typename F>
__device__ void gguf_kind(const i64* table, int kinds, int n, const i64* slots, const i64* at,
                          F value, int elems, int size) {
    typedef typename S::T OUT;
    static_assert(G == 32, "a warp's blocks are staged for 32 values a thread");
    const i64* p = table + blockIdx.y * GGUF_PARAMS;
    OUT* out = (OUT*)p[0];
    i64 ostride = p[1], per = p[2] / G, chunks = per * n;
    int vec = (int)p[3] & 1;
    const i64* addresses = table + kinds * GGUF_PARAMS + blockIdx.y * n;
    // where a matrix is whole warps of chunks (every real shape), a warp's 32 chunks are
    // one run of blocks: the warp reads it into shared memory in 16-byte words, once,
    // and its threads decode from there (a thread's own reads are bytes, scattered over
    // its sub-block; in place, each would be a PCIe read of its own)
    __align__(16) __shared__ unsigned char staged[8][STAGED];
#if defined(__CUDA_ARCH__)
    bool staging = per % 32 == 0 && blockDim.x <= 256 && blockDim.x % 32 == 0;
#else
    bool staging = per % 32 == 0;  // a host walk: one thread at a time, whatever the block
#endif
    unsigned char* mine = staged[(threadIdx.x >> 5) & 7];
    for (i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x; t < chunks;
         t += (i64)gridDim.x * blockDim.x) {
        int k = (int)quot(t, per);
        i64 i = (t - k * per) * G;
        const unsigned char* b;
        if (slots) {  // by a layer's table (``at``: its first column this launch's first kind)
            i64 e = slots[k];
            if (e < 0) continue;  // a whole warp's, when staging: its chunks share k
            b = (const unsigned char*)at[3 * e + blockIdx.y];
        } else {
            b = (const unsigned char*)addresses[k];
        }
        if (staging) {
            i64 first = (i - i % (32 * G)) / elems * size;  // the warp's first block
            unsigned long long from = (unsigned long long)(b + first);
            unsigned long long below = from & 15u;
            warp_copy(mine, (const unsigned char*)(from - below),
                      (int)((below + 32 * G / elems * size + 15) / 16));
            b = mine + below + ((i / elems) * size - first);
        } else {
            b += (i / elems) * size;
        }
        int j = (int)(i % elems);
        __builtin_assume((j & (G - 1)) == 0);  // the G values share sub-block fields
        __align__(16) OUT vals[G];
        #pragma unroll
        for (int e = 0; e < G; ++e) vals[e] = S::put(value(b, j + e));
        OUT* o = out + k * ostride + i;
        if (vec) store_vec<OUT, G>(o, vals);
        else for (int e = 0; e < G; ++e) o[e] = vals[e];
#if defined(__CUDA_ARCH__)
        if (staging) __syncwarp();  // every lane has decoded before the next copy
#endif
    }
}
"""

_GGUF_KERNEL = r"""
struct V_{name} {{
    __device__ __forceinline__ float operator()(const unsigned char* b, int j) const {{
        return {name}(b, j);
    }}
}};
#define GGUF_{name}(OUT, S) \
extern "C" __global__ void gguf_{name}_##OUT(const i64* table, int kinds, int n, \
                                            const i64* slots, const i64* at) {{ \
    gguf_kind<S, {group}>(table, kinds, n, slots, at, V_{name}(), {elems}, {size}); \
}}
GGUF_{name}(bf16, BF16)
GGUF_{name}(f16, F16)
GGUF_{name}(f32, F32)
"""


@functools.cache
def gguf_source() -> str:
    """The GGUF kernels: a thread turns ``GGUF_GROUP`` consecutive values of a block (every
    type's block is whole groups of them: one sub-block, whose fields the compiler then reads
    once) into the output type, from the foundation's value routines
    (gguf-py's float32 values, bit for bit) rounded once on the store, as torch's cast of
    gguf-py's float32 rounds them."""
    assert all(GGML_QUANT_SIZES[Q(q)][0] % GGUF_GROUP == 0 for q in GGUF_KERNELS)
    kernels = "".join(
        _GGUF_KERNEL.format(name=name.removeprefix("gguf_"), elems=GGML_QUANT_SIZES[Q(q)][0],
                            size=GGML_QUANT_SIZES[Q(q)][1], group=GGUF_GROUP)
        for q, name in GGUF_KERNELS.items())
    return (_PRELUDE + value_source() + f"#define GGUF_PARAMS {GGUF_PARAMS}\n" + _GGUF_KIND
            + kernels)
