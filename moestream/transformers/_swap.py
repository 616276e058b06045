"""The module swap: moestream's own experts modules where transformers computes the routed
experts outside its experts registry.

Most transformers MoE models call their experts through
``ALL_EXPERTS_FUNCTIONS[config._experts_implementation]``, where moestream is registered
(``_experts.py``). A few compute them in a module of their own, which no experts
implementation reaches; for those the loader swaps that module, on the meta model before
any weight is read, for one of the classes below: the parent's attribute is set to the new
module (``setattr``, as transformers' own quantizers swap ``nn.Linear`` for their layers),
nothing of transformers' classes is patched. Each swapped module

- keeps the experts' weights as meta parameters named ``gate_up_proj`` and ``down_proj``
  (the checkpoint's routed tensors, never loaded) and takes over every other submodule and
  parameter of the one it replaces under its own name (a router, a bias), so the dense
  weights load as before;
- computes exactly what the replaced module computes, in its own order of operations, with
  each expert's weights from the session: fetched for the experts the call routes to, in
  groups the budget holds (``ExpertStream``'s leases, as the registry path fetches them).

Swapped (``SWAPS``): Llama 4's ``Llama4TextExperts`` (every expert's input is the token's
hidden state times its router score, zero for the experts not routed to: the experts with
a non-zero input are fetched, and the others' output is the zero it would be) and
JetMoE's ``JetMoeMoE`` block (its router's token order, one linear per expert, the gate
values and bias as the block applies them). There is no ``grouped``/``eager`` choice for
them: transformers computes them one way, and so does the swap.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch  # type: ignore[import-not-found, unused-ignore]

from moestream import ExpertHandle
from moestream.pipeline.foundation.errors import UsageError
from moestream.transformers._experts import ExpertStream, uncompiled

__all__ = ["SWAPS", "JetMoeExperts", "Llama4Experts", "swap_experts"]


class _Swapped(torch.nn.Module):
    """What every swapped experts module shares: the attributes the loader reads
    (``num_experts``, ``has_gate``, ``is_transposed``, ``gate_up_proj``, ``down_proj``) and
    its leased experts."""

    has_gate = True
    is_transposed = False
    moestream_stream: ExpertStream | None = None
    moestream_layer: int = -1

    def _stream(self) -> ExpertStream:
        experts_stream = self.moestream_stream
        if not isinstance(experts_stream, ExpertStream):
            raise UsageError(f"{type(self).__name__} computes only in a model loaded by "
                             "moestream.transformers.from_pretrained")
        return experts_stream

    def _arrivals(self, wanted: Sequence[int]) -> Iterator[list[ExpertHandle]]:
        """The handles of the ``wanted`` experts, a batch at a time as they land, in groups
        the budget holds; each group's lease is released after the work queued on it (the
        registry path's leases: ``ExpertStream.arrivals``)."""
        return self._stream().arrivals(self.moestream_layer, wanted)


class Llama4Experts(_Swapped):
    """In place of ``Llama4TextExperts``: ``gate_up_proj`` ``[E, D, 2F]`` (gate the first F
    columns) and ``down_proj`` ``[E, F, D]``, applied with ``torch.bmm`` to each expert's
    block of the input ``(E * tokens, D)``, as transformers applies them."""

    is_transposed = True

    def __init__(self, original: Any) -> None:
        super().__init__()
        self.num_experts = int(original.num_experts)
        self.hidden_size = int(original.hidden_size)
        self.gate_up_proj = original.gate_up_proj
        self.down_proj = original.down_proj
        self.act_fn = original.act_fn

    @uncompiled
    def forward(self, hidden_states: Any) -> Any:
        blocks = hidden_states.view(self.num_experts, -1, self.hidden_size)
        # an expert routed to by no token has an all-zero block (its score is zero), and
        # its output is zero: the one host read, which experts to fetch
        wanted = torch.nonzero(blocks.ne(0).flatten(1).any(dim=1)).flatten().tolist()
        out = torch.zeros_like(blocks)
        experts_stream = self._stream()
        for batch in self._arrivals(wanted):
            handles = sorted(batch, key=lambda h: h.expert)
            gate_up, down = experts_stream.stacked(self, handles)
            at = torch.tensor([h.expert for h in handles], device=blocks.device)
            gate, up = torch.bmm(blocks[at], gate_up).chunk(2, dim=-1)
            out[at] = torch.bmm(up * self.act_fn(gate), down)
        return out.view(-1, self.hidden_size)


class JetMoeExperts(_Swapped):
    """In place of JetMoE's ``JetMoeMoE`` block: its router (kept), then per expert
    ``linear(x, input_linear[e])`` ``[2F, D]``, ``act(gate) * up``, ``linear(., output_linear
    [e])`` ``[D, F]``, the rows in the router's order, weighted and summed with ``index_add``
    and the block's bias added, as the block does."""

    def __init__(self, original: Any) -> None:
        super().__init__()
        self.num_experts = int(original.input_linear.num_experts)
        self.input_size = int(original.input_size)
        self.router = original.router
        self.bias = original.bias
        self.activation = original.activation
        self.gate_up_proj = original.input_linear.weight
        self.down_proj = original.output_linear.weight

    @uncompiled
    def forward(self, layer_input: Any) -> Any:
        bsz, length, emb_size = layer_input.size()
        layer_input = layer_input.reshape(-1, emb_size)
        _, batch_index, batch_gates, expert_size, _ = self.router(layer_input)
        expert_inputs = layer_input[batch_index]
        starts = [0]
        for size in expert_size:
            starts.append(starts[-1] + size)
        outputs = expert_inputs.new_empty((expert_inputs.size(0), emb_size))
        experts_stream = self._stream()
        linear = torch.nn.functional.linear
        wanted = [e for e, size in enumerate(expert_size) if size]
        for batch in self._arrivals(wanted):
            for h in batch:
                rows = slice(starts[h.expert], starts[h.expert + 1])
                gate_w, up_w, down_w = experts_stream.weights(self, h)
                gate, up = linear(expert_inputs[rows], torch.cat((gate_w, up_w))).chunk(2, dim=-1)
                outputs[rows] = linear(self.activation(gate) * up, down_w)
        outputs = outputs * batch_gates[:, None]
        zeros = torch.zeros((bsz * length, self.input_size), dtype=outputs.dtype,
                            device=outputs.device)
        layer_output = zeros.index_add(0, batch_index, outputs)
        return layer_output.view(bsz, length, self.input_size) + self.bias


SWAPS: dict[str, type[_Swapped]] = {
    "Llama4TextExperts": Llama4Experts,
    "JetMoeMoE": JetMoeExperts,
}
"""transformers' class name -> the module swapped in for it."""


def swap_experts(model: Any) -> int:
    """Swap every module of ``model`` whose class ``SWAPS`` names for moestream's (on the
    meta model, before the dense weights load); returns how many were swapped."""
    found = [(name, module) for name, module in model.named_modules()
             if type(module).__name__ in SWAPS]
    for name, module in found:
        parent_name, _, attribute = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, attribute, SWAPS[type(module).__name__](module))
    return len(found)
