"""A CUDA layer held whole: its experts call without the host reading the routing.

To fetch a layer's experts the experts call must name them, and on a GPU naming them reads
the router's choice on the host: a device synchronization per MoE layer, after which the
host no longer queues work ahead of the device. When the cache's budget holds every expert
of the model and a layer's experts are all cached, nothing can evict them, so the call
needs no lease to pin them: :class:`WholeLayers` keeps a device table of each such layer's
matrix addresses (its slot table, built once from one lease of the whole layer), and
:meth:`WholeLayers.grouped` computes the call on the device alone: the pairs sorted by
expert, the distinct experts numbered there, one kernel copying their weights from the
cache into the grouped product's stacked weights by the table, then transformers' own
grouped product (``grouped_mm_experts_forward``'s arithmetic, the same groups of the same
rows: the same bits). A decode step, which ``generate`` computes in ``batched_mm`` on a GPU,
has each (token, slot) pair's weights copied by the same table, then transformers' own
``batched_mm_experts_forward`` (:meth:`WholeLayers.batched`), or, with ``graphs.on``, the
same launches replayed as a CUDA graph once captured (``_graphs``: a decode step launches the
same kernels on the same shapes each token). A token's routing stays on
the device (:meth:`WholeLayers.take`) until it ends; it crosses to pinned host memory then,
with the routing of the tokens that end with it, in one transfer (:meth:`WholeLayers.land`),
to count its layers' hits in the session (:meth:`WholeLayers.account`). The per-token host
cost is what limits a model held whole (its device work queued ahead): launches and
accounting are kept few a token, not a layer.

On the host backend there is no routing to keep on a device, but the same holds: a model
held whole needs no lease a call. :meth:`WholeLayers.holding` says when (and which held-whole
period it is, so that views of the cache made before an eviction could move an expert are
not trusted), the experts call computes from views of the cache, and its routing is counted
at the token's end as here.

In place (``in_place``, a budget below the model's experts): once the cache is full, the
tables name the experts it lacks by their addresses in the registered page-cache mapping
(``SyncSession.in_place``), which the gather kernel (a quantized layer's: its slot
kernel) reads over PCIe. The lease path read each layer's routing on the host before
naming its misses, so their copies never ran under a kernel; read in place, they go inside
the layer's launch while the host runs ahead. No expert is then loaded or evicted, which
keeps the tables true, until a call leases (:meth:`WholeLayers.leasing`; every
``_REFRESH_TOKENS`` tokens one token does, so that the cache follows the routing) or the
mapping is released (:meth:`WholeLayers.begin`).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch  # type: ignore[import-not-found, unused-ignore]

from moestream import InPlace, SyncSession
from moestream.transformers._dequant_cuda import available as cuda_kernel
from moestream.transformers._dequant_cuda import kernels_serve
from moestream.transformers._expert_compute import slotted_grouped
from moestream.transformers._gguf_experts import GgufExperts
from moestream.transformers._graphs import DecodeGraphs
from moestream.transformers._landing import Landing, Routing
from moestream.transformers._launch import current_stream, raw_stream
from moestream.transformers._layout import TORCH_DTYPES, batched_mm, first_projection
from moestream.transformers._mtp import mtp_layers
from moestream.transformers._quantized import LayerScales
from moestream.transformers._table import LayerTable

__all__ = ["MAX_SLOTS", "WholeLayers"]

MAX_SLOTS = 64
"""The most distinct experts one call stacks on this path (a decode step's top-k, a short
verification forward's); a call that may route to more (a prompt) takes the lease path."""

_ALIGN_SLACK = 3 * 256
"""What the cache may add to an expert's file bytes: each of its three matrices placed at a
256-byte boundary (``stages.layout.DEVICE_ALIGN``). Room of an expert's bytes plus this is
room for one more; less, and the cache is full."""

_RETRY_TOKENS = 32
"""In-place mode: tokens between two asks whether the mapping serves every layer."""

_REFRESH_TOKENS = 32
"""In-place mode: tokens the cache stays as the tables found it. Then one token takes the
lease path (its misses loaded over the least recently used experts) and the next token's
tables name what the cache holds then: the cached experts follow the routing, a token's
worth at a time, instead of staying those of the tokens that filled the cache."""

_UNMADE: Any = object()
"""A layer's table not asked for yet (None: asked, and the layer takes the lease path)."""

class WholeLayers:
    """The slot tables of one CUDA model's layers, once the cache holds every expert of the
    model within a budget that holds them all: no miss can come, so nothing is evicted and
    the tables stay true (on the host: whether the model is held whole, and the calls
    served without a lease).

    Args:
        session: the model's session (CuPy backend).
        device: the torch CUDA device the model computes on.
        scales: each quantized layer's scales or GGUF types (``ExpertWeights.scales``):
            its slots are dequantized by the slot kernels where they serve it.
        fill: while a budget that holds every expert is not full yet, how many experts a
            token to load unasked in resident mode (``SyncSession.prefetch``); 0: only what
            the routing asks.
        in_place: below the model's experts, serve a full cache's model with the experts it
            lacks read in place (the module docstring); turned off for the session when a
            layer's layout is not one the tables serve.
    """

    def __init__(self, session: SyncSession, device: Any, *,
                 scales: Mapping[int, LayerScales | GgufExperts] | None = None,
                 fill: int = 0, in_place: bool = False) -> None:
        self.session = session
        self.device = torch.device(device)
        self.scales = scales or {}
        self.fill = fill
        self.in_place = in_place
        info = session.model
        # the model's MoE layers: a checkpoint's multi-token-prediction layers are never
        # fetched (the model has none), so waiting for their experts would never end
        skipped = mtp_layers(info.config, info.moe_layers)
        self._moe_layers = [layer for layer in info.moe_layers if layer not in skipped]
        self._total = sum(info.layers[layer].n_experts * info.layers[layer].expert_bytes
                          for layer in self._moe_layers)
        self._largest = max((info.layers[layer].expert_bytes for layer in self._moe_layers),
                            default=0)
        self._views: dict[int, InPlace] = {}  # by layer: every expert in the mapping
        self._wait = 0  # tokens before the mapping is asked again for every layer
        self._cached: dict[int, frozenset[int]] = {}  # by layer: the experts the cache held
        self._landed: dict[int, set[int]] = {}  # by layer: experts seen cached while filling
        self._budget = 0  # the budget the in-place tables were made under
        self._served = 0  # tokens begun since the in-place tables were made
        # a session's devices are fixed and its budget only shrinks (on a device's out of
        # memory): once either rules the model out, it is never held whole
        self._never = len(session.devices) != 1
        self._layers = [(layer, range(info.layers[layer].n_experts))
                        for layer in self._moe_layers]
        self._tables: dict[tuple[int, Any], LayerTable | None] = {}
        self._whole: bool | None = None
        self.period = 0
        """How many times the model came to be held whole: views of the cache made while
        one period lasts stay true through it (nothing can move an expert meanwhile)."""
        self._pending: list[tuple[int, Any]] = []  # each call's layer and routing
        self._complete: Any = None
        self._landing = Landing(self.device)
        self.graphs = DecodeGraphs(self.device)
        """A held-whole decode step's experts call replayed as a CUDA graph (on a GPU,
        ``graphs.on``)."""

    def forward(self, layer: int, module: Any, hidden: Any, top_k_index: Any,
                top_k_weights: Any, *, batched: bool = False) -> Any | None:
        """The experts call served on the device alone (in transformers' ``batched_mm``
        arithmetic if ``batched``, else its ``grouped_mm``), or None where this path does
        not apply (the model not held whole yet, a call of more than ``MAX_SLOTS`` experts
        or pairs, no tokens, a cast needed)."""
        if self._whole is False:  # not held whole this token: the lease path, at once
            return None
        pairs = top_k_index.numel()
        if pairs == 0 or min(pairs, module.num_experts) > MAX_SLOTS or (
                batched and pairs > MAX_SLOTS):
            return None
        dtype = module.down_proj.dtype
        table = self._tables.get((layer, dtype), _UNMADE)
        if table is _UNMADE:  # the layer's first call in this dtype (and shapes): once
            table = self._table(layer, dtype, tuple(first_projection(module).shape[1:]),
                                tuple(module.down_proj.shape[1:]))
        if table is None:
            return None
        if batched:
            return self.batched(layer, table, module, hidden, top_k_index, top_k_weights)
        return self.grouped(layer, table, module, hidden, top_k_index, top_k_weights)

    def holding(self) -> int:
        """The held-whole period now (``period``), or 0 while the model is not held whole:
        asked of the session once a token until it holds. On the host backend a call is
        served with no lease from views of the cache made in this period
        (``HostWeights.trusted``), and counted at the token's end as here."""
        if self._whole is None:  # asked once a token until it holds
            self._whole = self._holds_every_expert()
            self.period += self._whole
        return self.period if self._whole else 0

    def _table(self, layer: int, dtype: Any, first_shape: tuple[int, ...],
               down_shape: tuple[int, ...]) -> LayerTable | None:
        """The layer's table for ``dtype``, made now (``forward`` asks once a dtype)."""
        if not self.holding():
            return None
        made = self._make(layer, self.session.model.layers[layer].n_experts, dtype)
        if made is not None and not made.accept(first_shape, down_shape, dtype):
            made = None  # a layout the copies do not serve: the lease path
        self._tables[(layer, dtype)] = made
        return made

    def _holds_every_expert(self) -> bool:
        """Whether the budget holds every expert of the model and all are cached, on one
        device (a table holds one device's addresses); host queries: no device work. With
        ``in_place``, a budget below the model's experts also serves, once the cache is
        full and the device can read the others in place (``_fills_in_place``).

        The layers are asked from the one that was not yet ready last time: while the
        cache fills, a token's answer is most often its first query, not one a layer. In
        resident mode the experts of that layer not cached yet are hinted (``fill`` of them,
        a token; copies from the page cache): an expert the routing never picks would
        otherwise keep the model from ever being held whole. In direct mode they would be
        disk reads ahead of the token's own misses: the routing alone fills the cache."""
        session = self.session
        if self._never:
            return False
        counters = session.counters()
        if counters.budget_bytes < self._total:
            if self.in_place:
                return self._fills_in_place(counters.budget_bytes, counters.live_bytes)
            self._never = True
            return False
        layers = self._layers
        for i, (layer, experts) in enumerate(layers):
            if not session.ready(layer, experts):
                self._layers = layers[i:] + layers[:i]  # the same layers, this one first
                if self.fill and counters.mode == "resident":
                    session.prefetch(layer, self._lacking(layer, experts))
                return False
        return True

    def _lacking(self, layer: int, experts: range) -> list[int]:
        """Up to ``fill`` experts of ``layer`` not cached yet, each asked of the session
        until it is once (the budget holds every expert: a cached one stays), so that a
        token asks about the experts it hints and those that landed since, not the
        layer's every expert."""
        known = self._landed.setdefault(layer, set())
        lacking: list[int] = []
        for expert in experts:
            if expert in known:
                continue
            if self.session.ready(layer, [expert]):
                known.add(expert)
            elif len(lacking) < self.fill:
                lacking.append(expert)
            else:
                break
        return lacking

    def _fills_in_place(self, budget: int, live: int) -> bool:
        """In-place mode: the cache is full (no expert more fits) and the device can read
        every expert of every layer in place now (``SyncSession.in_place``); the tables are
        then made under this budget. A mapping not yet registered whole (a switch to
        resident mode registers the rest in the background) is asked again only after
        ``_RETRY_TOKENS`` tokens, so that a token does not pay the query a layer."""
        if budget - live >= self._largest + _ALIGN_SLACK:
            return False
        if self._wait:
            self._wait -= 1
            return False
        info = self.session.model
        views = {}
        for layer in self._moe_layers:
            view = self.session.in_place(layer, range(info.layers[layer].n_experts))
            if view is None:
                self._wait = _RETRY_TOKENS
                return False
            views[layer] = view
        self._views, self._budget = views, budget
        self._served = 0
        return True

    def _make(self, layer: int, n: int, dtype: Any) -> LayerTable | None:
        """A layer's table: plain float experts in ``dtype``, or quantized ones the slot
        kernels dequantize into it (``kernels_serve``); None for any other layer, and then, in
        place, in-place mode is off for the session (a layer's layout does not change:
        asking again each token would cost a stream sync)."""
        info = self.session.model.layers[layer]
        scales = self.scales.get(layer)
        if scales is not None:
            served = cuda_kernel() and kernels_serve(scales, dtype)
        elif info.interleaved:  # the copies would keep gate and up rows interleaved
            served = False
        elif self._budget:  # in place: the file's bytes must be the module's layout
            served = not (info.transposed or not info.gated or info.quant is not None or any(
                TORCH_DTYPES.get(t.name) != dtype for t in (info.gate_up_type, info.down_type)))
        else:  # held whole: the lease's matrices tell (``_from_cache``)
            served = True
        if not served:
            if self._budget:  # in place, every layer's calls must be served
                self.in_place = False
            return None
        if self._budget:
            return self._make_in_place(layer, n, dtype, scales)
        return self._from_cache(layer, list(range(n)), dtype, {}, scales)

    def _make_in_place(self, layer: int, n: int, dtype: Any,
                       scales: LayerScales | GgufExperts | None) -> LayerTable | None:
        """A layer's table from the experts the cache holds and, for the others, their
        addresses in the mapping (``SyncSession.in_place``)."""
        cached = [e for e in range(n) if self.session.ready(layer, [e])]
        view = self._views[layer]  # every expert of the layer, in order
        rows = {e: (list(view.addresses[e]), view.sizes[e])
                for e in sorted(set(range(n)) - set(cached))}
        self._cached[layer] = frozenset(cached)
        return self._from_cache(layer, cached, dtype, rows, scales)

    def _from_cache(self, layer: int, experts: list[int], dtype: Any,
                    rows: dict[int, tuple[list[int], tuple[int, ...]]],
                    scales: LayerScales | GgufExperts | None) -> LayerTable | None:
        """The table of ``experts`` (cached: their matrices' addresses, by one lease) and
        the ``rows`` given (addresses and sizes), or None if their dtypes (plain experts:
        ``dtype``) or sizes differ."""
        stream = self._stream()
        with self.session.fetch(layer, experts) as lease:
            handles = lease.gather() if experts else []  # all cached: nothing to wait for
            for h in handles:
                if stream is not None and h.pending_event() is not None:
                    h.wait(stream)  # landed this token: the stream waits for its upload once
                matrices = h.matrices
                if scales is None and any(TORCH_DTYPES.get(m.ggml_type.name) != dtype
                                          for m in matrices):
                    lease.release(after=stream)
                    return None  # the model computes in another dtype: the lease path casts
                rows[h.expert] = ([m.ptr for m in matrices], tuple(m.nbytes for m in matrices))
            lease.release(after=stream)
        sizes = {size for _, size in rows.values()}
        if len(sizes) != 1 or any(len(size) != 3 for size in sizes):
            return None
        addresses = torch.tensor([rows[e][0] for e in sorted(rows)], dtype=torch.int64
                                 ).to(self.device)
        gate, up, down = sizes.pop()
        return LayerTable(addresses, (gate, up, down), scales)

    def forget(self) -> None:
        """Drop every table (the session closes, or an expert they name was evicted): the
        lease path serves every layer."""
        self._drop_tables()
        self._whole = None
        self._pending.clear()
        self._landed.clear()

    def _drop_tables(self) -> None:
        self.graphs.clear()
        self._tables.clear()
        self._views.clear()
        self._budget = 0

    def begin(self) -> None:
        """A token starts: in-place tables over a mapping the session has since released
        (a switch to direct mode) are dropped before any call reads by them; every
        ``_REFRESH_TOKENS`` tokens they are dropped for the token (:meth:`leasing`), which
        then takes the lease path."""
        view = next(iter(self._views.values()), None)
        if view is not None and not self.session.in_place_current(view):
            self.forget()
        elif self._budget:
            self._served += 1
            if self._served > _REFRESH_TOKENS:
                self.leasing()

    def leasing(self) -> None:
        """A call of this token takes the lease path (a prompt of more experts than the
        tables serve, a layer they do not): in-place tables are dropped for the token,
        once the device has run the work queued by them (the lease's loads may evict an
        expert their rows name, and reuse its buffer, which the cache does not know they
        read). The token's calls served so far are still counted at its end."""
        if not (self._budget and self._tables):
            return
        stream = self._stream()
        if stream is not None:
            stream.synchronize()
        self._drop_tables()
        self._whole = False  # asked again at the token's end

    def grouped(self, layer: int, table: LayerTable, module: Any, hidden: Any, top_k_index: Any,
                top_k_weights: Any) -> Any:
        """``grouped_mm_experts_forward``'s output for a whole layer, queued on torch's
        stream with no host read of the routing."""

        def gather(slots: Any, first: Any, down: Any) -> None:
            self._gather(table, slots, first, down)

        out = slotted_grouped(module, hidden, top_k_index, top_k_weights, table.experts,
                              gather, table.first_shape, table.down_shape)
        self.remember(layer, top_k_index)
        return out

    def batched(self, layer: int, table: LayerTable, module: Any, hidden: Any, top_k_index: Any,
                top_k_weights: Any) -> Any:
        """``batched_mm_experts_forward``'s output for a whole layer: each (token, slot)
        pair's expert weights copied from the cache by the table in one launch, then
        transformers' own arithmetic; queued on torch's stream with no host read. A layer
        held whole replays it as a CUDA graph from its second call of a kind where
        ``graphs.on`` (the same launches, the host's cost of one)."""
        if self.graphs.on and self.device.type == "cuda" and (
                not self._budget and not torch.is_grad_enabled()):
            raw = raw_stream(self.device)
            key = (layer, raw, hidden.shape, top_k_index.shape, hidden.dtype,
                   top_k_index.dtype, top_k_weights.dtype, table.dtype)
            out = self.graphs.call(key, raw[1], functools.partial(self._step, table, module),
                                   hidden, top_k_index, top_k_weights)
        else:
            out = self._step(table, module, hidden, top_k_index, top_k_weights)
        self.remember(layer, top_k_index)
        return out

    def _step(self, table: LayerTable, module: Any, hidden: Any, top_k_index: Any,
              top_k_weights: Any) -> Any:
        """A decode step's launches (as ``graphs`` captures them): the gather into slot
        buffers of the step's own (a graph's pool holds them), transformers' product."""
        slots = top_k_index.reshape(-1).to(torch.int64)
        first = torch.empty((slots.shape[0], *table.first_shape), dtype=table.dtype,
                            device=self.device)
        down = torch.empty((slots.shape[0], *table.down_shape), dtype=table.dtype,
                           device=self.device)
        self._gather(table, slots, first, down)
        return batched_mm(module, first, down, hidden, top_k_index, top_k_weights)

    def _gather(self, table: LayerTable, slots: Any, first: Any, down: Any) -> None:
        """One launch on torch's stream: each slot's weights copied from the cache (or the
        mapping), or, quantized, dequantized from there."""
        table.fill(self.device, slots, first, down)

    def _stream(self) -> Any:
        """torch's current stream on the device (None on the host, where the session's
        backend needs none)."""
        return current_stream(self.device) if self.device.type == "cuda" else None

    def remember(self, layer: int, top_k_index: Any) -> None:
        """A call served with no lease: its routing, kept (on the device) until the
        forward's :meth:`take` (nothing writes it within the forward)."""
        self._pending.append((layer, top_k_index))

    def take(self) -> Routing:
        """The calls served since the last ``take`` (a forward's): their routing gathered
        into one tensor of its own on the device (one launch), for :meth:`land` once the
        token ends, however many forwards later."""
        pending, self._pending = self._pending, []
        if not pending:
            return Routing([], [], None)
        return Routing([layer for layer, _ in pending], [ids.numel() for _, ids in pending],
                       torch.cat([ids.reshape(-1) for _, ids in pending]))

    def land(self, routings: list[Routing], after: Any = None) -> list[list[list[int]]]:
        """Each routing's calls' expert ids on the host, once ``after`` (on a GPU, the CUDA
        event of the last one's work; None: the work queued on torch's stream so far)
        completes: one transfer for them all."""
        return self._landing.land(routings, after)

    def settle(self, routing: Routing, after: Any = None) -> None:
        """One token's :meth:`account`, its routing landed first (:meth:`land`)."""
        self.account(routing, self.land([routing], after)[0])

    def account(self, routing: Routing, calls: list[list[int]]) -> None:
        """Count a token's calls served here (``calls``: each one's ids, :meth:`land`) in
        the session (a lease of each call's experts, all hits): called once the token's
        device work is done, so the experts' compute is over (the session is told so by an
        event never recorded, which is complete). A model not yet held whole is asked
        again in the next token; where the session found an expert the tables name no
        longer cached (the budget shrank: a device's out of memory), the tables are
        dropped and the lease path serves."""
        cached = True
        if routing.layers:
            # a few ids a call: sets beat numpy's unique here
            uses = [(layer, sorted(set(ids)))
                    for layer, ids in zip(routing.layers, calls, strict=True)]
            if self._cached:  # in place: hits where the tables had the cache's rows
                held = {layer: self._cached.get(layer, frozenset()) for layer, _ in uses}
                read = [(layer, [e for e in experts if e not in held[layer]])
                        for layer, experts in uses]
                self.session.used_in_place([use for use in read if use[1]])
                uses = [(layer, [e for e in experts if e in held[layer]])
                        for layer, experts in uses]
            cached = self.session.used([use for use in uses if use[1]], after=self._done())
        if not self._whole:
            self._whole = False if self._never else None  # asked again unless it never can
        elif not cached:
            self.forget()

    def _done(self) -> Any:
        """A CuPy event never recorded (complete, as the CUDA runtime defines it): the
        ``after`` of work the host has seen end, with no event made a token; None on the
        host."""
        if self.device.type != "cuda":
            return None
        if self._complete is None:
            import cupy

            with cupy.cuda.Device(current_stream(self.device).device_index):
                self._complete = cupy.cuda.Event(block=False, disable_timing=True)
        return self._complete
