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
(``CallerWait``), not left to the token's ``host`` time.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any, TypeVar

from moestream._args import ExpertIds, Index
from moestream._caller_wait import CALLER_WAIT, CallerWait, WaitRelay
from moestream._handles import ExpertHandle
from moestream._lease import After, Lease, LeaseFacts
from moestream._loop_thread import LoopThread
from moestream._model_info import ModelInfo, Router
from moestream._open import Mode
from moestream._open import open as open_session
from moestream._session import Session
from moestream._signals import DEFERRAL
from moestream._stats import Counters, TokenStats
from moestream._tuning import Tuning
from moestream.gpu.interop import stream_pointer
from moestream.pipeline.foundation.config import Budget
from moestream.pipeline.foundation.errors import UsageError
from moestream.pipeline.streaming.lease import NOT_YET

__all__ = ["SyncLease", "SyncSession", "open_sync"]

T = TypeVar("T")


def _waiting_for(lease: Lease, wait: CallerWait) -> int:
    """On the loop, at the start of a blocked call's work: route the lease's waits to
    ``wait``; returns how many handles the lease had handed out."""
    if not isinstance(lease._on_wait, WaitRelay):
        lease._on_wait = WaitRelay(lease._on_wait)
    CALLER_WAIT.set(wait)  # the task's own context: this call's work only
    return lease._handed_count()


def _landed_meanwhile(lease: Lease, wait: CallerWait, handed: int) -> None:
    """The expert the caller blocked for landed during its hop to the loop (the lease
    waited for nothing): the caller's wait is still one for that expert's load."""
    if wait.waits:
        return
    landed = lease._load_handed(handed)
    if landed is None:
        return
    relay = lease._on_wait
    assert isinstance(relay, WaitRelay)
    now = time.perf_counter()
    wait.saw(relay.charge, landed[0], landed[1], now, now)


async def _next(lease: Lease, wait: CallerWait) -> ExpertHandle | None:
    handed = _waiting_for(lease, wait)
    try:
        return await lease.__anext__()
    except StopAsyncIteration:
        return None
    finally:
        _landed_meanwhile(lease, wait, handed)


async def _gather(lease: Lease, wait: CallerWait) -> list[ExpertHandle]:
    handed = _waiting_for(lease, wait)
    try:
        return await lease.gather()
    finally:
        _landed_meanwhile(lease, wait, handed)


class SyncLease(LeaseFacts):
    """A ``Lease`` for synchronous code: iterate it, or ``gather()``; leave its ``with``
    block (or ``release``) once the compute on its experts is queued."""

    __slots__ = ("_layer_lease", "_lease", "_loop", "_session")

    def __init__(self, session: SyncSession, lease: Lease, loop: LoopThread) -> None:
        self._session = session
        self._lease = lease
        self._layer_lease = lease._layer_lease  # ``LeaseFacts``' own: the same facts
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

    def _blocked(self, work: Callable[[Lease, CallerWait], Coroutine[Any, Any, T]]) -> T:
        """Run ``work`` on the loop, the caller blocked: its whole wait is a stall
        (``CallerWait``)."""
        wait = CallerWait()
        try:
            return self._loop.run(work(self._lease, wait))
        finally:
            ended = time.perf_counter()
            with contextlib.suppress(UsageError):  # closed meanwhile: nothing to count
                self._loop.query(wait.settle, ended)

    def _gathered_now(self) -> list[ExpertHandle] | None:
        self._lease.available()
        return self._lease._in_order() if self._layer_lease.pending == 0 else None

    def available(self) -> list[ExpertHandle]:
        """As ``Lease.available``."""
        return self._loop.call(self._lease.available)

    def release(self, after: After = None, *, ordered: bool = False) -> None:
        """As ``Lease.release``; None means each device's current CuPy stream *of the
        calling thread*."""
        if self._layer_lease.released:
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

    def __init__(self, session: Session, loop: LoopThread) -> None:
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
        return self._loop.call(self._fetch, layer, experts, undo=SyncLease.release)

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

    def read_header(self) -> bytearray:
        """As ``Session.read_header`` (on the caller's thread, as ``read_tensor``)."""
        return self._session.read_header()

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
    loop = LoopThread()
    try:
        loop.run(session._open())
    except BaseException:
        loop.stop()
        raise
    return SyncSession(session, loop)
