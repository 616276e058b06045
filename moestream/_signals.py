"""Signals deferred while the sync face changes the session's state on the main thread.

The sync face runs its non-waiting calls on the caller's thread (``moestream._sync``).
Python runs signal handlers on the main thread, between any two bytecodes, so a
``KeyboardInterrupt`` (Ctrl-C, or a timer's handler that raises) could land half way
through a fetch's bookkeeping: pins taken and never recorded, a cache index half updated.
So while a call holds the session's lock on the main thread, the Python handlers present
when the session opened (``default_int_handler`` for SIGINT, and any the application had
installed) only note the signal; the call finishes, and the handlers then run, in order,
before the call returns (a fetch whose caller is interrupted that way releases its lease).
A handler installed after the session opened is not deferred.

Deferring costs two integer updates per call; the handlers are wrapped once per process
and restored when the last session closes on the main thread.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

__all__ = ["DEFERRAL", "Deferral"]

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
