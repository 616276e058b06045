"""The ``"moestream"`` experts implementation: a MoE block's routed experts from a session.

transformers' MoE blocks route (router, top-k, weights) and then call
``experts(hidden_states, top_k_index, top_k_weights)``; the experts class dispatches that
call through ``ALL_EXPERTS_FUNCTIONS[config._experts_implementation]``. Registered there
under ``"moestream"``, :func:`experts_forward` serves the call from the :class:`ExpertStream`
the loader attached to the experts module: it asks the session for the experts the batch
routes to (``fetch``), computes those already on the device at once and the others as they
land, each on torch's current stream after that stream waited for the upload on the device,
and releases the lease after the compute is queued on that stream, so that the cache reuses
no buffer before the device has read it.

Two arithmetics, chosen per model (``compute=``):

- ``"grouped"`` (the default): the experts of a batch of arrivals as one grouped product,
  transformers' own ``grouped_mm`` path (its ``_grouped_linear``) over the leased weights
  stacked in arrival groups; the router-weighted rows are summed per token at the end, as
  ``grouped_mm_experts_forward`` does. Tokens match a whole model run with
  ``experts_implementation="grouped_mm"`` (transformers' default).
- ``"eager"``: one product per expert, in transformers' ``eager`` order (each expert's rows
  added into the output with ``index_add_`` in ascending expert order, whatever order the
  experts landed in), so that logits are ``torch.equal`` to a whole model run with
  ``experts_implementation="eager"``.

Experts a call routes to that do not fit the budget at once (a long prompt's prefill, a
large batch) are fetched in groups that do, each released before the next is fetched.
"""

from __future__ import annotations

import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Literal

import torch  # type: ignore[import-not-found, unused-ignore]
from transformers.integrations import moe as hf_moe  # type: ignore[import-not-found, unused-ignore]

from moestream import ExpertHandle, SyncSession, TokenStats
from moestream.pipeline.foundation.errors import UsageError
from moestream.transformers._dequant_cuda import CUDA_DTYPES, layer_experts_cuda
from moestream.transformers._dequant_cuda import available as cuda_kernel
from moestream.transformers._generate import GenerateStats
from moestream.transformers._gguf_experts import GgufExperts
from moestream.transformers._host_grouped import HostWeights, host_grouped
from moestream.transformers._layout import (
    TORCH_DTYPES,
    biases,
    first_projection,
    grouped_linear,
    raw,
    view,
)
from moestream.transformers._quantized import LayerScales
from moestream.transformers._routing import WholeLayers

__all__ = ["COMPUTES", "IMPLEMENTATION", "Compute", "ExpertStream", "experts_forward", "register",
           "stream_of"]

IMPLEMENTATION = "moestream"
"""The name the experts implementation is registered under."""

Compute = Literal["grouped", "eager"]
COMPUTES: tuple[Compute, ...] = ("grouped", "eager")

def register() -> None:
    """Register :func:`experts_forward` as ``"moestream"`` in transformers'
    ``ALL_EXPERTS_FUNCTIONS`` (idempotent); ``from_pretrained`` calls it."""
    hf_moe.ALL_EXPERTS_FUNCTIONS.register(IMPLEMENTATION, experts_forward)


def stream_of(model: Any) -> ExpertStream:
    """The :class:`ExpertStream` serving ``model``'s experts (one made by
    ``moestream.transformers.from_pretrained``).

    Raises:
        UsageError: the model was not loaded by moestream.
    """
    experts_stream = getattr(model, "moestream", None)
    if not isinstance(experts_stream, ExpertStream):
        raise UsageError("this model's experts are not served by moestream (load it with "
                         "moestream.transformers.from_pretrained)")
    return experts_stream


def experts_forward(self: Any, hidden_states: Any, top_k_index: Any, top_k_weights: Any) -> Any:
    """The experts call of one MoE layer, served by moestream (the registry's signature).

    Args:
        self: the model's experts module; the loader set its ``moestream_stream`` and
            ``moestream_layer``.
        hidden_states: ``(tokens, hidden)``.
        top_k_index: ``(tokens, top_k)`` expert ids.
        top_k_weights: ``(tokens, top_k)`` router weights.

    Raises:
        UsageError: the module was not set up by ``moestream.transformers.from_pretrained``.
    """
    experts_stream = getattr(self, "moestream_stream", None)
    if not isinstance(experts_stream, ExpertStream):
        raise UsageError(f'experts_implementation="{IMPLEMENTATION}" serves only models loaded '
                         "by moestream.transformers.from_pretrained")
    return experts_stream.forward(self.moestream_layer, self, hidden_states, top_k_index,
                                  top_k_weights)


class ExpertStream:
    """One model's experts served by one moestream session; the model holds it as
    ``model.moestream``.

    Args:
        session: the open session over the checkpoint's experts (closed by :meth:`close`).
        device: the torch device the model computes on.
        compute: ``"grouped"`` or ``"eager"`` (the module docstring says what each matches).
        group_experts: the most experts one fetch pins (what the budget holds beside
            another layer in flight).
        scales: the block scales of each quantized layer, on ``device``, or a GGUF
            layer's expert types (its experts are dequantized per use).
    """

    def __init__(self, session: SyncSession, device: Any, *, compute: Compute,
                 group_experts: int,
                 scales: Mapping[int, LayerScales | GgufExperts] | None = None) -> None:
        if compute not in COMPUTES:
            raise UsageError(f"compute must be one of {', '.join(COMPUTES)}, got {compute!r}")
        if group_experts < 1:
            raise UsageError(f"group_experts must be >= 1, got {group_experts}")
        self.session = session
        self.device = torch.device(device)
        self.compute: Compute = compute
        self.group_experts = group_experts
        self.scales: Mapping[int, LayerScales | GgufExperts] = scales or {}
        self.last: TokenStats | None = None
        """The last token's stats (``end_token``'s answer)."""
        self.tokens = 0
        self.last_generate: GenerateStats | None = None
        """What the model's last ``generate`` call did (its hits, misses, bytes, stall time);
        ``session.counters()`` holds the totals since loading."""
        self.on_token: Callable[[TokenStats], None] | None = None
        """Called with each token's stats (a live progress line, say)."""
        self._cuda = self.device.type == "cuda"
        self._started: Any = None
        self._host_weights = HostWeights(_held_experts(session) + group_experts)
        # a GPU model held whole computes its layers with no host read of the routing
        self._whole = WholeLayers(session, self.device) if self._cuda else None

    # -- the token boundary ----------------------------------------------------------------

    def begin_step(self) -> None:
        """The model's forward starts (a forward pre-hook): time its compute."""
        if self._cuda:
            self._started = torch.cuda.Event(enable_timing=True)
            self._started.record(torch.cuda.current_stream(self.device))
        else:
            self._started = time.perf_counter()

    def end_step(self) -> TokenStats:
        """The model's forward is done (a forward hook): one token for moestream
        (verification, the controller, the log's token line).

        On a GPU the forward's time on torch's stream, measured by CUDA events, is the
        engine's compute (``end_token(compute_ms=...)``); on the host moestream charges to
        compute what its own waits do not explain.
        """
        compute_ms: float | None = None
        if self._cuda and self._started is not None:
            done = torch.cuda.Event(enable_timing=True)
            done.record(torch.cuda.current_stream(self.device))
            if self._whole is not None:  # the hits of calls done, while the device ends
                self._whole.count_landed(torch.cuda.current_stream(self.device))
            done.synchronize()  # the logits are read next anyway (sampling)
            compute_ms = float(self._started.elapsed_time(done))
        if self._whole is not None:  # its calls' hits, counted now the device is done
            self._whole.account(torch.cuda.current_stream(self.device))
        self._started = None
        self.last = self.session.end_token(compute_ms=compute_ms)
        self.tokens += 1
        if self.on_token is not None:
            self.on_token(self.last)
        return self.last

    def close(self) -> None:
        """Close the session (idempotent); the model cannot compute its experts after."""
        self._host_weights.clear()
        if self._whole is not None:
            self._whole.forget()
        self.session.close()

    def __enter__(self) -> ExpertStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # as an unclosed file does: a session left open when its model is collected is the
        # caller's leak, said once as a ResourceWarning, and closed here so that its loop's
        # thread and device memory do not outlive the model
        session = getattr(self, "session", None)
        if session is None or session.closed or sys.is_finalizing():
            # at exit the loop's daemon thread and the executors no longer run: a close
            # would hang; the process's end releases what the session held
            return
        warnings.warn(f"unclosed moestream session over {session.model.path} (close the "
                      "model: model.moestream.close() or a with block)", ResourceWarning,
                      source=self, stacklevel=2)
        try:
            session.close()
        except UsageError:  # collected on the session's own loop thread: close from another
            threading.Thread(target=session.close, name="moestream-close", daemon=True).start()

    # -- one experts call ------------------------------------------------------------------

    def forward(self, layer: int, module: Any, hidden: Any, top_k_index: Any,
                top_k_weights: Any) -> Any:
        """The routed experts' output for ``hidden``, as the module's experts would give."""
        if self._whole is not None and self.compute == "grouped" and layer not in self.scales:
            out = self._whole.forward(layer, module, hidden, top_k_index, top_k_weights)
            if out is not None:
                return out
        # the one host read of a layer: which experts to ask for (eager reads it too); one
        # copy of the ids, not a device unique (which would synchronize once more)
        wanted = sorted({int(e) for e in top_k_index.flatten().tolist()})
        if self.compute == "eager":
            return self._eager(layer, module, hidden, top_k_index, top_k_weights, wanted)
        return self._grouped(layer, module, hidden, top_k_index, top_k_weights, wanted)

    def _groups(self, wanted: Sequence[int]) -> Iterator[list[int]]:
        size = self.group_experts
        for i in range(0, len(wanted), size):
            yield list(wanted[i:i + size])

    @contextmanager
    def _leased(self, layer: int, experts: Sequence[int]) -> Iterator[Iterator[list[ExpertHandle]]]:
        """The experts' handles in batches: those already there first, then each as it
        lands; torch's stream waits on the device for each upload not yet installed, once
        per event (``ExpertHandle.pending_event``: no query an expert). The lease is
        released on leaving, after the work queued on torch's stream."""
        lease = self.session.fetch(layer, experts)
        cuda_stream = torch.cuda.current_stream(self.device) if self._cuda else None

        def batches() -> Iterator[list[ExpertHandle]]:
            waited = None  # torch's stream waits once per upload event: a layer's misses share one
            while lease.remaining:
                batch = lease.available() or [next(lease)]
                if cuda_stream is not None:
                    for h in batch:
                        event = h.pending_event()  # None once installed: nothing to wait for
                        if event is not None and event is not waited:
                            h.wait(cuda_stream)
                            waited = event
                yield batch

        try:
            yield batches()
        finally:
            lease.release(after=cuda_stream)

    def _weights(self, module: Any, h: ExpertHandle) -> tuple[Any, Any, Any]:
        """The expert's gate ``(F, D)``, up ``(F, D)`` and down ``(D, F)`` (transposed: the
        row halves of gate_up ``(D, 2F)`` and down ``(F, D)``): views of the cache, cast
        (copied) only when the model computes in another dtype. Gate and up together are
        the module's gate_up of the expert either way."""
        dtype = module.down_proj.dtype
        scales = self.scales.get(h.layer)
        if scales is not None:
            gate, up, down = h.matrices
            return scales.expert(h.expert, (raw(gate), raw(up), raw(down)), dtype)
        return view(h.gate, dtype), view(h.up, dtype), view(h.down, dtype)

    def _dequantized(self, module: Any, handles: Sequence[ExpertHandle], gate_up: Any,
                     down: Any) -> None:
        """The quantized experts of ``handles`` dequantized into ``gate_up`` and ``down``:
        one product per matrix kind for the whole batch."""
        scales = self.scales[handles[0].layer]
        experts = [h.expert for h in handles]
        if (self._cuda and isinstance(scales, LayerScales)
                and (scales.method != "fp8" or not scales.transposed)
                and down.dtype in CUDA_DTYPES and cuda_kernel()):
            # one kernel a batch, reading the cache where it is: no stacked copy
            layer_experts_cuda(scales, [[h.matrices[at].ptr for h in handles] for at in range(3)],
                               experts, gate_up, down)
            return
        raws = [torch.stack([raw(h.matrices[at]) for h in handles]) for at in range(3)]
        scales.fill(experts, (raws[0], raws[1], raws[2]), gate_up, down)

    def _stacked(self, module: Any, handles: Sequence[ExpertHandle]) -> tuple[Any, Any]:
        """The experts' weights stacked for one grouped product, as the module keeps its
        own: ``gate_up`` ``(n, 2F, D)`` (gate the first F rows) and ``down`` ``(n, D, F)``,
        or transposed ``(n, D, 2F)`` and ``(n, F, D)``, copied from the cache on the device
        (an expert's gate_up is its gate and up bytes in order, in either layout). On a GPU
        the copies are queued on torch's stream by address (``cudaMemcpyAsync``, gate and
        up in one when they are adjacent): no tensor is made per matrix, whose DLPack import
        costs more host time than the copy; elsewhere, and when a cast is needed, one
        multi-tensor copy of the views."""
        n = len(handles)
        dtype = module.down_proj.dtype
        gate_up = torch.empty((n, *first_projection(module).shape[1:]), dtype=dtype,
                              device=self.device)
        down = torch.empty((n, *module.down_proj.shape[1:]), dtype=dtype, device=self.device)
        if handles[0].layer in self.scales:
            self._dequantized(module, handles, gate_up, down)
            return gate_up, down
        same = all(TORCH_DTYPES.get(m.ggml_type.name) == dtype for h in handles
                   for m in h.matrices)
        if self._cuda and same:
            import cupy  # the session's backend on a GPU: present whenever this runs

            copy = cupy.cuda.runtime.memcpyAsync
            kind = cupy.cuda.runtime.memcpyDeviceToDevice
            cuda_stream = torch.cuda.current_stream(self.device).cuda_stream
            row = gate_up.stride(0) * gate_up.element_size()
            base, down_base = gate_up.data_ptr(), down.data_ptr()
            for i, h in enumerate(handles):
                gate, up, d = h.gate, h.up, h.down
                g = gate.ptr
                if up.ptr == g + gate.nbytes:
                    copy(base + i * row, g, 2 * gate.nbytes, kind, cuda_stream)
                else:
                    copy(base + i * row, g, gate.nbytes, kind, cuda_stream)
                    copy(base + i * row + gate.nbytes, up.ptr, up.nbytes, kind, cuda_stream)
                copy(down_base + i * d.nbytes, d.ptr, d.nbytes, kind, cuda_stream)
            return gate_up, down
        views = [self._weights(module, h) for h in handles]
        flat, half = gate_up.view(n, -1), gate_up[0].numel() // 2
        targets = ([flat[i, :half] for i in range(n)] + [flat[i, half:] for i in range(n)]
                   + [down[i] for i in range(n)])
        sources = ([v[0].reshape(-1) for v in views] + [v[1].reshape(-1) for v in views]
                   + [v[2].view(down.shape[1:]) for v in views])
        torch._foreach_copy_(targets, sources)
        return gate_up, down

    def _eager(self, layer: int, module: Any, hidden: Any, top_k_index: Any,
               top_k_weights: Any, wanted: Sequence[int]) -> Any:
        final = torch.zeros_like(hidden)
        transposed = bool(getattr(module, "is_transposed", False))
        gate = module._apply_gate if getattr(module, "has_gate", True) else module.act_fn
        up_bias, down_bias = biases(module)
        linear = torch.nn.functional.linear
        with torch.no_grad():
            mask = torch.nn.functional.one_hot(top_k_index, num_classes=module.num_experts + 1)
            mask = mask.permute(2, 1, 0)
        rows: dict[int, tuple[Any, Any]] = {}
        for group in self._groups(wanted):
            with self._leased(layer, group) as batches:
                for batch in batches:
                    for h in batch:
                        first, second, down = self._weights(module, h)
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
                            out = gate(linear(current, gate_up,
                                              None if up_bias is None else up_bias[e]))
                            out = linear(out, down, None if down_bias is None else down_bias[e])
                        out = out * top_k_weights[token_idx, top_k_pos, None]
                        rows[h.expert] = (token_idx, out.to(final.dtype))
        for expert in sorted(rows):  # eager's order, whatever order they landed in
            token_idx, out = rows[expert]
            final.index_add_(0, token_idx, out)
        return final

    def _grouped(self, layer: int, module: Any, hidden: Any, top_k_index: Any,
                 top_k_weights: Any, wanted: Sequence[int]) -> Any:
        if not self._cuda and layer not in self.scales and len(wanted) <= self.group_experts:
            # the host: each expert's products on the cache's own matrices, no stacked copy
            with self._leased(layer, wanted) as batches:
                return host_grouped(batches, self._host_weights, module, hidden, top_k_index,
                                    top_k_weights)
        tokens, top_k = top_k_index.shape
        expert_ids = top_k_index.reshape(-1)
        sample_weights = top_k_weights.reshape(-1)
        weighted: Any = None
        for group in self._groups(wanted):
            with self._leased(layer, group) as batches:
                for batch in batches:
                    weighted = _grouped_rows(self, module, hidden, expert_ids, sample_weights,
                                             top_k, batch, weighted)
        if weighted is None:  # nothing routed (no tokens)
            return torch.zeros_like(hidden)
        final = weighted.view(tokens, top_k, hidden.size(-1)).sum(dim=1)
        return final.to(hidden.dtype)


def _held_experts(session: SyncSession) -> int:
    """How many of the model's smallest experts the session's budget holds."""
    info = session.model
    smallest = min((info.layers[layer].expert_bytes for layer in info.moe_layers), default=1)
    return session.counters().budget_bytes // max(1, smallest)


def _grouped_rows(experts_stream: ExpertStream, module: Any, hidden: Any, expert_ids: Any,
                  sample_weights: Any, top_k: int, batch: Sequence[ExpertHandle],
                  weighted: Any) -> Any:
    """The router-weighted output rows of the (token, slot) pairs routed to the experts of
    ``batch``, as transformers' ``grouped_mm_experts_forward`` computes them, written into
    ``weighted`` (``(tokens * top_k, hidden)``, made on the first batch) at the pairs'
    places. No host synchronization: pairs routed elsewhere sort to the tail, which the
    grouped product skips, and are left as they were."""
    handles = sorted(batch, key=lambda h: h.expert)
    n = len(handles)
    gate_up, down = experts_stream._stacked(module, handles)

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
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.size(0), device=device)
    rows = rows[inverse]
    if weighted is None:
        return rows  # the pairs of other experts are overwritten by their own batches
    mine = (local < n).unsqueeze(-1)
    return torch.where(mine, rows, weighted)

