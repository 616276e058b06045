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
"""

from __future__ import annotations

from typing import Any

import torch  # type: ignore[import-not-found, unused-ignore]

__all__ = ["fp8_blocks"]


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
