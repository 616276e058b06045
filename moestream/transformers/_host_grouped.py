"""The grouped arithmetic on the host backend: each expert's products on views of the cache.

On the host transformers' ``grouped_mm`` computes one matrix product per expert group (torch's
CPU ``grouped_mm`` runs ``mm`` over each group's rows), so the same products over the cache's
own matrices give the same bits without stacking the batch's weights first: the copy of
every routed expert's bytes, and three DLPack imports an expert, that the stacked product
costs each layer are the host backend's largest part of an experts call holding every
expert. :class:`HostWeights` keeps each cached expert's torch views while the cache keeps it
in place; :func:`host_grouped` is ``grouped_mm_experts_forward`` with the grouped products
taken one expert at a time as its weights arrive.

A model held whole (``WholeLayers.holding``: the budget holds every expert and all are
cached) needs no lease a call: nothing can evict or move an expert, so the views made while
that lasts stay true, and :meth:`HostWeights.trusted` gives a call's views with no lease
(the session is told of the hits at the token's end, ``SyncSession.used``). A lease made
and released a call was most of what holding every expert cost over the resident model.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch  # type: ignore[import-not-found, unused-ignore]

from moestream import ExpertHandle
from moestream.transformers._expert_weights import deinterleaved
from moestream.transformers._layout import TORCH_DTYPES, biases, view

__all__ = ["HostWeights", "host_grouped"]

Views = tuple[Any, Any]
"""An expert's first projection (gate and up in order, or up) and down, as torch tensors
laid out as the product's right operand: ``(in, out)`` (transposed views of the cache's
``(out, in)``, or the transposed layout's own)."""


class HostWeights:
    """Torch views of cached experts' matrices on the host, kept while the cache keeps each
    expert where it was: a view is made again when the expert's matrices moved (evicted and
    loaded again elsewhere). At most ``capacity`` views are kept (the oldest go first), so
    that the views of buffers the cache has let go of keep no more than that alive.

    Args:
        capacity: the most experts whose views are kept (what the budget holds).
        interleaved: the layers whose gate and up rows alternate in the cache
            (``LayerInfo.interleaved``): their first projection is a de-interleaved copy,
            made per use and not kept.
    """

    __slots__ = ("_views", "capacity", "interleaved")

    def __init__(self, capacity: int, interleaved: frozenset[int] = frozenset()) -> None:
        self.capacity = max(1, capacity)
        self.interleaved = interleaved
        # (layer, expert): where, views, dtype, the held-whole period they were made in
        self._views: dict[tuple[int, int], tuple[int, Views, Any, int]] = {}

    def of(self, handle: ExpertHandle, dtype: Any, transposed: bool, period: int = 0) -> Views:
        """``handle``'s first projection and down as the products' right operands (see
        ``Views``), in ``dtype``: views of the cache, cast (copied, and not kept) only when
        the cache holds another dtype. An expert's three matrices lie in one buffer at
        fixed offsets, so its gate's address says where all three are. ``period``: the
        held-whole period the lease is in (0: none), which a kept view remembers."""
        gate, up, down = handle.matrices
        where = gate.ptr
        key = (handle.layer, handle.expert)
        known = self._views.get(key)
        if known is not None and known[0] == where and known[2] is dtype:
            if known[3] != period:
                self._views[key] = (where, known[1], dtype, period)
            return known[1]
        first, second = _joined(gate, up, dtype), view(down, dtype)
        copied = handle.layer in self.interleaved
        if copied:
            first = torch.cat(deinterleaved(first))
        views = (first, second) if transposed else (first.t(), second.t())
        if copied or any(TORCH_DTYPES.get(m.ggml_type.name) != dtype for m in (gate, up, down)):
            return views  # a copy (cast, or de-interleaved): not kept
        self._views.pop(key, None)
        if len(self._views) >= self.capacity:
            self._views.pop(next(iter(self._views)))
        self._views[key] = (where, views, dtype, period)
        return views

    def leased(self, batches: Iterable[Sequence[ExpertHandle]], module: Any, period: int = 0
               ) -> Iterator[list[tuple[int, Views]]]:
        """Each batch of leased handles as (expert, views) for ``module``'s products."""
        dtype, transposed = _operands(module)
        for batch in batches:
            yield [(h.expert, self.of(h, dtype, transposed, period)) for h in batch]

    def trusted(self, layer: int, experts: Sequence[int], module: Any, period: int
                ) -> list[tuple[int, Views]] | None:
        """The experts' kept views for ``module`` if every one was made (or seen again
        under a lease) in the held-whole ``period`` now running, which no eviction or move
        can have outdated; else None (the call takes a lease)."""
        dtype, _ = _operands(module)
        views = self._views
        out = []
        for expert in experts:
            known = views.get((layer, expert))
            if known is None or known[3] != period or known[2] is not dtype:
                return None
            out.append((expert, known[1]))
        return out

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


def _operands(module: Any) -> tuple[Any, bool]:
    """The dtype the module computes in and whether its experts are stored transposed."""
    return module.down_proj.dtype, bool(getattr(module, "is_transposed", False))


def host_grouped(batches: Iterable[Sequence[tuple[int, Views]]], module: Any, hidden: Any,
                 top_k_index: Any, top_k_weights: Any) -> Any:
    """The experts' output for ``hidden`` as transformers' ``grouped_mm_experts_forward``
    gives it, each expert's group of rows computed as its views arrive in ``batches``
    (every expert of the call: ``HostWeights.leased`` or ``HostWeights.trusted``).

    A decode step's call is a few dozen microseconds of torch dispatch around its products,
    so each step is the cheapest op that moves the same values: one read of the sorted ids
    gives the groups, ``split_with_sizes`` the groups' views (not ``Tensor.split``'s Python
    wrapper), and the rows go back to their pairs' places by one ``index_copy_`` (not an
    inverse permutation built and then gathered by)."""
    tokens, top_k = top_k_index.shape
    sample_weights = top_k_weights.reshape(-1)
    expert_ids_g, perm = torch.sort(top_k_index.reshape(-1))
    group, sizes = _groups(expert_ids_g.tolist())
    dtype = module.down_proj.dtype
    selected = hidden.index_select(0, perm.div(top_k, rounding_mode="floor")).to(dtype)
    rows = selected.split_with_sizes(sizes)
    held: list[tuple[int, Any]] = []
    proj: Any = None
    parts: Any = None
    for batch in batches:
        for expert, (first, down) in batch:
            i = group[expert]
            if proj is None:
                proj = selected.new_empty((selected.size(0), first.shape[1]))
                parts = proj.split_with_sizes(sizes)
            # one group of the grouped product, as torch's CPU grouped_mm computes it
            torch.mm(rows[i], first, out=parts[i])
            held.append((i, down))
    if proj is None:  # nothing routed (no tokens)
        return torch.zeros_like(hidden)
    up_bias, down_bias = biases(module)
    if up_bias is not None:
        proj.add_(up_bias[expert_ids_g])
    proj = module._apply_gate(proj) if getattr(module, "has_gate", True) else module.act_fn(proj)
    proj = proj.to(dtype)
    out = proj.new_empty((proj.size(0), held[0][1].shape[1]))
    rows, parts = proj.split_with_sizes(sizes), out.split_with_sizes(sizes)
    for i, down in held:
        torch.mm(rows[i], down, out=parts[i])
    if down_bias is not None:
        out.add_(down_bias[expert_ids_g])
    weighted = out * sample_weights.index_select(0, perm).unsqueeze(-1)  # (promotes as theirs)
    unsorted = torch.empty_like(weighted).index_copy_(0, perm, weighted)  # pairs' own places
    final = unsorted.view(tokens, top_k, hidden.size(-1)).sum(dim=1)
    return final.to(hidden.dtype)


def _groups(sorted_ids: list[int]) -> tuple[dict[int, int], list[int]]:
    """The groups of the ids sorted by expert: each expert's group number (ascending
    expert order, as the sort's groups) and each group's rows."""
    counts = Counter(sorted_ids)  # sorted input: its keys come in ascending order
    return {expert: i for i, expert in enumerate(counts)}, list(counts.values())
