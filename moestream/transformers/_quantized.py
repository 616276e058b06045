"""A quantized checkpoint's scales: the experts' kept on the device, the dense ones folded in
at load.

The routed experts stream quantized; their scales (``ExpertQuant.scales``: a few hundred
bytes a matrix for FP8 blocks, 1/16 of the bytes for FP4; gpt-oss's MXFP4 one tensor a
layer) are read once through the session (``read_tensor``: the files as identified) and
kept on the compute device as one tensor per layer and matrix, indexed by expert, so that
dequantizing a batch of arrived experts is one gather and one product. FP8 block scales are
kept as float32; the FP4 formats' E8M0 scales as their bytes (a scale per 32 values is 1/16
of the experts' bytes: as float32 it would be a quarter), turned into numbers per use for
the experts gathered. The dense weights (attention, shared experts) are dequantized once
at load, as transformers' ``dequantize=True`` does: the model then holds them in its own
dtype. Their scales are ``<weight>_scale_inv`` or, as DeepSeek-V4 names them, ``.scale``
beside an F8_E4M3 ``.weight``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch  # type: ignore[import-not-found, unused-ignore]

import moestream
from moestream.pipeline.foundation.errors import ModelFileError
from moestream.transformers._dequant import (
    e2m1_pairs,
    fp4_blocks,
    fp8_blocks,
    mxfp4_blocks,
    mxfp4_exponents,
)

__all__ = ["DenseScales", "LayerScales", "load_scales"]

_SCALE = "_scale_inv"


@dataclass(frozen=True, slots=True)
class LayerScales:
    """One layer's expert scales on the device, per matrix ``(experts, rows / bm, cols /
    bn)`` (float32; the FP4 formats' E8M0 bytes as uint8), and what they scale.

    Attributes:
        method: ``fp8``, ``fp4`` or ``mxfp4`` (``ExpertQuant.method``).
        block: the elements one scale covers.
        gate, up, down: the scales, indexed by expert.
        pairs: the E2M1 table on the device (FP4 formats), else None.
        transposed: the module keeps the experts transposed (gpt-oss) while the bytes are
            rows of the untransposed matrices (MXFP4).
    """

    method: str
    block: tuple[int, int]
    gate: Any
    up: Any
    down: Any
    pairs: Any = None
    transposed: bool = False

    def dequantize(self, which: str, experts: Any, raw: Any, dtype: Any) -> Any:
        """``raw`` quantized matrices ``(n, rows, bytes)`` of ``experts`` (a tensor of ids
        on the device), or one 2-D of expert ``experts`` (an int), in ``dtype``, as stored
        (``(n, rows, cols)``: MXFP4's untransposed)."""
        scales = getattr(self, which)[experts]
        if self.method == "mxfp4":
            return mxfp4_blocks(raw, mxfp4_exponents(scales), dtype, self.pairs)
        if self.method == "fp4":
            return fp4_blocks(raw, scales.view(torch.float8_e8m0fnu), dtype, self.pairs)
        return fp8_blocks(raw, scales, self.block, dtype)

    def expert(self, expert: int, raws: tuple[Any, Any, Any], dtype: Any
               ) -> tuple[Any, Any, Any]:
        """One expert's matrices as the module's layout has them: gate ``(F, D)``, up and
        down ``(D, F)``; transposed, the row halves of gate_up ``(D, 2F)`` and down ``(F,
        D)``, each contiguous (a product reads them as the module's own)."""
        gate, up, down = (self.dequantize(name, expert, raw, dtype)
                          for name, raw in zip(("gate", "up", "down"), raws, strict=True))
        if not self.transposed:
            return gate, up, down
        gate_up = torch.cat((gate.T, up.T), dim=1)
        half = gate_up.shape[0] // 2
        return gate_up[:half], gate_up[half:], down.T.contiguous()

    def targets(self, gate_up: Any, down: Any) -> tuple[Any, Any, Any]:
        """Where the gate, up and down matrices go in the stacked ``gate_up`` and ``down``
        (views): gate the first F rows of gate_up, up the others, or, transposed, its
        first and last F columns."""
        if self.transposed:
            ffn = down.shape[-2]
            return gate_up[..., :ffn], gate_up[..., ffn:], down
        ffn = down.shape[-1]
        return gate_up[:, :ffn], gate_up[:, ffn:], down

    def fill(self, experts: list[int], raws: tuple[Any, Any, Any], gate_up: Any,
             down: Any) -> None:
        """The experts' matrices (``raws``: the stacked gate, up and down bytes) dequantized
        into the module's layout: ``gate_up`` ``(n, 2F, D)`` and ``down`` ``(n, D, F)``, or
        transposed ``(n, D, 2F)`` and ``(n, F, D)``; one product per matrix kind."""
        targets = self.targets(gate_up, down)
        # the ids on the device once a batch (from pinned memory: queued, not waited), not
        # one host-to-device copy a matrix kind
        ids = torch.tensor(experts, dtype=torch.int64, pin_memory=self.gate.is_cuda)
        ids = ids.to(self.gate.device, non_blocking=True)
        for name, raw, target in zip(("gate", "up", "down"), raws, targets, strict=True):
            value = self.dequantize(name, ids, raw, target.dtype)
            target.copy_(value.transpose(-1, -2) if self.transposed else value)


def load_scales(session: moestream.SyncSession, layers: list[int], device: Any,
                read: Callable[[moestream.TensorSpec], Any]) -> dict[int, LayerScales]:
    """Every quantized layer's expert scales, read through ``read`` (a CPU tensor of a
    spec), stacked per matrix and moved to ``device``."""
    out: dict[int, LayerScales] = {}
    pairs = None
    for layer in layers:
        info = session.model.layers[layer]
        quant = info.quant
        if quant is None:
            continue
        tensors = session.model.tensors
        if quant.layer_scales is not None:  # MXFP4: one tensor a layer, rows gate then up
            gate_up, down = (read(tensors[name]).to(device) for name in quant.layer_scales)
            stacks = [gate_up[:, :info.ffn], gate_up[:, info.ffn:], down]
        elif quant.method == "fp4":  # E8M0 bytes
            stacks = [torch.stack([read(tensors[names[i]]).view(torch.uint8)
                                   for names in quant.scales]).to(device) for i in range(3)]
        else:
            stacks = [torch.stack([read(tensors[names[i]]).to(torch.float32)
                                   for names in quant.scales]).to(device) for i in range(3)]
        if quant.method != "fp8" and pairs is None:
            pairs = e2m1_pairs(device)
        out[layer] = LayerScales(quant.method, quant.block, stacks[0], stacks[1], stacks[2],
                                 pairs=None if quant.method == "fp8" else pairs,
                                 transposed=info.transposed)
    return out


class DenseScales:
    """The dense FP8 weights' scales: which tensors are scales (consumed, never assigned)
    and the dequantization of a weight that has one.

    Args:
        session: the open session (its tensors and config).
        root: the checkpoint, for messages.
    """

    def __init__(self, session: moestream.SyncSession, root: Path) -> None:
        self._tensors: Mapping[str, moestream.TensorSpec] = session.model.tensors
        self._root = root
        quant = session.model.config.get("quantization_config")
        block = quant.get("weight_block_size") if isinstance(quant, dict) else None
        self._block = (int(block[0]), int(block[1])) if block else None  # checked by the table
        self._expert_scales = {name for layer in session.model.layers.values()
                               if layer.quant is not None for name in layer.quant.names}

    def is_scale(self, name: str) -> bool:
        """Whether ``name`` is a scale another tensor consumes: an expert's, a weight's
        ``_scale_inv``, or the ``.scale`` of an F8_E4M3 ``.weight`` (DeepSeek-V4)."""
        if name in self._expert_scales:
            return True
        if name.endswith(_SCALE):
            return name.removesuffix(_SCALE) in self._tensors
        weight = self._tensors.get(name.removesuffix(".scale") + ".weight")
        return name.endswith(".scale") and weight is not None and weight.dtype == "F8_E4M3"

    def _scale_of(self, name: str) -> moestream.TensorSpec | None:
        scale = self._tensors.get(name + _SCALE)
        if scale is None and name.endswith(".weight"):
            scale = self._tensors.get(name.removesuffix(".weight") + ".scale")
        return scale

    def weight(self, spec: moestream.TensorSpec, tensor: Any, dtype: Any,
               read: Callable[[moestream.TensorSpec], Any]) -> Any:
        """``tensor`` in ``dtype``: an FP8 weight times its block scales (read by ``read``).

        Raises:
            ModelFileError: an FP8 weight without its scale or a quantization_config, or a
                scale of another shape; an integer weight with a scale (a dense weight
                quantized otherwise: FP4, integer).
        """
        if spec.dtype != "F8_E4M3":
            if spec.dtype in ("I8", "U8") and self._scale_of(spec.name) is not None:
                raise ModelFileError(self._root, f"{spec.name[:120]} is {spec.dtype} with a "
                                     "scale: moestream dequantizes F8_E4M3 dense weights, "
                                     "quantized experts otherwise")
            return tensor
        scale = self._scale_of(spec.name)
        if scale is None or self._block is None:
            lacks = f"its {_SCALE} or .scale" if scale is None else "a quantization_config"
            raise ModelFileError(self._root, f"{spec.name[:120]} is F8_E4M3 without {lacks}: "
                                 "no scale to read it with")
        bm, bn = self._block
        rows, cols = spec.shape if len(spec.shape) == 2 else (0, 0)
        if tuple(scale.shape) != (-(-rows // bm), -(-cols // bn)):
            raise ModelFileError(self._root, f"{scale.name[:120]} is {list(scale.shape)[:4]}, "
                                 f"not a scale per {bm} x {bn} block of {spec.name[:80]} "
                                 f"{list(spec.shape)[:4]}")
        return fp8_blocks(tensor, read(scale).to(tensor.device), self._block, dtype)
