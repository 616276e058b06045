"""The sync face's private event loop: a daemon thread, and the lock that serializes it.

The loop's thread holds the lock whenever it runs (every callback and task step) and lets
go of it only while it waits for events in ``select``. A call that never waits runs on the
caller's own thread under that lock (``LoopThread.call``, ``LoopThread.query``); a call that
waits runs on the loop while the caller blocks without it (``LoopThread.run``).
``moestream._sync``'s docstring says which calls take which path.
"""

from __future__ import annotations

import asyncio
import selectors
import threading
from _thread import allocate_lock
from asyncio.events import _get_running_loop, _set_running_loop
from collections.abc import Callable, Coroutine
from threading import get_ident
from typing import Any, TypeVar

from moestream._signals import DEFERRAL
from moestream.pipeline.foundation.errors import UsageError

__all__ = ["LoopThread"]

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


class LoopThread:
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

    def call(self, fn: Callable[..., T], *args: Any,
             undo: Callable[[T], object] | None = None) -> T:
        """Run ``fn`` (which never waits) on the calling thread, under the lock, with the
        loop as this thread's running loop; the loop is woken if ``fn`` gave it work.

        ``undo`` is applied to ``fn``'s result when a signal handler run after it raises:
        the result is never handed out (a lease, released rather than left pinned)."""
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
                        if done and undo is not None:  # never handed out
                            undo(result)
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
