"""Quantized experts of a checkpoint: which formats are read, and where their scales are.

A quantized expert matrix is streamed as the file stores it (its bytes are what a miss reads,
uploads and the budget counts); whoever computes with it turns it into numbers with its
scales. The scales are small tensors beside each matrix (1/16384 of an FP8 matrix's bytes
at 128 x 128 blocks, 1/16 of an MXFP4 one's): they stay non-routed tensors of the table, read
once by the engine (``Session.read_tensor``) and kept on its device, and
:class:`ExpertQuant` names them so nothing has to guess a naming. Every quantized matrix
travels as :data:`CARRIER` (I8: its bytes as the file has them; what they mean is
``ExpertQuant``'s).

Formats read:

- ``fp8`` (``quantization_config: {quant_method: fp8, fmt: e4m3, weight_block_size: [bm,
  bn]}``: DeepSeek-V3/R1, Qwen3-FP8, GLM, MiniMax, Kimi): each expert matrix F8_E4M3
  ``[rows, cols]``, its ``weight_scale_inv`` ``[ceil(rows / bm), ceil(cols / bn)]`` in F32
  or BF16 (edge blocks may be partial); per-expert tensors only.
- ``mxfp4`` (gpt-oss: ``quant_method: mxfp4``): the fused, transposed layout's experts as
  ``gate_up_proj_blocks`` U8 ``[E, 2F, D / 32, 16]`` and ``down_proj_blocks`` ``[E, D,
  F / 32, 16]`` (E2M1 pairs, the low nibble first, rows of the untransposed matrices), their
  ``*_scales`` U8 ``[E, 2F, D / 32]`` and ``[E, D, F / 32]`` (E8M0: ``2 ** (s - 127)``),
  one tensor a layer (expert ``e``'s scales are its slice ``e``). An expert's bytes are its
  slices of the blocks.

Any other quantized expert (another ``quant_method``, integer, an FP8 fused layout) is
refused in one line that names it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeAlias

from gguf import GGMLQuantizationType

from pipeline.foundation.errors import ExpertLayoutError

__all__ = ["CARRIER", "FP8_CARRIER", "ExpertQuant", "QuantConfig", "Spec", "carried",
           "fp8_layer_quant", "mxfp4_layer_quant", "quant_config"]

CARRIER = GGMLQuantizationType.I8
"""The GGUF type a quantized matrix's bytes travel as (``ExpertQuant`` says what they
mean)."""
FP8_CARRIER = CARRIER
""":data:`CARRIER`, under the name it had while FP8 was the one format read."""
FP4_GROUP = 32
"""Values one E8M0 scale covers along a row in MXFP4 (gpt-oss)."""
_FP8_SCALE_TYPES = ("F32", "BF16")
_FILE_TYPES = {"fp8": "F8_E4M3", "mxfp4": "U8"}
"""The file's type of each format's expert matrices."""

Shape2: TypeAlias = tuple[int, int]


@dataclass(frozen=True, slots=True)
class QuantConfig:
    """A checkpoint's ``quantization_config``, as far as its experts are concerned.

    Attributes:
        method: ``quant_method`` (``fp8``, ``mxfp4``).
        block: the dense FP8 weights' ``weight_block_size`` (``(1, 32)`` for mxfp4).
        experts: the experts' format: ``fp8`` or ``mxfp4``.
    """

    method: str
    block: Shape2
    experts: str = "fp8"


@dataclass(frozen=True, slots=True)
class ExpertQuant:
    """How a MoE layer's quantized experts become numbers.

    Attributes:
        method: ``fp8`` (E4M3 values times a scale per block) or ``mxfp4`` (E2M1 pairs
            times an E8M0 scale per 32 along a row in gpt-oss's blocks, its scales one
            tensor a layer).
        block: ``(bm, bn)``: the rows and columns (elements) one scale covers (edge blocks
            partial); ``(1, 32)`` for ``mxfp4``.
        scales: per expert, the names of its gate, up and down scale tensors (non-routed
            tensors of the model: ``ModelInfo.tensors``); empty for ``mxfp4``.
        scale_dtype: the scales' type as the file names it (``F32``, ``BF16``, ``U8``).
        layer_scales: ``mxfp4``: the layer's gate_up and down scale tensors, ``[E, 2F, D /
            32]`` and ``[E, D, F / 32]``, expert ``e`` their slice ``e`` (gate the first F
            rows of gate_up's, up the others); None otherwise.
        shapes: the gate, up and down bytes' shapes as stored (``Matrix.shape``) where a
            byte is not an element (two E2M1 codes a byte, rows of the untransposed matrices:
            ``mxfp4`` gate and up are the row halves of gate_up ``[2F, D / 2]``, down ``[D,
            F / 2]``); None where it is (``fp8``).
    """

    method: str
    block: Shape2
    scales: tuple[tuple[str, str, str], ...]
    scale_dtype: str
    layer_scales: tuple[str, str] | None = None
    shapes: tuple[Shape2, Shape2, Shape2] | None = None

    @property
    def names(self) -> tuple[str, ...]:
        """Every scale tensor of the layer."""
        per_expert = tuple(name for names in self.scales for name in names)
        return per_expert + (self.layer_scales or ())


Spec: TypeAlias = tuple[str, str, tuple[int, ...]]
"""A tensor as the header declares it: (name, dtype, shape)."""


def quant_config(path: Path, config: Mapping[str, Any]) -> QuantConfig | None:
    """The checkpoint's expert quantization from ``config.json``; None when it has none.

    Raises:
        ExpertLayoutError: a ``quantization_config`` moestream does not read, or a
            malformed one; one line naming it.
    """
    q = config.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise ExpertLayoutError(path, "config.json's quantization_config is not an object")
    method = q.get("quant_method")
    if method == "mxfp4":
        return QuantConfig("mxfp4", (1, FP4_GROUP), "mxfp4")
    if method != "fp8":
        raise ExpertLayoutError(path, f"config.json's quantization_config quant_method "
                                      f"{str(method)[:40]!r}: moestream reads fp8 (E4M3 "
                                      "blocks) and mxfp4 quantized experts")
    fmt = q.get("fmt", "e4m3")
    block = q.get("weight_block_size")
    if fmt != "e4m3" or not (isinstance(block, list) and len(block) == 2
                             and all(type(b) is int and 0 < b <= 1 << 16 for b in block)):
        raise ExpertLayoutError(path, f"config.json's fp8 quantization_config (fmt "
                                      f"{str(fmt)[:20]!r}, weight_block_size "
                                      f"{str(block)[:40]}): moestream reads e4m3 with a "
                                      "[rows, cols] block size")
    return QuantConfig("fp8", (block[0], block[1]), "fp8")


def carried(quant: QuantConfig | None, dtype: str) -> bool:
    """Whether an expert matrix of file type ``dtype`` is read as quantized bytes
    (:data:`CARRIER`): the type the checkpoint's expert format stores."""
    return quant is not None and _FILE_TYPES[quant.experts] == dtype


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
            name = matrix_name + "_scale_inv"
            scale = tensors.get(name)
            if scale is None:
                raise ExpertLayoutError(path, f"layer {index}: {name[:120]} is missing (an FP8 "
                                              "expert matrix needs its block scales)")
            _, dtype, scale_shape = scale
            first = first or dtype
            want = (-(-rows // bm), -(-cols // bn))
            if dtype not in _FP8_SCALE_TYPES or dtype != first or tuple(scale_shape) != want:
                raise ExpertLayoutError(path, f"layer {index}: {name[:120]} is {dtype[:20]} "
                                              f"{list(scale_shape)[:4]}, expected "
                                              f"{first[:20]} {list(want)} (F32 or BF16, a "
                                              f"scale per {bm} x {bn} block)")
            row.append(name)
        names.append((row[0], row[1], row[2]))
    return ExpertQuant("fp8", quant.block, tuple(names), first or "F32")


def mxfp4_layer_quant(path: Path, index: int, gate_up: Spec, down: Spec,
                      tensors: Mapping[str, Spec]) -> tuple[int, int, int, ExpertQuant]:
    """One layer of gpt-oss's MXFP4 experts: its expert count, hidden size, expert FFN and
    scales, from ``gate_up_proj_blocks`` and ``down_proj_blocks`` and the ``*_scales``
    beside them.

    Raises:
        ExpertLayoutError: blocks or scales missing, of another type, or of shapes that do
            not make ``[E, 2F, D / 32, 16]`` and ``[E, D, F / 32, 16]``.
    """
    shapes = []
    for name, dtype, shape in (gate_up, down):
        if dtype != "U8" or len(shape) != 4 or shape[3] != FP4_GROUP // 2:
            raise ExpertLayoutError(path, f"layer {index}: {name[:120]} is {dtype[:20]} "
                                          f"{list(shape)[:6]}; MXFP4 blocks are U8 [experts, "
                                          "rows, groups, 16]")
        shapes.append(shape)
    (n, rows, groups, _), (n_down, hidden, down_groups, _) = shapes
    ffn = rows // 2
    if (n != n_down or rows % 2 or groups * FP4_GROUP != hidden
            or down_groups * FP4_GROUP != ffn or 0 in (n, ffn, hidden)):
        raise ExpertLayoutError(path, f"layer {index}: gate_up_proj_blocks {list(shapes[0])} "
                                      f"and down_proj_blocks {list(shapes[1])} are not [E, 2F, "
                                      "D / 32, 16] and [E, D, F / 32, 16]")
    names = []
    for (name, _, shape) in (gate_up, down):
        scale_name = name.removesuffix("_blocks") + "_scales"
        scale = tensors.get(scale_name)
        if scale is None:
            raise ExpertLayoutError(path, f"layer {index}: {scale_name[:120]} is missing (MXFP4 "
                                          "blocks need their scales)")
        if scale[1] != "U8" or tuple(scale[2]) != tuple(shape[:3]):
            raise ExpertLayoutError(path, f"layer {index}: {scale_name[:120]} is "
                                          f"{scale[1][:20]} {list(scale[2])[:6]}, expected U8 "
                                          f"{list(shape[:3])} (an E8M0 scale per 32 values)")
        names.append(scale_name)
    half = FP4_GROUP // 2
    quant = ExpertQuant("mxfp4", (1, FP4_GROUP), (), "U8", layer_scales=(names[0], names[1]),
                        shapes=((ffn, groups * half), (ffn, groups * half),
                                (hidden, down_groups * half)))
    return n, hidden, ffn, quant
