"""Stop signals for the command lines: SIGINT, SIGTERM and SIGHUP, handled the same way.

By default Python turns only SIGINT into an exception (``KeyboardInterrupt``); SIGTERM and
SIGHUP end the process on the spot, so no ``finally`` block runs and an atomic write leaves
its hidden temporary file behind (``.NAME.*.tmp``, hundreds of MB for a model). A command
whose entry point is decorated with :func:`stoppable` handles all three alike: the first
raises :class:`Stopped` in the main thread, so context managers and ``finally`` blocks clean
up, then the command prints ``PROG: interrupted by NAME`` and returns :func:`exit_code`
(128 + the signal's number: 130, 143, 129); a second signal exits at once (``os._exit``),
cleanup or not.

:func:`exit_on_signals` is the bare form, for a process that has nothing to clean up yet
(``python -m pipeline.run`` while it imports and parses, before its event loop's own
handlers take over): the same line, then ``os._exit``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any, ParamSpec

__all__ = [
    "STOP_SIGNALS",
    "Stopped",
    "exit_code",
    "exit_on_signals",
    "restore_signals",
    "stop_on_signals",
    "stoppable",
]

STOP_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""The signals that stop a command: interrupt, terminate, hang-up."""

_P = ParamSpec("_P")


def exit_code(signum: int) -> int:
    """The exit status of a command stopped by ``signum``: 128 + its number, as a shell
    reports a process the signal killed (SIGINT 130, SIGTERM 143, SIGHUP 129)."""
    return 128 + signum


class Stopped(BaseException):
    """A stop signal arrived (raised by the handler :func:`stop_on_signals` installs).

    Not an ``Exception``, as ``KeyboardInterrupt`` is not: ``except Exception`` lets it
    through, ``finally`` blocks and context managers run.
    """

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.name = signal.Signals(signum).name
        self.exit_code = exit_code(signum)
        super().__init__(f"stopped by {self.name}")


def _write_line(prog: str, text: str) -> None:
    with contextlib.suppress(OSError):  # stderr may be gone (a closed terminal: SIGHUP)
        os.write(2, f"{prog}: {text}\n".encode())


def _install(handler: Any) -> dict[int, Any] | None:
    """Install ``handler`` for every stop signal; the previous handlers, or None off the
    main thread (where Python does not allow it)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    previous: dict[int, Any] = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    for s in STOP_SIGNALS:
        signal.signal(s, handler)
    return previous


def restore_signals(previous: dict[int, Any] | None) -> None:
    """Put back the handlers :func:`exit_on_signals` returned."""
    for s, handler in (previous or {}).items():
        signal.signal(s, handler if handler is not None else signal.SIG_DFL)


def exit_on_signals(prog: str) -> dict[int, Any] | None:
    """From now on a stop signal prints ``PROG: interrupted by NAME`` and exits at once with
    :func:`exit_code`. Returns the previous handlers (None off the main thread)."""

    def handler(signum: int, frame: FrameType | None) -> None:
        _write_line(prog, f"interrupted by {signal.Signals(signum).name}")
        os._exit(exit_code(signum))

    return _install(handler)


@contextlib.contextmanager
def stop_on_signals(prog: str) -> Iterator[None]:
    """Within the block, the first stop signal raises :class:`Stopped`; a second one prints
    a line and exits at once. The previous handlers come back when the block ends. Off the
    main thread it does nothing.

    Args:
        prog: the command's name, for the line a second signal prints.
    """
    stopping: list[int] = []

    def handler(signum: int, frame: FrameType | None) -> None:
        if stopping:
            _write_line(prog, f"second signal ({signal.Signals(signum).name}) while "
                        "cleaning up: exiting at once")
            os._exit(exit_code(stopping[0]))
        stopping.append(signum)
        raise Stopped(signum)

    previous = _install(handler)
    try:
        yield
    finally:
        restore_signals(previous)


def stoppable(prog: str) -> Callable[[Callable[_P, int]], Callable[_P, int]]:
    """Decorate a command's ``main`` (which returns its exit status) to run it inside
    :func:`stop_on_signals`; a :class:`Stopped` it lets out becomes one line on stderr and
    the signal's exit status.

    Args:
        prog: the command's name, the prefix of its lines.
    """

    def decorate(main: Callable[_P, int]) -> Callable[_P, int]:
        @functools.wraps(main)
        def run(*args: _P.args, **kwargs: _P.kwargs) -> int:
            try:
                with stop_on_signals(prog):
                    return main(*args, **kwargs)
            except Stopped as stop:
                _write_line(prog, f"interrupted by {stop.name}")
                return stop.exit_code

        return run

    return decorate
