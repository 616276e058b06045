"""moestream's two arithmetics of one experts call, over the leased experts' batches as
they land (the module docstring of ``_experts.py`` says what each matches):

- :func:`grouped`: the experts of a batch of arrivals as one grouped product,
  transformers' own ``grouped_mm`` path (``_grouped_linear``) over their stacked weights,
  the router-weighted rows summed per token at the end, as ``grouped_mm_experts_forward``;
- :func:`eager`: one product per expert, the rows added into the output in ascending
  expert order whatever order the experts landed in, as transformers' ``eager`` (in
  float32 for the experts whose own eager forward sums so: ``FLOAT32_SUMS``);
- :func:`batched`: every (token, slot) pair's expert weights stacked in the pairs' order,
  then transformers' own ``batched_mm_experts_forward``: what ``generate``'s decode steps
  on a GPU compute where the experts use ``grouped_mm``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch  # type: ignore[import-not-found, unused-ignore]

from moestream import ExpertHandle
from moestream.transformers._expert_weights import ExpertWeights
from moestream.transformers._layout import batched_mm, biases, grouped_linear

__all__ = ["FLOAT32_SUMS", "Gather", "batched", "eager", "grouped", "slotted_grouped"]

FLOAT32_SUMS = frozenset({"Inkling2Experts", "Inkling2LoopExperts"})
"""Experts modules whose own eager forward adds the experts' rows into a float32 output
(cast to the hidden dtype at the end) where transformers' common one adds them in the hidden
dtype: Inkling2's, "as in the original"."""


def eager(arrivals: Iterable[list[ExpertHandle]], weights: ExpertWeights, module: Any,
          hidden: Any, top_k_index: Any, top_k_weights: Any) -> Any:
    """The experts' output for ``hidden`` in transformers' ``eager`` arithmetic."""
    final = torch.zeros_like(
        hidden, dtype=torch.float32 if type(module).__name__ in FLOAT32_SUMS else None)
    transposed = bool(getattr(module, "is_transposed", False))
    gate = module._apply_gate if getattr(module, "has_gate", True) else module.act_fn
    up_bias, down_bias = biases(module)
    linear = torch.nn.functional.linear
    with torch.no_grad():
        mask = torch.nn.functional.one_hot(top_k_index, num_classes=module.num_experts + 1)
        mask = mask.permute(2, 1, 0)
    rows: dict[int, tuple[Any, Any]] = {}
    for batch in arrivals:
        for h in batch:
            first, second, down = weights.expert(module, h)
            top_k_pos, token_idx = torch.where(mask[h.expert])
            current = hidden[token_idx]
            gate_up = torch.cat((first, second))  # or the gate-less up
            e = h.expert
            if transposed:  # x @ W (+ b), as gpt-oss's own eager
                out = current @ gate_up
                if up_bias is not None:
                    out = out + up_bias[e]
                out = gate(out) @ down
                if down_bias is not None:
                    out = out + down_bias[e]
            else:  # the module's own gate (a SwiGLU, a clamped one, or none)
                out = gate(linear(current, gate_up, None if up_bias is None else up_bias[e]))
                out = linear(out, down, None if down_bias is None else down_bias[e])
            out = out * top_k_weights[token_idx, top_k_pos, None]
            rows[h.expert] = (token_idx, out.to(final.dtype))
    for expert in sorted(rows):  # eager's order, whatever order they landed in
        token_idx, out = rows[expert]
        final.index_add_(0, token_idx, out)
    return final.to(hidden.dtype)


def batched(arrivals: Iterable[list[ExpertHandle]], weights: ExpertWeights, module: Any,
            hidden: Any, top_k_index: Any, top_k_weights: Any, pairs: Sequence[int]) -> Any:
    """The experts' output for ``hidden`` in transformers' ``batched_mm`` arithmetic, once
    every expert of the call landed: ``pairs`` are ``top_k_index``'s ids in order (read on
    the host already), each pair's weights stacked from its expert's handle."""
    handles = {h.expert: h for batch in arrivals for h in batch}
    first, down = weights.stacked(module, [handles[e] for e in pairs])
    return batched_mm(module, first, down, hidden, top_k_index, top_k_weights)


def grouped(arrivals: Iterable[list[ExpertHandle]], weights: ExpertWeights, module: Any,
            hidden: Any, top_k_index: Any, top_k_weights: Any) -> Any:
    """The experts' output for ``hidden`` in transformers' ``grouped_mm`` arithmetic, one
    grouped product per batch of arrivals."""
    tokens, top_k = top_k_index.shape
    expert_ids = top_k_index.reshape(-1)
    sample_weights = top_k_weights.reshape(-1)
    weighted: Any = None
    for batch in arrivals:
        weighted = _grouped_rows(weights, module, hidden, expert_ids, sample_weights, top_k,
                                 batch, weighted)
    if weighted is None:  # nothing routed (no tokens)
        return torch.zeros_like(hidden)
    final = weighted.view(tokens, top_k, hidden.size(-1)).sum(dim=1)
    return final.to(hidden.dtype)


def _grouped_rows(weights: ExpertWeights, module: Any, hidden: Any, expert_ids: Any,
                  sample_weights: Any, top_k: int, batch: Sequence[ExpertHandle],
                  weighted: Any) -> Any:
    """The router-weighted output rows of the (token, slot) pairs routed to the experts of
    ``batch``, as transformers' ``grouped_mm_experts_forward`` computes them, written into
    ``weighted`` (``(tokens * top_k, hidden)``, made on the first batch) at the pairs'
    places. No host synchronization: pairs routed elsewhere sort to the tail, which the
    grouped product skips, and are left as they were."""
    handles = sorted(batch, key=lambda h: h.expert)
    n = len(handles)
    gate_up, down = weights.stacked(module, handles)

    device = hidden.device
    # local ids: the batch's experts 0..n-1 in ascending expert order, every other expert n
    lookup = torch.full((module.num_experts,), n, dtype=expert_ids.dtype, device=device)
    ids = torch.tensor([h.expert for h in handles], dtype=expert_ids.dtype,
                       pin_memory=device.type == "cuda")
    # from pinned memory the copy is queued, not waited for: no second host synchronization
    lookup[ids.to(device, non_blocking=True)] = torch.arange(n, dtype=expert_ids.dtype,
                                                             device=device)
    local = lookup[expert_ids]
    local_sorted, perm = torch.sort(local)
    selected = hidden[perm // top_k]
    offsets = torch.searchsorted(
        local_sorted, torch.arange(1, n + 1, dtype=local_sorted.dtype, device=device)
    ).to(torch.int32)
    transposed = bool(getattr(module, "is_transposed", False))
    up_bias, down_bias = biases(module)
    if up_bias is not None:  # per sorted row, as grouped_mm_experts_forward
        row_experts = expert_ids[perm]  # the tail's rows (other experts) are never used
        up_bias, down_bias = up_bias[row_experts], down_bias[row_experts]
    proj = grouped_linear(selected, gate_up, offsets, up_bias, transposed)
    proj = module._apply_gate(proj) if getattr(module, "has_gate", True) else module.act_fn(proj)
    proj = grouped_linear(proj, down, offsets, down_bias, transposed)
    rows = proj * sample_weights[perm].unsqueeze(-1)
    # back to the pairs' own places in one copy (no inverse permutation built first)
    rows = torch.empty_like(rows).index_copy_(0, perm, rows)
    if weighted is None:
        return rows  # the pairs of other experts are overwritten by their own batches
    mine = (local < n).unsqueeze(-1)
    return torch.where(mine, rows, weighted)


Gather = Callable[[Any, Any, Any], None]
"""Fills ``first`` ``(slots, ...)`` and ``down`` with the weights of each slot's expert (the
``slots`` tensor's ids; -1 for none)."""


def slotted_grouped(module: Any, hidden: Any, top_k_index: Any, top_k_weights: Any,
                    n_experts: int, gather: Gather, first_shape: tuple[int, ...],
                    down_shape: tuple[int, ...]) -> Any:
    """``grouped_mm_experts_forward``'s arithmetic over the call's distinct experts only,
    numbered on the device: the pairs sorted by expert, slot ``j`` the ``j``-th distinct
    expert (its weights put there by ``gather``), the slots past the last distinct expert
    empty groups. Each group is the same rows times the same weights as in transformers'
    product over every expert: the same bits, with no host read."""
    tokens, top_k = top_k_index.shape
    device = hidden.device
    expert_ids = top_k_index.reshape(-1)
    sample_weights = top_k_weights.reshape(-1)
    expert_ids_g, perm = torch.sort(expert_ids)
    n = min(expert_ids_g.numel(), n_experts)
    new = torch.ones_like(expert_ids_g, dtype=torch.bool)
    new[1:] = expert_ids_g[1:] != expert_ids_g[:-1]
    local = torch.cumsum(new, 0) - 1  # each pair's slot
    slots = torch.full((n,), -1, dtype=torch.int64, device=device)
    slots.scatter_(0, local, expert_ids_g.to(torch.int64))
    offsets = torch.searchsorted(
        local, torch.arange(1, n + 1, dtype=local.dtype, device=device)).to(torch.int32)
    dtype = module.down_proj.dtype
    first = torch.empty((n, *first_shape), dtype=dtype, device=device)
    down = torch.empty((n, *down_shape), dtype=dtype, device=device)
    gather(slots, first, down)
    transposed = bool(getattr(module, "is_transposed", False))
    up_bias, down_bias = biases(module)
    if up_bias is not None:
        up_bias, down_bias = up_bias[expert_ids_g], down_bias[expert_ids_g]
    selected = hidden[perm // top_k]
    proj = grouped_linear(selected, first, offsets, up_bias, transposed)
    proj = module._apply_gate(proj) if getattr(module, "has_gate", True) else module.act_fn(proj)
    proj = grouped_linear(proj, down, offsets, down_bias, transposed)
    weighted = proj * sample_weights[perm].unsqueeze(-1)
    # back to the pairs' own places in one copy, as the other grouped paths do
    unsorted = torch.empty_like(weighted).index_copy_(0, perm, weighted)
    final = unsorted.view(tokens, top_k, hidden.size(-1)).sum(dim=1)
    return final.to(hidden.dtype)
