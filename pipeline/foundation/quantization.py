"""Quantized experts of a checkpoint: which formats are read, and where their scales are.

A quantized expert matrix is streamed as the file stores it (its bytes are what a miss reads,
uploads and the budget counts); whoever computes with it turns it into numbers with its
scales. The scales are small tensors beside each matrix (1/16384 of an FP8 matrix's bytes
at 128 x 128 blocks): they stay non-routed tensors of the table, read once by the engine
(``Session.read_tensor``) and kept on its device, and :class:`ExpertQuant` names them per
expert so nothing has to guess a naming.

Formats read:

- ``fp8`` (``quantization_config: {quant_method: fp8, fmt: e4m3, weight_block_size: [bm,
  bn]}``: DeepSeek-V3/R1, Qwen3-FP8, GLM, MiniMax, Kimi): each expert matrix F8_E4M3
  ``[rows, cols]``, its ``weight_scale_inv`` ``[ceil(rows / bm), ceil(cols / bn)]`` in F32
  or BF16 (edge blocks may be partial); per-expert tensors only.

Any other quantized expert (another ``quant_method``, MXFP4, integer, an FP8 fused layout)
is refused in one line that names it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeAlias

from gguf import GGMLQuantizationType

from pipeline.foundation.errors import ExpertLayoutError

__all__ = ["FP8_CARRIER", "ExpertQuant", "QuantConfig", "Spec", "fp8_layer_quant", "quant_config"]

FP8_CARRIER = GGMLQuantizationType.I8
"""The GGUF type an FP8 matrix's bytes travel as (one byte an element; ``ExpertQuant``
says what they mean)."""
_FP8_SCALE_TYPES = ("F32", "BF16")
_SCALE_SUFFIX = "_scale_inv"


@dataclass(frozen=True, slots=True)
class QuantConfig:
    """A checkpoint's ``quantization_config``, as far as its experts are concerned."""

    method: str
    block: tuple[int, int]


@dataclass(frozen=True, slots=True)
class ExpertQuant:
    """How a MoE layer's quantized experts become numbers.

    Attributes:
        method: ``fp8`` (E4M3 values times a scale per block).
        block: ``(bm, bn)``: the rows and columns one scale covers (edge blocks partial).
        scales: per expert, the names of its gate, up and down scale tensors (non-routed
            tensors of the model: ``ModelInfo.tensors``).
        scale_dtype: the scales' type as the file names it (``F32``, ``BF16``).
    """

    method: str
    block: tuple[int, int]
    scales: tuple[tuple[str, str, str], ...]
    scale_dtype: str


Spec: TypeAlias = tuple[str, str, tuple[int, ...]]
"""A tensor as the header declares it: (name, dtype, shape)."""


def quant_config(path: Path, config: Mapping[str, Any]) -> QuantConfig | None:
    """The checkpoint's expert quantization from ``config.json``; None when it has none.

    Raises:
        ExpertLayoutError: a ``quantization_config`` moestream does not read, or a malformed
            one; one line naming it.
    """
    q = config.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise ExpertLayoutError(path, "config.json's quantization_config is not an object")
    method = q.get("quant_method")
    if method != "fp8":
        raise ExpertLayoutError(path, f"config.json's quantization_config quant_method "
                                      f"{str(method)[:40]!r}: moestream reads fp8 (E4M3 "
                                      "blocks) quantized experts")
    fmt = q.get("fmt", "e4m3")
    block = q.get("weight_block_size")
    if fmt != "e4m3" or not (isinstance(block, list) and len(block) == 2
                             and all(type(b) is int and 0 < b <= 1 << 16 for b in block)):
        raise ExpertLayoutError(path, f"config.json's fp8 quantization_config (fmt "
                                      f"{str(fmt)[:20]!r}, weight_block_size "
                                      f"{str(block)[:40]}): moestream reads e4m3 with a "
                                      "[rows, cols] block size")
    return QuantConfig("fp8", (block[0], block[1]))


def fp8_layer_quant(path: Path, index: int, quant: QuantConfig,
                    experts: Sequence[tuple[Spec, Spec, Spec]],
                    tensors: Mapping[str, Spec]) -> ExpertQuant:
    """The scales of one layer's FP8 experts (per expert its gate, up and down matrices),
    each checked against its matrix and the block size; ``tensors``: the non-routed tensors
    by name.

    Raises:
        ExpertLayoutError: a scale missing, of another type than the layer's first, or of
            a shape the block size does not give.
    """
    bm, bn = quant.block
    names: list[tuple[str, str, str]] = []
    first: str | None = None
    for matrices in experts:
        row = []
        for matrix_name, _, (rows, cols) in matrices:
            name = matrix_name + _SCALE_SUFFIX
            scale = tensors.get(name)
            if scale is None:
                raise ExpertLayoutError(path, f"layer {index}: {name[:120]} is missing (an FP8 "
                                              "expert matrix needs its block scales)")
            _, dtype, shape = scale
            first = first or dtype
            want = (-(-rows // bm), -(-cols // bn))
            if dtype not in _FP8_SCALE_TYPES or dtype != first or tuple(shape) != want:
                raise ExpertLayoutError(path, f"layer {index}: {name[:120]} is {dtype[:20]} "
                                              f"{list(shape)[:4]}, expected {first[:20]} "
                                              f"{list(want)} (F32 or BF16, a scale per "
                                              f"{bm} x {bn} block)")
            row.append(name)
        names.append((row[0], row[1], row[2]))
    return ExpertQuant("fp8", quant.block, tuple(names), first or "F32")
