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
  ``experts_implementation="grouped_mm"`` (transformers' default). On a GPU, ``generate``
  computes such a model's decode steps in ``batched_mm`` instead (its
  ``_optimize_model_for_decode``); a grouped moestream model follows the same switch
  (:func:`follow_decode_switch`): each step's pairs' weights stacked in order, then
  transformers' own ``batched_mm_experts_forward``.
- ``"eager"``: one product per expert, in transformers' ``eager`` order (each expert's rows
  added into the output with ``index_add_`` in ascending expert order, whatever order the
  experts landed in), so that logits are ``torch.equal`` to a whole model run with
  ``experts_implementation="eager"``.

Experts a call routes to that do not fit the budget at once (a long prompt's prefill, a
large batch) are fetched in groups that do, each released before the next is fetched.

This module holds the registry's entry and the model's :class:`ExpertStream` (its session,
token boundary and life); the leases are ``_leases.py``'s, the experts' tensors
``_expert_weights.py``'s and the two arithmetics ``_expert_compute.py``'s. The swapped
experts modules (``_swap.py``) reach the same through :meth:`ExpertStream.arrivals`,
:meth:`ExpertStream.weights` and :meth:`ExpertStream.stacked`.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal, NamedTuple, TypeVar, cast

import torch  # type: ignore[import-not-found, unused-ignore]
from transformers.integrations import moe as hf_moe  # type: ignore[import-not-found, unused-ignore]

from moestream import ExpertHandle, SyncSession, TokenStats
from moestream.pipeline.foundation.errors import UsageError
from moestream.transformers._expert_compute import batched, eager, grouped
from moestream.transformers._expert_weights import ExpertWeights
from moestream.transformers._generate import GenerateStats
from moestream.transformers._gguf_experts import GgufExperts
from moestream.transformers._graphs import DecodeGraphs
from moestream.transformers._host_grouped import HostWeights, host_grouped
from moestream.transformers._landing import HELD_TOKENS, Routing
from moestream.transformers._launch import current_stream
from moestream.transformers._layout import BATCHED_MM
from moestream.transformers._leases import groups, leased
from moestream.transformers._prefetch import NextRouter
from moestream.transformers._quantized import LayerScales
from moestream.transformers._routing import WholeLayers

__all__ = ["COMPUTES", "IMPLEMENTATION", "Compute", "ExpertStream", "experts_forward",
           "follow_decode_switch", "register", "stream_of", "uncompiled"]

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


F = TypeVar("F", bound=Callable[..., Any])


def uncompiled(fn: F) -> F:
    """``fn`` never traced by ``torch.compile``, which ``generate`` applies on its own to a
    GPU model with a static cache: moestream's calls read and change the session's state on
    the host and launch their own kernels, which a graph cannot hold; a compiled model
    breaks its graph at ``fn`` and runs it as it is (~1 us a call more when nothing
    compiles)."""
    return cast(F, torch.compiler.disable(fn))


@uncompiled
def experts_forward(self: Any, hidden_states: Any, top_k_index: Any, top_k_weights: Any) -> Any:
    """The experts call of one MoE layer, served by moestream (the registry's signature).

    Never traced by ``torch.compile`` (:func:`uncompiled`).

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


class _HeldToken(NamedTuple):
    """A token the whole-layer path served, not yet ended: its forward's CUDA events
    (started, done), its calls' routing and its wall time on the host."""

    started: Any
    done: Any
    routing: Routing
    wall_ms: float


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
        next_routers: per MoE layer, the next one's router: its calls hint the experts
            that router picks for their hidden state (``prefetch="predict"``,
            ``_prefetch.py``); None or empty: no hints.
        in_place: on a GPU, once the cache is full, serve grouped calls with no lease: the
            cached experts by their cache addresses, the others read in place from the
            registered page-cache mapping (``WholeLayers``, ``SyncSession.in_place``).
    """

    def __init__(self, session: SyncSession, device: Any, *, compute: Compute,
                 group_experts: int,
                 scales: Mapping[int, LayerScales | GgufExperts] | None = None,
                 next_routers: Mapping[int, NextRouter] | None = None,
                 in_place: bool = False) -> None:
        if compute not in COMPUTES:
            raise UsageError(f"compute must be one of {', '.join(COMPUTES)}, got {compute!r}")
        if group_experts < 1:
            raise UsageError(f"group_experts must be >= 1, got {group_experts}")
        self.session = session
        self.device = torch.device(device)
        self.compute: Compute = compute
        self.group_experts = group_experts
        self.scales: Mapping[int, LayerScales | GgufExperts] = scales or {}
        self.next_routers: Mapping[int, NextRouter] = next_routers or {}
        self.last: TokenStats | None = None
        """The last token's stats (``end_token``'s answer)."""
        self.tokens = 0
        self.whole_tokens = 0
        """Of ``tokens``, those on a GPU whose every experts call the whole-layer path served
        (no lease, no host read of the routing): all of them once a model is held whole."""
        self.last_generate: GenerateStats | None = None
        """What the model's last ``generate`` call did (its hits, misses, bytes, stall time);
        ``session.counters()`` holds the totals since loading."""
        self.on_token: Callable[[TokenStats], None] | None = None
        """Called with each token's stats (a live progress line, say)."""
        self.batched = False
        """Whether a grouped model's calls compute in transformers' ``batched_mm``
        arithmetic: set while ``generate`` decodes on a GPU, where transformers switches
        ``grouped_mm`` to it (``follow_decode_switch``), so that the tokens stay the
        reference's bits."""
        self.defer = False
        """Whether a token whose every experts call the whole-layer path served is held,
        its device work not waited for meanwhile, and ended with those held before it once
        more than ``held_tokens`` wait. Set with ``batched``: ``generate``'s loop reads a
        decode step's result one step late (transformers' ``DeferredStopCheck``), so the
        host queues a step while the GPU computes the one before; a wait at each token's
        end here undid that. ``last`` and ``on_token`` are then up to ``held_tokens``
        tokens behind until the decode ends (``flush``)."""
        self.held_tokens = HELD_TOKENS
        """How many tokens ``defer`` holds before it ends them together."""
        self._cuda = self.device.type == "cuda"
        self._started: Any = None
        self._begun = 0.0  # when the token's forward began, on the host's clock
        self._leased = False  # this token took a lease (the whole-layer path did not serve)
        self._held: list[_HeldToken] = []  # tokens served whole, not yet ended (``defer``)
        interleaved = frozenset(n for n, layer in session.model.layers.items()
                                if layer.interleaved)
        self._weights = ExpertWeights(self.device, self.scales, interleaved)
        self._host_weights = HostWeights(_held_experts(session) + group_experts, interleaved)
        # a model held whole computes its layers with no lease: on a GPU with no host read
        # of the routing, on the host from views of the cache (``HostWeights.trusted``)
        self._whole = WholeLayers(session, self.device, scales=self.scales,
                                  fill=group_experts, in_place=in_place and self._cuda)

    # -- the token boundary ----------------------------------------------------------------

    def begin_step(self) -> None:
        """The model's forward starts (a forward pre-hook): time its compute."""
        self._leased = False
        self._whole.begin()
        self._begun = time.perf_counter()
        if self._cuda:
            self._started = torch.cuda.Event(enable_timing=True)
            self._started.record(current_stream(self.device))

    def end_step(self) -> TokenStats | None:
        """The model's forward is done (a forward hook): one token for moestream
        (verification, the controller, the log's token line).

        On a GPU the forward's time on torch's stream, measured by CUDA events, is the
        engine's compute (``end_token(compute_ms=...)``); on the host moestream charges to
        compute what its own waits do not explain. A token the whole-layer path served
        tells the session of its hits only at its end, so its wall time is the forward's,
        measured here (``wall_ms``). Under ``defer`` such a token is held and ended with
        the others once more than ``held_tokens`` wait: returns the last ended token's
        stats (None before any).
        """
        started, self._started = self._started, None
        whole = self._whole
        routing = whole.take()  # this token's calls, their routing still on the device
        if not (self._cuda and started is not None):
            self.flush()
            whole.settle(routing)
            return self._ended(None, None)
        done = torch.cuda.Event(enable_timing=True)
        done.record(current_stream(self.device))
        self.whole_tokens += not self._leased
        if self.defer and not self._leased:
            self._held.append(_HeldToken(started, done, routing, self._wall_ms()))
            if len(self._held) > self.held_tokens:
                self.flush(keep=1)  # the newest may still run on the device
            return self.last
        self.flush()
        done.synchronize()
        # a leased token's clock ran in the session from its first fetch
        wall_ms = None if self._leased else self._wall_ms()
        whole.settle(routing, done)  # counted now the device is done
        return self._ended(float(started.elapsed_time(done)), wall_ms)

    def _wall_ms(self) -> float:
        """The host's time since the token's forward began."""
        return (time.perf_counter() - self._begun) * 1000.0

    def flush(self, keep: int = 0) -> None:
        """End the held tokens (``defer``) but the newest ``keep``, in order, once the
        device has done the last of them (done by now, or nearly: the host runs at most a
        token ahead of it), their routing landed on the host in one transfer; nothing
        held, nothing done."""
        held = self._held
        ending = held[:len(held) - keep]
        if not ending:
            return
        landed = self._whole.land([token.routing for token in ending], ending[-1].done)
        for token, calls in zip(ending, landed, strict=True):
            del held[0]  # one at a time: a token's end that raises keeps the rest held
            self._whole.account(token.routing, calls)
            self._ended(float(token.started.elapsed_time(token.done)), token.wall_ms)

    def _ended(self, compute_ms: float | None, wall_ms: float | None) -> TokenStats:
        self.last = self.session.end_token(compute_ms=compute_ms, wall_ms=wall_ms)
        self.tokens += 1
        if self.on_token is not None:
            self.on_token(self.last)
        return self.last

    def close(self) -> None:
        """Close the session (idempotent); the model cannot compute its experts after."""
        self._held.clear()  # tokens held by a decode cut short: their ends are not counted
        self._host_weights.clear()
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

    @property
    def graphs(self) -> DecodeGraphs:
        """The CUDA graphs a held-whole decode step's experts calls replay on a GPU where
        ``graphs.on`` (on by default; a capture that fails turns it off), each call's
        kernels launched as they are otherwise; ``graphs.replays``: the calls replayed."""
        return self._whole.graphs

    # -- one experts call ------------------------------------------------------------------

    def forward(self, layer: int, module: Any, hidden: Any, top_k_index: Any,
                top_k_weights: Any) -> Any:
        """The routed experts' output for ``hidden``, as the module's experts would give."""
        if self._cuda and self.compute == "grouped":
            out = self._whole.forward(layer, module, hidden, top_k_index, top_k_weights,
                                      batched=self.batched)
            if out is not None:
                return out
        self._leasing()
        wanted, pairs, hint = self._wanted(layer, hidden, top_k_index)
        if self.compute == "eager":
            return eager(self.arrivals(layer, wanted, hint), self._weights, module, hidden,
                         top_k_index, top_k_weights)
        if self.batched and len(wanted) <= self.group_experts:
            # a decode step's experts in one lease; a call of more groups (a long
            # verification) stays grouped: batched_mm needs every pair's weights at once
            with leased(self.session, self.device, layer, wanted, hint) as batches:
                return batched(batches, self._weights, module, hidden, top_k_index,
                               top_k_weights, pairs)
        if not self._cuda and layer not in self.scales and len(wanted) <= self.group_experts:
            # the host: each expert's products on the cache's own matrices, no stacked copy
            period = self._whole.holding()
            kept = period and self._host_weights.trusted(layer, wanted, module, period)
            if kept:  # held whole: no lease, the hits counted at the token's end
                out = host_grouped([kept], module, hidden, top_k_index, top_k_weights)
                self._whole.remember(layer, top_k_index)
                return out
            with leased(self.session, self.device, layer, wanted, hint) as batches:
                return host_grouped(self._host_weights.leased(batches, module, period), module,
                                    hidden, top_k_index, top_k_weights)
        return grouped(self.arrivals(layer, wanted, hint), self._weights, module, hidden,
                       top_k_index, top_k_weights)

    def _leasing(self) -> None:
        """This token takes a lease: it will not be held, and the held tokens end first
        (the session sees tokens in order), counted by the tables they ran on, before this
        token's lease drops the in-place tables (``WholeLayers.leasing``)."""
        self._leased = True
        if self._held:
            self.flush()
        self._whole.leasing()

    def _wanted(self, layer: int, hidden: Any, top_k_index: Any
                ) -> tuple[list[int], list[int], Callable[[], object] | None]:
        """The experts the call routes to (ascending), each (token, slot) pair's expert in
        order, and the next layer's prefetch hint (None: no guess here): the one host read
        of a layer, which experts to ask for, copies the ids and the next router's guess
        together (not a device unique, which would synchronize once more)."""
        ids = top_k_index.flatten()
        following = self.next_routers.get(layer)
        if following is None:
            pairs = ids.tolist()
            return sorted(set(pairs)), pairs, None
        with torch.no_grad():
            guess = following.guess(hidden, top_k_index.shape[-1]).flatten()
        read = torch.cat((ids, guess.to(ids.dtype))).tolist()
        pairs = read[:ids.numel()]
        guessed = sorted(set(read[ids.numel():]))
        return sorted(set(pairs)), pairs, functools.partial(
            self.session.prefetch, following.layer, guessed)

    def arrivals(self, layer: int, wanted: Sequence[int],
                 hint: Callable[[], object] | None = None) -> Iterator[list[ExpertHandle]]:
        """The handles of the ``wanted`` experts of ``layer``, a batch at a time as they
        land, fetched in groups the budget holds (``group_experts``); each group's lease is
        released after the work queued on torch's stream, before the next is fetched.
        ``hint`` (the next layer's prefetch) runs once the call's experts are pinned, when
        one group holds them all (else the hint would evict the later groups' experts)."""
        self._leasing()  # the swapped modules lease here, not through forward
        several = len(wanted) > self.group_experts
        for group in groups(wanted, self.group_experts):
            with leased(self.session, self.device, layer, group,
                        None if several else hint) as batches:
                yield from batches

    def weights(self, module: Any, h: ExpertHandle) -> tuple[Any, Any, Any]:
        """The leased expert's gate, up and down as ``module`` applies them (views of the
        cache, or dequantized): ``ExpertWeights.expert``."""
        return self._weights.expert(module, h)

    def stacked(self, module: Any, handles: Sequence[ExpertHandle]) -> tuple[Any, Any]:
        """The leased experts' ``gate_up`` and ``down`` stacked as ``module`` keeps its own,
        for one grouped product: ``ExpertWeights.stacked``."""
        return self._weights.stacked(module, handles)


def follow_decode_switch(model: Any, experts_stream: ExpertStream) -> None:
    """``generate`` computes its decode steps on a GPU in ``batched_mm`` where a model's
    experts use ``grouped_mm`` (transformers' ``_optimize_model_for_decode``, which switches
    the registry's names only, not moestream's): a grouped moestream model follows that
    context, so that every step is the resident model's arithmetic, bit for bit; and its
    tokens' ends wait for the device a few tokens late (``ExpertStream.defer``), as
    transformers' loop reads each step's result, ended when the context ends."""
    original = getattr(model, "_optimize_model_for_decode", None)
    if original is None or BATCHED_MM is None or experts_stream.compute != "grouped":
        return

    @contextlib.contextmanager
    def optimized() -> Iterator[None]:
        with original():
            before = experts_stream.batched, experts_stream.defer
            # transformers keeps grouped_mm on a CPU and switches elsewhere
            switch = experts_stream.device.type != "cpu"
            experts_stream.batched = switch or before[0]
            experts_stream.defer = switch or before[1]
            try:
                yield
            finally:
                experts_stream.batched, experts_stream.defer = before
                if not experts_stream.defer:
                    experts_stream.flush()

    model._optimize_model_for_decode = optimized


def _held_experts(session: SyncSession) -> int:
    """How many of the model's smallest experts the session's budget holds."""
    info = session.model
    smallest = min((info.layers[layer].expert_bytes for layer in info.moe_layers), default=1)
    return session.counters().budget_bytes // max(1, smallest)

