"""The session's layer leases and prefetch hints: what an engine's fetches pin, what a
hint loads ahead, and the background reads they pause.

``LeaseDesk`` sits between the token accounting (``TokenLedger``, which its leases count
into) and ``StreamSession`` (which opens the parts it hands leases out of: the devices'
streamers, caches and event joiners, and the placement of experts on devices). All methods
run on the event loop's thread that opened the session.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import structlog

from moestream.gpu.backend import Event
from moestream.gpu.cache.store import DeviceCache, Entry
from moestream.pipeline.foundation.errors import UsageError
from moestream.pipeline.foundation.table import ExpertTable
from moestream.pipeline.streaming.lease import LayerLease
from moestream.pipeline.streaming.lease_parts import EventJoiner, LeasePart, unpin_when_landed
from moestream.pipeline.streaming.ledger import TokenLedger
from moestream.pipeline.streaming.loads import Arrivals, LayerLoad
from moestream.pipeline.streaming.streamer import ExpertStreamer

__all__ = ["LastUse", "LeaseDesk"]

_log = structlog.get_logger("moestream.session")

LastUse = Callable[[LeasePart], Event | None]
"""The event after which a released lease's buffers on a part's device may be reused."""

Hints = list[tuple[list[int], list[LeasePart]]]
"""A layer's prefetch hints: each one's guessed experts and the loads it started."""


class LeaseDesk(TokenLedger):
    """The leases and hints held now, and what their loads pause."""

    def __init__(self) -> None:
        super().__init__()
        self.table: ExpertTable | None = None
        self.closed = False
        self.streamers: list[ExpertStreamer] = []
        self.caches: list[DeviceCache] = []
        self._joiners: list[EventJoiner] = []
        self._place: Callable[[tuple[int, int]], int] = lambda key: 0
        self.default_last_use: LastUse = lambda part: None
        """What a lease released by the session itself (token end, close) ends with."""
        self._leases: set[LayerLease] = set()
        self._hints: dict[int, Hints] = {}
        self._guess_loads: dict[int, list[LayerLoad]] = {}  # a fetched layer's hints' loads
        self._hints_of: dict[LayerLease, Hints] = {}
        self._holds: set[int] = set()  # leases and hints whose loads pause the background
        self._background: Any = None  # the digest manifest's builder, while it reads
        self._hinted = False  # a prefetch was asked for: token lines carry ``prefetch``
        self._hinted_now: set[int] = set()  # layers hinted this token (carried over once)

    def _check_open(self) -> ExpertTable:
        if self.closed:
            raise UsageError("the session is closed")
        if self.table is None:
            raise UsageError("the session is not open yet")
        return self.table

    def _check_layer(self, layer: int, experts: Sequence[int]) -> list[int]:
        table = self._check_open()
        info = table.layers.get(layer)
        if info is None:
            raise UsageError(f"layer {layer} is not a MoE layer (MoE layers: "
                             f"{table.moe_layers[0]}..{table.moe_layers[-1]})")
        # the API's calls hand lists of ints (``moestream._args.expert_ids``): kept as given
        chosen = experts if type(experts) is list else [int(e) for e in experts]
        if chosen and not (min(chosen) >= 0 and max(chosen) < info.n_experts):
            bad = next(e for e in chosen if not 0 <= e < info.n_experts)
            raise UsageError(f"layer {layer} has experts 0..{info.n_experts - 1}, not {bad}")
        if len(set(chosen)) != len(chosen):
            raise UsageError(f"layer {layer}: experts {chosen} name one expert twice")
        return chosen

    def fetch(self, layer: int, experts: Sequence[int]) -> LayerLease:
        """Pin ``experts`` of ``layer`` on their devices and start loading the misses.

        The lease counts (hits, misses, bytes, the experts of the token's log line) when it
        is released, in the token it was used in: a layer fetched ahead, during the token
        before, counts in its own, and the counting runs while the engine's device
        computes, off the path between two layers. The hints made for ``layer`` go with
        the lease and end at its release (what it used of them it pins itself meanwhile).

        Raises:
            UsageError: the session is closed; ``layer`` is not a MoE layer; an expert is
                out of range or named twice; the pinned experts no longer fit the budget
                (more layers held at once than ``layers_in_flight``).
            DeviceMemoryError: the device refused memory even after the budget shrank.
        """
        chosen = self._check_layer(layer, experts)
        self._clock()
        for streamer in self.streamers:
            streamer.poll_installs()
        parts = self._start_parts(layer, chosen)
        lease = LayerLease(layer, tuple(chosen), parts, on_wait=self._waited,
                           on_use=self._clock, fetched_at=self._token)
        self._leases.add(lease)
        if self._background is not None and lease.misses:
            self._hold(lease)
        hints = self._hints.pop(layer, None)
        if hints is not None:
            self._hints_of[lease] = hints
            loads = self._guess_loads.setdefault(layer, [])
            for guess, hint_parts in hints:
                self._totals.correct += len(set(guess) & set(chosen))
                loads.extend(hint.load for hint in hint_parts)
        return lease

    def _start_parts(self, layer: int, experts: Sequence[int], *,
                     prefetch: bool = False) -> list[LeasePart]:
        """Start a layer's loads (``prefetch``: a hint's) on each device that holds some of
        ``experts``: a part each."""
        streamers, caches, joiners = self.streamers, self.caches, self._joiners
        if len(streamers) == 1:  # one device holds them all: no placement to ask
            streamer = streamers[0]
            load = streamer.start_layer(layer, experts, prefetch=prefetch)
            return [LeasePart(0, caches[0], joiners[0], load)]
        split: dict[int, list[int]] = {}
        for e in experts:
            split.setdefault(self._place((layer, e)), []).append(e)
        parts: list[LeasePart] = []
        arrived: Arrivals[tuple[Entry, BaseException | None]] = Arrivals()  # the lease's
        try:
            for device in sorted(split):
                streamer = streamers[device]
                load = streamer.start_layer(layer, split[device],
                                            None if prefetch else arrived, prefetch=prefetch)
                parts.append(LeasePart(device, caches[device], joiners[device], load))
        except BaseException:
            # a later device refused (budget, memory): the earlier ones keep no pins
            for part in parts:
                for entry in (*part.load.plan.hits, *part.load.plan.misses):
                    unpin_when_landed(part, entry)
            raise
        return parts

    def _hold(self, owner: object) -> None:
        """``owner``'s loads are decode's: background reads (the digest manifest's builder)
        pause until it ends (``_unhold``)."""
        if id(owner) not in self._holds:
            self._holds.add(id(owner))
            self._background.pause()

    def _unhold(self, owner: object) -> None:
        if id(owner) in self._holds:
            self._holds.discard(id(owner))
            self._background.resume()

    def use_cached(self, calls: Sequence[tuple[int, Sequence[int]]]
                   ) -> list[tuple[int, list[int]]]:
        """Count each call's ``experts`` of its ``layer``, an engine's compute on them over,
        as a lease of them would be counted from its fetch to its release, with no lease:
        when the session has one device, no hint of the layer is pending and every one is
        cached and landed (``SyncSession.used``'s common case: a budget that holds every
        expert). One pass over a token's calls: the engine tells them at its end, and a
        call a layer there would cost more than the counting does.

        Returns:
            The calls not counted (checked: a list of ints each), in order: each needs a
            lease.

        Raises:
            UsageError: as ``fetch`` (before anything is counted).
        """
        checked = [(layer, self._check_layer(layer, experts)) for layer, experts in calls]
        if len(self.caches) != 1:
            return checked
        cache, hints = self.caches[0], self._hints
        rest: list[tuple[int, list[int]]] = []
        self._clock()
        for layer, chosen in checked:
            used = None if layer in hints else cache.use_hits(layer, chosen)
            if used is None:
                rest.append((layer, chosen))
            else:
                self._count_hits(layer, chosen, *used)
        return rest

    def in_place(self, layer: int, experts: Sequence[int]
                 ) -> tuple[Any, list[tuple[int, ...]], list[tuple[int, ...]]] | None:
        """Where ``experts`` of ``layer`` lie for the device to read in place, and the
        mapping that holds them (``RegisteredLayers.in_place``); None with several devices
        or where they cannot be read so now.

        Raises:
            UsageError: as ``fetch``.
        """
        chosen = self._check_layer(layer, experts)
        if len(self.streamers) != 1:
            return None
        return self.streamers[0].in_place([(layer, e) for e in chosen])

    def in_place_current(self, mapping: Any) -> bool:
        """Whether addresses ``in_place`` gave within ``mapping`` may still be read."""
        return (len(self.streamers) == 1 and self.streamers[0].mode == "resident"
                and self.streamers[0].mapping is mapping)

    def use_in_place(self, layer: int, experts: Sequence[int]) -> None:
        """Count ``experts`` of ``layer``, read in place by an engine's compute (addresses
        from ``in_place``): misses whose bytes were read from the file's pages, each once in
        the token; nothing loaded, pinned or evicted.

        Raises:
            UsageError: as ``fetch``.
        """
        chosen = self._check_layer(layer, experts)
        self._clock()
        self._count_in_place(layer, chosen, self._check_open().layers[layer].expert_bytes)

    def all_ready(self, layer: int, experts: Sequence[int]) -> bool:
        """Every one of ``experts`` is cached on its device and its upload has landed: a
        lease of them now would load nothing and wait for nothing."""
        caches, place = self.caches, self._place
        keys = [(layer, int(e)) for e in experts]
        found = (caches[0].get_many(keys) if len(caches) == 1
                 else [caches[place(key)].get(key) for key in keys])
        for entry in found:
            if entry is None:
                return False
            if entry.ready:
                continue
            # landed (a lease's miss or a hint, this token) but not yet marked: a lease
            # hands it out at once, as ``LayerLease`` does
            loaded = entry.loaded
            if loaded is not None and (not loaded.done() or loaded.cancelled()
                                       or loaded.exception() is not None):
                return False
        return True

    def prefetch(self, layer: int, experts: Sequence[int]) -> int:
        """Start loading guessed experts of a later layer: those not cached, if they fit.

        Held until the lease of that layer's next fetch is released, or until the token
        ends if the layer is not fetched. Returns the loads started (their reads count in
        this token's ``file_bytes``, their evictions in its ``evictions``).

        Raises:
            UsageError: as ``fetch``.
        """
        chosen = self._check_layer(layer, experts)
        self._clock()
        parts = self._start_parts(layer, chosen, prefetch=True)
        self._hints.setdefault(layer, []).append((chosen, parts))
        self._hinted_now.add(layer)
        self._hinted = True
        started = sum(len(p.load.plan.misses) for p in parts)
        if started and self._background is not None:
            self._hold(parts)
        totals = self._totals
        totals.predicted += len(chosen)
        totals.loaded += started
        totals.file_bytes += sum(e.nbytes for p in parts for e in p.load.plan.misses)
        totals.evictions += sum(p.load.plan.evicted for p in parts)
        return started

    def release(self, lease: LayerLease, last_use: LastUse, reason: str = "", *,
                ordered: bool = False) -> None:
        """Release ``lease`` (idempotent); see ``LayerLease.release``."""
        lease.release(last_use, reason, ordered=ordered)
        if lease not in self._leases:
            return  # released before
        self._leases.discard(lease)
        self._count(lease)
        self._unhold(lease)
        for _, parts in self._hints_of.pop(lease, ()):  # its layer's hints end with it
            self._end_hint(parts, lease.experts)

    def _end_hint(self, parts: Sequence[LeasePart], used: Sequence[int] = ()) -> None:
        """Unpin a hint's loads (each once it has landed); those ``used`` by no fetch were
        wasted reads."""
        for hint in parts:
            guessed = hint.load.plan.misses
            self._totals.wasted_bytes += sum(e.nbytes for e in guessed if e.key[1] not in used)
            for entry in guessed:
                unpin_when_landed(hint, entry)
        self._unhold(parts)

    def _waited(self, entry: Entry | None, load: LayerLoad | None, start: float,
                end: float) -> None:
        """The engine waited for an expert: a stall, charged to what its load was doing
        (``foundation.timesplit``); a load the session did not start for it counts as read."""
        totals = self._totals
        totals.stall_ms += (end - start) * 1000.0
        phases = None
        if entry is not None:
            if self._devices:
                self._devices[self._place(entry.key)].stall_ms += (end - start) * 1000.0
            # the lease's own load, or the hint that loads it
            for loading in (load, *self._guess_loads.get(entry.key[0], ())):
                phases = loading.phases.get(entry.key) if loading is not None else None
                if phases is not None:
                    break
        if phases is not None:
            charged_ms = phases.charge(totals.time, start, end)
            # the part of the wait its load's phases leave as ``host`` (its launch not yet
            # begun, its arrival's hop to the engine): a stall all the same, never compute
            self._unexplained_ms += (end - start) * 1000.0 - charged_ms
        else:
            totals.time.charge("read", end - start)

    def _drop_hints(self, *, carry: bool = False) -> None:
        """End the hints no fetch took; with ``carry`` (a token's end) those made during
        this token are kept for the next one (a hint for the next token's first layers)."""
        kept = {n: self._hints[n] for n in self._hinted_now if n in self._hints} if carry else {}
        for layer, hints in self._hints.items():
            if layer not in kept:
                for _, parts in hints:
                    self._end_hint(parts)
        self._hints = kept
        self._hinted_now = set()
        self._guess_loads.clear()

    def _release_used(self) -> None:
        """A token's end: release the leases used during it; one not used yet (a later
        layer fetched ahead, across the boundary) stays held for its own token."""
        for lease in list(self._leases):  # a pin never outlives the token it was used in
            if lease.on_use is not None:
                continue  # fetched ahead for a later token, not used yet
            _log.warning("lease_released_at_token_end", layer=lease.layer, token=self._token,
                         hint="release leases (a with block) before end_token")
            self.release(lease, self.default_last_use, "at the end of its token")
        self._drop_hints(carry=True)

    def _release_all(self, reason: str) -> None:
        """Release every lease and hint (the session is closing)."""
        for lease in list(self._leases):
            self.release(lease, self.default_last_use, reason)
        self._drop_hints()

    async def _stop_launchers(self) -> None:
        """Cancel the loads still waiting for staging slots, and wait for them to stop."""
        tasks = [task for streamer in self.streamers for task in streamer.launchers]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task

    @property
    def open_leases(self) -> int:
        return len(self._leases)

    def leases(self) -> list[LayerLease]:
        """The leases held now (not released), in no particular order."""
        return list(self._leases)

    def hinted_layers(self) -> list[int]:
        """The layers whose prefetch hints are held now (pinned until used or ended)."""
        return sorted(self._hints)
