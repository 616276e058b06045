"""Leased experts as the torch tensors a product takes: one expert's matrices as views of
the cache, or a batch's stacked as the experts module keeps its own.

A quantized layer's experts (``LayerScales``: FP8, FP4, MXFP4; ``GgufExperts``: a GGUF
layer's types) are dequantized per use, on a GPU by one CuPy kernel a batch where it
applies; the others are views of the cache, cast (copied) only when the model computes in
another dtype, and stacked on a GPU by one gather kernel a batch on torch's stream.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch  # type: ignore[import-not-found, unused-ignore]

from moestream import ExpertHandle
from moestream.transformers._dequant_cuda import available as cuda_kernel
from moestream.transformers._dequant_cuda import (
    gguf_layer_cuda,
    kernels_serve,
    layer_experts_cuda,
)
from moestream.transformers._gather import blocks, launch
from moestream.transformers._gguf_experts import GgufExperts
from moestream.transformers._launch import raw_stream
from moestream.transformers._layout import TORCH_DTYPES, first_projection, raw, view
from moestream.transformers._quantized import LayerScales

__all__ = ["ExpertWeights", "deinterleaved"]


class ExpertWeights:
    """The weights of leased experts on ``device``.

    Args:
        device: the torch device the model computes on.
        scales: the block scales of each quantized layer, on ``device``, or a GGUF
            layer's expert types (its experts are dequantized per use).
        interleaved: the layers whose experts' gate and up rows alternate in the file
            (``LayerInfo.interleaved``): de-interleaved per use, as transformers' loading
            does once.
    """

    def __init__(self, device: Any, scales: Mapping[int, LayerScales | GgufExperts],
                 interleaved: frozenset[int] = frozenset()) -> None:
        self.device = device
        self.scales = scales
        self.interleaved = interleaved
        self._cuda = device.type == "cuda"
        self._slots: dict[int, Any] = {}  # 0..n-1 on the device: the gather's slots

    def expert(self, module: Any, h: ExpertHandle) -> tuple[Any, Any, Any]:
        """The expert's gate ``(F, D)``, up ``(F, D)`` and down ``(D, F)`` (transposed: the
        row halves of gate_up ``(D, 2F)`` and down ``(F, D)``): views of the cache, cast
        (copied) only when the model computes in another dtype; an interleaved layer's gate
        and up are strided views of its rows, joined once. Gate and up together are the
        module's gate_up of the expert either way."""
        dtype = module.down_proj.dtype
        scales = self.scales.get(h.layer)
        if scales is None:
            gate, up = view(h.gate, dtype), view(h.up, dtype)
            if h.layer in self.interleaved:
                gate, up = deinterleaved(torch.cat((gate, up)))
            return gate, up, view(h.down, dtype)
        if not scales.transposed and self._on_kernels(scales, dtype):
            # one launch for the expert's three matrices (the batch path's), not torch's
            # several ops a matrix: the same values, the halves of its first projection
            gate_up, down = self.stacked(module, [h])
            half = gate_up.shape[1] // 2
            return gate_up[0, :half], gate_up[0, half:], down[0]
        gate, up, down = h.matrices
        return scales.expert(h.expert, (raw(gate), raw(up), raw(down)), dtype)

    def stacked(self, module: Any, handles: Sequence[ExpertHandle]) -> tuple[Any, Any]:
        """The experts' weights stacked for one grouped product, as the module keeps its
        own: ``gate_up`` ``(n, 2F, D)`` (gate the first F rows) and ``down`` ``(n, D, F)``,
        or transposed ``(n, D, 2F)`` and ``(n, F, D)``, copied from the cache on the device
        (an expert's gate_up is its gate and up bytes in order, in either layout). On a GPU
        the copies are one kernel on torch's stream, by address (:meth:`_copied`); elsewhere,
        and when a cast is needed, one multi-tensor copy of the views."""
        n = len(handles)
        dtype = module.down_proj.dtype
        gate_up = torch.empty((n, *first_projection(module).shape[1:]), dtype=dtype,
                              device=self.device)
        down = torch.empty((n, *module.down_proj.shape[1:]), dtype=dtype, device=self.device)
        if handles[0].layer in self.scales:
            self._dequantized(handles, gate_up, down)
            return gate_up, down
        # a layer's experts share their matrices' types (the table checks it): the first
        # expert's say, not a look at every expert's
        same = all(TORCH_DTYPES.get(m.ggml_type.name) == dtype for m in handles[0].matrices)
        if self._cuda and same and handles[0].layer not in self.interleaved:
            self._copied(handles, gate_up, down)
            return gate_up, down
        views = [self.expert(module, h) for h in handles]
        flat, half = gate_up.view(n, -1), gate_up[0].numel() // 2
        targets = ([flat[i, :half] for i in range(n)] + [flat[i, half:] for i in range(n)]
                   + [down[i] for i in range(n)])
        sources = ([v[0].reshape(-1) for v in views] + [v[1].reshape(-1) for v in views]
                   + [v[2].view(down.shape[1:]) for v in views])
        torch._foreach_copy_(targets, sources)
        return gate_up, down

    def _on_kernels(self, scales: LayerScales | GgufExperts, dtype: Any) -> bool:
        """Whether the layer's experts are dequantized by the CUDA kernels into ``dtype``:
        on a GPU with CuPy, in a format they serve (``kernels_serve``)."""
        return self._cuda and cuda_kernel() and kernels_serve(scales, dtype)

    def _copied(self, handles: Sequence[ExpertHandle], gate_up: Any, down: Any) -> None:
        """The experts' bytes copied into ``gate_up`` and ``down`` on torch's stream by one
        launch of the gather kernel, their addresses sent with it (a table in pinned
        memory, copied without a wait): no call a matrix, and no tensor made per matrix,
        whose DLPack import costs more host time than the copy."""
        n = len(handles)
        table = torch.tensor([[m.ptr for m in h.matrices] for h in handles],
                             dtype=torch.int64, pin_memory=True)
        gate, up, down_matrix = handles[0].matrices  # a layer's experts: alike
        sizes = (gate.nbytes, up.nbytes, down_matrix.nbytes)
        slots = self._slots.get(n)
        if slots is None:
            slots = self._slots[n] = torch.arange(n, dtype=torch.int64, device=self.device)
        index, stream = raw_stream(self.device)
        launch(index, (blocks(max(sizes)), n), stream,
               table.to(self.device, non_blocking=True).data_ptr(), slots.data_ptr(),
               gate_up.data_ptr(), down.data_ptr(), sizes)

    def _dequantized(self, handles: Sequence[ExpertHandle], gate_up: Any, down: Any) -> None:
        """The quantized experts of ``handles`` dequantized into ``gate_up`` and ``down``:
        one product per matrix kind for the whole batch."""
        scales = self.scales[handles[0].layer]
        experts = [h.expert for h in handles]
        if self._on_kernels(scales, down.dtype):
            # one kernel a batch (two for a GGUF layer of two types), reading the cache
            # where it is: no stacked copy
            addresses = [[h.matrices[at].ptr for h in handles] for at in range(3)]
            if isinstance(scales, GgufExperts):
                gguf_layer_cuda(scales, addresses, gate_up, down)
            else:
                layer_experts_cuda(scales, addresses, experts, gate_up, down)
            return
        raws = [torch.stack([raw(h.matrices[at]) for h in handles]) for at in range(3)]
        scales.fill(experts, (raws[0], raws[1], raws[2]), gate_up, down)


def deinterleaved(gate_up: Any) -> tuple[Any, Any]:
    """The gate and up of a gate_up ``(2F, D)`` whose rows alternate gate, up (Inkling2's
    ``w13_weight``): strided views of it, rows 0, 2, 4... and 1, 3, 5..., which
    ``torch.cat`` joins as transformers' loading lays the expert out."""
    rows = gate_up.view(-1, 2, gate_up.shape[-1])
    return rows[:, 0], rows[:, 1]
