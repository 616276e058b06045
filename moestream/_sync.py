"""The synchronous API, for engines without asyncio: the same session on a private loop.

``open_sync`` starts an event loop on a daemon thread and opens a ``Session`` there. The
loop's thread holds the session's lock whenever it runs (every callback and task step),
and lets go of it only while it waits for events. A call that never waits (``fetch``,
``prefetch``, ``ready``, ``available``, ``release``, ``counters``, and iterating a lease
whose next expert has landed) takes the lock and runs on the caller's own thread, with
the session's loop set as that thread's running loop meanwhile: no hop to the loop, so it
costs about what the same call costs on the asynchronous face. A call that waits
(iterating a lease whose next expert is loading, ``gather`` of one not yet landed,
``end_token``, ``close``) runs on the loop and the caller blocks without the lock.

Calls may come from any of the engine's threads, one at a time or concurrently: they are
serialized by the lock. A call interrupted while it waits (``KeyboardInterrupt``) cancels
its work on the loop; a fetch interrupted part way releases what it pinned.

A wait is a stall on this face as on the asynchronous one: a call blocked on the loop for
a lease's experts is charged, from the moment the caller blocked to the moment it is back
(the hops to the loop and back included), to what the awaited load was doing meanwhile
(``_CallerWait``), not left to the token's ``host`` time.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import selectors
import threading
import time
from _thread import allocate_lock
from asyncio.events import _get_running_loop, _set_running_loop
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from contextvars import ContextVar
from threading import get_ident
from types import TracebackType
from typing import Any, TypeVar

from moestream._args import ExpertIds, Index
from moestream._handles import ExpertHandle
from moestream._session import (
    After,
    Counters,
    Lease,
    LeaseFacts,
    Mode,
    ModelInfo,
    Router,
    Session,
    TokenStats,
    Tuning,
)
from moestream._session import open as open_session
from moestream._signals import DEFERRAL
from moestream.gpu.interop import stream_pointer
from moestream.pipeline.foundation.config import Budget
from moestream.pipeline.foundation.errors import UsageError
from moestream.pipeline.streaming.lease import NOT_YET, LayerLease

__all__ = ["SyncLease", "SyncSession", "open_sync"]

T = TypeVar("T")


class _LockedSelector(selectors.DefaultSelector):
    """The loop's selector: the loop's thread lets go of ``lock`` only while it waits in
    ``select``, so it runs everything else under the lock."""

    def __init__(self, lock: threading.Lock) -> None:
        super().__init__()
        self._lock = lock

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        self._lock.release()
        try:
            return super().select(timeout)
        finally:
            self._lock.acquire()


class _LoopThread:
    """A private event loop on a daemon thread, and the lock that makes its state safe to
    touch from other threads (see the module's docstring)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.loop = asyncio.SelectorEventLoop(_LockedSelector(self.lock))
        self.closed = False
        self.thread = threading.Thread(target=self._serve, name="moestream-loop", daemon=True)
        self.thread.start()
        self._ident = self.thread.ident

    def _serve(self) -> None:
        with self.lock:
            asyncio.set_event_loop(self.loop)
            try:
                self.loop.run_forever()
            finally:
                self.loop.run_until_complete(self.loop.shutdown_asyncgens())
                self.loop.run_until_complete(self.loop.shutdown_default_executor())
                self.loop.close()

    def _refuse_own_thread(self) -> None:
        if threading.get_ident() == self._ident:
            raise UsageError("a SyncSession is not called from its own loop's thread "
                             "(use the Session it wraps there)")

    def run(self, work: Coroutine[Any, Any, T]) -> T:
        """Run ``work`` on the loop and wait for its result (its error is raised here).

        The wait is a plain lock's acquire, which a signal interrupts cleanly (a
        ``Condition``'s wait, as ``Future.result`` does, can break its lock); the future's
        own bookkeeping runs with the main thread's handlers deferred. Interrupted while
        waiting, the work on the loop is cancelled.

        Raises:
            UsageError: called from the loop's own thread (it would wait on itself), or the
                session is closed.
        """
        if get_ident() == self._ident or self.closed:
            work.close()
            self._refuse_own_thread()
            raise UsageError("the session is closed")
        deferral = DEFERRAL
        main = get_ident() == deferral.main
        waiter = allocate_lock()
        waiter.acquire()
        with deferral.holding(main):
            future = asyncio.run_coroutine_threadsafe(work, self.loop)
            future.add_done_callback(lambda _: waiter.release())
        try:
            waiter.acquire()
        except BaseException:
            with deferral.holding(main):
                future.cancel()  # interrupted while waiting: stop the work too
            raise
        with deferral.holding(main):
            return future.result()

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn`` (which never waits) on the calling thread, under the lock, with the
        loop as this thread's running loop; the loop is woken if ``fn`` gave it work."""
        ident = get_ident()
        if ident == self._ident:
            self._refuse_own_thread()
        deferral = DEFERRAL
        main = ident == deferral.main  # where signal handlers run: deferred meanwhile
        if main:  # first: an interrupt must not land between taking the lock and ``try``
            deferral.busy += 1
        done = False
        try:
            with self.lock:
                if self.closed:
                    raise UsageError("the session is closed")
                loop = self.loop
                # private fields of asyncio's loop, read to wake it only when needed: a
                # wake is a write to its self-pipe, which would cost more than most calls
                ready = loop._ready  # type: ignore[attr-defined]
                queued, timers = len(ready), len(loop._scheduled)  # type: ignore[attr-defined]
                outer = _get_running_loop()
                _set_running_loop(loop)
                try:
                    result = fn(*args)
                    done = True
                finally:
                    _set_running_loop(outer)
                    if len(ready) != queued or len(loop._scheduled) != timers:  # type: ignore[attr-defined]
                        loop._write_to_self()  # type: ignore[attr-defined]
        finally:
            if main:
                deferral.busy -= 1
                if deferral.pending:
                    try:
                        deferral.run_pending()  # outside the lock: a handler may call us
                    except BaseException:
                        if done and isinstance(result, SyncLease):  # never handed out
                            result.release()
                        raise
        return result

    def query(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn``, a pure query of the session's state, on the calling thread under
        the lock (no running loop needed, nothing to wake)."""
        deferral = DEFERRAL
        main = get_ident() == deferral.main
        if main:
            deferral.busy += 1
        try:
            with self.lock:
                if self.closed:
                    raise UsageError("the session is closed")
                return fn(*args)
        finally:
            if main:
                deferral.busy -= 1
                if deferral.pending:
                    deferral.run_pending()

    def stop(self) -> None:
        if not self.closed:
            self.closed = True
            DEFERRAL.uninstall()
        if self.thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join()


WaitCharge = Callable[[Any, Any, float, float], None]
"""A lease's ``on_wait``: (entry, load, start, end), as ``pipeline.streaming.lease.LayerLease``."""


class _CallerWait:
    """One call of an engine's thread blocked on the loop for a lease's experts (iterating
    one still loading, ``gather``).

    The lease measures its waits on the loop, from when the call's work started there to
    when the expert was delivered there; the caller was blocked longer, by the hop to the
    loop (while the load went on) and the hop back. The waits seen on the loop are kept
    here (``saw``, on the loop's thread) and charged once the caller is back (``settle``,
    on the caller's thread), the first from when the caller blocked, the last to when it
    was back: the session splits each by what the load was doing, as for an async engine
    whose wait is its own. Both run under the session's lock.
    """

    __slots__ = ("settled", "started", "waits")

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.waits: list[tuple[WaitCharge, Any, Any, float, float]] = []
        self.settled = False

    def saw(self, charge: WaitCharge, entry: Any, load: Any, start: float,
            end: float) -> None:
        if self.settled:  # the caller left (interrupted): nothing more to stretch
            charge(entry, load, start, end)
        else:
            self.waits.append((charge, entry, load, start, end))

    def settle(self, ended: float) -> None:
        self.settled = True
        last = len(self.waits) - 1
        for i, (charge, entry, load, start, end) in enumerate(self.waits):
            charge(entry, load, min(start, self.started) if i == 0 else start,
                   max(end, ended) if i == last else end)
        self.waits.clear()


_CALLER: ContextVar[_CallerWait | None] = ContextVar("moestream_caller_wait", default=None)
"""The blocked call whose work runs in this task on the loop (None: an async caller)."""


class _Relay:
    """A lease's ``on_wait`` once a sync caller waited on it: a wait seen in the work of a
    blocked call goes to that call's ``_CallerWait``, any other straight on."""

    __slots__ = ("charge",)

    def __init__(self, charge: WaitCharge) -> None:
        self.charge = charge

    def __call__(self, entry: Any, load: Any, start: float, end: float) -> None:
        wait = _CALLER.get()
        if wait is None:
            self.charge(entry, load, start, end)
        else:
            wait.saw(self.charge, entry, load, start, end)


def _waiting_for(lease: Lease, wait: _CallerWait) -> tuple[LayerLease, int]:
    """On the loop, at the start of a blocked call's work: route the lease's waits to
    ``wait``; returns the lease's core and how many handles it had handed out."""
    core = lease._core
    if not isinstance(core.on_wait, _Relay):
        core.on_wait = _Relay(core.on_wait)
    _CALLER.set(wait)  # the task's own context: this call's work only
    return core, len(lease._handed)


def _landed_meanwhile(lease: Lease, wait: _CallerWait, core: LayerLease, handed: int) -> None:
    """The expert the caller blocked for landed during its hop to the loop (the lease
    waited for nothing): the caller's wait is still one for that expert's load."""
    if wait.waits or len(lease._handed) <= handed:
        return
    first = lease._handed[handed]
    relay = core.on_wait
    assert isinstance(relay, _Relay)
    now = time.perf_counter()
    wait.saw(relay.charge, first._entry, first._part.load, now, now)


async def _next(lease: Lease, wait: _CallerWait) -> ExpertHandle | None:
    core, handed = _waiting_for(lease, wait)
    try:
        return await lease.__anext__()
    except StopAsyncIteration:
        return None
    finally:
        _landed_meanwhile(lease, wait, core, handed)


async def _gather(lease: Lease, wait: _CallerWait) -> list[ExpertHandle]:
    core, handed = _waiting_for(lease, wait)
    try:
        return await lease.gather()
    finally:
        _landed_meanwhile(lease, wait, core, handed)


class SyncLease(LeaseFacts):
    """A ``Lease`` for synchronous code: iterate it, or ``gather()``; leave its ``with``
    block (or ``release``) once the compute on its experts is queued."""

    __slots__ = ("_core", "_lease", "_loop", "_session")

    def __init__(self, session: SyncSession, lease: Lease, loop: _LoopThread) -> None:
        self._session = session
        self._lease = lease
        self._core = lease._core
        self._loop = loop

    def __iter__(self) -> Iterator[ExpertHandle]:
        return self

    def __next__(self) -> ExpertHandle:
        """As ``Lease.__anext__``: on the caller's thread if the expert has landed, else
        waiting on the loop."""
        handle = self._loop.call(self._lease._next_nowait)
        if handle is NOT_YET:
            handle = self._blocked(_next)
        if handle is None:
            raise StopIteration
        assert isinstance(handle, ExpertHandle)
        return handle

    def gather(self) -> list[ExpertHandle]:
        """As ``Lease.gather``: on the caller's thread if every expert has landed."""
        done = self._loop.call(self._gathered_now)
        return done if done is not None else self._blocked(_gather)

    def _blocked(self, work: Callable[[Lease, _CallerWait], Coroutine[Any, Any, T]]) -> T:
        """Run ``work`` on the loop, the caller blocked: its whole wait is a stall
        (``_CallerWait``)."""
        wait = _CallerWait()
        try:
            return self._loop.run(work(self._lease, wait))
        finally:
            ended = time.perf_counter()
            with contextlib.suppress(UsageError):  # closed meanwhile: nothing to count
                self._loop.query(wait.settle, ended)

    def _gathered_now(self) -> list[ExpertHandle] | None:
        self._lease.available()
        return self._lease._in_order() if self._core.pending == 0 else None

    def available(self) -> list[ExpertHandle]:
        """As ``Lease.available``."""
        return self._loop.call(self._lease.available)

    def release(self, after: After = None, *, ordered: bool = False) -> None:
        """As ``Lease.release``; None means each device's current CuPy stream *of the
        calling thread*."""
        if self._core.released:
            return
        if after is None and self._session._cupy:
            after = _current_streams(self._session.devices)
        self._loop.call(functools.partial(self._lease.release, after, ordered=ordered))

    def __enter__(self) -> SyncLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"Sync{self._lease!r}"


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

    def __init__(self, session: Session, loop: _LoopThread) -> None:
        self._session = session
        self._loop = loop
        self._cupy = session.backend == "cupy"

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
        return self._loop.call(self._session.router, seed)

    def fetch(self, layer: Index, experts: ExpertIds) -> SyncLease:
        """As ``Session.fetch`` (on the caller's thread: it never waits)."""
        return self._loop.call(self._fetch, layer, experts)

    def _fetch(self, layer: Index, experts: ExpertIds) -> SyncLease:
        lease = self._session._fetch(layer, experts)
        try:
            return SyncLease(self, lease, self._loop)
        except BaseException:  # interrupted before the caller got it: it pins nothing
            lease.release()
            raise

    def prefetch(self, layer: Index, experts: ExpertIds) -> int:
        """As ``Session.prefetch`` (on the caller's thread)."""
        return self._loop.call(self._session._prefetch, layer, experts)

    def read_tensor(self, name: str) -> bytearray:
        """As ``Session.read_tensor`` (on the caller's thread: a blocking read that needs
        nothing of the loop)."""
        return self._session.read_tensor(name)

    def ready(self, layer: Index, experts: ExpertIds) -> bool:
        """As ``Session.ready`` (on the caller's thread)."""
        return self._loop.query(self._session._ready, layer, experts)

    def end_token(self, *, compute_ms: float | Sequence[float] | None = None,
                  upload_ms: float = 0.0) -> TokenStats:
        """As ``Session.end_token`` (on the loop: it may wait for the controller)."""
        return self._loop.run(self._session.end_token(compute_ms=compute_ms,
                                                      upload_ms=upload_ms))

    def counters(self) -> Counters:
        """As ``Session.counters`` (on the caller's thread; it releases leases dropped
        meanwhile, as every call does)."""
        return self._loop.call(self._session._counters)

    def close(self) -> None:
        """As ``Session.aclose``, then stop the loop's thread. Idempotent."""
        self.__exit__(None, None, None)

    def __enter__(self) -> SyncSession:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._loop.closed:  # closed already
            return
        try:  # as ``Session.__aexit__``: a failed with block closes without raising over it
            self._loop.run(self._session.__aexit__(exc_type, exc, tb))
        finally:
            self._loop.stop()

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
    DEFERRAL.install()
    loop = _LoopThread()
    try:
        loop.run(session._open())
    except BaseException:
        loop.stop()
        raise
    return SyncSession(session, loop)
