"""The grouped arithmetic on the host backend: each expert's products on views of the cache.

On the host transformers' ``grouped_mm`` computes one matrix product per expert group (torch's
CPU ``grouped_mm`` runs ``mm`` over each group's rows), so the same products over the cache's
own matrices give the same bits without stacking the batch's weights first: the copy of
every routed expert's bytes, and three DLPack imports an expert, that the stacked product
costs each layer are the host backend's largest part of an experts call holding every
expert. :class:`HostWeights` keeps each cached expert's torch views while the cache keeps it
in place; :func:`host_grouped` is ``grouped_mm_experts_forward`` with the grouped products
taken one expert at a time as its weights arrive.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch  # type: ignore[import-not-found, unused-ignore]

from moestream import ExpertHandle
from moestream.transformers._layout import TORCH_DTYPES, biases, view

__all__ = ["HostWeights", "host_grouped"]

Views = tuple[Any, Any]
"""An expert's first projection (gate and up in order, or up) and down, as torch tensors."""


class HostWeights:
    """Torch views of cached experts' matrices on the host, kept while the cache keeps each
    expert where it was: a view is made again when the expert's matrices moved (evicted and
    loaded again elsewhere). At most ``capacity`` views are kept (the oldest go first), so
    that the views of buffers the cache has let go of keep no more than that alive.

    Args:
        capacity: the most experts whose views are kept (what the budget holds).
    """

    __slots__ = ("_views", "capacity")

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._views: dict[tuple[int, int], tuple[tuple[int, int, int], Views]] = {}

    def of(self, handle: ExpertHandle, dtype: Any) -> Views:
        """``handle``'s first projection ``(2F, D)`` (or the layout's own) and down, in
        ``dtype``: views of the cache, cast (copied, and not kept) only when the cache holds
        another dtype."""
        gate, up, down = handle.matrices
        if any(TORCH_DTYPES.get(m.ggml_type.name) != dtype for m in (gate, up, down)):
            return _joined(gate, up, dtype), view(down, dtype)
        where = (gate.ptr, up.ptr, down.ptr)
        key = (handle.layer, handle.expert)
        known = self._views.get(key)
        if known is not None and known[0] == where:
            return known[1]
        views = (_joined(gate, up, dtype), view(down, dtype))
        self._views.pop(key, None)
        if len(self._views) >= self.capacity:
            self._views.pop(next(iter(self._views)))
        self._views[key] = (where, views)
        return views

    def clear(self) -> None:
        """Drop every view (the session is closing)."""
        self._views.clear()


def _joined(gate: Any, up: Any, dtype: Any) -> Any:
    """Gate and up as one ``(gate rows + up rows, columns)`` tensor: a view of both when up
    follows gate in the cache (an expert's bytes in file order), else a copy."""
    first, second = view(gate, dtype), view(up, dtype)
    stored = {TORCH_DTYPES.get(m.ggml_type.name) for m in (gate, up)}
    if stored == {dtype} and gate.ptr + gate.nbytes == up.ptr:
        raw = gate.bytes
        both = np.lib.stride_tricks.as_strided(raw, shape=(gate.nbytes + up.nbytes,),
                                               strides=(1,), writeable=False)
        rows = first.shape[0] + second.shape[0]
        return torch.utils.dlpack.from_dlpack(both).view(dtype).view(rows, first.shape[1])
    return torch.cat((first, second))


def host_grouped(batches: Iterable[Sequence[ExpertHandle]], weights: HostWeights,
                 module: Any, hidden: Any, top_k_index: Any, top_k_weights: Any) -> Any:
    """The experts' output for ``hidden`` as transformers' ``grouped_mm_experts_forward``
    gives it, each expert's group of rows computed as its handle arrives in ``batches``
    (all of the call's experts, in one lease)."""
    tokens, top_k = top_k_index.shape
    expert_ids = top_k_index.reshape(-1)
    sample_weights = top_k_weights.reshape(-1)
    expert_ids_g, perm = torch.sort(expert_ids)
    experts, counts = torch.unique_consecutive(expert_ids_g, return_counts=True)
    spans: dict[int, tuple[int, int]] = {}
    start = 0
    for expert, count in zip(experts.tolist(), counts.tolist(), strict=True):
        spans[expert] = (start, start + count)
        start += count
    dtype = module.down_proj.dtype
    transposed = bool(getattr(module, "is_transposed", False))
    selected = hidden[perm // top_k].to(dtype)
    held: list[tuple[tuple[int, int], Any]] = []
    proj: Any = None
    for batch in batches:
        for h in batch:
            first, down = weights.of(h, dtype)
            span = spans[h.expert]
            if proj is None:
                proj = selected.new_empty((selected.size(0), _out_features(first, transposed)))
            _product(selected, first, span, proj, transposed)
            held.append((span, down))
    if proj is None:  # nothing routed (no tokens)
        return torch.zeros_like(hidden)
    up_bias, down_bias = biases(module)
    if up_bias is not None:
        proj.add_(up_bias[expert_ids_g])
    proj = module._apply_gate(proj) if getattr(module, "has_gate", True) else module.act_fn(proj)
    proj = proj.to(dtype)
    out = proj.new_empty((proj.size(0), _out_features(held[0][1], transposed)))
    for span, down in held:
        _product(proj, down, span, out, transposed)
    if down_bias is not None:
        out.add_(down_bias[expert_ids_g])
    if getattr(module, "has_post_expert_norm", False):
        out = module.post_expert_norm(out)
    weighted = out * sample_weights[perm].unsqueeze(-1)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.size(0))
    final = weighted[inverse].view(tokens, top_k, hidden.size(-1)).sum(dim=1)
    return final.to(hidden.dtype)


def _out_features(weight: Any, transposed: bool) -> int:
    return int(weight.shape[1] if transposed else weight.shape[0])


def _product(rows: Any, weight: Any, span: tuple[int, int], out: Any, transposed: bool) -> None:
    """One expert's group of the grouped product: ``rows[span] @ W`` into ``out[span]``, as
    torch's CPU ``grouped_mm`` computes each group (``mm`` into the group's rows)."""
    start, end = span
    torch.mm(rows[start:end], weight if transposed else weight.t(), out=out[start:end])
