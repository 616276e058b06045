"""The asynchronous API's session: ``fetch`` a layer's experts, ``end_token``, ``close``.

``Session`` is a thin face over ``pipeline.streaming.session.StreamSession`` (the parts) and
``pipeline.streaming.lease.LayerLease`` (pins and arrivals, behind ``Lease``); it checks where
it is called from, builds handles and reports counters in public types. ``moestream.open``
(``moestream._open``) makes one.
"""

from __future__ import annotations

import asyncio
import contextlib
import warnings
import weakref
from collections.abc import Callable, Generator, Mapping, Sequence
from types import TracebackType
from typing import Any, Self, TypeVar

from moestream._args import ExpertIds, Index, engine_ms, expert_ids, index, milliseconds
from moestream._handles import InPlace, LeaseShared
from moestream._lease import After, Lease, LeaseBase, pins_held
from moestream._model_info import ModelInfo, Router
from moestream._stats import Counters, TokenStats, counters_of, token_stats
from moestream.gpu.interop import event_after
from moestream.pipeline.foundation.errors import UsageError
from moestream.pipeline.foundation.table import ExpertTable
from moestream.pipeline.streaming.lease import LayerLease
from moestream.pipeline.streaming.session import StreamSession

__all__ = ["Session"]

L = TypeVar("L", bound=LeaseBase)


class Session:
    """An open model whose experts stream into the device cache while an engine decodes.

    Made by ``moestream.open``; ``await`` it or enter it with ``async with``. Every method
    runs on the event loop that opened it (from other threads, use ``open_sync``).
    """

    def __init__(self, streaming: StreamSession) -> None:
        """The face of ``streaming`` (not yet opened): ``open`` makes one (``open_config``
        a ``RunSession``)."""
        self._streaming = streaming
        self._loop: asyncio.AbstractEventLoop | None = None
        self._model: ModelInfo | None = None
        self._tensor_index: dict[str, Any] | None = None
        self._drops: list[LayerLease] = []

    # -- lifetime --------------------------------------------------------------------------

    async def _open(self) -> Self:
        if self._loop is not None:
            return self
        await self._streaming.open()
        self._loop = asyncio.get_running_loop()
        assert self._streaming.table is not None
        self._model = ModelInfo.of(self._streaming.table)
        backends = self._streaming.backends
        self._streaming.default_last_use = lambda part: event_after(backends[part.device], None)
        return self

    def __await__(self) -> Generator[Any, None, Self]:
        return self._open().__await__()

    async def __aenter__(self) -> Self:
        return await self._open()

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if exc is None:
            await self.aclose()
        else:
            cancelled = isinstance(exc, asyncio.CancelledError)
            await self._streaming.aclose(outcome="cancelled" if cancelled
                                         else str(exc) or type(exc).__name__)

    async def aclose(self) -> None:
        """Release every lease, finish or abandon loads in flight, free the device memory,
        close the log. Idempotent.

        Raises:
            VerificationError: an expert compared at close (a file without recorded
                digests) differs from the file.
            OutputError: the log's last lines could not be written.
        """
        await self._streaming.aclose()

    @property
    def closed(self) -> bool:
        return self._streaming.closed

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
        assert self._streaming.table is not None
        return self._streaming.table

    @property
    def backend(self) -> str:
        """``cupy`` (views are CuPy arrays) or ``host`` (numpy arrays)."""
        return self._streaming.backends[0].name if self._streaming.backends else "host"

    @property
    def devices(self) -> tuple[int, ...]:
        """The device numbers, in the order ``ExpertHandle.device`` indexes them."""
        return tuple(b.device for b in self._streaming.backends)

    @property
    def mode(self) -> str:
        """The I/O mode in force: ``direct`` or ``resident``."""
        return self._streaming.mode

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

    def read_header(self) -> bytearray:
        """The bytes of a GGUF model's header (magic, metadata, tensor table: everything
        before its tensor data; of a split model, its first shard's, which holds the
        metadata and lists that shard's tensors), read as ``read_tensor`` reads, from the
        file as the session identified it: an engine building its config or tokenizer from
        these bytes builds them from the file its experts come from, never from whatever
        the path names later.

        Raises:
            UsageError: the model is a checkpoint (its ``config.json`` is ``model.config``),
                or the session is not open.
            ModelChangedError: the file changed since the session opened it.
            ModelFileError: it was cut short.
        """
        table = self._table
        if not table.header_bytes:
            raise UsageError(f"{self.model.path} is not a GGUF file: a checkpoint's config "
                             "is model.config")
        return table.read_bytes(0, table.header_bytes)

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
        home = self._streaming.backends[0]
        with home.activate():
            return LiveRouter(self._table, home, seed)

    # -- leases dropped unreleased ---------------------------------------------------------

    def _dropped(self, lease: LayerLease) -> None:
        """A lease whose last reference went away unreleased (on any thread, from a
        finalizer): warn, and release it at the session's next call or on its loop,
        whichever comes first."""
        self._drops.append(lease)  # first: an interrupt in the warning must not lose it
        warnings.warn(
            f"a lease of layer {lease.layer} (experts {list(lease.experts)}) was dropped "
            "without release; released now (release leases, or use a with block, once "
            "their compute is queued)", ResourceWarning, stacklevel=2)
        loop = self._loop
        if loop is not None and not loop.is_closed():
            # closed meanwhile: so is the session, which released it
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._release_drops)

    def _sweep_drops(self) -> None:
        """Release the dropped leases, those no finalizer told of too: a signal handler
        that raises (a timer's KeyboardInterrupt) can land on a finalizer's first line,
        and Python then drops what it had left to do. Run where a token ends and where
        counters are read, so that a pin so lost is held a token at most."""
        if self._drops:
            self._release_drops()
        lost = [lease for lease in self._streaming.leases()
                if lease.face is not None and lease.face() is None]
        for lease in lost:
            self._dropped(lease)
        if lost:
            self._release_drops()

    def _release_drops(self) -> None:
        while self._drops:
            lease = self._drops.pop()
            streaming = self._streaming
            if not lease.released and not streaming.closed:
                streaming.release(lease, streaming.default_last_use, "dropped unreleased")

    def _abandon(self, made: LayerLease | None) -> None:
        """A fetch that raised (an interrupt, a failure) after pinning: release what it
        made, which its caller never got (``made``, or every lease without a face)."""
        streaming = self._streaming
        orphans = [c for c in streaming.leases() if c.owner is None]
        for lease in orphans if made is None else [made]:
            streaming.release(lease, streaming.default_last_use, "its fetch was interrupted")

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
        return self._fetch(layer, experts, Lease)

    def _ran(self, after: After) -> bool:
        """Whether the engine's compute that ``after`` names (as ``Lease.release`` takes it)
        has run, on a session of one device: its event complete, or the host backend's."""
        backends = self._streaming.backends
        if len(backends) != 1:
            return False
        if backends[0].name == "host":
            return True
        target = after.get(0) if isinstance(after, Mapping) else after
        if target is None:
            return False
        event = event_after(backends[0], target)
        return event is None or event.done()

    def _use_cached(self, calls: list[tuple[Index, ExpertIds]]) -> list[tuple[int, list[int]]]:
        """``SyncSession.used`` of a token's calls with no lease where it can
        (``LeaseDesk.use_cached``: every expert of a call cached and landed), once the
        engine's compute on them has run (``_ran``): nothing to pin, no last use to record.
        Returns the calls that need a lease (checked)."""
        checked = [(layer := index(raw, "layer"), expert_ids(experts, layer))
                   for raw, experts in calls]
        if self._drops:
            self._release_drops()
        return self._streaming.use_cached(checked)

    def _fetch(self, layer: Index, experts: ExpertIds,
               face: Callable[[LayerLease, LeaseShared, StreamSession,
                               asyncio.AbstractEventLoop], L]) -> L:
        """``fetch`` once the caller's place was checked, its lease made by ``face``
        (``Lease``; ``SyncLease`` on the sync face's path)."""
        layer = index(layer, "layer")
        chosen = expert_ids(experts, layer)
        if self._drops:
            self._release_drops()
        layer_lease: LayerLease | None = None
        try:
            layer_lease = self._streaming.fetch(layer, chosen)
            table, loop = self._streaming.table, self._loop
            assert table is not None and loop is not None  # open: the fetch checked
            shared = LeaseShared(layer_lease, self._streaming.backends, table.layers[layer],
                                 self._dropped)
            lease = face(layer_lease, shared, self._streaming, loop)
            # the session, not the lease: the layer lease must not keep its face alive
            layer_lease.owner, layer_lease.face = self, weakref.ref(shared)
            return lease
        except BaseException as exc:
            self._abandon(layer_lease)
            if isinstance(exc, UsageError) and "does not fit the cache budget" in str(exc):
                raise UsageError(f"{exc}: {pins_held(self._streaming)}") from exc
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
        return self._streaming.all_ready(layer, expert_ids(experts, layer))

    def _in_place(self, layer: Index, experts: ExpertIds) -> InPlace | None:
        layer = index(layer, "layer")
        found = self._streaming.in_place(layer, expert_ids(experts, layer))
        if found is None:
            return None
        mapping, rows, sizes = found
        return InPlace(layer, tuple(rows), tuple(sizes), mapping)

    def _in_place_current(self, view: InPlace) -> bool:
        return self._streaming.in_place_current(view.mapping)

    def _used_in_place(self, calls: list[tuple[Index, ExpertIds]]) -> None:
        if self._drops:
            self._release_drops()
        for layer, experts in calls:
            at = index(layer, "layer")
            self._streaming.use_in_place(at, expert_ids(experts, at))

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
        return self._streaming.prefetch(layer, chosen)

    async def end_token(self, *, compute_ms: float | Sequence[float] | None = None,
                        upload_ms: float = 0.0, wall_ms: float | None = None) -> TokenStats:
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
            wall_ms: the token's wall time as the engine measured it, for an engine that
                ends a token after it ran (a token whose device work it does not wait for
                at once: a session told of it only at its end would time the token from
                that telling). None: from the token's first fetch, hint or use to this
                call.

        Raises:
            UsageError: the session is closed, or called from another loop or thread.
            VerificationError: an expert loaded during the token differs from the file.
            OutputError: the log file stopped taking lines.
        """
        self._here()
        engine = engine_ms(compute_ms, len(self._streaming.backends))
        upload = milliseconds(upload_ms, "upload_ms")
        wall = None if wall_ms is None else milliseconds(wall_ms, "wall_ms")
        self._sweep_drops()
        f = await self._streaming.end_token(compute_ms=engine, upload_ms=upload, wall_ms=wall)
        return token_stats(f)

    def counters(self) -> Counters:
        """Totals so far (a snapshot; cheap).

        Raises:
            UsageError: called from another loop or thread.
        """
        self._here()
        return self._counters()

    def _counters(self) -> Counters:
        self._sweep_drops()  # a session call: what was dropped is released first (and counted)
        return counters_of(self._streaming)

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open" if self._loop else "not open"
        return f"Session({self._streaming.config.model}, {self.backend}, {state})"
