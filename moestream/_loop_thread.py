"""The sync face's private event loop: a daemon thread, the lock that serializes it, and
the signals deferred while a caller holds that lock.

The loop's thread holds the lock whenever it runs (every callback and task step) and lets
go of it only while it waits for events in ``select``. A call that never waits runs on the
caller's own thread under that lock (``LoopThread.call``, ``LoopThread.query``); a call that
is the loop's work (opening and closing the session) runs on the loop while the caller
blocks without it (``LoopThread.run``); a call that may wait but mostly does not runs on the
caller's thread up to its first wait and on the loop from there (``LoopThread.run_eager``).
A wait for an expert is neither: the caller blocks on its own ``ThreadWaiter``, between two
``call``s.
``moestream._sync``'s docstring says which calls take which path.

Signals (``Deferral``): Python runs signal handlers on the main thread, between any two
bytecodes, so a ``KeyboardInterrupt`` (Ctrl-C, or a timer's handler that raises) could land
half way through a fetch's bookkeeping: pins taken and never recorded, a cache index half
updated. So while a call holds the session's lock on the main thread, the Python handlers
present when the session opened (``default_int_handler`` for SIGINT, and any the
application had installed) only note the signal; the call finishes, and the handlers then
run, in order, before the call returns (a fetch whose caller is interrupted that way
releases its lease). A handler installed after the session opened is not deferred.
Deferring costs two integer updates per call; the handlers are wrapped once per process
(when the first loop thread starts on the main thread) and restored when the last one
stops there.
"""

from __future__ import annotations

import asyncio
import contextlib
import selectors
import signal
import threading
from _thread import allocate_lock
from asyncio.events import _get_running_loop, _set_running_loop
from collections.abc import Callable, Coroutine, Iterator
from threading import get_ident
from types import FrameType
from typing import Any, TypeVar

from moestream.pipeline.foundation.errors import UsageError

__all__ = ["DEFERRAL", "Deferral", "LoopThread"]

T = TypeVar("T")

Handler = Callable[[int, FrameType | None], Any]


class Deferral:
    """The process's deferral of Python signal handlers on the main thread."""

    __slots__ = ("_originals", "_users", "busy", "main", "pending")

    def __init__(self) -> None:
        self.main = threading.main_thread().ident
        self.busy = 0
        self.pending: list[tuple[Handler, int, FrameType | None]] = []
        self._originals: dict[int, Handler] = {}
        self._users = 0

    def install(self) -> None:
        """Wrap the Python handlers now installed (main thread only; elsewhere a no-op:
        the session's calls there are never interrupted by a handler)."""
        if threading.get_ident() != self.main:
            return
        self._users += 1
        if self._users > 1:
            return
        for signum in signal.valid_signals():
            try:
                handler = signal.getsignal(signum)
            except (ValueError, OSError):
                continue
            if callable(handler) and not getattr(handler, "_moestream_deferred", False):
                self._originals[signum] = handler
                signal.signal(signum, self._wrap(handler))

    def uninstall(self) -> None:
        """Restore the handlers wrapped (when the last user leaves, on the main thread)."""
        if threading.get_ident() != self.main or self._users == 0:
            return
        self._users -= 1
        if self._users:
            return
        for signum, handler in self._originals.items():
            current = signal.getsignal(signum)
            if getattr(current, "_moestream_deferred", False):
                signal.signal(signum, handler)
        self._originals.clear()

    def _wrap(self, handler: Handler) -> Handler:
        def deferred(signum: int, frame: FrameType | None) -> Any:
            if self.busy:
                self.pending.append((handler, signum, frame))
                return None
            return handler(signum, frame)

        deferred._moestream_deferred = True  # type: ignore[attr-defined]
        return deferred

    @contextlib.contextmanager
    def holding(self, main: bool) -> Iterator[None]:
        """Defer the handlers meanwhile (when ``main``: on the main thread), then run
        those of signals that arrived."""
        if not main:
            yield
            return
        self.busy += 1
        try:
            yield
        finally:
            self.busy -= 1
            if self.pending and not self.busy:
                self.run_pending()

    def run_pending(self) -> None:
        """Run the handlers of the signals that arrived meanwhile (each may raise)."""
        pending, self.pending = self.pending, []
        for handler, signum, frame in pending:
            handler(signum, frame)


DEFERRAL = Deferral()



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
        DEFERRAL.install()  # undone by ``stop``
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

    def run_eager(self, work: Coroutine[Any, Any, T]) -> T:
        """``run``, its first step taken on the calling thread as ``call`` runs a function:
        work that finishes without waiting (a token's end between two RAM samples, the
        common case) costs no hop to the loop, whose wake-up and the handover of the GIL
        between the two threads cost more than the work (~0.5 ms a token); work that waits
        goes on on the loop from where it stopped, as ``run``'s whole would (a task there
        sends it what its waits give, or throws a cancellation into it).

        Raises:
            UsageError: as ``run``.
        """
        try:
            finished, value = self.call(_first_step, work)
        except BaseException:
            work.close()  # never started (refused), or it raised and is closed already
            raise
        if finished:
            return value  # type: ignore[no-any-return]
        return self.run(_resume(work, value))

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


def _first_step(work: Coroutine[Any, Any, Any]) -> tuple[bool, Any]:
    """Run ``work`` to its first wait: (True, its result), or (False, what it yielded)."""
    try:
        return False, work.send(None)
    except StopIteration as stop:
        return True, stop.value


async def _resume(work: Coroutine[Any, Any, T], yielded: Any) -> T:
    """``work``, stopped at its first wait (having yielded ``yielded``), finished by the task
    running this, as if that task had run it from the start."""
    result: T = await _Resumed(work, yielded)
    return result


class _Resumed:
    """The awaitable of :func:`_resume`: each value ``work`` yields goes to the task, what
    the task sends or throws goes back into ``work``."""

    __slots__ = ("_work", "_yielded")

    def __init__(self, work: Coroutine[Any, Any, Any], yielded: Any) -> None:
        self._work, self._yielded = work, yielded

    def __await__(self) -> Any:
        work, yielded = self._work, self._yielded
        while True:
            try:
                sent = yield yielded
            except BaseException as exc:  # a cancellation (or a close) thrown into the task
                step: Callable[[Any], Any] = work.throw
                argument: Any = exc
            else:
                step, argument = work.send, sent
            try:
                yielded = step(argument)
            except StopIteration as stop:
                return stop.value
