"""The staging ring: page-aligned (pinned, on a GPU) host slots that reads land in.

A slot is handed out again only after the upload that read it has completed: the slot
keeps that upload's event, and the next user waits on it before writing. Reuse is never
inferred from counts (flashpack's habit: safe only while two numbers happen to match).

Slots are allocated up front, after one check: a ring that would take more than
``RAM_SHARE`` of the RAM available now is refused in one line before anything is allocated
(``UsageError`` naming the slots that would fit; ``DeviceMemoryError`` when not even one
does), so a large ``staging_slots`` cannot drive the machine out of memory. If pinned memory
still runs out part way, the ring keeps the slots it got (fewer reads in flight, logged
once); with none at all it raises ``DeviceMemoryError``; anything else that fails part way
frees what was allocated before it propagates. Closing the ring wakes every task still
waiting for a slot with a ``StageError``, so no waiter outlives it.

The readers that fill the slots are a ``WorkerPool``: work handed over at the cost of one
queue put. Why not ``concurrent.futures.ThreadPoolExecutor``: the direct path hands its
readers a chunk at a time, three or more an expert, from the event loop's thread, and a
``submit`` builds a future (a condition, a lock) and a work item and checks the thread count
each time: 9.2 us a call on the dev VM against 0.16 us for a ``queue.SimpleQueue.put``, on
the thread that also decodes. Nothing here needs a future: a chunk reports its outcome to
the loop itself (``ExpertJobs._read_chunk``), so a pool is a queue and its threads.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psutil
import structlog

from moestream.gpu.backend import Backend, Event, HostBuffer
from moestream.pipeline.foundation.errors import DeviceMemoryError, StageError, UsageError
from moestream.pipeline.foundation.faults import FaultPlan

__all__ = ["RAM_SHARE", "StagingRing", "StagingSlot", "WorkerPool", "check_ring_fits"]

_log = structlog.get_logger("moestream.staging")

RAM_SHARE = 0.5
"""The most of the RAM available (``psutil``'s ``available``) one staging ring may take:
the rest is the page cache's, the engine's and the other devices' rings'."""


def check_ring_fits(n_slots: int, slot_bytes: int, available_bytes: int | None = None) -> None:
    """Refuse a ring of ``n_slots`` slots of ``slot_bytes`` above ``RAM_SHARE`` of the RAM
    available, before anything is allocated.

    Args:
        n_slots: the slots asked for.
        slot_bytes: the bytes of one.
        available_bytes: the RAM available (default: ``psutil.virtual_memory().available``).

    Raises:
        UsageError: too many slots; the message says how many fit.
        DeviceMemoryError: not even one slot fits.
    """
    if available_bytes is None:
        available_bytes = int(psutil.virtual_memory().available)
    allowed = int(available_bytes * RAM_SHARE)
    if n_slots * slot_bytes <= allowed:
        return
    fit = allowed // slot_bytes if slot_bytes else n_slots
    if fit < 1:
        raise DeviceMemoryError(
            f"one staging slot of {slot_bytes} bytes is more than half the "
            f"{available_bytes} bytes of RAM available: free memory first")
    raise UsageError(
        f"{n_slots} staging slots of {slot_bytes} bytes ({n_slots * slot_bytes} bytes) are "
        f"more than half the {available_bytes} bytes of RAM available: give at most {fit} "
        "staging slots (--staging-slots, Tuning.staging_slots)")


@dataclass(slots=True, eq=False)
class StagingSlot:
    """One staging buffer. ``buffer.array`` is valid until the ring closes.

    ``busy_until``: the event of the last upload that read this slot; whoever writes into
    the slot next must wait for it first (``wait_reusable``).
    """

    index: int
    buffer: HostBuffer
    busy_until: Event | None = None

    def wait_reusable(self) -> None:
        """Block until the previous upload out of this slot is done (call off the loop)."""
        if self.busy_until is not None:
            self.busy_until.synchronize()
            self.busy_until = None


class StagingRing:
    """A fixed set of staging slots handed out in turn.

    Args:
        backend: allocates the (pinned) host memory.
        n_slots: how many experts can be staged at once (fewer if pinned memory runs out).
        slot_bytes: the largest aligned cover of one expert.
        faults: injected faults (``staging_oom``; tests and ``--inject`` only).

    Raises:
        UsageError: the slots would take more than ``RAM_SHARE`` of the RAM available.
        DeviceMemoryError: not even one slot fits, or could be allocated.
    """

    def __init__(
        self, backend: Backend, n_slots: int, slot_bytes: int, faults: FaultPlan | None = None
    ) -> None:
        if n_slots < 1:
            raise ValueError(f"need at least one staging slot, got {n_slots}")
        check_ring_fits(n_slots, slot_bytes)
        self.slot_bytes = slot_bytes
        self.requested_slots = n_slots
        self._slots: list[StagingSlot] = []
        try:
            self._allocate(backend, n_slots, faults)
        except BaseException:
            for slot in self._slots:  # nobody holds the ring yet to close it
                slot.buffer.close()
            self._slots.clear()
            raise
        self._free: asyncio.Queue[StagingSlot | None] = asyncio.Queue()
        for slot in self._slots:
            self._free.put_nowait(slot)
        self._waiting = 0
        self._closed = False

    def _allocate(self, backend: Backend, n_slots: int, faults: FaultPlan | None) -> None:
        """Allocate the slots; fewer when pinned memory runs out after the first."""
        slot_bytes = self.slot_bytes
        for i in range(n_slots):
            try:
                if faults and faults.hit("staging_oom") is not None:
                    raise DeviceMemoryError(
                        f"pinned host allocation of {slot_bytes} bytes failed (injected)")
                buffer = backend.alloc_host(slot_bytes)
            except (DeviceMemoryError, MemoryError) as exc:
                if not self._slots:
                    raise DeviceMemoryError(f"staging ring: no slot could be allocated: {exc}"
                                            ) from exc
                _log.warning("staging_shrunk", requested_slots=n_slots, slots=i,
                             slot_bytes=slot_bytes, reason=str(exc),
                             action="fewer reads in flight for the rest of the run")
                return
            self._slots.append(StagingSlot(i, buffer))

    @property
    def n_slots(self) -> int:
        return len(self._slots)

    @property
    def n_free(self) -> int:
        return self._free.qsize()

    async def acquire(self) -> StagingSlot:
        """The next free slot; it may still be read by an upload (see ``wait_reusable``).

        Raises:
            StageError: the ring is closed, or closed while this call waited.
        """
        if self._closed:
            raise StageError("staging ring is closed")
        self._waiting += 1
        try:
            slot = await self._free.get()
        finally:
            self._waiting -= 1
        if slot is None:  # the wake-up ``close`` sends each waiter
            raise StageError("staging ring closed while waiting for a slot")
        return slot

    def release(self, slot: StagingSlot, busy_until: Event | None) -> None:
        """Return ``slot``; it stays unwritable until ``busy_until`` completes.

        Must be called on the event loop's thread (workers use call_soon_threadsafe).
        """
        slot.busy_until = busy_until
        self._free.put_nowait(slot)

    def close(self) -> None:
        """Wait for uploads still reading the slots, then free the memory.

        Tasks waiting in ``acquire`` are woken with a ``StageError``. Idempotent.
        """
        if self._closed:
            return
        self._closed = True
        for _ in range(self._waiting):
            self._free.put_nowait(None)
        for slot in self._slots:
            slot.wait_reusable()
            slot.buffer.close()

    def __enter__(self) -> StagingRing:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_STOP = None


class WorkerPool:
    """``threads`` daemon threads running submitted calls in submission order.

    The threads start with the first ``submit`` (a pool that is never used costs none).
    A call's exception is logged and the thread goes on: callers report their own outcome
    (a call that can fail catches its errors and hands them on itself).
    """

    def __init__(self, threads: int, name: str) -> None:
        if threads < 1:
            raise ValueError(f"a worker pool needs a thread, got {threads}")
        self._n = threads
        self._name = name
        self._queue: queue.SimpleQueue[tuple[Callable[..., None], tuple[Any, ...]] | None] = (
            queue.SimpleQueue())
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._lock = threading.Lock()  # a submit and a shutdown, from two threads

    def submit(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` on a worker.

        Raises:
            RuntimeError: the pool was shut down.
        """
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self._name}: submit after shutdown")
            if not self._threads:
                self._start()
            self._queue.put((fn, args))

    def _start(self) -> None:
        for i in range(self._n):
            thread = threading.Thread(target=self._work, name=f"{self._name}_{i}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def _work(self) -> None:
        get = self._queue.get
        while (item := get()) is not _STOP:
            fn, args = item
            try:
                fn(*args)
            except BaseException as exc:  # the caller's to report; the worker goes on
                _log.error("worker_call_failed", pool=self._name, call=getattr(
                    fn, "__qualname__", repr(fn)), error=f"{type(exc).__name__}: {exc}")

    def shutdown(self, *, cancel: bool) -> int:
        """Stop taking work, drop what has not started (``cancel``) or let it run, and join
        every thread (blocks: call it off the event loop). Returns how many calls were
        dropped. Idempotent."""
        with self._lock:
            self._closed = True
        dropped = 0
        if cancel:
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                dropped += item is not _STOP
        for _ in self._threads:
            self._queue.put(_STOP)
        for thread in self._threads:
            thread.join()
        self._threads.clear()
        return dropped
