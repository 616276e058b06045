"""GGUF quantized blocks' values as CUDA C device routines, bitwise what gguf-py's
``gguf.quants.dequantize`` computes: one ``__device__ float <type>(block, j)`` a type (value
``j`` of the block at ``block``), and the IQ grids, sign patterns and levels they read,
written from gguf-py's own tables.

Why in the foundation: two layers build kernels on these routines, the proxy engine's
(``moestream.gpu.dequantsource``: float32 values) and the transformers integration's
(``moestream.transformers._dequant_source``: the model's dtype, straight into its stacked
weights), and neither may import the other. The text is plain C++ with CUDA's qualifiers,
so the tests also build it for the host.

A value is computed from its block alone, in gguf-py's float32 operations and their order
(``d * sc`` before ``* q``, ``dl * q - ml``); the products and sums are the ``_rn`` intrinsics
so the compiler cannot contract them into a fused multiply-add (one rounding fewer: not
gguf-py's bits). Float16 scales are widened by their bits (exact, subnormals included), not by
``cuda_fp16.h``.
"""

from __future__ import annotations

import functools

import numpy as np
from gguf import quants

__all__ = ["value_source"]

_ROUTINES = r"""
__device__ __forceinline__ unsigned int word16(const unsigned char* p) {
    return (unsigned int)p[0] | ((unsigned int)p[1] << 8);
}
__device__ __forceinline__ float half_bits(unsigned int h) {
    // IEEE half to float by its bits: exact, as numpy's astype(float32)
    unsigned int sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0x1fu) return __uint_as_float(sign | 0x7f800000u | (m << 13));
    if (e != 0) return __uint_as_float(sign | ((e + 112u) << 23) | (m << 13));
    float v = (float)m * 5.9604644775390625e-08f;  // m * 2**-24: exact
    return sign ? -v : v;
}
__device__ __forceinline__ float h2f(const unsigned char* p) { return half_bits(word16(p)); }

__device__ __forceinline__ unsigned int nib(const unsigned char* qs, int j, int half) {
    // value j of 2 * half nibbles: the low nibbles of qs[0..half), then the high ones
    return j < half ? (qs[j] & 15u) : (qs[j - half] >> 4);
}

__device__ __forceinline__ void k_scale_min(const unsigned char* s, int g, unsigned int* sc,
                                            unsigned int* mn) {
    // Q4_K's and Q5_K's 6-bit scale and min of sub-block g (gguf-py's get_scale_min)
    if (g < 4) { *sc = s[g] & 63u; *mn = s[4 + g] & 63u; return; }
    int i = g - 4;
    *sc = (s[8 + i] & 15u) | ((s[i] >> 2) & 0x30u);
    *mn = (s[8 + i] >> 4) | ((s[4 + i] >> 2) & 0x30u);
}

__device__ __forceinline__ float q4_0(const unsigned char* b, int j) {
    return __fmul_rn(h2f(b), (float)((int)nib(b + 2, j, 16) - 8));
}
__device__ __forceinline__ float q4_1(const unsigned char* b, int j) {
    return __fadd_rn(__fmul_rn(h2f(b), (float)nib(b + 4, j, 16)), h2f(b + 2));
}
__device__ __forceinline__ unsigned int q5_bits(const unsigned char* qh, const unsigned char* qs,
                                                int j) {
    return nib(qs, j, 16) | (((qh[j >> 3] >> (j & 7)) & 1u) << 4);
}
__device__ __forceinline__ float q5_0(const unsigned char* b, int j) {
    return __fmul_rn(h2f(b), (float)((int)q5_bits(b + 2, b + 6, j) - 16));
}
__device__ __forceinline__ float q5_1(const unsigned char* b, int j) {
    return __fadd_rn(__fmul_rn(h2f(b), (float)q5_bits(b + 4, b + 8, j)), h2f(b + 2));
}
__device__ __forceinline__ float q8_0(const unsigned char* b, int j) {
    return __fmul_rn((float)(signed char)b[2 + j], h2f(b));
}

__device__ __forceinline__ unsigned int crumb(const unsigned char* qs, int j) {
    // 2-bit value j of 256: two halves of 32 bytes, each four planes of 2 bits
    int r = j & 127;
    return (qs[(j >> 7) * 32 + (r & 31)] >> (2 * (r >> 5))) & 3u;
}
__device__ __forceinline__ float q2_k(const unsigned char* b, int j) {
    unsigned int s = b[j >> 4];
    float dl = __fmul_rn(h2f(b + 80), (float)(s & 15u));
    float ml = __fmul_rn(h2f(b + 82), (float)(s >> 4));
    return __fsub_rn(__fmul_rn(dl, (float)crumb(b + 16, j)), ml);
}
__device__ __forceinline__ float q3_k(const unsigned char* b, int j) {
    const unsigned char* s = b + 96;
    int g = j >> 4;
    unsigned int low = (s[g & 7] >> (4 * (g >> 3))) & 15u;
    unsigned int high = (s[8 + (g & 3)] >> (2 * (g >> 2))) & 3u;
    float dl = __fmul_rn(h2f(b + 108), (float)((int)(low | (high << 4)) - 32));
    unsigned int borrow = ((b[j & 31] >> (j >> 5)) & 1u) ^ 1u;  // set: 4 comes off
    return __fmul_rn(dl, (float)((int)crumb(b + 32, j) - (int)(borrow << 2)));
}
__device__ __forceinline__ float q4_k(const unsigned char* b, int j) {
    unsigned int sc, mn;
    int g = j >> 5;
    k_scale_min(b + 4, g, &sc, &mn);
    float d = __fmul_rn(h2f(b), (float)sc), dm = __fmul_rn(h2f(b + 2), (float)mn);
    unsigned int q = (b[16 + (g >> 1) * 32 + (j & 31)] >> (4 * (g & 1))) & 15u;
    return __fsub_rn(__fmul_rn(d, (float)q), dm);
}
__device__ __forceinline__ float q5_k(const unsigned char* b, int j) {
    unsigned int sc, mn;
    int g = j >> 5;
    k_scale_min(b + 4, g, &sc, &mn);
    float d = __fmul_rn(h2f(b), (float)sc), dm = __fmul_rn(h2f(b + 2), (float)mn);
    unsigned int q = (b[48 + (g >> 1) * 32 + (j & 31)] >> (4 * (g & 1))) & 15u;
    q |= ((b[16 + (j & 31)] >> g) & 1u) << 4;
    return __fsub_rn(__fmul_rn(d, (float)q), dm);
}
__device__ __forceinline__ float q6_k(const unsigned char* b, int j) {
    int half = j >> 7, r = j & 127;
    unsigned int low = (b[half * 64 + (r & 63)] >> (4 * (r >> 6))) & 15u;
    unsigned int high = (b[128 + half * 32 + (r & 31)] >> (2 * (r >> 5))) & 3u;
    float d = __fmul_rn(h2f(b + 208), (float)(signed char)b[192 + (j >> 4)]);
    return __fmul_rn(d, (float)((int)(low | (high << 4)) - 32));
}
__device__ __forceinline__ float iq2_xxs(const unsigned char* b, int j) {
    const unsigned char* sub = b + 2 + 8 * (j >> 5);  // 4 grid indices, then a meta word
    unsigned int meta = (unsigned int)sub[4] | ((unsigned int)sub[5] << 8)
                        | ((unsigned int)sub[6] << 16) | ((unsigned int)sub[7] << 24);
    float db = __fmul_rn(__fmul_rn(h2f(b), __fadd_rn(0.5f, (float)(meta >> 28))), 0.25f);
    int k = (j >> 3) & 3, e = j & 7;
    float v = __fmul_rn(db, (float)((IQ2_XXS_GRID[sub[k]] >> (8 * e)) & 255u));
    // a sign flips the sign bit only: (db * grid) * -1 is -(db * grid), bit for bit
    return (KSIGNS[(meta >> (7 * k)) & 127u] >> e) & 1u ? -v : v;
}
__device__ __forceinline__ float iq2_xs(const unsigned char* b, int j) {
    const unsigned char* q = b + 2 + 2 * (j >> 3);  // a 9-bit grid index, 7 bits of signs
    unsigned int word = word16(q);
    unsigned int scale = (b[66 + (j >> 5)] >> (4 * ((j >> 4) & 1))) & 15u;
    float db = __fmul_rn(__fmul_rn(h2f(b), __fadd_rn(0.5f, (float)scale)), 0.25f);
    int e = j & 7;
    float v = __fmul_rn(db, (float)((IQ2_XS_GRID[word & 511u] >> (8 * e)) & 255u));
    return (KSIGNS[word >> 9] >> e) & 1u ? -v : v;
}
__device__ __forceinline__ float iq2_s(const unsigned char* b, int j) {
    // a grid index a 8 values: its low byte, then 2 high bits in a byte of four; a sign bit
    // a value; a 4-bit scale a 16 values
    int i = j >> 3;
    unsigned int index = b[2 + i] | (((b[66 + (i >> 2)] >> (2 * (i & 3))) & 3u) << 8);
    unsigned int scale = (b[74 + (j >> 5)] >> (4 * ((j >> 4) & 1))) & 15u;
    float db = __fmul_rn(__fmul_rn(h2f(b), __fadd_rn(0.5f, (float)scale)), 0.25f);
    float v = __fmul_rn(db, (float)((IQ2_S_GRID[index] >> (8 * (j & 7))) & 255u));
    return (b[34 + (j >> 3)] >> (j & 7)) & 1u ? -v : v;
}
__device__ __forceinline__ float iq3_s(const unsigned char* b, int j) {
    // a grid index a 4 values: its low byte, then a high bit in a byte of eight; a sign bit
    // a value; a 4-bit scale a 32 values, d * (1 + 2 * scale) (an exact integer first)
    int i = j >> 2;
    unsigned int index = b[2 + i] | (((b[66 + (i >> 3)] >> (i & 7)) & 1u) << 8);
    unsigned int scale = (b[106 + (j >> 6)] >> (4 * ((j >> 5) & 1))) & 15u;
    float db = __fmul_rn(h2f(b), (float)(1u + 2u * scale));
    float v = __fmul_rn(db, (float)((IQ3_S_GRID[index] >> (8 * (j & 3))) & 255u));
    return (b[74 + (j >> 3)] >> (j & 7)) & 1u ? -v : v;
}
__device__ __forceinline__ float iq1(float dl, unsigned int index, bool negative, int e) {
    // dl * (grid + delta): a grid value -1, 0 or 1 (2 bits, stored + 1), delta -+1/8; the
    // sum is exact, the product gguf-py's one rounding
    float g = (float)((int)((IQ1_GRID[index] >> (2 * e)) & 3u) - 1);
    return __fmul_rn(dl, __fadd_rn(g, negative ? -0.125f : 0.125f));
}
__device__ __forceinline__ float iq1_s(const unsigned char* b, int j) {
    // a 16-bit word a 32 values: 3 high index bits for each of its four grid indices, a
    // 3-bit scale (bits 12..14) and the delta's sign (bit 15)
    unsigned int qh = word16(b + 34 + 2 * (j >> 5));
    int i = j >> 3;
    float dl = __fmul_rn(h2f(b), (float)(2u * ((qh >> 12) & 7u) + 1u));
    return iq1(dl, b[2 + i] | (((qh >> (3 * (i & 3))) & 7u) << 8), (qh & 0x8000u) != 0, j & 7);
}
__device__ __forceinline__ float iq1_m(const unsigned char* b, int j) {
    // the float16 scale is the top nibbles of the four scale words (the first word's the
    // lowest); their low 12 bits are 3-bit scales, one a 16 values; a nibble a grid index:
    // 3 high index bits and the delta's sign
    const unsigned char* s = b + 48;
    unsigned int d = (word16(s) >> 12) | ((word16(s + 2) >> 8) & 0xf0u)
                     | ((word16(s + 4) >> 4) & 0xf00u) | (word16(s + 6) & 0xf000u);
    int g = j >> 4, i = j >> 3;
    unsigned int scale = (word16(s + 2 * (g >> 2)) >> (3 * (g & 3))) & 7u;
    float dl = __fmul_rn(half_bits(d), (float)(2u * scale + 1u));
    unsigned int q = (b[32 + (i >> 1)] >> (4 * (i & 1))) & 15u;
    return iq1(dl, b[i] | ((q & 7u) << 8), (q & 8u) != 0, j & 7);
}
__device__ __forceinline__ float iq4_nl(const unsigned char* b, int j) {
    return __fmul_rn(h2f(b), (float)IQ4_LEVELS[nib(b + 2, j, 16)]);
}
__device__ __forceinline__ float iq3_xxs(const unsigned char* b, int j) {
    const unsigned char* w = b + 66 + 4 * (j >> 5);  // the sub-block's meta word
    unsigned int meta = (unsigned int)w[0] | ((unsigned int)w[1] << 8)
                        | ((unsigned int)w[2] << 16) | ((unsigned int)w[3] << 24);
    float db = __fmul_rn(__fmul_rn(h2f(b), __fadd_rn(0.5f, (float)(meta >> 28))), 0.5f);
    int k = (j >> 3) & 3, e = j & 7;
    float v = __fmul_rn(db, (float)((IQ3_XXS_GRID[b[2 + (j >> 2)]] >> (8 * (j & 3))) & 255u));
    return (KSIGNS[(meta >> (7 * k)) & 127u] >> e) & 1u ? -v : v;
}
__device__ __forceinline__ float iq4_xs(const unsigned char* b, int j) {
    int g = j >> 5, r = j & 31;
    unsigned int high = (word16(b + 2) >> (2 * g)) & 3u;
    unsigned int low = (b[4 + (g >> 1)] >> (4 * (g & 1))) & 15u;
    float dl = __fmul_rn(h2f(b), (float)((int)(low | (high << 4)) - 32));
    unsigned int q = (b[8 + g * 16 + (r & 15)] >> (4 * (r >> 4))) & 15u;
    return __fmul_rn(dl, (float)IQ4_LEVELS[q]);
}
__device__ __forceinline__ float nvfp4(const unsigned char* b, int j) {
    // a UE4M3 scale a 16 values (gguf-py's decoding, by its bits), 8 bytes of E2M1 codes
    // a 16 values, the low nibbles first; every value exact
    int s = j >> 4, r = j & 15;
    unsigned int code = (b[4 + 8 * s + (r & 7)] >> (4 * (r >> 3))) & 15u;
    return __fmul_rn(__uint_as_float(UE4M3_BITS[b[s]]), (float)MXFP4_LEVELS[code]);
}
__device__ __forceinline__ float mxfp4(const unsigned char* b, int j) {
    // ggml_e8m0_to_fp32_half: 2**(e - 128); below e = 2 that scale is subnormal, and a
    // flush-to-zero build (as NVRTC's can be) would flush it and the products it makes, so
    // there the value is built from its bits: |level| << (e + 21) units of 2**-149
    unsigned int e = b[0];
    int level = MXFP4_LEVELS[nib(b + 1, j, 16)];
    if (e >= 2u) return __fmul_rn(__uint_as_float((e - 1u) << 23), (float)level);
    unsigned int n = (unsigned int)(level < 0 ? -level : level) << (e + 21u);
    unsigned int bits = n < 0x00800000u ? n : __float_as_uint((float)n) - (149u << 23);
    return __uint_as_float(level < 0 ? bits | 0x80000000u : bits);
}
"""


def _table(name: str, values: np.ndarray, ctype: str = "unsigned char") -> str:
    suffix = "ull" if ctype == "unsigned long long" else "u" if ctype == "unsigned int" else ""
    body = ",".join(f"{int(v)}{suffix}" for v in values.reshape(-1))
    return f"__device__ const {ctype} {name}[{values.size}] = {{{body}}};\n"


def _grid(kind: type) -> np.ndarray:
    """An IQ type's grid values (small integers, exact in a byte), row by row."""
    kind.init_grid()  # type: ignore[attr-defined]
    grid: np.ndarray = kind.grid  # type: ignore[attr-defined]
    return grid.reshape(-1).astype(np.uint8)


def _packed(grid: np.ndarray, width: int) -> np.ndarray:
    """A grid's rows of ``width`` bytes as one little-endian word each: a row is then one
    load, not ``width`` (the values of a row come from one index, so the compiler loads the
    word once for all of them), its byte ``e`` the row's value ``e``."""
    rows = grid.reshape(-1, width).astype(np.uint64)
    words: np.ndarray = (rows << (8 * np.arange(width, dtype=np.uint64))).sum(
        axis=1, dtype=np.uint64)
    return words


def _crumbs(kind: type) -> np.ndarray:
    """IQ1's grid (-1, 0, 1; rows of 8) as 2 bits a value, stored + 1, a 16-bit word a row:
    4 KiB where a byte a value would take 16."""
    kind.init_grid()  # type: ignore[attr-defined]
    grid: np.ndarray = kind.grid  # type: ignore[attr-defined]
    rows = (grid.reshape(-1, 8) + 1).astype(np.uint16)
    words: np.ndarray = (rows << (2 * np.arange(8, dtype=np.uint16))).sum(axis=1,
                                                                          dtype=np.uint16)
    return words


@functools.cache
def value_source() -> str:
    """The tables and the value routines, as CUDA C (no kernel: the callers write theirs)."""
    return (_table("IQ2_XXS_GRID", _packed(_grid(quants.IQ2_XXS), 8), "unsigned long long")
            + _table("IQ2_XS_GRID", _packed(_grid(quants.IQ2_XS), 8), "unsigned long long")
            + _table("IQ2_S_GRID", _packed(_grid(quants.IQ2_S), 8), "unsigned long long")
            + _table("IQ3_XXS_GRID", _packed(_grid(quants.IQ3_XXS), 4), "unsigned int")
            + _table("IQ3_S_GRID", _packed(_grid(quants.IQ3_S), 4), "unsigned int")
            + _table("IQ1_GRID", _crumbs(quants.IQ1_S), "unsigned short")
            + _table("KSIGNS", np.frombuffer(quants.IQ2_XXS.ksigns, dtype=np.uint8))
            + _table("IQ4_LEVELS", np.array(quants.IQ4_NL.kvalues), "signed char")
            + _table("MXFP4_LEVELS", np.array(quants.MXFP4.kvalues), "signed char")
            + _table("UE4M3_BITS", quants.NVFP4.ue4m3_to_fp32(np.arange(256, dtype=np.uint8))
                     .astype(np.float32).view(np.uint32), "unsigned int")
            + _ROUTINES)
