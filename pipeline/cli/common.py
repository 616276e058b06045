"""What every moestream command line shares: safe one-line errors, and a stdout that may close.

Error lines name paths the user typed, and a path may hold any byte but ``/`` and NUL: a
newline would split the one-line error, an ESC would drive the terminal. :func:`printable`
(the error hierarchy's, ``moestream.pipeline.foundation.errors``, re-exported) escapes every control
character (C0, DEL, C1, and the undecodable bytes Python keeps as surrogates) the way
``repr`` does; :func:`print_error` prints through it, cut to a readable length.

A reader may close stdout before a command is done (``moestream-run | true``,
``moestream-analyze LOG | head -1``). That is not an error of the command: the rest of its
output is dropped (stdout is pointed at ``/dev/null``, so the interpreter's last flush
cannot fail either) and the exit status is the one the command would have had, 0 when it
succeeded. :func:`closable_stdout` wraps the code that writes to stdout.

Argument errors are one line too: :class:`UsageParser` raises them as ``UsageError`` (exit 2)
instead of printing the usage and exiting.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
from collections.abc import Iterator
from typing import NoReturn

from moestream.pipeline.foundation.errors import UsageError, one_line, printable

__all__ = ["UsageParser", "closable_stdout", "drop_stdout", "print_error", "printable"]


def print_error(prefix: str, error: object) -> None:
    """One line on stderr: ``prefix`` then the error's message, control characters escaped
    and cut to ``MAX_MESSAGE_CHARS`` (``moestream.pipeline.foundation.errors.one_line``: moestream's
    own errors are already cut; this also holds for any other)."""
    sys.stderr.write(f"{prefix}{one_line(str(error))}\n")
    sys.stderr.flush()


class UsageParser(argparse.ArgumentParser):
    """An argument parser whose errors are ``UsageError``s (one line, exit 2), not usage
    dumps and ``SystemExit``."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def drop_stdout() -> None:
    """Point stdout at ``/dev/null``: its reader has gone, and nothing written from now on,
    the interpreter's flush at exit included, may fail for that."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, ValueError, io.UnsupportedOperation):
        return  # a stdout with no descriptor (replaced in-process): no pipe to have closed
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


@contextlib.contextmanager
def closable_stdout() -> Iterator[None]:
    """Run a block that writes to stdout, then flush it; if stdout's reader has gone
    (``BrokenPipeError``), drop the rest of the output and go on after the block."""
    try:
        yield
        sys.stdout.flush()
    except BrokenPipeError:
        drop_stdout()
