"""Input files: regular files only, checked without ever blocking.

Opening a FIFO for reading waits for a writer, possibly forever, and a character device
(``/dev/zero``, a terminal) streams without end; either would hang a command in a system
call that no signal handler written in Python can interrupt. Inputs (the model, a routing
trace, run logs to analyze) are opened here: ``O_NONBLOCK`` (a FIFO opens at once), then
``fstat`` on the descriptor, refused unless it is a regular file, and only then switched to
blocking reads. Outputs have their own rules in ``moestream.pipeline.foundation.outputs``.

Inputs are also bounded in what they cost to parse: :func:`read_input` reads a whole file
only up to a size the caller derives from what the file can legitimately hold (a link to
``/dev/zero`` or a 64 GiB sparse file is refused, never read), and :func:`load_json_bounded`
is the one JSON loader for input documents: it refuses nesting deeper than a limit before
``json.loads`` would recurse into it (about 1000 levels raise ``RecursionError``, a
traceback, instead of the one-line error every other malformed input gets).
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Callable
from itertools import accumulate
from pathlib import Path
from typing import Any, BinaryIO

__all__ = [
    "JSON_MAX_DEPTH",
    "InputTooLargeError",
    "JSONDepthError",
    "NotRegularFileError",
    "file_kind",
    "json_depth",
    "load_json_bounded",
    "open_input",
    "read_input",
    "require_regular_file",
]

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


class InputTooLargeError(OSError):
    """The input is larger than anything it may legitimately hold; never read whole.

    An ``OSError`` for the same reason as :class:`NotRegularFileError`.
    """

    def __init__(self, path: str | os.PathLike[str], size: int, max_bytes: int) -> None:
        message = f"is {size} bytes or more, larger than the {max_bytes} it can hold"
        super().__init__(message)
        self.strerror = message
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


def read_input(path: str | os.PathLike[str], max_bytes: int,
               opener: Callable[[str | os.PathLike[str]], BinaryIO] | None = None) -> bytes:
    """The whole of a regular file of at most ``max_bytes`` bytes (opened by
    :func:`open_input`, or ``opener``, which checks more: never waits on a FIFO, never
    streams a device).

    The size is checked on the descriptor before reading, and at most ``max_bytes + 1``
    bytes are read, so a file that grows meanwhile is refused too, never held whole.

    Raises:
        NotRegularFileError: a directory, FIFO, device or socket.
        InputTooLargeError: larger than ``max_bytes``.
        OSError: as ``open`` and ``read`` raise it (missing, permission denied, I/O error).
    """
    with (opener or open_input)(path) as handle:
        size = os.fstat(handle.fileno()).st_size
        if size > max_bytes:
            raise InputTooLargeError(path, size, max_bytes)
        data = handle.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise InputTooLargeError(path, len(data), max_bytes)
    return data


JSON_MAX_DEPTH = 64
"""Default nesting limit of :func:`load_json_bounded`: every document moestream reads (trace
rows, log events, manifest headers) nests four levels or fewer."""


class JSONDepthError(ValueError):
    """A JSON document nests deeper than its reader allows.

    A ``ValueError``, as ``json.JSONDecodeError`` is: callers treat it as any other
    malformed document.
    """


# A JSON string: a quote, then characters and escapes up to the closing quote or the end of
# the text (an unterminated string runs to the end: every quote is scanned once, so the scan
# stays linear on any input).
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\[\s\S]?[^"\\]*)*"?')
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))
_STEP = [0] * 256
_STEP[ord("[")] = _STEP[ord("{")] = 1
_STEP[ord("]")] = _STEP[ord("}")] = -1


def json_depth(text: str | bytes | bytearray) -> int:
    """The deepest nesting of arrays and objects in a JSON text (0 for a scalar).

    Brackets inside strings (escaped quotes included) do not count. On malformed text the
    answer is an upper bound of what a parser would enter before failing.
    """
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else bytes(text)
    brackets = _JSON_STRING.sub(b"", data).translate(None, _NOT_BRACKETS)
    return max(accumulate(map(_STEP.__getitem__, brackets)), default=0)


def load_json_bounded(text: str | bytes | bytearray, what: str,
                      max_depth: int = JSON_MAX_DEPTH, *,
                      object_pairs_hook: Callable[[list[tuple[str, Any]]], Any] | None = None,
                      ) -> Any:
    """``json.loads(text)`` for an input document, refusing nesting deeper than
    ``max_depth`` before the parser recurses into it.

    The common case costs two ``count`` calls: a text with at most ``max_depth`` opening
    brackets cannot nest deeper; only other texts are scanned (:func:`json_depth`).

    Args:
        text: the document (a line of a JSON-lines file, a header).
        what: what it is, for the message (``trace.jsonl:3``, ``manifest header``).
        max_depth: the deepest nesting accepted.
        object_pairs_hook: as ``json.loads`` takes it (to refuse duplicate keys).

    Raises:
        JSONDepthError: nested deeper than ``max_depth``.
        json.JSONDecodeError: not JSON (also a ``ValueError``).
        UnicodeDecodeError: bytes that are not UTF-8 (also a ``ValueError``).
    """
    if isinstance(text, str):
        opening = text.count("[") + text.count("{")
    else:
        opening = text.count(b"[") + text.count(b"{")
    if opening > max_depth:
        depth = json_depth(text)
        if depth > max_depth:
            raise JSONDepthError(f"{what}: JSON nested {depth} levels deep, deeper than the "
                                 f"{max_depth} accepted")
    return json.loads(text, object_pairs_hook=object_pairs_hook)
