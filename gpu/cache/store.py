"""The per-(layer, expert) device cache with a byte-accurate budget.

Decisions (hit, miss, which key to evict) are made by ``gpu.cache.policy.CacheIndex``; this module
holds the buffers behind them. The contract:

- live entry bytes + bytes parked in the pool never exceed the budget, counted at each
  entry's real size (the ds4 lesson: counting "entries x nominal size" let a 100 GB budget
  reach ~121 GB);
- an entry is visible to compute only through its upload event: compute streams wait on
  it, and the entry is marked ready once the event has completed;
- an entry pinned by the layer being computed (or by a load in flight) is never evicted;
- a buffer that is evicted or recycled is not overwritten before the last compute that
  read it has finished (its ``last_use`` event);
- when the device refuses an allocation (out of memory), the budget shrinks to the bytes
  the cache holds at that moment (the device evidently holds those), the figures are
  logged (``device_oom_budget_shrunk``), and the layer is planned once more; a second
  refusal, or a shrunk budget below one layer's experts, raises ``DeviceMemoryError``.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Iterable, Sequence

import structlog

from moestream.gpu.backend import Backend, DeviceBuffer, Event
from moestream.gpu.cache.entries import CacheCounters, Entry, LayerPlan
from moestream.gpu.cache.policy import CacheIndex, ExpertKey, make_policy
from moestream.gpu.cache.pool import BufferPool
from moestream.pipeline.foundation.errors import DeviceMemoryError, UsageError
from moestream.pipeline.foundation.faults import FaultPlan
from moestream.pipeline.foundation.sizes import size_text

__all__ = ["CacheCounters", "DeviceCache", "Entry", "LayerPlan"]

_log = structlog.get_logger("moestream.cache")


class DeviceCache:
    """Experts on the device under a byte budget.

    Args:
        backend: allocates device buffers.
        budget_bytes: the most device bytes entries and parked buffers may hold.
        policy: eviction policy name (``lru`` or ``freq``).
        min_bytes: one layer's worth of experts; a smaller budget cannot decode.
        faults: injected faults (``device_oom``; tests and ``--inject`` only).
    """

    def __init__(
        self,
        backend: Backend,
        budget_bytes: int,
        policy: str = "lru",
        *,
        min_bytes: int = 0,
        faults: FaultPlan | None = None,
    ) -> None:
        free = backend.device_free_bytes()
        if budget_bytes > free:
            _log.warning(
                "budget_clamped", budget_bytes=budget_bytes, device_free_bytes=free,
                reason="budget larger than free device memory",
            )
            budget_bytes = free
        if budget_bytes < min_bytes:  # the session checked the budget asked: it was cut
            raise UsageError(
                f"cache budget of {size_text(budget_bytes)}"
                f"{' (cut to the free device memory)' if budget_bytes == free else ''} cannot "
                f"hold one layer's top-k experts for each layer in flight, "
                f"{size_text(min_bytes)}: free device memory, or pin fewer layers at once"
            )
        self._backend = backend
        self._min_bytes = min_bytes
        self._index = CacheIndex(budget_bytes, make_policy(policy))
        self._entries: dict[ExpertKey, Entry] = {}
        self._pinned: set[ExpertKey] = set()
        self.pool = BufferPool(backend, faults)
        self.counters = CacheCounters()

    @property
    def budget_bytes(self) -> int:
        return self._index.capacity_bytes

    @property
    def live_bytes(self) -> int:
        return self._index.live_bytes

    @property
    def device(self) -> int:
        return self._backend.device

    @property
    def parked_bytes(self) -> int:
        return self.pool.parked_bytes

    @property
    def device_bytes(self) -> int:
        """Bytes of device memory held: live entries plus parked buffers."""
        return self._index.live_bytes + self.pool.parked_bytes

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def get(self, key: ExpertKey) -> Entry | None:
        return self._entries.get(key)

    def get_many(self, keys: Iterable[ExpertKey]) -> list[Entry | None]:
        """``get`` of each of ``keys``, in one call (a layer's, checked between kernels)."""
        held = self._entries
        return [held.get(key) for key in keys]

    def entries(self) -> list[Entry]:
        """Every entry held now, ready or still loading (a snapshot)."""
        return list(self._entries.values())

    def plan_layer(self, keys: Sequence[ExpertKey], sizes: Sequence[int]) -> LayerPlan:
        """Look up a layer's experts, reserve buffers for its misses, pin all of them.

        Misses get an entry at once (so a second request for the key finds it in flight and
        waits on ``entry.loaded`` instead of reading again), but are ready only after their
        upload. If the device refuses an allocation, the lookup's reservations are undone,
        the budget shrinks to what the cache holds (logged) and the layer is planned again,
        once.

        Raises:
            DeviceMemoryError: the device refused again after the shrink, or the shrunk
                budget cannot hold one layer's experts. Nothing of the lookup remains.
        """
        plan = self._plan_hits(keys)
        if plan is not None:
            return plan
        try:
            return self._plan_layer(keys, sizes)
        except DeviceMemoryError as exc:
            self._shrink_to_held(exc, sum(sizes))
        return self._plan_layer(keys, sizes)

    def _plan_hits(self, keys: Sequence[ExpertKey]) -> LayerPlan | None:
        """The all-hit layer (the common case once warm), planned without the miss
        machinery; None when a key is not held. The same decisions, pins and counters as
        ``_plan_layer`` makes for such a layer: each key a use for the policy, in order."""
        hits = self._held(keys)
        if hits is None:
            return None
        self._hit(keys, hits)
        pinned = self._pinned
        for entry in hits:
            entry.pins += 1
            pinned.add(entry.key)
        return LayerPlan(hits)

    def use_hits(self, layer: int, experts: Sequence[int]) -> tuple[list[Entry], int] | None:
        """A layer's experts an engine computed on with no lease, every one held and
        landed, and its compute on them over: the same uses for the policy and counters as
        a plan of them (``plan_layer``) and their release would make, with no pin taken
        and given back, and no last use to record. Their entries and bytes; None, nothing
        done, when one is not held or not landed."""
        keys = [(layer, expert) for expert in experts]
        hits = self._held(keys, landed=True)
        if hits is None:
            return None
        return hits, self._hit(keys, hits)

    def _held(self, keys: Sequence[ExpertKey], *, landed: bool = False) -> list[Entry] | None:
        """The entries of ``keys``, all held (and, with ``landed``, all installed); None
        where one is not."""
        entries = self._entries
        hits: list[Entry] = []
        for key in keys:
            entry = entries.get(key)
            if entry is None or (landed and not entry.ready):
                return None
            hits.append(entry)
        return hits

    def _hit(self, keys: Sequence[ExpertKey], hits: Sequence[Entry]) -> int:
        """``keys``, all held (``hits``): each a use for the policy, in order, counted (a
        hit holds no more device memory: the peak stands). Returns their bytes."""
        self._index.used(keys)
        nbytes = sum(entry.nbytes for entry in hits)
        c = self.counters
        c.lookups += len(hits)
        c.hits += len(hits)
        c.bytes_from_cache += nbytes
        return nbytes

    def _plan_layer(self, keys: Sequence[ExpertKey], sizes: Sequence[int]) -> LayerPlan:
        outcome = self._index.access_layer(keys, sizes, self._pinned)
        entries, pinned = self._entries, self._pinned
        plan = LayerPlan(evicted=len(outcome.evicted))
        # a victim's buffer goes straight to a miss of its size (what parking it and
        # popping it again would do: the pool hands out the last parked first); before
        # anything is allocated they are parked, where the budget counts them
        freed: dict[int, list[tuple[DeviceBuffer, Event | None]]] = {}
        for key in outcome.evicted:
            victim = entries.pop(key)
            freed.setdefault(victim.nbytes, []).append((victim.buffer, victim.last_use))
        misses = plan.misses
        file_bytes = 0
        try:
            if outcome.refused:
                raise UsageError(f"expert {outcome.refused[0]} does not fit the cache budget")
            size_of = dict(zip(keys, sizes, strict=True))
            for key in outcome.misses:
                size = size_of[key]
                spare = freed.get(size)
                if spare:
                    buffer, reuse_after = spare.pop()
                else:
                    self._park(freed)
                    buffer, reuse_after = self._buffer_for(size)
                entry = Entry(key, buffer, size, reuse_after)
                entry.pins = 1
                entries[key] = entry
                pinned.add(key)
                misses.append(entry)
                file_bytes += size
        except BaseException:
            self._park(freed)
            for key in outcome.misses:
                if key in entries:
                    self.drop(key)
                elif key in self._index:  # admitted, but no buffer was reserved for it
                    self._index.remove(key)
            raise
        self._park(freed)
        hits = plan.hits
        cache_bytes = 0
        for key in outcome.hits:
            entry = entries[key]
            hits.append(entry)
            entry.pins += 1
            pinned.add(key)
            cache_bytes += entry.nbytes
        c = self.counters
        c.lookups += len(keys)
        c.hits += len(hits)
        c.misses += len(misses)
        c.evictions += plan.evicted
        c.bytes_from_cache += cache_bytes
        c.bytes_from_file += file_bytes
        c.peak_device_bytes = max(c.peak_device_bytes, self.device_bytes)
        return plan

    def _park(self, freed: dict[int, list[tuple[DeviceBuffer, Event | None]]]) -> None:
        """Victims' buffers no miss took: into the pool, as evicted buffers go."""
        for spare in freed.values():
            for buffer, last_use in spare:
                self.pool.park(buffer, last_use)
        freed.clear()

    def prefetch(self, keys: Sequence[ExpertKey], sizes: Sequence[int]) -> LayerPlan:
        """Admit guessed experts ahead of their layer: only the absent ones, only if room.

        Not a lookup (no hit or miss is counted); admission evicts by the same policy and
        never touches pinned entries or the guessed keys already held. The new entries are
        pinned until released, like a layer's. A guess that does not fit, or whose buffer
        the device refuses, is simply not prefetched.
        """
        plan = LayerPlan()
        guessed = set(keys)
        for key, size in zip(keys, sizes, strict=True):
            if key in self._index:
                continue
            admitted, evicted = self._index.admit(key, size, self._pinned | guessed)
            if not admitted:
                continue
            for victim_key in evicted:
                victim = self._entries.pop(victim_key)
                self.pool.park(victim.buffer, victim.last_use)
            plan.evicted += len(evicted)
            try:
                buffer, reuse_after = self._buffer_for(size)
            except DeviceMemoryError:
                self._index.remove(key)
                break
            entry = Entry(key, buffer, size, reuse_after=reuse_after, pins=1)
            self._entries[key] = entry
            self._pinned.add(key)
            plan.misses.append(entry)
        c = self.counters
        c.evictions += plan.evicted
        c.prefetched += len(plan.misses)
        c.bytes_prefetched += sum(e.nbytes for e in plan.misses)
        c.peak_device_bytes = max(c.peak_device_bytes, self.device_bytes)
        return plan

    def _shrink_to_held(self, exc: DeviceMemoryError, layer_bytes: int) -> None:
        """The device is full: hold no more than now (live + parked), or give up."""
        old = self.budget_bytes
        held = self.device_bytes
        try:
            free: int | None = self._backend.device_free_bytes()
        except Exception:  # only a figure for the log; the decision does not use it
            free = None
        figures = {"old_budget_bytes": old, "new_budget_bytes": held,
                   "live_bytes": self.live_bytes, "parked_bytes": self.pool.parked_bytes,
                   "layer_bytes": layer_bytes, "min_bytes": self._min_bytes,
                   "device_free_bytes": free, "reason": str(exc)}
        if held < max(self._min_bytes, 1) or held >= old:
            _log.error("device_oom_fatal", **figures)
            raise DeviceMemoryError(
                f"{exc}; the cache holds {held} bytes and cannot shrink to fit "
                f"(one layer needs {self._min_bytes} bytes, budget was {old})"
            ) from exc
        _log.warning("device_oom_budget_shrunk", **figures,
                     action="continue with the smaller budget")
        self.resize(held)
        self.counters.budget_shrinks += 1

    def _buffer_for(self, nbytes: int) -> tuple[DeviceBuffer, Event | None]:
        """A parked buffer of this size, or a new one after trimming the pool to fit."""
        # live already includes this entry (the index admitted it): parked must fit the rest
        index = self._index
        try:
            return self.pool.take(nbytes, index.capacity_bytes - index.live_bytes)
        finally:  # a refusal may have freed parked buffers first
            self.counters.allocations = self.pool.allocations
            self.counters.frees = self.pool.frees

    def release(self, entries: Sequence[Entry], last_use: Event | None) -> None:
        """Unpin a layer's entries after its compute was queued; ``last_use`` ends it.
        An entry the cache no longer holds (dropped: its key may belong to a new entry,
        whose pins are not ours to take) is left as it is."""
        held = self._entries
        for entry in entries:
            if held.get(entry.key) is not entry:
                continue
            entry.pins -= 1
            if last_use is not None:
                entry.last_use = last_use
            if entry.pins == 0:
                self._pinned.discard(entry.key)

    def release_guess(self, entries: Sequence[Entry]) -> None:
        """Unpin prefetched entries that their layer did not use. One still loading keeps
        its pin until its load lands, then ends with its upload event: its buffer is never
        handed to another expert while a read or copy still writes into it."""
        for entry in entries:
            if entry.loaded is None or entry.loaded.done():
                self.release([entry], entry.upload)
            else:
                entry.loaded.add_done_callback(functools.partial(self._guess_landed, entry))

    def _guess_landed(self, entry: Entry, _loaded: asyncio.Future[None]) -> None:
        if self._entries.get(entry.key) is entry:  # a failed guess was dropped already
            self.release([entry], entry.upload)

    def mark_ready(self, entries: Iterable[Entry]) -> int:
        """Their upload events have completed: compute need not wait on them any more.
        Entries the cache no longer holds (dropped, their key reloaded) are left as they
        are; returns how many were marked."""
        held = self._entries
        marked = 0
        for entry in entries:
            if held.get(entry.key) is entry:
                entry.ready = True
                marked += 1
        return marked

    def drop(self, key: ExpertKey) -> None:
        """Forget ``key`` (a failed load): its buffer goes back to the pool, never installed."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return
        if key in self._index:
            self._index.remove(key)
        self._pinned.discard(key)
        self.pool.park(entry.buffer, entry.last_use or entry.reuse_after)
        self.pool.trim(self.budget_bytes - self._index.live_bytes)
        if entry.loaded is not None and not entry.loaded.done():
            entry.loaded.cancel()

    def advance_token(self) -> None:
        self._index.advance_token()

    def resize(self, budget_bytes: int) -> None:
        """Change the budget: trim parked buffers first, then evict unpinned entries."""
        evicted = self._index.resize(budget_bytes, self._pinned)
        for key in evicted:
            victim = self._entries.pop(key)
            self.pool.free(victim.buffer, victim.last_use)
            self.counters.evictions += 1
        self.pool.trim(max(0, budget_bytes - self._index.live_bytes))
        self.counters.frees = self.pool.frees
        _log.info("budget_changed", budget_bytes=budget_bytes, live_bytes=self.live_bytes,
                  evicted=len(evicted))

    def clear(self) -> None:
        """Drop every unpinned entry and give all buffers back to the device."""
        for key in [k for k in self._entries if k not in self._pinned]:
            entry = self._entries.pop(key)
            self._index.remove(key)
            self.pool.free(entry.buffer, entry.last_use)
        self.pool.close()
        self.counters.frees = self.pool.frees

    def close(self) -> None:
        """Release everything, pinned or not (the run is over)."""
        self._pinned.clear()
        for entry in self._entries.values():
            entry.pins = 0
        self.clear()

    def __enter__(self) -> DeviceCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
