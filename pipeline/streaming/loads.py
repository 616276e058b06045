"""What the streamer's loads are made of: a layer in flight (``LayerLoad``), the queue its
landed misses reach their lease through (``Arrivals``), one expert's job from read to
delivery (``LoadJob``), a registered miss's copies (``MappedCopies``), the stages' busy
times, and the I/O modes.

Why ``Arrivals`` and not ``asyncio.Queue``: a queue also counts tasks for ``join`` and keeps
putters for a bound no arrival queue has; on a fine-grained shape (200 misses a token) its
``put_nowait`` and ``get_nowait`` were a visible share of a warm miss's host time. ``Arrivals``
keeps what a lease uses: ``put_nowait`` (and ``put_many``), ``get_nowait`` (and ``take_all``),
``empty`` and ``get``, on the event loop's thread (or under the sync face's lock, which a
thread blocked in ``ThreadWaiter.wait`` does not hold).
"""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, NamedTuple, Protocol, TypeVar

from moestream.gpu.backend import Stream
from moestream.gpu.cache.store import Entry, LayerPlan
from moestream.pipeline.foundation.timesplit import LaunchTimes, LoadPhases
from moestream.stages.layout import ExpertLayout
from moestream.stages.staging import StagingSlot

__all__ = [
    "Arrivals", "IOMode", "JobMode", "LayerLoad", "LoadJob", "MappedCopies", "StageTimes",
    "ThreadWaiter", "Waiter", "WarmGate",
]

T = TypeVar("T")


class Waiter(Protocol):
    """What ``Arrivals`` wakes: a task's future, or a blocked thread's ``ThreadWaiter``."""

    def done(self) -> bool: ...

    def set_result(self, result: None, /) -> None: ...


class ThreadWaiter:
    """A thread blocked for an arrival without the loop's lock (the sync face): the loop's
    thread wakes it as it wakes a task, by ``set_result``. The wait is a plain lock's
    acquire, which a signal interrupts cleanly; woken and waited, it may wait again.
    ``queued``: its owner's note that it is in a queue (or woken and its item not taken)."""

    __slots__ = ("_lock", "queued")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()
        self.queued = False

    def done(self) -> bool:
        return not self._lock.locked()

    def set_result(self, result: None, /) -> None:
        self._lock.release()

    def wait(self) -> None:
        self._lock.acquire()


class Arrivals(Generic[T]):
    """An unbounded FIFO for one event loop; ``get`` waits for an item, and a thread
    without the loop waits through ``add_waiter`` (several waiters are served in the order
    they came, as ``asyncio.Queue`` serves them)."""

    __slots__ = ("_getters", "_items")

    def __init__(self) -> None:
        self._items: collections.deque[T] = collections.deque()
        self._getters: collections.deque[Waiter] = collections.deque()

    def empty(self) -> bool:
        return not self._items

    def put_nowait(self, item: T) -> None:
        self._items.append(item)
        if self._getters:
            self._wake_next()

    def put_many(self, items: Sequence[T]) -> None:
        """``put_nowait`` each of ``items``, in order (a layer landed at once)."""
        self._items.extend(items)
        for _ in items:  # each item wakes one waiter, as ``put_nowait`` would
            if not self._getters:
                break
            self._wake_next()

    def take_all(self) -> list[T]:
        """Every item queued, oldest first, at once (none: an empty list)."""
        items = list(self._items)
        self._items.clear()
        return items

    def put_back(self, items: Sequence[T]) -> None:
        """Return ``items`` taken by ``take_all`` and not used to the front, in order."""
        self._items.extendleft(reversed(items))

    def get_nowait(self) -> T:
        """The oldest item.

        Raises:
            asyncio.QueueEmpty: there is none.
        """
        if not self._items:
            raise asyncio.QueueEmpty
        return self._items.popleft()

    async def get(self) -> T:
        """The oldest item, waiting for one if there is none."""
        while not self._items:
            getter = asyncio.get_running_loop().create_future()
            self._getters.append(getter)
            try:
                await getter
            except BaseException:
                getter.cancel()  # a no-op if it was woken already
                self.drop_waiter(getter)
                raise
        return self._items.popleft()

    def add_waiter(self, waiter: Waiter) -> None:
        """Wake ``waiter`` when an item comes, after those waiting already."""
        self._getters.append(waiter)

    def drop_waiter(self, waiter: Waiter) -> None:
        """``waiter`` stopped waiting (cancelled, interrupted): it is forgotten, or, woken
        already, its item goes to the next one."""
        if waiter in self._getters:
            self._getters.remove(waiter)
        elif self._items:
            self._wake_next()

    def _wake_next(self) -> None:
        while self._getters:
            getter = self._getters.popleft()
            if not getter.done():
                getter.set_result(None)
                return


class WarmGate(Protocol):
    """Something that reads in the background and yields to decode (a ``WarmEngine``)."""

    def pause(self) -> None: ...

    def resume(self) -> None: ...


IOMode = Literal["direct", "resident"]
"""The streamer's I/O mode: O_DIRECT reads through staging, or copies from the mapping."""
JobMode = Literal["direct", "resident", "tier"]
"""How one expert is read: O_DIRECT, from the mapping, or buffered with pages kept."""


@dataclass(slots=True)
class StageTimes:
    """Busy milliseconds per stage, summed over workers (may exceed wall time)."""

    read_ms: float = 0.0
    stage_ms: float = 0.0
    upload_ms: float = 0.0
    install_ms: float = 0.0

    def add(self, other: StageTimes) -> None:
        self.read_ms += other.read_ms
        self.stage_ms += other.stage_ms
        self.upload_ms += other.upload_ms
        self.install_ms += other.install_ms


@dataclass(slots=True)
class LayerLoad:
    """A layer in flight: its plan, and a queue yielding misses as their uploads are queued.

    ``phases``: what each miss's load did over time, by key, so that a wait for one is
    charged to its read, upload or slot (``pipeline.foundation.timesplit``); ``launch``: the launch
    they waited behind.
    """

    plan: LayerPlan
    arrived: Arrivals[tuple[Entry, BaseException | None]] | None = None
    launcher: asyncio.Task[None] | None = None
    pending: int = 0
    launched: int = 0
    delivered: int = 0
    gate: WarmGate | None = None
    prefetch: bool = False
    launch: LaunchTimes | None = None
    phases: dict[tuple[int, int], LoadPhases] = field(default_factory=dict)


class MappedCopies(NamedTuple):
    """A registered miss's copies, computed once per expert and mapping, for the path the
    streamer takes: for the gather (which reads across windows) its launch rows, one per
    range (``gather_rows``); for the copy engines (device offset, mapping address,
    bytes), one per window piece (a copy may not span two registrations); and for the
    copy engines the (device offset, bytes) ranges its install digest reads."""

    rows: list[int]
    copies: list[tuple[int, int, int]]
    ranges: list[tuple[int, int]]


@dataclass(slots=True, eq=False)
class LoadJob:
    """One expert being loaded; ``remaining`` chunks count down on worker threads.

    ``reuse_wait_s``: the longest any chunk waited for the slot's last upload to finish.
    """

    entry: Entry
    layout: ExpertLayout
    stream: Stream
    load: LayerLoad
    mode: JobMode
    phases: LoadPhases
    slot: StagingSlot | None = None
    remaining: int = 0
    reuse_wait_s: float = 0.0
    error: BaseException | None = None
    digest_row: int = -1
    digest_results: Any = None
    lock: threading.Lock = field(default_factory=threading.Lock)

