"""A quantized checkpoint's scales: the experts' kept on the device, the dense ones folded in
at load.

The routed experts stream quantized; their block scales (``ExpertQuant.scales``: a few
hundred bytes a matrix) are read once through the session (``read_tensor``: the files as
identified) and kept on the compute device as one float32 tensor per layer and matrix,
indexed by expert, so that dequantizing a batch of arrived experts is one gather and one
product. The dense weights (attention, shared experts) are dequantized once at load, as
transformers' ``dequantize=True`` does: the model then holds them in its own dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch  # type: ignore[import-not-found, unused-ignore]

import moestream
from moestream.transformers._dequant import fp8_blocks
from pipeline.foundation.errors import ModelFileError

__all__ = ["DenseScales", "LayerScales", "load_scales"]

_SCALE = "_scale_inv"


@dataclass(frozen=True, slots=True)
class LayerScales:
    """One layer's expert scales on the device: ``(experts, rows / bm, cols / bn)`` float32
    per matrix, and the block they scale."""

    block: tuple[int, int]
    gate: Any
    up: Any
    down: Any

    def dequantize(self, which: str, experts: list[int], raw: Any, dtype: Any) -> Any:
        """``raw`` FP8 matrices ``(n, rows, cols)`` (or one, 2-D) of ``experts``, in
        ``dtype``."""
        scales = getattr(self, which)[experts[0] if raw.dim() == 2 else experts]
        return fp8_blocks(raw, scales, self.block, dtype)


def load_scales(session: moestream.SyncSession, layers: list[int], device: Any,
                read: Callable[[moestream.TensorSpec], Any]) -> dict[int, LayerScales]:
    """Every quantized layer's expert scales, read through ``read`` (a CPU tensor of a
    spec), stacked per matrix and moved to ``device``."""
    out: dict[int, LayerScales] = {}
    for layer in layers:
        quant = session.model.layers[layer].quant
        if quant is None:
            continue
        tensors = session.model.tensors
        stacks = [torch.stack([read(tensors[names[i]]).to(torch.float32)
                               for names in quant.scales]).to(device) for i in range(3)]
        out[layer] = LayerScales(quant.block, *stacks)
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
                               if layer.quant is not None
                               for names in layer.quant.scales for name in names}

    def is_scale(self, name: str) -> bool:
        """Whether ``name`` is a scale another tensor consumes."""
        return name in self._expert_scales or (
            name.endswith(_SCALE) and name.removesuffix(_SCALE) in self._tensors)

    def weight(self, spec: moestream.TensorSpec, tensor: Any, dtype: Any,
               read: Callable[[moestream.TensorSpec], Any]) -> Any:
        """``tensor`` in ``dtype``: an FP8 weight times its block scales (read by ``read``)."""
        if spec.dtype != "F8_E4M3":
            return tensor
        scale = self._tensors.get(spec.name + _SCALE)
        if scale is None or self._block is None:
            raise ModelFileError(self._root, f"{spec.name[:120]} is F8_E4M3 without "
                                 f"{'its ' + _SCALE if scale is None else 'a quantization_config'}"
                                 ": no scale to read it with")
        bm, bn = self._block
        rows, cols = spec.shape if len(spec.shape) == 2 else (0, 0)
        if tuple(scale.shape) != (-(-rows // bm), -(-cols // bn)):
            raise ModelFileError(self._root, f"{scale.name[:120]} is {list(scale.shape)[:4]}, "
                                 f"not a scale per {bm} x {bn} block of {spec.name[:80]} "
                                 f"{list(spec.shape)[:4]}")
        return fp8_blocks(tensor, read(scale).to(tensor.device), self._block, dtype)
