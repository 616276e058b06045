"""The asynchronous API: ``open`` a model, ``fetch`` a layer's experts, ``end_token``.

``Session`` is a thin face over ``pipeline.streaming.session.StreamSession`` (the parts) and
``pipeline.streaming.lease.LayerLease`` (pins and arrivals); it checks where it is called from,
builds handles and reports counters in public types.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import os
import warnings
from asyncio.events import _get_running_loop
from collections.abc import AsyncIterator, Generator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Protocol

from gguf import GGMLQuantizationType

from moestream._args import (
    ExpertIds,
    Index,
    budget_of,
    choice,
    devices_of,
    expert_ids,
    index,
    milliseconds,
)
from moestream._handles import ExpertHandle, LeaseSource
from moestream._logging import route_unconfigured
from moestream.gpu.backend import Event
from moestream.gpu.interop import StreamLike, event_after
from moestream.pipeline.foundation.config import GATHER_BLOCKS, Budget, RunConfig, check_bound
from moestream.pipeline.foundation.errors import UsageError, UsageTypeError
from moestream.pipeline.foundation.quantization import ExpertQuant
from moestream.pipeline.foundation.table import ExpertTable
from moestream.pipeline.makers.modelgen import ensure_default_model
from moestream.pipeline.streaming.controller import Sampler
from moestream.pipeline.streaming.lease import NOT_YET, Arrival, LayerLease, LeasePart
from moestream.pipeline.streaming.session import StreamSession

__all__ = ["Counters", "LayerInfo", "Lease", "ModelInfo", "Router", "Session", "TensorSpec",
           "TokenStats", "Tuning", "open"]

Mode = Literal["auto", "direct", "resident"]
After = StreamLike | Event | Mapping[int, Any]
"""What a release waits for: a stream (its work so far), an event, or one per device."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Tuning:
    """Settings that rarely need changing (the defaults are ``moestream.pipeline.cli.run``'s).

    Each setting has a range, checked here, at once, in one line (``UsageError``; the same
    ranges as ``pipeline.cli.run``'s flags, ``pipeline.foundation.config.TUNING_BOUNDS``): the
    upper ends keep a typo from asking for gigabytes of pinned memory or thousands of
    threads. A staging ring that would take more than half the RAM available when the
    session opens is refused then, before anything is allocated.

    Attributes:
        queue_depth: reader threads per device (reads in flight); 1 to 64.
        chunk_bytes: largest single read (a multiple of 4096); 4096 to 256 MiB.
        staging_slots: experts staged in pinned memory at once, per device; 1 to 1024.
        upload_streams: upload streams per device; 1 to 16.
        gather: a layer's resident misses copied by one gather kernel on the SMs, where it
            serves (small expert matrices, ``streaming.streamer.GATHER_BELOW_BYTES``); False:
            always the copy engines, which leave the SMs to the engine's kernels.
        gather_blocks: the gather's blocks per copy, at most (its SM budget); 1 to 1024.
        layers_in_flight: layers whose experts may be pinned at once (a fetched layer and
            a prefetched one, or concurrent fetches); the budget must hold that many
            layers' top-k experts; 1 to 256.
        ram_limit: the RAM the controller may believe in, at most (bytes); 0 to 2**62.
        sample_ms: the controller's sampling period; 1 to 60,000 ms.
        margin_bytes: the controller's safety margin (None: max(2 GiB, 5% of RAM));
            0 to 2**62 bytes.
        warmup: in resident mode, warm the model's missing pages in the background.
        dwell_s: least time between two mode switches; 0 to 3600 s.
        sampler: machine readings for the controller (tests feed their own).
        faults: injected faults (``moestream.pipeline.foundation.faults``), a test facility.
    """

    queue_depth: int = 8
    chunk_bytes: int = 4 << 20
    staging_slots: int = 16
    upload_streams: int = 2
    gather: bool = True
    gather_blocks: int = GATHER_BLOCKS
    layers_in_flight: int = 2
    ram_limit: int | None = None
    sample_ms: float = 250.0
    margin_bytes: int | None = None
    warmup: bool = True
    dwell_s: float = 2.0
    sampler: Sampler | None = field(default=None, repr=False)
    faults: str = ""

    def __post_init__(self) -> None:
        # the ranges are ``pipeline.foundation.config.TUNING_BOUNDS``, the command line's too
        for name in ("queue_depth", "staging_slots", "upload_streams", "layers_in_flight",
                     "gather_blocks"):
            check_bound(name, index(getattr(self, name), f"Tuning.{name}"), f"Tuning.{name}")
        if not isinstance(self.gather, bool):
            raise UsageTypeError(f"Tuning.gather must be True or False, not {self.gather!r}")
        chunk = index(self.chunk_bytes, "Tuning.chunk_bytes")
        if chunk % 4096:
            raise UsageError(f"Tuning.chunk_bytes must be a multiple of 4096, not {chunk}")
        check_bound("chunk_bytes", chunk, "Tuning.chunk_bytes")
        for name in ("ram_limit", "margin_bytes"):
            value = getattr(self, name)
            if value is not None:
                check_bound(name, index(value, f"Tuning.{name}"), f"Tuning.{name}")
        check_bound("sample_ms", milliseconds(self.sample_ms, "Tuning.sample_ms"),
                    "Tuning.sample_ms")
        check_bound("dwell_s", milliseconds(self.dwell_s, "Tuning.dwell_s"), "Tuning.dwell_s")


@dataclass(frozen=True, slots=True)
class LayerInfo:
    """One MoE layer of the model."""

    layer: int
    n_experts: int
    hidden: int
    ffn: int
    gate_up_type: GGMLQuantizationType
    down_type: GGMLQuantizationType
    expert_bytes: int
    """Bytes of one expert's three matrices in the file."""
    transposed: bool = False
    """gpt-oss's layout: gate_up (hidden, 2 * ffn), gate and up interleaved by column, its
    row halves handed out as ``gate`` and ``up``; down (ffn, hidden) (see ``Matrix``)."""
    gated: bool = True
    """False for experts without a gate (Nemotron-H): the up projection (ffn, hidden) is
    handed out as its row halves in ``gate`` and ``up`` (see ``Matrix``)."""
    quant: ExpertQuant | None = None
    """Quantized experts (``fp8`` blocks, ``mxfp4``, ``fp4``): the matrices are their file
    bytes (``gate_up_type`` I8 as the carrier; ``quant.shapes`` their shapes where a byte
    holds two values), to be multiplied by their scales, non-routed tensors named here
    (``read_tensor``); None for float and GGUF experts."""


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """A tensor of the model that is not a routed expert (embeddings, attention, norms,
    routers, shared experts), as the file declares it; ``Session.read_tensor`` reads it.

    Attributes:
        name: its name in the file.
        dtype: the file's name of its type (safetensors ``BF16``, ``F8_E4M3``...; a GGUF
            type name such as ``Q4_K``).
        shape: elements along each axis, outermost first.
        nbytes: its bytes in the file.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """The model a session streams.

    Attributes:
        path: the model as opened (a GGUF file, a checkpoint directory or file).
        moe_layers: the model layer indices of the MoE layers, in decode order.
        layers: each MoE layer's description, by layer index.
        n_experts: routed experts per layer (the largest).
        top_k: experts the router picks per layer and token.
        hidden: the hidden size.
        hash_routed: how many of the first MoE layers route by token id (no router).
        tensors: every other tensor, by name (``Session.read_tensor`` reads one).
        config: a checkpoint's ``config.json`` as the session's one read of it parsed it
            (bounded in size and depth, no duplicate keys); empty for a GGUF file. Build a
            model from these values, not from a second read of the path.
    """

    path: Path
    moe_layers: tuple[int, ...]
    layers: Mapping[int, LayerInfo]
    n_experts: int
    top_k: int
    hidden: int
    hash_routed: int
    tensors: Mapping[str, TensorSpec] = field(default_factory=dict)
    config: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, table: ExpertTable) -> ModelInfo:
        layers = {
            n: LayerInfo(n, m.n_experts, m.shape[0], m.shape[1], m.gate_up_type, m.down_type,
                         m.expert_bytes, m.transposed, m.gated, m.quant)
            for n, m in table.layers.items()
        }
        tensors = {t.name: TensorSpec(t.name, t.type_name, t.shape, t.nbytes)
                   for t in table.non_routed}
        return cls(table.path, tuple(table.moe_layers), layers, table.n_experts, table.top_k,
                   table.hidden, table.hash_routed, tensors, copy.deepcopy(table.config))


@dataclass(frozen=True, slots=True)
class TokenStats:
    """What one token did (the fields of its ``token`` log event, docs/LOG_SCHEMA.md).

    ``compute_ms`` is the token's wall time not spent waiting for experts: the engine's
    own work, as moestream sees it from between the fetches.
    """

    token: int
    wall_ms: float
    stall_ms: float
    compute_ms: float
    hits: int
    misses: int
    evictions: int
    file_bytes: int
    cache_bytes: int
    storage_bytes: int
    mode: str
    experts: tuple[tuple[int, ...], ...]
    """Per MoE layer (``ModelInfo.moe_layers`` order), the experts fetched."""
    time: Mapping[str, float] = field(default_factory=dict)
    """The wall time by what it went to, ms: ``compute_ms``, ``read_ms``, ``upload_ms``,
    ``slot_ms``, ``switch_ms``, ``host_ms`` (the log's ``time`` object; they add up to
    ``wall_ms``)."""
    cpu_ms: float = 0.0
    """CPU time of the session's event-loop thread during the token: ``wall_ms`` well above
    it and its waits means that thread was blocked elsewhere (a full CUDA launch queue, the
    GIL held by another thread), not computing."""


@dataclass(frozen=True, slots=True)
class Counters:
    """Totals since the session opened, the token under way included (a lease counts once
    released, a hint once made).

    Device bytes are summed over the devices.
    """

    tokens: int
    hits: int
    misses: int
    evictions: int
    prefetched: int
    file_bytes: int
    cache_bytes: int
    storage_bytes: int
    stall_ms: float
    verified: int
    mismatches: int
    unverified: int
    mode: str
    switches: int
    budget_bytes: int
    live_bytes: int
    parked_bytes: int
    peak_device_bytes: int
    open_leases: int

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class Router(Protocol):
    """The model's own router (``ffn_gate_inp``), as ``pipeline.cli.run --router live`` applies
    it; ``Session.router`` makes one. An engine normally routes with its own kernels; this
    one serves examples and tests."""

    def embedding(self, token: int) -> Any:
        """The hidden state token ``token`` starts with (a float32 vector on the device)."""

    def route(self, token: int, i: int, hidden: Any) -> tuple[list[int], list[float]]:
        """Experts and weights of MoE layer *position* ``i`` (an index into
        ``ModelInfo.moe_layers``) for ``hidden``."""

    def predict(self, token: int, i: int, hidden: Any) -> list[int]:
        """A guess of ``route(token, i, ...)`` from an earlier hidden state."""


class LeaseFacts:
    """What a fetch asked for and found (``Lease`` and ``SyncLease`` alike)."""

    __slots__ = ()
    _core: LayerLease

    @property
    def layer(self) -> int:
        return self._core.layer

    @property
    def experts(self) -> tuple[int, ...]:
        """The experts asked for, in the order asked."""
        return self._core.experts

    @property
    def hits(self) -> int:
        """Experts that were in the device cache (or already loading) when fetched."""
        return self._core.hits

    @property
    def misses(self) -> int:
        """Experts this fetch started loading."""
        return self._core.misses

    @property
    def released(self) -> bool:
        return self._core.released

    @property
    def remaining(self) -> int:
        """Experts not handed out yet (loading, or landed and waiting for ``available`` or
        the iteration); 0 once every one was, or failed."""
        return self._core.pending


class Lease(LeaseFacts):
    """One layer's fetched experts, pinned on their devices until released.

    Iterate it (``async for``) for handles as experts become available, hits first, misses
    as they land; or ``await gather()`` for all of them in the order asked. Leave the
    ``with``/``async with`` block, or call ``release``, when the engine's compute on them is
    queued: their buffers are reused only after that compute has run.
    """

    __slots__ = ("_core", "_handed", "_session", "_source")

    def __init__(self, session: Session, core: LayerLease) -> None:
        self._session = session
        self._core = core
        self._handed: list[ExpertHandle] = []
        self._source = LeaseSource(core, session._core.backends,
                                   session._table.layers[core.layer], session._dropped)
        core.owner = session  # not the lease: the core must not keep its face alive

    def _handle(self, arrival: Arrival) -> ExpertHandle:
        handle = ExpertHandle(self._source, arrival)
        self._handed.append(handle)
        return handle

    def __aiter__(self) -> AsyncIterator[ExpertHandle]:
        return self

    async def __anext__(self) -> ExpertHandle:
        """The next expert available.

        Raises:
            StageError: this expert's load failed (its bytes never reach the cache);
                iterating again goes on with the other experts. ``ModelChangedError``:
                the model file changed under the session.
            UsageError: the lease was released or the session closed, also while waiting.
        """
        arrival = await self._core.next()
        if arrival is None:
            raise StopAsyncIteration
        return self._handle(arrival)

    def _next_nowait(self) -> ExpertHandle | Any | None:
        """The next expert if available now, None when all were handed out, ``NOT_YET``
        when iterating would wait (the sync face's path without a hop)."""
        arrival = self._core.next_nowait()
        if arrival is None or arrival is NOT_YET:
            return arrival
        return self._handle(arrival)

    def _in_order(self) -> list[ExpertHandle]:
        """Every handle handed out, in the order asked (``gather``'s answer)."""
        by_expert = {h.expert: h for h in self._handed}
        return [by_expert[e] for e in self.experts]

    def available(self) -> list[ExpertHandle]:
        """Every expert available now and not handed out yet, without waiting: the hits
        that have landed, then the misses that have (a layer copied in one launch lands
        at once). Stops before a failed one, which iterating then raises. Iterating goes
        on with those still to come.

        Raises:
            UsageError: the lease was released or the session closed; called from another
                thread than the session's loop.
        """
        self._session._on_loop()
        core = self._core
        arrivals = core.take_ready()
        arrivals.extend(core.take_landed())
        # made here, not per arrival through ``_handle``: a warm layer's experts are handed
        # out between two layers' kernels, where every microsecond shows
        source = self._source
        handles = [ExpertHandle(source, a) for a in arrivals]
        self._handed.extend(handles)
        return handles

    async def gather(self) -> list[ExpertHandle]:
        """Every expert, once all have landed, in the order asked (those iterated already
        included).

        Raises:
            As ``__anext__``, for the first expert that fails.
        """
        async for _ in self:
            pass
        return self._in_order()

    def release(self, after: After = None, *, ordered: bool = False) -> None:
        """Unpin the experts (again: nothing happens). Idempotent.

        Args:
            after: what the engine's compute on these experts was queued on: a stream
                (CuPy, torch, an int ``cudaStream_t``), an event it recorded, or a mapping
                from device index to either; None: each device's current CuPy stream.
                Buffers are reused only after it. Ignored on the host backend.
            ordered: ``after`` comes after every earlier use of these experts on its
                device (the engine computes on one stream per device, and no other lease
                of them is held elsewhere): their earlier events are replaced, not joined
                on a device stream (a join per expert saved).

        A miss still loading (a fetch cancelled part way) keeps its pin until it lands.

        Raises:
            UsageError: called from another thread than the session's loop (a
                ``SyncLease`` may be released from any thread).
        """
        if self._core.released:
            return
        self._session._on_loop()
        backends = self._session._core.backends

        def last_use(part: LeasePart) -> Event | None:
            target = after.get(part.device) if isinstance(after, Mapping) else after
            return event_after(backends[part.device], target)

        self._session._core.release(self._core, last_use, ordered=ordered)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    async def __aenter__(self) -> Lease:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self.released else f"{self.hits} hits, {self.misses} misses"
        return f"Lease(layer={self.layer}, experts={list(self.experts)}, {state})"


class Session:
    """An open model whose experts stream into the device cache while an engine decodes.

    Made by ``moestream.open``; ``await`` it or enter it with ``async with``. Every method
    runs on the event loop that opened it (from other threads, use ``open_sync``).
    """

    def __init__(self, core: StreamSession) -> None:
        """The face of ``core`` (not yet opened). ``open`` makes one; ``moestream.pipeline.cli.run``
        makes its own core, with what only the run has (its summary, fault plan,
        compute)."""
        self._core = core
        self._loop: asyncio.AbstractEventLoop | None = None
        self._model: ModelInfo | None = None
        self._tensor_index: dict[str, Any] | None = None
        self._drops: list[LayerLease] = []

    # -- lifetime --------------------------------------------------------------------------

    async def _open(self) -> Session:
        if self._loop is not None:
            return self
        await self._core.open()
        self._loop = asyncio.get_running_loop()
        assert self._core.table is not None
        self._model = ModelInfo.of(self._core.table)
        backends = self._core.backends
        self._core.default_last_use = lambda part: event_after(backends[part.device], None)
        return self

    def __await__(self) -> Generator[Any, None, Session]:
        return self._open().__await__()

    async def __aenter__(self) -> Session:
        return await self._open()

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if exc is None:
            await self.aclose()
        else:
            await self._core.aclose(outcome="cancelled" if isinstance(exc, asyncio.CancelledError)
                                   else str(exc) or type(exc).__name__)

    async def aclose(self) -> None:
        """Release every lease, finish or abandon loads in flight, free the device memory,
        close the log. Idempotent.

        Raises:
            VerificationError: an expert compared at close (a file without recorded
                digests) differs from the file.
            OutputError: the log's last lines could not be written.
        """
        await self._core.aclose()

    @property
    def closed(self) -> bool:
        return self._core.closed

    def _on_loop(self) -> None:
        """Refuse a lease's call from another thread than the session's loop (the sync
        face's calls run with that loop set as their thread's running loop)."""
        if _get_running_loop() is not self._loop:
            raise UsageError("a Lease is used from the event loop that opened its session; "
                             "from other threads use moestream.open_sync")

    def _here(self) -> None:
        """Refuse calls from anywhere but the session's own event loop."""
        if self._loop is None:
            raise UsageError("the session is not open yet: await moestream.open(...) first")
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is not self._loop:
            raise UsageError("a Session is used from the event loop that opened it; from "
                             "other threads use moestream.open_sync")

    # -- the model and the devices ---------------------------------------------------------

    @property
    def model(self) -> ModelInfo:
        if self._model is None:
            raise UsageError("the session is not open yet")
        return self._model

    @property
    def _table(self) -> ExpertTable:
        assert self._core.table is not None
        return self._core.table

    @property
    def backend(self) -> str:
        """``cupy`` (views are CuPy arrays) or ``host`` (numpy arrays)."""
        return self._core.backends[0].name if self._core.backends else "host"

    @property
    def devices(self) -> tuple[int, ...]:
        """The device numbers, in the order ``ExpertHandle.device`` indexes them."""
        return tuple(b.device for b in self._core.backends)

    @property
    def mode(self) -> str:
        """The I/O mode in force: ``direct`` or ``resident``."""
        return self._core.mode

    def read_tensor(self, name: str) -> bytearray:
        """The bytes of the non-routed tensor ``name`` (``model.tensors``), read from the
        model's files as the session identified them when it opened: the file is opened
        again only if its identity (device, inode, size, modification and change times) is
        the one the table was read from, and checked again after the read. A file renamed
        over, replaced or written meanwhile is never read: an engine loading its dense
        weights this way computes with the bytes of the files its experts come from.

        A blocking read (meant for load time), from any thread; it does not wait on the
        session's loop.

        Raises:
            UsageError: no such tensor, or the session is not open.
            ModelChangedError: the file changed since the session opened it.
            ModelFileError: it was cut short.
        """
        info = self._table_tensors().get(name)
        if info is None:
            raise UsageError(f"{name[:120]!r} is not a non-routed tensor of {self.model.path}")
        return self._table.read_bytes(info.offset, info.nbytes)

    def _table_tensors(self) -> Mapping[str, Any]:
        if self._tensor_index is None:
            self._tensor_index = {t.name: t for t in self._table.non_routed}
        return self._tensor_index

    def router(self, seed: int = 0) -> Router:
        """The model's own router on the first device (see ``Router``).

        Raises:
            ExpertLayoutError: the model has no F32 router tensors.
        """
        from moestream.pipeline.streaming.routing import LiveRouter

        self._here()
        home = self._core.backends[0]
        with home.activate():
            return LiveRouter(self._table, home, seed)

    # -- leases dropped unreleased ---------------------------------------------------------

    def _dropped(self, lease: LayerLease) -> None:
        """A lease whose last reference went away unreleased (on any thread, from a
        finalizer): warn, and release it at the session's next call or on its loop,
        whichever comes first."""
        warnings.warn(
            f"a lease of layer {lease.layer} (experts {list(lease.experts)}) was dropped "
            "without release; released now (release leases, or use a with block, once "
            "their compute is queued)", ResourceWarning, stacklevel=2)
        self._drops.append(lease)
        loop = self._loop
        if loop is not None and not loop.is_closed():
            # closed meanwhile: so is the session, which released it
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._release_drops)

    def _release_drops(self) -> None:
        while self._drops:
            lease = self._drops.pop()
            if not lease.released and not self._core.closed:
                self._core.release(lease, self._core.default_last_use, "dropped unreleased")

    def _abandon(self, made: LayerLease | None) -> None:
        """A fetch that raised (an interrupt, a failure) after pinning: release what it
        made, which its caller never got (``made``, or every lease without a face)."""
        orphans = [c for c in self._core.leases() if c.owner is None]
        for lease in orphans if made is None else [made]:
            self._core.release(lease, self._core.default_last_use, "its fetch was interrupted")

    def _pinned_by(self) -> str:
        """Who holds the pins, for a fetch that cannot fit."""
        held = sorted(self._core.leases(), key=lambda c: (c.fetched_at, c.layer))
        words = [f"layer {c.layer} experts {list(c.experts)} (fetched in token {c.fetched_at}"
                 + (", never used)" if c.on_use is not None else ")") for c in held]
        hinted = self._core.hinted_layers()
        loading = sum(1 for c in self._core.caches for e in c.entries()
                      if e.pins and e.loaded is not None and not e.loaded.done())
        return ("pins held by " + (f"{len(held)} leases: " + "; ".join(words) if held
                                   else "no lease")
                + (f", and prefetch hints of layers {hinted}" if hinted else "")
                + (f", and {loading} loads in flight (a released lease's misses keep their "
                   "pins until they land)" if loading else "")
                + " (release leases once their compute is queued; a lease used and still "
                  "held ends at end_token)")

    # -- experts ---------------------------------------------------------------------------

    def fetch(self, layer: Index, experts: ExpertIds) -> Lease:
        """Pin a layer's experts and start loading the misses; returns at once.

        Two fetches of one layer may be held at once: each pins its own experts, and an
        expert both ask for is loaded once and handed to both.

        Args:
            layer: a model layer index (one of ``model.moe_layers``).
            experts: distinct expert indices of that layer.

        Raises:
            UsageTypeError: ``layer`` or an expert is not an integer (an ``int`` or a numpy
                integer), or ``experts`` is not a list, tuple, range or 1-D integer array.
            UsageError: the session is closed, or called from another loop or thread; a
                layer that is not a MoE layer, an expert out of range or named twice; more
                pinned than the budget holds (the message names the leases, hints and
                loads in flight that hold the pins).
            DeviceMemoryError: the device refused memory even after the budget shrank.
        """
        self._here()
        return self._fetch(layer, experts)

    def _fetch(self, layer: Index, experts: ExpertIds) -> Lease:
        """``fetch`` once the caller's place was checked (the sync face's path)."""
        layer = index(layer, "layer")
        chosen = expert_ids(experts, layer)
        if self._drops:
            self._release_drops()
        core: LayerLease | None = None
        try:
            core = self._core.fetch(layer, chosen)
            core.fetched_at = self._core.token
            return Lease(self, core)
        except BaseException as exc:
            self._abandon(core)
            if isinstance(exc, UsageError) and "does not fit the cache budget" in str(exc):
                raise UsageError(f"{exc}: {self._pinned_by()}") from exc
            raise

    def ready(self, layer: Index, experts: ExpertIds) -> bool:
        """Whether every one of ``experts`` is cached on its device with its upload landed:
        a ``fetch`` of them now would load nothing and hand every one out at once. A
        query (no pin, no count): an engine that knows a later layer's experts can fetch
        it early when they are, while the device computes.

        Raises:
            UsageError: called from another loop or thread.
        """
        self._here()
        return self._ready(layer, experts)

    def _ready(self, layer: Index, experts: ExpertIds) -> bool:
        layer = index(layer, "layer")
        return self._core.all_ready(layer, expert_ids(experts, layer))

    def prefetch(self, layer: Index, experts: ExpertIds) -> int:
        """Hint: start loading experts a later layer will likely fetch (those not cached,
        as far as the budget has room). Held until the lease of that layer's next fetch
        is released (the guesses it did not ask for are then unpinned), or until the token
        ends if the layer is not fetched. Their reads count in the token's ``file_bytes``.
        Returns how many loads started.

        Raises:
            UsageError: as ``fetch``.
        """
        self._here()
        return self._prefetch(layer, experts)

    def _prefetch(self, layer: Index, experts: ExpertIds) -> int:
        layer = index(layer, "layer")
        chosen = expert_ids(experts, layer)
        if self._drops:
            self._release_drops()
        return self._core.prefetch(layer, chosen)

    async def end_token(self, *, compute_ms: float | Sequence[float] | None = None,
                        upload_ms: float = 0.0) -> TokenStats:
        """Mark a token boundary: verify what was loaded, let the controller look at the
        machine (auto mode), write the token's log line. Leases used during the token and
        still held are released (logged: release them before); a lease not used yet (a
        layer fetched ahead, for a later token) stays held until used and released.

        Args:
            compute_ms: the engine's own measure of its compute this token (the host's
                waits for its device work included), or one figure per device
                (``devices`` order) adding up to it, for the log's per-device lines.
                Given, the wall time neither it nor moestream's waits explain is ``host``
                in ``TokenStats.time``; None, that rest is counted as the engine's compute.
            upload_ms: the part of those device waits the engine's stream sat on expert
                upload events (``ExpertHandle.event``), charged to ``upload``.

        Raises:
            UsageError: the session is closed, or called from another loop or thread.
            VerificationError: an expert loaded during the token differs from the file.
            OutputError: the log file stopped taking lines.
        """
        self._here()
        engine_ms = self._engine_ms(compute_ms)
        upload = milliseconds(upload_ms, "upload_ms")
        if self._drops:
            self._release_drops()
        f = await self._core.end_token(compute_ms=engine_ms, upload_ms=upload)
        return TokenStats(
            token=f["token"], wall_ms=f["wall_ms"], stall_ms=f["stall_ms"],
            compute_ms=f["compute_ms"], hits=f["hits"], misses=f["misses"],
            evictions=f["evictions"], file_bytes=f["file_bytes"], cache_bytes=f["cache_bytes"],
            storage_bytes=f["storage_bytes"], mode=f["mode"],
            experts=tuple(tuple(layer) for layer in f["experts"]), time=f["time"],
            cpu_ms=f["cpu_ms"])

    def _engine_ms(self, compute_ms: object) -> float | list[float] | None:
        """``end_token``'s ``compute_ms``, checked: a number, or one per device."""
        if compute_ms is None:
            return None
        if isinstance(compute_ms, Sequence) and not isinstance(compute_ms, (str, bytes)):
            figures = [milliseconds(ms, "compute_ms (per device)") for ms in compute_ms]
            if len(figures) != len(self._core.backends):
                raise UsageError(f"compute_ms gives {len(figures)} figures for "
                                 f"{len(self._core.backends)} devices: give one per device "
                                 "(devices order), or one number")
            return figures if len(figures) > 1 else figures[0]
        if not isinstance(compute_ms, (int, float)):
            raise UsageTypeError(f"compute_ms must be a number of milliseconds or one per "
                                 f"device, not {type(compute_ms).__name__}")
        return milliseconds(compute_ms, "compute_ms")

    def counters(self) -> Counters:
        """Totals so far (a snapshot; cheap).

        Raises:
            UsageError: called from another loop or thread.
        """
        self._here()
        return self._counters()

    def _counters(self) -> Counters:
        if self._drops:  # a session call: what was dropped is released first (and counted)
            self._release_drops()
        core = self._core
        done, now = core.counters_now()
        cache, caches = core.cache, core.caches
        controller = core.controller
        return Counters(
            tokens=done.tokens, hits=done.hits + now.hits, misses=done.misses + now.misses,
            evictions=done.evictions + now.evictions,
            prefetched=sum(c.counters.prefetched for c in caches),
            file_bytes=done.file_bytes + now.file_bytes,
            cache_bytes=done.cache_bytes + now.cache_bytes, storage_bytes=done.storage_bytes,
            stall_ms=done.stall_ms + now.stall_ms, verified=done.verified,
            mismatches=done.mismatches, unverified=done.unverified, mode=core.mode,
            switches=controller.switches if controller is not None else 0,
            budget_bytes=cache.budget_bytes, live_bytes=cache.live_bytes,
            parked_bytes=cache.parked_bytes,
            peak_device_bytes=sum(c.counters.peak_device_bytes for c in caches),
            open_leases=core.open_leases)

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open" if self._loop else "not open"
        return f"Session({self._core.config.model}, {self.backend}, {state})"


def open(
    model: str | os.PathLike[str] | None = None,
    *,
    devices: int | Sequence[int] | None = None,
    budget: int | str | Budget | None = None,
    mode: Mode = "auto",
    policy: str = "lru",
    verify: bool = True,
    backend: str = "auto",
    log: str | os.PathLike[str] | None = None,
    tuning: Tuning | None = None,
) -> Session:
    """Open a model for streaming; ``await`` the result or use it with ``async with``.

    Args:
        model: a GGUF file; None makes (once) and uses the embedded tiny model.
        devices: a device index or several (experts are sharded over them); None: every
            visible device. On the host backend indices emulate devices.
        budget: the device cache, in experts or bytes: an int or its text (``2522`` or
            ``"2522"``: that many experts of the model's largest size), a size with its
            unit (``"20GiB"``, ``"11GB"``: bytes), or a ``Budget``; None holds every
            expert. Clamped (logged) to free device memory.
        mode: ``auto`` (the controller picks direct or resident from live RAM, and
            switches while running), ``direct`` (O_DIRECT) or ``resident`` (page cache).
        policy: eviction, ``lru`` or ``freq``.
        verify: digest every loaded expert on the device and compare with the file at
            each token's end (``end_token``).
        backend: ``auto`` (CuPy when a CUDA device answers), ``cupy`` or ``host``.
        log: a JSON-lines log in the run log's schema (``docs/LOG_SCHEMA.md``).
        tuning: rarely changed settings (``Tuning``).

    Raises:
        UsageError: a bad value (at once); or, when opened: no usable CUDA device for
            ``backend="cupy"``, a budget below ``Tuning.layers_in_flight`` layers.
        ModelFileError: (when opened) the model is not a usable GGUF MoE file.
        OutputError: (when opened) the log cannot be written.
        StageError: (when opened) a device or pinned allocation failed.
    """
    if model is not None and not isinstance(model, (str, os.PathLike)):
        raise UsageTypeError(f"model must be a path, not {type(model).__name__}")
    if log is not None and not isinstance(log, (str, os.PathLike)):
        raise UsageTypeError(f"log must be a path, not {type(log).__name__}")
    if not isinstance(verify, bool):
        raise UsageTypeError(f"verify must be True or False, not {verify!r}")
    if tuning is not None and not isinstance(tuning, Tuning):
        raise UsageTypeError(f"tuning must be a moestream.Tuning, not {type(tuning).__name__}")
    tuning = tuning or Tuning()
    chosen = devices_of(devices)
    choice(mode, "mode", ("auto", "direct", "resident"))
    choice(policy, "policy", ("lru", "freq"))
    choice(backend, "backend", ("auto", "cupy", "host"))
    route_unconfigured()
    cfg = RunConfig(
        # the embedded tiny model is this API's default, chosen here: never by the session
        model=Path(model) if model is not None else ensure_default_model(),
        budget=budget_of(budget),
        mode=mode, policy=policy, backend=backend,
        devices=chosen,
        queue_depth=tuning.queue_depth, chunk_bytes=tuning.chunk_bytes,
        staging_slots=tuning.staging_slots, upload_streams=tuning.upload_streams,
        gather=tuning.gather, gather_blocks=tuning.gather_blocks,
        verify=verify, log=Path(log) if log is not None else None,
        ram_limit=tuning.ram_limit, sample_ms=tuning.sample_ms,
        margin_bytes=tuning.margin_bytes, warmup=tuning.warmup, dwell_s=tuning.dwell_s,
        faults=tuning.faults,
    )
    return Session(StreamSession(cfg, layers_in_flight=tuning.layers_in_flight,
                                 sampler=tuning.sampler))
