"""Input files: regular files only, checked without ever blocking.

Opening a FIFO for reading waits for a writer, possibly forever, and a character device
(``/dev/zero``, a terminal) streams without end; either would hang a command in a system
call that no signal handler written in Python can interrupt. Inputs (the model, a routing
trace, run logs to analyze) are opened here: ``O_NONBLOCK`` (a FIFO opens at once), then
``fstat`` on the descriptor, refused unless it is a regular file, and only then switched to
blocking reads. Outputs have their own rules in ``pipeline.foundation.outputs``.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO

__all__ = ["NotRegularFileError", "file_kind", "open_input", "require_regular_file"]

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


class NotRegularFileError(OSError):
    """The input exists but is not a regular file; ``strerror`` says what it is.

    An ``OSError``, so callers that already turn open errors into their own one-line errors
    (``cannot read: ...``) report it the same way.
    """

    def __init__(self, path: str | os.PathLike[str], kind: str) -> None:
        super().__init__(f"is {kind}, not a regular file")
        self.strerror = f"is {kind}, not a regular file"
        self.filename = os.fspath(path)


def file_kind(mode: int) -> str | None:
    """What a non-regular file is (``a FIFO``), from its ``st_mode``; None for a regular file."""
    if stat.S_ISREG(mode):
        return None
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def open_input(path: str | os.PathLike[str]) -> BinaryIO:
    """Open ``path`` for binary reading if it is a regular file, without blocking.

    Raises:
        NotRegularFileError: a directory, FIFO, device or socket.
        OSError: as ``open`` raises it (missing, permission denied).
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        kind = file_kind(os.fstat(fd).st_mode)
        if kind is not None:
            raise NotRegularFileError(path, kind)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def require_regular_file(path: str | os.PathLike[str]) -> Path:
    """Check, without blocking, that ``path`` opens as a regular file; returns it as a Path.

    Raises:
        NotRegularFileError: a directory, FIFO, device or socket.
        OSError: as ``open`` raises it (missing, permission denied).
    """
    open_input(path).close()
    return Path(path)
