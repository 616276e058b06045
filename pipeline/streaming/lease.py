"""A layer lease: one fetch of a layer's experts, pinned until released, handed out as they
become available (hits first, misses as they land).

The engine-facing API (``moestream``) builds its handles on these; the rules that keep a
buffer from being read after it was reused live here, whatever the caller does:

- every entry a lease planned stays pinned until the lease is released; one whose load is
  still in flight then (a fetch cancelled or released early) keeps its pin until the load
  lands, so no read or copy ever writes into a buffer handed to another expert;
- a failed load is dropped from the cache (never installed), and the lease's iterator
  raises for that expert;
- a released entry's buffer is not overwritten before the event given at release (the
  engine's compute): the cache keeps one ``last_use`` event per entry, so when several
  leases used an entry their events are joined on a device stream (no host wait);
- a lease released, or aborted by the session's close, never waits again: a task or a
  thread waiting for an arrival is woken with ``UsageError``.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from moestream.gpu.backend import Event
from moestream.gpu.cache.store import Entry
from moestream.pipeline.foundation.errors import MoestreamError, StageError, UsageError
from moestream.pipeline.streaming.lease_parts import LeasePart, unpin
from moestream.pipeline.streaming.loads import Arrivals, LayerLoad, Waiter

__all__ = ["NOT_YET", "Arrival", "LayerLease", "WaitTold"]


@dataclass(slots=True)
class Arrival:
    """An expert the lease hands out: its entry and the part (device) it lives on."""

    entry: Entry
    part: LeasePart


def _load_error(entry: Entry, error: BaseException) -> MoestreamError:
    """The error the lease raises for an expert whose load failed: a stage's own class
    (``ReadError``, ``UploadError``...) with the expert named, another moestream error
    (the model file changed) as itself, anything else as a ``StageError``."""
    where = f"layer {entry.key[0]} expert {entry.key[1]}"
    if isinstance(error, StageError):
        try:
            return type(error)(f"{where}: {error}")
        except TypeError:  # a subclass with another constructor: the wording stays its own
            return error
    if isinstance(error, MoestreamError):
        return error  # e.g. the model file changed: its own class and exit code
    return StageError(f"{where}: {error}")


_ABORT = object()
"""Put in a lease's queue to wake a waiter when the lease is released or aborted."""
_END = object()
"""Put in a lease's queue once every expert was handed out: a waiter still there (another
task or thread iterating the same lease) is woken to stop, and leaves it for the next."""

WaitTold = Callable[[Entry | None, LayerLoad | None, float, float], None]
"""What is told of a wait for an arrival (``LayerLease.on_wait``)."""

NOT_YET: Any = object()
"""What ``LayerLease.next_nowait`` returns when the next expert has not landed yet."""


@dataclass(eq=False)
class LayerLease:
    """One fetch of one layer: its experts pinned on their devices until ``release``.

    Made by the session (``pipeline.streaming.desk``); the loads have started when it is made.

    Args:
        layer: the model layer index.
        experts: the experts asked for, in the caller's order.
        parts: one per device with experts of this layer.
        on_wait: told of each wait for an arrival: the expert that ended it (None when a
            release or a cancel did), its load when it is this lease's own (whose phases
            tell what the wait was spent on), and the wait's start and end
            (``time.perf_counter`` seconds).
    """

    layer: int
    experts: tuple[int, ...]
    parts: list[LeasePart]
    on_wait: WaitTold = lambda entry, load, start, end: None
    on_use: Callable[[], None] | None = None
    """Told once, when the lease is first used: an expert handed out, or the release (the
    token's clock runs from then)."""
    released: bool = False
    closed_reason: str = ""
    _ready: list[Arrival] = field(default_factory=list)
    _queue: Arrivals[Any] | None = None
    """Arrivals still to come, made on first use (an all-hit lease needs none)."""
    _part_of: dict[Entry, LeasePart] = field(default_factory=dict)
    _pending: int = 0
    _handed: set[Entry] = field(default_factory=set)
    _held: set[Entry] = field(default_factory=set)
    """Entries (by identity: ``Entry`` compares so) this lease still pins: each pin is
    dropped exactly once."""
    _stashed: Any = None
    """A failed arrival ``take_landed`` stopped at, for ``next`` to raise."""
    fetched_at: int = -1
    """The token the fetch was made in (for messages naming who holds pins)."""
    owner: Any = None
    """The public object that hands this lease out (set once it exists): a lease without
    one was made by a fetch that never returned, and is released by it."""
    face: Any = None
    """A weak reference to what its public lease and handles share (set with ``owner``):
    dead while the lease is held, the lease was dropped unreleased."""

    def __post_init__(self) -> None:
        for part in self.parts:
            if part.load.plan.misses:
                # the loads deliver their misses into one queue, this lease's (the
                # streamer's own on one device, the one ``LeaseDesk._start_parts`` gave
                # every device's load on several); they have not yet run: a launch is a
                # task, a registered layer a callback, both after this returns
                self._queue = part.load.arrived
                break
        for part in self.parts:
            plan = part.load.plan
            self._held.update(plan.hits)
            self._held.update(plan.misses)
            for entry in plan.hits:
                loaded = entry.loaded
                if entry.ready or loaded is None or (loaded.done() and not loaded.cancelled()
                                                     and loaded.exception() is None):
                    self._ready.append(Arrival(entry, part))
                    continue
                # in flight for someone else (a prefetch, another lease), or just failed
                # and not yet dropped: it arrives through the queue, with its error if any
                self._part_of[entry] = part
                self._pending += 1
                if loaded.done():
                    self._hit_landed(entry, loaded)
                else:
                    loaded.add_done_callback(functools.partial(self._hit_landed, entry))
            for entry in plan.misses:  # a failed one is dropped by its streamer as it lands
                self._part_of[entry] = part
            self._pending += len(plan.misses)

    # -- counts ----------------------------------------------------------------------------

    @property
    def hits(self) -> int:
        parts = self.parts  # one device: no generator a layer
        return (len(parts[0].load.plan.hits) if len(parts) == 1
                else sum(len(p.load.plan.hits) for p in parts))

    @property
    def misses(self) -> int:
        parts = self.parts
        return (len(parts[0].load.plan.misses) if len(parts) == 1
                else sum(len(p.load.plan.misses) for p in parts))

    @property
    def evicted(self) -> int:
        return sum(p.load.plan.evicted for p in self.parts)

    @property
    def pending(self) -> int:
        """Experts still to be handed out by ``next`` after ``take_ready`` (loading, or
        landed and queued)."""
        return self._pending + len(self._ready)

    @property
    def entries(self) -> list[tuple[Entry, LeasePart]]:
        """Every entry planned, hits then misses, per device."""
        return [(e, p) for p in self.parts for e in (*p.load.plan.hits, *p.load.plan.misses)]

    # -- arrivals --------------------------------------------------------------------------

    def _hit_landed(self, entry: Entry, loaded: asyncio.Future[None]) -> None:
        error: BaseException | None = None
        if loaded.cancelled():
            error = StageError(f"load of {entry.key} was abandoned (its expert was dropped)")
        elif loaded.exception() is not None:
            error = loaded.exception()
        if self._queue is None:
            self._queue = Arrivals()
        self._queue.put_nowait((entry, error))

    def _miss_landed(self, part: LeasePart, entry: Entry, loaded: asyncio.Future[None]) -> None:
        """Our own load landed after our release: the pin left in place for it is dropped
        now (a failed one with its entry). Told only then, not for every miss: a callback
        per miss was a visible share of a warm miss's host time on fine-grained shapes."""
        if loaded.cancelled() or loaded.exception() is not None:
            self._drop_failed(part, entry)
            return
        self._unpin(part, entry, None)

    def _drop_failed(self, part: LeasePart, entry: Entry) -> None:
        """Our own load failed: its entry leaves the cache (if still there) with our pin."""
        self._held.discard(entry)
        if part.cache.get(entry.key) is entry:
            part.cache.drop(entry.key)

    def _unpin(self, part: LeasePart, entry: Entry, last_use: Event | None) -> None:
        if entry in self._held:
            self._held.discard(entry)
            unpin(part, entry, last_use)

    def _check(self) -> None:
        if self.released:
            raise UsageError(f"layer {self.layer}: its lease was released"
                             + (f" ({self.closed_reason})" if self.closed_reason else ""))
        told = self.on_use
        if told is not None:
            self.on_use = None
            told()

    def take_ready(self) -> list[Arrival]:
        """Every expert available now, without waiting: the hits whose loads have landed,
        in the order asked (what ``next`` would hand out first, all at once); ``next``
        then hands out the rest as they land.

        Raises:
            UsageError: the lease was released (or its session closed).
        """
        self._check()
        ready, self._ready = self._ready, []
        self._handed.update([arrival.entry for arrival in ready])
        return ready

    def take_landed(self) -> list[Arrival]:
        """Every arrival that has landed already, without waiting, in order (a layer
        gathered in one launch lands at once: its misses are handed out together). Stops
        before a failed one, which ``next`` then raises.

        Raises:
            UsageError: the lease was released (or its session closed).
        """
        self._check()
        out: list[Arrival] = []
        queue = self._queue
        if self._stashed is not None or queue is None:
            return out
        items = queue.take_all()
        part_of, handed = self._part_of, self._handed
        for i, item in enumerate(items):  # ``_hand_out``'s work for the landed ones, inline
            if item is _END:
                queue.put_back(items[i:])
                break
            if item is _ABORT or item[1] is not None:
                self._stashed = item
                queue.put_back(items[i + 1 :])
                break
            entry = item[0]
            handed.add(entry)
            out.append(Arrival(entry, part_of[entry]))
        if out:
            self._handed_out(len(out))
        return out

    async def next(self) -> Arrival | None:
        """The next expert available, hits first, then misses as they land; None when all
        were handed out.

        Raises:
            StageError: this expert's load failed (it is dropped from the cache; iterating
                again goes on with the others); ``ModelChangedError`` and other
                non-stage errors as themselves.
            UsageError: the lease was released (or its session closed), also while waiting.
        """
        arrival = self.next_nowait()
        if arrival is not NOT_YET:
            return arrival
        t0 = time.perf_counter()
        item: Any = _ABORT
        try:
            item = await self._arrivals().get()
        finally:
            self._tell_wait(item, t0)
        return self._hand_out(item)

    def next_or_wait(self, waiter: Waiter, since: float | None = None
                     ) -> Arrival | Any | None:
        """As ``next_nowait``, for a thread that waits without the loop (the sync face):
        where it is ``NOT_YET``, ``waiter`` is woken by the next arrival, a release's
        included. Called again once woken, with ``since`` (when it began to wait): the
        arrival that woke it is handed out, its wait told as ``next`` tells its own (or,
        taken meanwhile by another caller of this lease, ``waiter`` waits again)."""
        queue = self._queue
        if since is not None and queue is not None and not queue.empty() \
                and self._stashed is None:
            item = queue.get_nowait()
            self._tell_wait(item, since)
            return self._hand_out(item)
        arrival = self.next_nowait()
        if arrival is NOT_YET:
            self._arrivals().add_waiter(waiter)
        return arrival

    def stop_waiting(self, waiter: Waiter, since: float) -> None:
        """A thread's wait from ``next_or_wait`` ended without an arrival (interrupted):
        told as an interrupted ``next`` tells its wait."""
        self._arrivals().drop_waiter(waiter)
        self._tell_wait(_ABORT, since)

    def _arrivals(self) -> Arrivals[Any]:
        queue = self._queue
        if queue is None:  # only hits loading for others are to come: none landed yet
            queue = self._queue = Arrivals()
        return queue

    def _tell_wait(self, item: Any, start: float) -> None:
        """Tell ``on_wait`` of a wait since ``start`` that ``item`` ended."""
        end = time.perf_counter()
        if item is _ABORT or item is _END:
            self.on_wait(None, None, start, end)
            return
        entry = item[0]
        load = self._part_of[entry].load
        self.on_wait(entry, load if entry in load.plan.misses else None, start, end)

    def next_nowait(self) -> Arrival | Any | None:
        """As ``next`` without waiting: the next expert if it is available now, None when
        all were handed out, ``NOT_YET`` when ``next`` would wait.

        Raises:
            As ``next``.
        """
        self._check()
        if self._ready:
            arrival = self._ready.pop(0)
            self._handed.add(arrival.entry)
            return arrival
        if self._stashed is not None:
            stashed, self._stashed = self._stashed, None
            return self._hand_out(stashed)
        if self._pending == 0:
            return None
        queue = self._queue
        if queue is not None and not queue.empty():  # landed already: no wait to charge
            return self._hand_out(queue.get_nowait())
        return NOT_YET

    def _hand_out(self, item: Any) -> Arrival | None:
        """Hand out one queued arrival (raising its load's error); None for ``_END``."""
        if item is _ABORT:
            self._check()  # raises: only ``release`` queues it
        if item is _END:
            self._arrivals().put_nowait(_END)  # for the next waiter
            return None
        entry: Entry = item[0]
        error: BaseException | None = item[1]
        self._handed_out(1)
        if error is not None:
            part = self._part_of[entry]
            if entry in part.load.plan.misses:  # ours: dropped now, not when told later
                self._drop_failed(part, entry)
            raise _load_error(entry, error) from error
        self._handed.add(entry)
        return Arrival(entry, self._part_of[entry])

    def _handed_out(self, n: int) -> None:
        """``n`` more arrivals were taken from the queue; after the last, ``_END`` wakes
        whoever still waits in it."""
        self._pending -= n
        if self._pending == 0:
            self._arrivals().put_nowait(_END)

    # -- release ---------------------------------------------------------------------------

    def release(self, last_use: Callable[[LeasePart], Event | None], reason: str = "", *,
                ordered: bool = False) -> None:
        """Unpin every entry (idempotent). Entries handed out end with ``last_use(part)``
        (the caller's compute on that device), joined with the event of their earlier
        users; the others with their upload. A miss still loading keeps its pin until it
        lands. A task waiting in ``next`` is woken.

        Args:
            last_use: the event after the caller's use of a part's entries.
            reason: why the lease ends (told to a task still waiting in it).
            ordered: ``last_use(part)`` comes after every earlier use of the entries handed
                out, so it replaces their events with no join (every use on one compute
                stream per device, as ``moestream.pipeline.cli.run``'s decoder queues them).
        """
        if self.released:
            return
        told = self.on_use
        if told is not None:
            self.on_use = None
            told()
        self.released = True
        self.closed_reason = reason
        for part in self.parts:
            self._release_part(part, last_use, ordered)
        if self._queue is not None:  # wakes a task waiting in ``next``
            self._queue.put_nowait(_ABORT)

    def _release_part(self, part: LeasePart, last_use: Callable[[LeasePart], Event | None],
                      ordered: bool) -> None:
        """Unpin this lease's entries on one part (``release``): ``last_use(part)`` asked
        at most once, and only when an entry was handed out."""
        held, handed = self._held, self._handed
        plan, cache = part.load.plan, part.cache
        used: Event | None = None
        asked = False
        # entries that end with one event are unpinned in one call (usually all)
        batch: list[Entry] = []
        batch_event: Event | None = None
        misses = len(plan.misses)
        for i, entry in enumerate((*plan.misses, *plan.hits)):
            if entry not in held:
                continue
            if i < misses:
                loaded = entry.loaded
                if loaded is not None and not loaded.done():
                    # unpinned once the load has landed
                    loaded.add_done_callback(
                        functools.partial(self._miss_landed, part, entry))
                    continue
                if loaded is not None and (loaded.cancelled()
                                           or loaded.exception() is not None):
                    self._drop_failed(part, entry)
                    continue
            held.discard(entry)  # a dropped one is left alone by ``cache.release``
            event = None
            if entry in handed:
                if not asked:
                    used, asked = last_use(part), True
                event = used
            join = event is None or not ordered  # ordered: after every earlier use
            if event is None:
                event = entry.upload
            if join and entry.last_use is not None and entry.last_use is not event:
                event = part.joiner.join(entry.last_use, event)
            if batch and event is not batch_event:
                cache.release(batch, batch_event)
                batch = []
            batch.append(entry)
            batch_event = event
        if batch:
            cache.release(batch, batch_event)
