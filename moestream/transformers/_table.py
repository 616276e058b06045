"""A whole layer's device table for the whole-layer path (``_routing.WholeLayers``): each
expert's matrix addresses, and the one launch that fills a call's slots from them: the
gather kernel's copies for plain float experts, a quantized layer's slot kernel
(``_dequant_cuda.layer_slots_cuda``) otherwise."""

from __future__ import annotations

import math
from typing import Any

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from moestream.transformers._dequant_cuda import layer_slots_cuda
from moestream.transformers._gather import blocks, launch
from moestream.transformers._gguf_experts import GgufExperts
from moestream.transformers._launch import raw_stream
from moestream.transformers._quantized import LayerScales

__all__ = ["LayerTable"]

_BITS = {"fp8": 8, "fp4": 4, "mxfp4": 4}
"""A quantized expert's bits a weight, by ``LayerScales.method``."""


def _matrix_bytes(scales: LayerScales | GgufExperts | None, dtype: Any, values: int,
                  down: bool) -> int:
    """The bytes of a matrix of ``values`` weights as the cache holds it: plain in
    ``dtype``, FP8/FP4 at their bits a weight, a GGUF type in its blocks."""
    if scales is None:
        return values * int(dtype.itemsize)
    if isinstance(scales, GgufExperts):
        elems, size = GGML_QUANT_SIZES[GGMLQuantizationType(
            scales.down_type if down else scales.gate_up_type)]
        return values // elems * size
    return values * _BITS[scales.method] // 8


class LayerTable:
    """One whole layer's addresses on the device, ``(experts, 3)`` int64, and its matrices'
    bytes (every expert of a layer has the same); with what each call of the layer would
    otherwise work out again: the module's projection shapes and dtype (set once
    :meth:`accept` took them) and the kernel's grid width. A quantized layer's ``scales``
    (None: plain float experts, copied as they are) say how its slots are dequantized
    instead (``layer_slots_cuda``)."""

    __slots__ = ("addresses", "blocks", "down_bytes", "down_shape", "dtype", "experts",
                 "first_shape", "gate_bytes", "scales", "sizes", "up_bytes")

    def __init__(self, addresses: Any, sizes: tuple[int, int, int],
                 scales: LayerScales | GgufExperts | None = None) -> None:
        self.addresses = addresses
        self.scales = scales
        self.experts = int(addresses.shape[0])
        self.gate_bytes, self.up_bytes, self.down_bytes = sizes
        self.sizes = sizes  # the kernel's arguments
        largest = max(sizes)
        self.blocks = blocks(largest)
        self.first_shape: tuple[int, ...] = ()
        self.down_shape: tuple[int, ...] = ()
        self.dtype: Any = None

    def accept(self, first_shape: tuple[int, ...], down_shape: tuple[int, ...], dtype: Any
               ) -> bool:
        """Take the module's projection shapes if an expert's gate and up fill one first
        projection and its down one down projection, in ``dtype`` or, quantized, in its
        format's bytes (what the copies and kernels assume); False, taking nothing, where
        they do not."""
        if (_matrix_bytes(self.scales, dtype, math.prod(first_shape), False)
                != self.gate_bytes + self.up_bytes
                or _matrix_bytes(self.scales, dtype, math.prod(down_shape), True)
                != self.down_bytes):
            return False
        self.first_shape, self.down_shape, self.dtype = first_shape, down_shape, dtype
        return True

    def fill(self, device: Any, slots: Any, first: Any, down: Any) -> None:
        """One launch on torch's stream of ``device``: slot ``j`` of ``first`` and ``down``
        gets the weights of expert ``slots[j]`` (-1: left as it is), copied or dequantized."""
        if self.scales is not None:
            layer_slots_cuda(self.scales, self.addresses.data_ptr(), slots, first, down)
            return
        index, stream = raw_stream(device)
        launch(index, (self.blocks, slots.shape[0]), stream, self.addresses.data_ptr(),
               slots.data_ptr(), first.data_ptr(), down.data_ptr(), self.sizes)
