"""Quantized experts of a checkpoint: which formats are read, and where their scales are.

A quantized expert matrix is streamed as the file stores it (its bytes are what a miss reads,
uploads and the budget counts); whoever computes with it turns it into numbers with its
scales. The scales are small tensors beside each matrix (1/16384 of an FP8 matrix's bytes
at 128 x 128 blocks, 1/16 of an FP4 one's): they stay non-routed tensors of the table, read
once by the engine (``Session.read_tensor``) and kept on its device, and
:class:`ExpertQuant` names them so nothing has to guess a naming. Every quantized matrix
travels as :data:`CARRIER` (I8: its bytes as the file has them; what they mean is
``ExpertQuant``'s).

Formats read:

- ``fp8`` (``quantization_config: {quant_method: fp8, fmt: e4m3, weight_block_size: [bm,
  bn]}``: DeepSeek-V3/R1, Qwen3-FP8, GLM, MiniMax, Kimi): each expert matrix F8_E4M3
  ``[rows, cols]``, its scale ``[ceil(rows / bm), ceil(cols / bn)]`` in F32 or BF16 (edge
  blocks may be partial), or F8_E8M0 with ``scale_fmt: ue8m0``; named ``weight_scale_inv``
  or, as DeepSeek-V4 names them, ``.scale`` beside ``.weight``; per-expert tensors only.
- ``fp4`` (DeepSeek-V4-Flash: ``quant_method: fp8``, ``scale_fmt: ue8m0`` and top-level
  ``expert_dtype: fp4``): each expert matrix I8 ``[rows, cols / 2]``, two E2M1 codes a
  byte (the low nibble first), its ``.scale`` F8_E8M0 ``[rows, cols / 32]``, one power of
  two per 32 values along a row. The dense weights are FP8 as above.
- ``mxfp4`` (gpt-oss: ``quant_method: mxfp4``): the fused, transposed layout's experts as
  ``gate_up_proj_blocks`` U8 ``[E, 2F, D / 32, 16]`` and ``down_proj_blocks`` ``[E, D,
  F / 32, 16]`` (E2M1 pairs, the low nibble first, rows of the untransposed matrices), their
  ``*_scales`` U8 ``[E, 2F, D / 32]`` and ``[E, D, F / 32]`` (E8M0: ``2 ** (s - 127)``),
  one tensor a layer (expert ``e``'s scales are its slice ``e``). An expert's bytes are its
  slices of the blocks.

Any other quantized expert (another ``quant_method`` or ``expert_dtype``, integer, an FP8
fused layout) is refused in one line that names it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeAlias

from gguf import GGMLQuantizationType

from moestream.pipeline.foundation.errors import ExpertLayoutError

__all__ = ["CARRIER", "FP8_CARRIER", "ExpertQuant", "QuantConfig", "Spec", "carried",
           "element_shape", "expert_layer_quant", "fp8_layer_quant", "mxfp4_layer_quant",
           "quant_config"]

CARRIER = GGMLQuantizationType.I8
"""The GGUF type a quantized matrix's bytes travel as (``ExpertQuant`` says what they
mean)."""
FP8_CARRIER = CARRIER
""":data:`CARRIER`, under the name it had while FP8 was the one format read."""
FP4_GROUP = 32
"""Values one E8M0 scale covers along a row, in FP4 (DeepSeek-V4) and MXFP4 (gpt-oss)."""
_FP8_SCALE_TYPES = ("F32", "BF16", "F8_E8M0")
_EXPERT_DTYPE = {None: "fp8", "fp8": "fp8", "fp4": "fp4"}
"""config.json's top-level ``expert_dtype`` under ``quant_method: fp8``: the experts'
format."""
_FILE_TYPES = {"fp8": "F8_E4M3", "fp4": "I8", "mxfp4": "U8"}
"""The file's type of each format's expert matrices."""
_SCALE_FMTS = (None, "float", "ue8m0")

Shape2: TypeAlias = tuple[int, int]


@dataclass(frozen=True, slots=True)
class QuantConfig:
    """A checkpoint's ``quantization_config``, as far as its experts are concerned.

    Attributes:
        method: ``quant_method`` (``fp8``, ``mxfp4``).
        block: the dense FP8 weights' ``weight_block_size`` (``(1, 32)`` for mxfp4).
        experts: the experts' format: ``fp8``, ``fp4`` (``expert_dtype: fp4``) or ``mxfp4``.
    """

    method: str
    block: Shape2
    experts: str = "fp8"


@dataclass(frozen=True, slots=True)
class ExpertQuant:
    """How a MoE layer's quantized experts become numbers.

    Attributes:
        method: ``fp8`` (E4M3 values times a scale per block), ``fp4`` (E2M1 pairs times an
            E8M0 scale per 32 along a row, DeepSeek-V4) or ``mxfp4`` (the same values in
            gpt-oss's blocks, its scales one tensor a layer).
        block: ``(bm, bn)``: the rows and columns (elements) one scale covers (edge blocks
            partial); ``(1, 32)`` for the FP4 formats.
        scales: per expert, the names of its gate, up and down scale tensors (non-routed
            tensors of the model: ``ModelInfo.tensors``); empty for ``mxfp4``.
        scale_dtype: the scales' type as the file names it (``F32``, ``BF16``, ``F8_E8M0``,
            ``U8``).
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
        ExpertLayoutError: a ``quantization_config`` (or ``expert_dtype``) moestream does
            not read, or a malformed one; one line naming it.
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
                                      "blocks, FP4 experts with expert_dtype fp4) and mxfp4 "
                                      "quantized experts")
    fmt = q.get("fmt", "e4m3")
    block = q.get("weight_block_size")
    if fmt != "e4m3" or not (isinstance(block, list) and len(block) == 2
                             and all(type(b) is int and 0 < b <= 1 << 16 for b in block)):
        raise ExpertLayoutError(path, f"config.json's fp8 quantization_config (fmt "
                                      f"{str(fmt)[:20]!r}, weight_block_size "
                                      f"{str(block)[:40]}): moestream reads e4m3 with a "
                                      "[rows, cols] block size")
    scale_fmt = q.get("scale_fmt")
    if scale_fmt not in _SCALE_FMTS:
        raise ExpertLayoutError(path, f"config.json's fp8 quantization_config scale_fmt "
                                      f"{str(scale_fmt)[:20]!r}: moestream reads float and "
                                      "ue8m0 scales")
    expert_dtype = config.get("expert_dtype")
    experts = _EXPERT_DTYPE.get(expert_dtype) if isinstance(expert_dtype, str | None) else None
    if experts is None:
        raise ExpertLayoutError(path, f"config.json's expert_dtype {str(expert_dtype)[:20]!r}: "
                                      "moestream reads fp8 and fp4 experts")
    return QuantConfig("fp8", (block[0], block[1]), experts)


def carried(quant: QuantConfig | None, dtype: str) -> bool:
    """Whether an expert matrix of file type ``dtype`` is read as quantized bytes
    (:data:`CARRIER`): the type the checkpoint's expert format stores."""
    return quant is not None and _FILE_TYPES[quant.experts] == dtype


def element_shape(quant: QuantConfig | None, dtype: str,
                  shape: tuple[int, ...]) -> tuple[int, ...]:
    """A per-expert matrix's shape in elements: an FP4 matrix's rows hold two a byte."""
    if quant is not None and quant.experts == "fp4" and dtype == "I8" and len(shape) == 2:
        return (shape[0], 2 * shape[1])
    return shape


def expert_layer_quant(path: Path, index: int, quant: QuantConfig,
                       experts: Sequence[tuple[Spec, Spec, Spec]],
                       tensors: Mapping[str, Spec]) -> ExpertQuant:
    """The scales of one layer's per-expert quantized matrices (per expert its gate, up
    and down, as stored), in the checkpoint's expert format.

    Raises:
        ExpertLayoutError: a scale missing or not as the format has it; FP4 rows that are
            not whole groups of 32.
    """
    if quant.experts == "fp4":
        for name, _, shape in experts[0]:
            if 2 * shape[-1] % FP4_GROUP:
                raise ExpertLayoutError(path, f"layer {index}: {name[:120]} holds rows of "
                                              f"{2 * shape[-1]} FP4 values, not groups of "
                                              f"{FP4_GROUP} (one scale each)")
        found = _block_scales(path, index, "fp4", (1, FP4_GROUP), experts, tensors,
                              element=lambda s: (s[0], 2 * s[1]), types=("F8_E8M0",))
        gate, up, down = (spec[2] for spec in experts[0])
        return replace(found, shapes=((gate[0], gate[1]), (up[0], up[1]), (down[0], down[1])))
    return fp8_layer_quant(path, index, quant, experts, tensors)


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
    return _block_scales(path, index, "fp8", quant.block, experts, tensors)


def _block_scales(path: Path, index: int, method: str, block: Shape2,
                  experts: Sequence[tuple[Spec, Spec, Spec]], tensors: Mapping[str, Spec], *,
                  element: Callable[[tuple[int, ...]], tuple[int, ...]] | None = None,
                  types: tuple[str, ...] = _FP8_SCALE_TYPES) -> ExpertQuant:
    """Per expert matrix its scale tensor, one per ``block`` of its elements (``element``:
    a stored shape to its shape in elements), of one of ``types``, the same for all."""
    bm, bn = block
    names: list[tuple[str, str, str]] = []
    first: str | None = None
    for matrices in experts:
        row = []
        for matrix_name, _, shape in matrices:
            rows, cols = element(shape) if element is not None else shape
            inverse, beside = _scale_names(matrix_name)
            name = beside if beside in tensors else inverse
            scale = tensors.get(name)
            if scale is None:
                raise ExpertLayoutError(path, f"layer {index}: {inverse[:120]} (or "
                                              f"{beside[-40:]}) is missing (a quantized "
                                              "expert matrix needs its scales)")
            _, dtype, scale_shape = scale
            first = first or dtype
            want = (-(-rows // bm), -(-cols // bn))
            if dtype not in types or dtype != first or tuple(scale_shape) != want:
                raise ExpertLayoutError(path, f"layer {index}: {name[:120]} is {dtype[:20]} "
                                              f"{list(scale_shape)[:4]}, expected "
                                              f"{first[:20]} {list(want)} ({' or '.join(types)},"
                                              f" a scale per {bm} x {bn} block)")
            row.append(name)
        names.append((row[0], row[1], row[2]))
    return ExpertQuant(method, block, tuple(names), first or types[0])


def _scale_names(matrix_name: str) -> tuple[str, str]:
    """The names the scale of ``matrix_name`` (a ``.weight``) may have: ``<name>_scale_inv``
    (DeepSeek-V3, Qwen3) and ``.scale`` in place of ``.weight`` (DeepSeek-V4)."""
    return matrix_name + "_scale_inv", matrix_name.removesuffix(".weight") + ".scale"


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
