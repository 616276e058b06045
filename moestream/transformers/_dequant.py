"""Quantized expert matrices to the compute dtype, on the device that computes them.

A quantized checkpoint's experts stay quantized in the file, on the wire and in the device
cache (a miss reads and uploads their bytes, a budget holds more of them); each use turns
the experts of one arrival batch into the compute dtype in reused scratch, then the same
grouped or eager arithmetic as for float experts.

FP8 blocks (DeepSeek-V3, Qwen3-FP8, GLM, MiniMax, Kimi: ``quant_method: fp8``): each matrix
is F8_E4M3 with one scale per ``weight_block_size`` block in ``weight_scale_inv`` (F32 or
BF16; edge blocks may be partial). The value is ``float32(w) * float32(scale)`` rounded once
to the compute dtype: transformers' ``Fp8Dequantize`` (``FineGrainedFP8Config(
dequantize=True)``) computes exactly this product, so the results are bitwise equal where
it runs (it refuses grids whose blocks do not divide the matrix; the partial edge blocks
here follow the checkpoint's own rule: block ``i`` covers rows ``i * bm`` up to the edge).
DeepSeek-V4's dense weights are FP8 with E8M0 scales (powers of two), the same product.

FP4 (DeepSeek-V4-Flash's experts, ``expert_dtype: fp4``) and MXFP4 (gpt-oss's experts,
``quant_method: mxfp4``): two E2M1 codes a byte, the low nibble first, and one E8M0 scale
per 32 values along a row. A byte is looked up whole in a table of its two values (one
gather), then scaled in float32 and rounded once to the compute dtype, by each format's
rule as transformers applies it: DeepSeek-V4's ``float32(e2m1) * float32(scale)``
(``Fp8Dequantize``'s FP4 path: E8M0 255 is NaN), gpt-oss's ``ldexp(e2m1, s - 127)``
(``convert_moe_packed_tensors``: the same but for 255, ``2 ** 128``, where a zero stays
zero). transformers' own functions are not called per use: each builds its value table
from a Python list per call (a blocking host-to-device copy on a GPU), and gpt-oss's
converts a whole layer in chunks; these are batched over the experts of an arrival, reuse
one table a device, and are tested bitwise equal to transformers' on every code and scale.
"""

from __future__ import annotations

from typing import Any

import torch  # type: ignore[import-not-found, unused-ignore]

__all__ = ["E2M1_VALUES", "e2m1_pairs", "fp4_blocks", "fp8_blocks", "mxfp4_blocks",
           "mxfp4_exponents"]

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The 16 E2M1 (FP4) codes' values: sign, two exponent bits, one mantissa bit."""


def fp8_blocks(weights: Any, scales: Any, block: tuple[int, int], dtype: Any) -> Any:
    """FP8 E4M3 matrices times their block scales, in ``dtype``.

    Args:
        weights: ``(..., rows, cols)``, float8_e4m3fn (or its bytes, uint8).
        scales: ``(..., ceil(rows / bm), ceil(cols / bn))``, any float type.
        block: ``(bm, bn)``, the checkpoint's ``weight_block_size``.
        dtype: the compute dtype.
    """
    if weights.dtype == torch.uint8:
        weights = weights.view(torch.float8_e4m3fn)
    rows, cols = weights.shape[-2:]
    bm, bn = block
    scale = scales.to(torch.float32)
    if rows % bm == 0 and cols % bn == 0:  # whole blocks: a broadcast, no expanded copy
        grid = weights.to(torch.float32).unflatten(-1, (cols // bn, bn))
        grid = grid.unflatten(-3, (rows // bm, bm))
        return (grid * scale[..., :, None, :, None]).flatten(-4, -3).flatten(-2).to(dtype)
    expanded = scale.repeat_interleave(bm, dim=-2)[..., :rows, :]
    expanded = expanded.repeat_interleave(bn, dim=-1)[..., :cols]
    return (weights.to(torch.float32) * expanded).to(dtype)


def e2m1_pairs(device: Any) -> Any:
    """``(256, 2)`` float32 on ``device``: each byte's two E2M1 values, the low nibble's
    first (made once a device: the table every FP4 dequantization gathers from)."""
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    codes = torch.arange(256)
    return torch.stack((values[codes & 15], values[codes >> 4]), dim=-1).to(device)


def mxfp4_exponents(scales: Any) -> Any:
    """MXFP4's E8M0 scale bytes (uint8) as the int32 powers of two they stand for, ``s -
    127``, as transformers' gpt-oss conversion reads them."""
    return scales.to(torch.int32) - 127


def fp4_blocks(packed: Any, scales: Any, dtype: Any, pairs: Any) -> Any:
    """E2M1 pairs times one scale per 32 values along a row, in ``dtype`` (DeepSeek-V4's
    FP4: ``float32(e2m1) * float32(scale)``, E8M0 255 NaN).

    Args:
        packed: ``(..., rows, cols / 2)``, uint8 or int8: two codes a byte, the low nibble
            first.
        scales: ``(..., rows, cols / 32)``, any float type (E8M0 included).
        dtype: the compute dtype.
        pairs: :func:`e2m1_pairs` on ``packed``'s device.
    """
    scale = scales.to(torch.float32)
    return (_values(packed, pairs, scale.shape[-1]) * scale[..., None]).flatten(-2).to(dtype)


def mxfp4_blocks(packed: Any, exponents: Any, dtype: Any, pairs: Any) -> Any:
    """E2M1 pairs times ``2 ** e`` per 32 values along a row, in ``dtype`` (gpt-oss's
    MXFP4: ``ldexp``, as transformers' conversion, so E8M0 255 is ``2 ** 128``: a zero stays
    zero, anything else overflows to inf unless it is 0.5, ``2 ** 127``).

    Args:
        packed: ``(..., rows, cols / 2)``, uint8: two codes a byte, the low nibble first.
        exponents: ``(..., rows, cols / 32)``, int32 (:func:`mxfp4_exponents`).
        dtype: the compute dtype.
        pairs: :func:`e2m1_pairs` on ``packed``'s device.
    """
    values = _values(packed, pairs, exponents.shape[-1])
    return torch.ldexp(values, exponents[..., None]).flatten(-2).to(dtype)


def _values(packed: Any, pairs: Any, groups: int) -> Any:
    """The E2M1 codes of ``packed`` as float32, ``(..., rows, groups, cols / groups)``."""
    values = pairs[packed.view(torch.uint8).to(torch.int32)]  # (..., rows, cols / 2, 2)
    return values.flatten(-2).unflatten(-1, (groups, -1))
