"""Quantizing float32 weights by the formats' own rules, in numpy: FP8 blocks and MX E2M1.

Why: ``tools.make_model --quant`` writes FP8, MXFP4 and FP4 checkpoints of any shape, and a
checkpoint is only a fair stand-in for a downloaded one if its bytes are what the format's
own quantizer would have made of the same weights. numpy keeps the writer free of torch.

- **FP8 E4M3 blocks** (DeepSeek-V3, Qwen3-FP8): per block of ``block`` rows x columns (edge
  blocks partial), ``scale = max(|w|, 1e-12) / 448`` in float32, and ``w / scale`` rounded
  to the nearest E4M3 value (ties to even; E4M3FN: no infinities, largest 448). With
  ``pow2`` (DeepSeek-V4's ``scale_fmt: ue8m0``) the scale is rounded up to a power of two,
  ``2 ** ceil(log2(max|w| / 448))``, stored as its E8M0 byte.
- **MX E2M1** (gpt-oss's MXFP4, DeepSeek-V4's FP4 experts): per 32 values along a row,
  ``scale = 2 ** ceil(log2(max|w| / 6))`` (6 is E2M1's largest value: the smallest power of
  two under which nothing is clipped), stored as its E8M0 byte (exponent + 127), and
  ``w / scale`` rounded to the nearest E2M1 value (0, 0.5, 1, 1.5, 2, 3, 4, 6; ties to the
  even code); two codes a byte, the first in the low nibble.

A power-of-two scale's exponent is the exact ``ceil(log2(max|w| / limit))``: the smallest
``e`` with ``max|w| <= limit * 2**e``, not the float32 quotient's (which can round down
onto a power of two and clip the largest value).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt

__all__ = ["E2M1_MAX", "E2M1_VALUES", "E4M3_MAX", "MX_BLOCK", "e4m3_codes", "e8m0_bytes",
           "pow2_e8m0", "quantize_fp8_blocks", "quantize_mx_e2m1"]

F32 = npt.NDArray[np.float32]
U8 = npt.NDArray[np.uint8]

E4M3_MAX = 448.0
E2M1_MAX = 6.0
MX_BLOCK = 32
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""E2M1 magnitudes by code (bits 0-2); bit 3 is the sign."""

_E4M3_MIN_NORMAL = np.float32(2.0**-6)
_E4M3_REBIAS = np.uint32((127 - 7) << 3)  # float32 exponent bias to E4M3's, above 3 bits


def _e4m3_magnitude_codes(magnitude: F32) -> U8:
    """E4M3 codes (without sign) of float32 magnitudes in [0, 448]: nearest, ties to even."""
    bits = magnitude.view(np.uint32)
    # Normal range: round the 23-bit mantissa to 3 bits, nearest-even, by adding just under
    # half an E4M3 ulp plus the kept lowest bit; a carry moves into the exponent as it must.
    rounded = bits + np.uint32(0x7FFFF) + ((bits >> np.uint32(20)) & np.uint32(1))
    rounded >>= np.uint32(20)
    rounded -= _E4M3_REBIAS  # wraps below 2^-6, where the subnormal branch is taken
    # Subnormals are multiples of 2^-9, and code 8 (2^-6) is the first normal: rint counts.
    small = np.rint(magnitude * np.float32(512.0)).astype(np.uint32)
    return np.where(magnitude < _E4M3_MIN_NORMAL, small, rounded).astype(np.uint8)


def _e2m1_magnitude_codes(magnitude: F32) -> U8:
    """E2M1 codes (without sign) of float32 magnitudes in [0, 6]: nearest, ties to even."""
    bits = magnitude.view(np.uint32)
    # From 1 up (exponent bias 1, one mantissa bit): round the float32 mantissa to 1 bit,
    # nearest-even, as for E4M3 to 3; a carry moves into the exponent.
    rounded = bits + np.uint32(0x1FFFFF) + ((bits >> np.uint32(22)) & np.uint32(1))
    rounded >>= np.uint32(22)
    rounded -= np.uint32((127 - 1) << 1)  # wraps below 1, where the other branch is taken
    # Below 1 the values are 0, 0.5, 1: codes 0, 1, 2 are twice the value, and rint ties even.
    small = np.rint(magnitude * np.float32(2.0)).astype(np.uint32)
    return np.where(magnitude < np.float32(1.0), small, rounded).astype(np.uint8)


class _RoundingTable:
    """A rounding function's codes for every float32 magnitude up to ``limit``, looked up
    by the upper 16 bits (a BF16 value) and whether the lower 16 are zero.

    Exact: every rounding boundary of E4M3 and E2M1 (a midpoint between two codes, at most
    5 significant bits) is a BF16 value, so no boundary lies strictly between a BF16 value
    and the next, and all magnitudes above one BF16 value and below the next round alike.
    Four whole-array passes and a gather instead of a dozen passes: about twice as fast.
    """

    __slots__ = ("_table",)

    def __init__(self, codes_of: Callable[[F32], U8], limit: float) -> None:
        top = int(np.float32(limit).view(np.uint32)) >> 16
        exact = (np.arange(top + 1, dtype=np.uint32) << np.uint32(16)).view(np.float32)
        above = np.minimum(np.nextafter(exact, np.float32(np.inf)), np.float32(limit))
        self._table = np.empty(2 * (top + 1), dtype=np.uint8)
        self._table[0::2] = codes_of(exact)
        self._table[1::2] = codes_of(above)

    def __call__(self, magnitude: F32) -> U8:
        bits = magnitude.view(np.uint32)
        index = bits >> np.uint32(16)
        index <<= np.uint32(1)
        index |= (bits & np.uint32(0xFFFF)) != 0
        codes: U8 = self._table[index]
        return codes


_E4M3_TABLE = _RoundingTable(_e4m3_magnitude_codes, E4M3_MAX)
_E2M1_TABLE = _RoundingTable(_e2m1_magnitude_codes, E2M1_MAX)


def e4m3_codes(values: F32) -> U8:
    """E4M3FN bytes of float32 ``values``: nearest value, ties to even, magnitudes beyond
    448 saturated to 448 (never NaN); the sign kept (``-0.0`` is ``0x80``)."""
    codes = _E4M3_TABLE(np.minimum(np.abs(values), np.float32(E4M3_MAX)))
    codes |= ((values.view(np.uint32) >> np.uint32(24)) & np.uint32(0x80)).astype(np.uint8)
    return codes


def _pow2_exponents(amax: F32, limit: float) -> npt.NDArray[np.int32]:
    """The smallest ``e`` with ``amax <= limit * 2**e`` for positive float32 ``amax``,
    clamped to E8M0's [-127, 127]."""
    mantissa, exponent = np.frexp(amax / np.float32(limit))  # q = m * 2**x, m in [0.5, 1)
    estimate: npt.NDArray[np.int32] = np.clip(exponent - (mantissa == 0.5), -127,
                                              127).astype(np.int32)
    # the quotient rounds to nearest; where it rounded down onto 2**e, amax is above the limit
    estimate += (amax > np.ldexp(np.float32(limit), estimate)) & (estimate < 127)
    return estimate


def e8m0_bytes(exponents: npt.NDArray[np.int32]) -> U8:
    """E8M0 bytes (``2 ** (byte - 127)``) of power-of-two exponents, clamped to the format's
    range [-127, 127] (255 is NaN)."""
    return (np.clip(exponents, -127, 127) + 127).astype(np.uint8)


def pow2_e8m0(scales: F32) -> U8:
    """E8M0 bytes of power-of-two float32 ``scales`` (exact)."""
    return e8m0_bytes(np.frexp(scales)[1].astype(np.int32) - 1)


def _grid(weight: F32, block: tuple[int, int]) -> tuple[F32, int, int]:
    """``weight`` as ``[row blocks, rows, column blocks, columns]``, zero-padded to whole
    blocks (zeros change no block's largest magnitude)."""
    rows, cols = weight.shape
    bm, bn = block
    sr, sc = -(-rows // bm), -(-cols // bn)
    if (sr * bm, sc * bn) != (rows, cols):
        padded = np.zeros((sr * bm, sc * bn), dtype=np.float32)
        padded[:rows, :cols] = weight
        weight = padded
    return weight.reshape(sr, bm, sc, bn), sr, sc


def quantize_fp8_blocks(weight: F32, block: tuple[int, int] = (128, 128), *,
                        pow2: bool = False) -> tuple[U8, F32]:
    """E4M3 bytes of ``weight`` ``[rows, cols]`` and its float32 scales, one per block.

    Args:
        weight: float32 values, 2-D.
        block: rows x columns of a block; edge blocks are partial.
        pow2: scales rounded up to powers of two (``scale_fmt: ue8m0``); ``e8m0_bytes`` of
            their exponents is what such a checkpoint stores.

    Returns:
        ``(codes [rows, cols], scales [ceil(rows / block[0]), ceil(cols / block[1])])``:
        ``e4m3(codes) * scale`` approximates ``weight``.
    """
    rows, cols = weight.shape
    grid, sr, sc = _grid(weight, block)
    amax = np.maximum(np.abs(grid).max(axis=(1, 3)), np.float32(1e-12))
    if pow2:
        scales = np.ldexp(np.float32(1.0), _pow2_exponents(amax, E4M3_MAX)).astype(np.float32)
    else:
        scales = amax / np.float32(E4M3_MAX)
    codes = e4m3_codes(grid / scales[:, None, :, None])
    return codes.reshape(sr * block[0], sc * block[1])[:rows, :cols], scales.astype(np.float32)


def quantize_mx_e2m1(weight: F32) -> tuple[U8, U8]:
    """MX E2M1 of ``weight`` ``[rows, cols]`` (``cols`` a multiple of 32).

    Returns:
        ``(packed [rows, cols / 2], scales [rows, cols / 32])``: two E2M1 codes a byte (the
        even column in the low nibble) and one E8M0 byte per 32 values of a row.
    """
    rows, cols = weight.shape
    if cols % MX_BLOCK:
        raise ValueError(f"MX blocks need a multiple of {MX_BLOCK} columns, got {cols}")
    groups = weight.reshape(rows, cols // MX_BLOCK, MX_BLOCK)
    magnitude = np.abs(groups)
    amax = magnitude.max(axis=2)
    exponents = _pow2_exponents(np.where(amax > 0, amax, np.float32(2.0**-140)), E2M1_MAX)
    # 2**-e for e in [-127, 127] is a float32 (2**-127 a subnormal): scaling by it is exact
    magnitude *= np.ldexp(np.float32(1.0), -exponents).astype(np.float32)[:, :, None]
    np.minimum(magnitude, np.float32(E2M1_MAX), out=magnitude)
    codes = _E2M1_TABLE(magnitude).reshape(rows, cols)
    codes |= ((weight.view(np.uint32) >> np.uint32(28)) & np.uint32(8)).astype(np.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << np.uint8(4))
    return packed, e8m0_bytes(exponents)
