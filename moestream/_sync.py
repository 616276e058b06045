"""The synchronous API, for engines without asyncio: the same session on a private loop.

``open_sync`` starts a uvloop event loop on a daemon thread and opens a ``Session`` there;
every call hops to that loop and waits for its answer (tens of microseconds), so the calls
may come from any of the engine's threads, one at a time or concurrently (they run in the
order they reach the loop). A call interrupted while it waits (``KeyboardInterrupt``)
cancels its work on the loop: a fetch interrupted part way behaves as a cancelled one.
"""

from __future__ import annotations

import asyncio
import functools
import os
import threading
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any, TypeVar

import uvloop

from gpu.interop import stream_pointer
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
from pipeline.foundation.config import Budget
from pipeline.foundation.errors import UsageError

__all__ = ["SyncLease", "SyncSession", "open_sync"]

T = TypeVar("T")


class _LoopThread:
    """A private event loop on a daemon thread, running coroutines for other threads."""

    def __init__(self) -> None:
        self.loop = uvloop.new_event_loop()
        self.thread = threading.Thread(target=self._serve, name="moestream-loop", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.run_until_complete(self.loop.shutdown_default_executor())
            self.loop.close()

    def run(self, work: Coroutine[Any, Any, T]) -> T:
        """Run ``work`` on the loop and wait for its result (its error is raised here).

        Raises:
            UsageError: called from the loop's own thread (it would wait on itself).
        """
        if threading.current_thread() is self.thread:
            work.close()
            raise UsageError("a SyncSession is not called from its own loop's thread "
                             "(use the Session it wraps there)")
        if not self.thread.is_alive():
            work.close()
            raise UsageError("the session is closed")
        future = asyncio.run_coroutine_threadsafe(work, self.loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # interrupted while waiting: stop the work too
            raise

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a plain function on the loop's thread."""

        async def called() -> T:
            return fn(*args)

        return self.run(called())

    def stop(self) -> None:
        if self.thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join()


async def _next(lease: Lease) -> ExpertHandle | None:
    try:
        return await lease.__anext__()
    except StopAsyncIteration:
        return None


class SyncLease(LeaseFacts):
    """A ``Lease`` for synchronous code: iterate it, or ``gather()``; leave its ``with``
    block (or ``release``) once the compute on its experts is queued."""

    __slots__ = ("_core", "_lease", "_loop", "_session")

    def __init__(self, session: SyncSession, lease: Lease, loop: _LoopThread) -> None:
        self._session = session
        self._lease = lease
        self._core = lease.core
        self._loop = loop

    def __iter__(self) -> Iterator[ExpertHandle]:
        return self

    def __next__(self) -> ExpertHandle:
        """As ``Lease.__anext__``."""
        handle = self._loop.run(_next(self._lease))
        if handle is None:
            raise StopIteration
        return handle

    def gather(self) -> list[ExpertHandle]:
        """As ``Lease.gather``."""
        return self._loop.run(self._lease.gather())

    def available(self) -> list[ExpertHandle]:
        """As ``Lease.available``."""
        return self._loop.call(self._lease.available)

    def release(self, after: After = None, *, ordered: bool = False) -> None:
        """As ``Lease.release``; None means each device's current CuPy stream *of the
        calling thread* (looked up here, before the hop to the loop's thread)."""
        if after is None and self._session.backend == "cupy":
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

    def fetch(self, layer: int, experts: Sequence[int]) -> SyncLease:
        """As ``Session.fetch``."""
        return SyncLease(self, self._loop.call(self._session.fetch, layer, list(experts)),
                         self._loop)

    def prefetch(self, layer: int, experts: Sequence[int]) -> int:
        """As ``Session.prefetch``."""
        return self._loop.call(self._session.prefetch, layer, list(experts))

    def ready(self, layer: int, experts: Sequence[int]) -> bool:
        """As ``Session.ready``."""
        return self._loop.call(self._session.ready, layer, list(experts))

    def end_token(self, *, compute_ms: float | Sequence[float] | None = None,
                  upload_ms: float = 0.0) -> TokenStats:
        """As ``Session.end_token``."""
        return self._loop.run(self._session.end_token(compute_ms=compute_ms,
                                                      upload_ms=upload_ms))

    def counters(self) -> Counters:
        """As ``Session.counters``."""
        return self._loop.call(self._session.counters)

    def close(self) -> None:
        """As ``Session.aclose``, then stop the loop's thread. Idempotent."""
        self.__exit__(None, None, None)

    def __enter__(self) -> SyncSession:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if not self._loop.thread.is_alive():  # closed already
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
    budget: str | Budget | None = None,
    mode: Mode = "auto",
    policy: str = "lru",
    verify: bool = True,
    backend: str = "auto",
    log: str | os.PathLike[str] | None = None,
    tuning: Tuning | None = None,
) -> SyncSession:
    """``moestream.open`` for synchronous code: the session is open when this returns.

    Arguments and errors as ``open``; the session's own loop (uvloop) runs on a daemon
    thread until ``close``.
    """
    session = open_session(model, devices=devices, budget=budget, mode=mode, policy=policy,
                           verify=verify, backend=backend, log=log, tuning=tuning)
    loop = _LoopThread()
    try:
        loop.run(session._open())
    except BaseException:
        loop.stop()
        raise
    return SyncSession(session, loop)
