"""The synchronous API, for engines without asyncio: the same session on a private loop.

``open_sync`` starts an event loop on a daemon thread and opens a ``Session`` there. The
loop's thread holds the session's lock whenever it runs (every callback and task step),
and lets go of it only while it waits for events. Every call but ``close`` takes the lock
and runs on the caller's own thread, with the session's loop set as that thread's running
loop meanwhile: no hop to the loop, so it costs about what the same call costs on the
asynchronous face. Iterating a lease whose next expert is still loading (and ``gather``
of one) waits on the caller's thread without the lock, on a ``ThreadWaiter`` in the lease's
arrival queue: the loop's thread wakes it as it delivers the expert, and the caller takes
the lock back to hand it out. ``end_token`` runs on the caller's thread up to its first
wait, which most tokens never reach, and goes on on the loop from there
(``LoopThread.run_eager``); ``close`` runs on the loop, the caller blocked without the lock.

Calls may come from any of the engine's threads, one at a time or concurrently: they are
serialized by the lock. A call interrupted while it waits (``KeyboardInterrupt``) stops
waiting (its work on the loop cancelled, for ``close``); a fetch interrupted part way
releases what it pinned.

A wait is a stall on this face as on the asynchronous one: a caller blocked for a lease's
expert is charged, from the moment it found the expert loading to the moment it has it,
to what the awaited load was doing meanwhile (``LayerLease.on_wait``), not left to the
token's ``host`` time.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any

import structlog

from moestream._args import ExpertIds, Index
from moestream._handles import ExpertHandle, InPlace, LeaseShared
from moestream._lease import After, LeaseBase
from moestream._loop_thread import LoopThread
from moestream._model_info import ModelInfo, Router
from moestream._open import Mode
from moestream._open import open as open_session
from moestream._session import Session
from moestream._stats import Counters, TokenStats
from moestream._tuning import Tuning
from moestream.gpu.interop import stream_pointer
from moestream.pipeline.foundation.config import Budget
from moestream.pipeline.foundation.errors import UsageError
from moestream.pipeline.streaming.lease import NOT_YET, LayerLease
from moestream.pipeline.streaming.loads import ThreadWaiter
from moestream.pipeline.streaming.session import StreamSession

__all__ = ["SyncLease", "SyncSession", "open_sync"]

_log = structlog.get_logger("moestream.session")


class SyncLease(LeaseBase):
    """A ``Lease`` for synchronous code: iterate it, or ``gather()``; leave its ``with``
    block (or ``release``) once the compute on its experts is queued.

    Made by ``SyncSession.fetch``; used on the caller's thread, under the session's lock
    except while it waits for an expert to land.
    """

    __slots__ = ("_cupy_devices", "_thread")

    def __init__(self, layer_lease: LayerLease, shared: LeaseShared, streaming: StreamSession,
                 loop: asyncio.AbstractEventLoop, *, thread: LoopThread,
                 cupy_devices: Sequence[int] | None) -> None:
        super().__init__(layer_lease, shared, streaming, loop)
        self._thread = thread
        self._cupy_devices = cupy_devices  # None: the host backend, no streams to ask

    def __iter__(self) -> Iterator[ExpertHandle]:
        return self

    def __next__(self) -> ExpertHandle:
        """As ``Lease.__anext__``, on the caller's thread; an expert still loading is waited
        for there, without the session's lock (``_waited``)."""
        handle = self._thread.call(self._next_or_wait, None, None)
        if handle is NOT_YET:
            handle = self._waited()
        if handle is None:
            raise StopIteration
        assert isinstance(handle, ExpertHandle)
        return handle

    def _waited(self) -> ExpertHandle | None:
        """Block on a ``ThreadWaiter`` in the lease's arrival queue until the next expert
        lands (the loop's thread wakes it as it delivers it): the whole wait, to the
        hand-out under the lock, is the lease's stall (``LayerLease.on_wait``)."""
        waiter = ThreadWaiter()
        since = time.perf_counter()
        try:
            handle = self._thread.call(self._next_or_wait, waiter, None)
            while handle is NOT_YET:
                waiter.wait()
                handle = self._thread.call(self._next_or_wait, waiter, since)
        except BaseException:
            if waiter.queued:  # interrupted: the lease's queue forgets it, or passes its wake on
                with contextlib.suppress(UsageError):  # closed meanwhile: nothing to count
                    self._thread.call(self._layer_lease.stop_waiting, waiter, since)
            raise
        return handle

    def _next_or_wait(self, waiter: ThreadWaiter | None, since: float | None
                      ) -> ExpertHandle | Any | None:
        """The next expert if available now (``since``: after a wait since then, which it
        ended), None when all were handed out, ``NOT_YET`` (with ``waiter``, if any,
        queued)."""
        if waiter is None:
            arrival = self._layer_lease.next_nowait()
        else:
            waiter.queued = False
            arrival = self._layer_lease.next_or_wait(waiter, since)
        if arrival is NOT_YET:
            if waiter is not None:
                waiter.queued = True
            return arrival
        return None if arrival is None else self._handle(arrival)

    def gather(self) -> list[ExpertHandle]:
        """As ``Lease.gather``: on the caller's thread, waiting as iterating does; what
        landed together is taken together."""
        while (done := self._thread.call(self._gathered_now)) is None:
            next(self, None)
        return done

    def _gathered_now(self) -> list[ExpertHandle] | None:
        LeaseBase.available(self)
        return self._in_order() if self._layer_lease.pending == 0 else None

    # -- on the caller's thread -----------------------------------------------------------

    def available(self) -> list[ExpertHandle]:
        """As ``Lease.available``."""
        return self._thread.call(super().available)

    def release(self, after: After = None, *, ordered: bool = False) -> None:
        """As ``Lease.release``; None means each device's current CuPy stream *of the
        calling thread*."""
        if self._layer_lease.released:
            return
        if after is None and self._cupy_devices is not None:
            after = _current_streams(self._cupy_devices)
        self._thread.call(functools.partial(LeaseBase.release, self, after, ordered=ordered))


def _current_streams(devices: Sequence[int]) -> Mapping[int, int]:
    """Each device's current CuPy stream in the calling thread."""
    import cupy

    out = {}
    for i, device in enumerate(devices):
        with cupy.cuda.Device(device):
            out[i] = stream_pointer(None)
    return out


class SyncSession:
    """A ``Session`` driven from ordinary threads; made by ``open_sync``.

    Close it (``close()`` or a ``with`` block): that also stops its loop's thread.
    """

    def __init__(self, session: Session, thread: LoopThread) -> None:
        self._session = session
        self._thread = thread
        cupy_devices = session.devices if session.backend == "cupy" else None
        self._cupy_devices = cupy_devices  # None: the host backend, no streams to ask
        self._new_lease: Callable[[LayerLease, LeaseShared, StreamSession,
                                   asyncio.AbstractEventLoop], SyncLease] = (
            functools.partial(SyncLease, thread=thread, cupy_devices=cupy_devices))

    @property
    def model(self) -> ModelInfo:
        return self._session.model

    @property
    def backend(self) -> str:
        return self._session.backend

    @property
    def devices(self) -> tuple[int, ...]:
        return self._session.devices

    @property
    def mode(self) -> str:
        return self._session.mode

    @property
    def closed(self) -> bool:
        return self._session.closed

    def router(self, seed: int = 0) -> Router:
        """As ``Session.router``; the router itself may be called from any thread."""
        return self._thread.call(self._session.router, seed)

    def fetch(self, layer: Index, experts: ExpertIds) -> SyncLease:
        """As ``Session.fetch`` (on the caller's thread: it never waits)."""
        lease: SyncLease = self._thread.call(self._session._fetch, layer, experts,
                                           self._new_lease, undo=SyncLease.release)
        return lease

    def used(self, uses: Iterable[tuple[Index, ExpertIds]], after: After = None) -> bool:
        """Count experts an engine computed on without a lease of its own, as ``fetch``,
        ``available`` and ``release(after)`` of each ``(layer, experts)`` would, all in one
        hop to the loop (those three are one hop each).

        Why: an engine that keeps the addresses of experts it knows stay cached (a budget
        holding every expert: nothing can evict them) computes a token's layers with no
        lease at all, then tells the session what it used, once a token: the hits, the LRU
        order and the token's counts are then as if each layer had been fetched. An expert
        not cached is loaded as a fetch would load it, and its pin kept until it lands. A
        layer all cached and landed, told once the compute ``after`` names has run (an
        event complete; always on the host backend), is counted with no lease made at all
        (a lease's fetch and release cost tens of microseconds a layer), all such layers in
        one pass before a layer with a miss is leased: that miss's evictions never take an
        expert the same token used. Every call is checked before any is counted.

        Args:
            uses: each layer's experts, in the order they were used.
            after: as ``SyncLease.release``: what the compute on them was queued on.

        Returns:
            Whether every expert told was cached: False where one was not (loaded now,
            counted as a miss and warned of), so that an engine keeping cache addresses
            knows they no longer hold, with no other question a token.
        """
        calls = [(layer, experts) for layer, experts in uses]
        if after is None and self._cupy_devices is not None:
            after = _current_streams(self._cupy_devices)
        return self._thread.call(self._used, calls, after)

    def _used(self, calls: list[tuple[Index, ExpertIds]], after: After) -> bool:
        session = self._session
        # done computing: a layer all cached needs no lease
        rest = session._use_cached(calls) if session._ran(after) else calls
        cached = True
        for layer, experts in rest:
            lease = session._fetch(layer, experts, LeaseBase)
            try:
                lease.available()
            finally:
                lease.release(after)
            if lease.misses:  # the engine computed on experts it took for cached
                _log.warning("used.missed", layer=lease.layer, misses=lease.misses)
                cached = False
        return cached

    def prefetch(self, layer: Index, experts: ExpertIds) -> int:
        """As ``Session.prefetch`` (on the caller's thread)."""
        return self._thread.call(self._session._prefetch, layer, experts)

    def read_tensor(self, name: str) -> bytearray:
        """As ``Session.read_tensor`` (on the caller's thread: a blocking read that needs
        nothing of the loop)."""
        return self._session.read_tensor(name)

    def read_header(self) -> bytearray:
        """As ``Session.read_header`` (on the caller's thread, as ``read_tensor``)."""
        return self._session.read_header()

    def ready(self, layer: Index, experts: ExpertIds) -> bool:
        """As ``Session.ready`` (on the caller's thread)."""
        return self._thread.query(self._session._ready, layer, experts)

    def in_place(self, layer: Index, experts: ExpertIds) -> InPlace | None:
        """Where ``experts`` of ``layer`` lie for the session's device to read in place
        (``InPlace``): a query, no pin, no count. None unless each can be read so now: one
        device, resident mode, a backend that maps registered host memory (a GPU's where
        the driver allows it; the host backend), every range in a registered window.

        Raises:
            UsageError: a bad layer or expert, as ``fetch``.
        """
        return self._thread.query(self._session._in_place, layer, experts)

    def in_place_current(self, view: InPlace) -> bool:
        """Whether ``view``'s addresses may still be read: the session is in resident mode
        over the mapping they were taken from. A switch to direct mode (the controller,
        at a token's end) synchronizes the whole device before it releases the mapping, so
        work queued before the switch reads it safely; nothing queued after may."""
        return self._thread.query(self._session._in_place_current, view)

    def used_in_place(self, uses: Iterable[tuple[Index, ExpertIds]]) -> None:
        """Count experts an engine read in place (``in_place``) for its compute, a token's
        in one hop: misses whose bytes came from the file's pages (``file_bytes``), each
        once in the token; nothing is loaded, pinned or evicted (``used`` would load them).

        Raises:
            UsageError: a bad layer or expert, as ``fetch``.
        """
        self._thread.call(self._session._used_in_place,
                          [(layer, experts) for layer, experts in uses])

    def end_token(self, *, compute_ms: float | Sequence[float] | None = None,
                  upload_ms: float = 0.0, wall_ms: float | None = None) -> TokenStats:
        """As ``Session.end_token``: on the caller's thread up to its first wait, which
        most tokens never reach; a wait (the controller's reading or switch) goes on on
        the loop (``LoopThread.run_eager``)."""
        return self._thread.run_eager(self._session.end_token(
            compute_ms=compute_ms, upload_ms=upload_ms, wall_ms=wall_ms))

    def counters(self) -> Counters:
        """As ``Session.counters`` (on the caller's thread; it releases leases dropped
        meanwhile, as every call does)."""
        return self._thread.call(self._session._counters)

    def close(self) -> None:
        """As ``Session.aclose``, then stop the loop's thread. Idempotent."""
        self.__exit__(None, None, None)

    def __enter__(self) -> SyncSession:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._thread.closed:  # closed already
            return
        try:  # as ``Session.__aexit__``: a failed with block closes without raising over it
            self._thread.run(self._session.__aexit__(exc_type, exc, tb))
        finally:
            self._thread.stop()

    def __repr__(self) -> str:
        return f"Sync{self._session!r}"


def open_sync(
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
) -> SyncSession:
    """``moestream.open`` for synchronous code: the session is open when this returns.

    Arguments and errors as ``open`` (a bad value raises here, before any thread starts);
    the session's own event loop runs on a daemon thread until ``close``.
    """
    session = open_session(model, devices=devices, budget=budget, mode=mode, policy=policy,
                           verify=verify, backend=backend, log=log, tuning=tuning)
    thread = LoopThread()
    try:
        thread.run(session._open())
    except BaseException:
        thread.stop()
        raise
    return SyncSession(session, thread)
