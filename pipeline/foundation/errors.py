"""The one error hierarchy of moestream.

Every failure a user can cause or meet is one of these; boundaries (file I/O, GGUF parsing,
CuPy) translate low-level errors into them with the context a user needs: the path, the
layer and expert, the byte offset. The CLI prints ``str(error)`` on one line and exits with
``error.exit_code``::

    MoestreamError
    ├── UsageError                 bad option or argument value (exit 2); a ValueError
    │   └── UsageTypeError         an argument of the wrong type; also a TypeError
    ├── ModelFileError             the model file cannot be used (exit 2)
    │   ├── NotGGUFError           wrong magic or unsupported version
    │   ├── TruncatedFileError     header or tensor data past the end of the file
    │   ├── ExpertLayoutError      expert tensors missing, inconsistent or of mixed types
    │   └── ModelChangedError      truncated, modified or replaced while running
    ├── TraceError                 a routing trace or log that does not fit the model (exit 2)
    ├── OutputError                an output file that cannot be written (exit 2)
    ├── StageError                 a pipeline stage failed while running (exit 1)
    │   ├── ReadError              a read failed or came back short; an OSError
    │   ├── UploadError            a host-to-device copy failed
    │   └── DeviceMemoryError      device or pinned allocation failed
    ├── ResidencyError             mincore / mlock / fadvise refused (exit 1)
    └── VerificationError          consumed bytes differ from the file's bytes (exit 3)

Every message is one readable line, whoever built it: the constructor escapes control
characters the way ``repr`` does (a newline would split the CLI's one line, an ESC from a
file name or a log would drive the terminal) and cuts a message longer than
``MAX_MESSAGE_CHARS`` in the middle, keeping its start and its end (what was wrong, and
usually what to do) around ``... (N more characters) ...``: a value echoed from a file or a
flag (a 4000-digit shape, a list of 20,000 layers) cannot make an error of megabytes.
"""

from __future__ import annotations

import unicodedata

__all__ = [
    "MAX_MESSAGE_CHARS",
    "DeviceMemoryError",
    "ExpertLayoutError",
    "ModelChangedError",
    "ModelFileError",
    "MoestreamError",
    "NotGGUFError",
    "OutputError",
    "ReadError",
    "ResidencyError",
    "StageError",
    "TraceError",
    "TruncatedFileError",
    "UploadError",
    "UsageError",
    "UsageTypeError",
    "VerificationError",
    "one_line",
    "printable",
]

MAX_MESSAGE_CHARS = 400
"""The longest message an error carries; a longer one keeps its first and last characters
(about five lines of a terminal in all)."""

_TAIL_CHARS = 80  # the end of a cut message: the clause that says what was expected
_MARK_CHARS = 40  # room for `` ... (N more characters) ... ``
_BREAK_CHARS = 30  # a cut moves back this far, at most, to end on a space or a comma

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(char: str) -> str:
    if char in _NAMED:
        return _NAMED[char]
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: str) -> str:
    """``text`` with each control character escaped as ``repr`` would (``\\n``, ``\\x1b``,
    ``\\x9b``, ``\\udcff``); everything else, non-ASCII letters included, as it is."""
    if text.isprintable():  # the common case: nothing to escape (spaces are printable)
        return text
    return "".join(_escape(c) if unicodedata.category(c) in ("Cc", "Cs") else c for c in text)


def one_line(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """``text`` escaped (``printable``) and, when longer than ``limit``, cut in the middle:
    its start and its last characters around ``... (N more characters) ...``.

    Args:
        text: the message.
        limit: the most characters the result has (at least 200).
    """
    text = printable(text)
    if len(text) <= limit:
        return text
    limit = max(limit, 200)
    head_end = limit - _TAIL_CHARS - _MARK_CHARS
    cut = max(text.rfind(" ", head_end - _BREAK_CHARS, head_end),
              text.rfind(",", head_end - _BREAK_CHARS, head_end))
    head = text[: cut + 1 if cut > 0 else head_end].rstrip()
    tail_start = len(text) - _TAIL_CHARS
    space = text.find(" ", tail_start, tail_start + _BREAK_CHARS)
    tail = text[space + 1 if space >= 0 else tail_start :]
    more = len(text) - len(head) - len(tail)
    return f"{head} ... ({more} more characters) ... {tail}"


class MoestreamError(Exception):
    """Base of every error moestream raises on purpose.

    Its message is made one readable line here (``one_line``), so the API's exceptions and
    the CLI's error line are short and safe alike, whatever value a message echoes.
    """

    exit_code = 1

    def __init__(self, *args: object) -> None:
        super().__init__(*(one_line(str(arg)) for arg in args))


class UsageError(MoestreamError, ValueError):
    """An option or argument has a value that cannot be used (also a ``ValueError``, the
    builtin a Python caller catches for a bad value)."""

    exit_code = 2


class UsageTypeError(UsageError, TypeError):
    """An argument of a type that cannot be used (also a ``TypeError``)."""


class ModelFileError(MoestreamError):
    """The model file cannot be used; the message names the file and the problem."""

    exit_code = 2

    def __init__(self, path: object, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = path
        self.problem = problem


class NotGGUFError(ModelFileError):
    """Wrong magic number or unsupported GGUF version."""


class TruncatedFileError(ModelFileError):
    """The header or some tensor data lies past the end of the file."""


class ExpertLayoutError(ModelFileError):
    """Routed-expert tensors are missing, inconsistent, or of mixed types."""


class ModelChangedError(ModelFileError):
    """The file was truncated, modified or replaced while the run was reading it.

    Bytes read after the change are never installed: the reader checks the file's identity
    (device, inode, size, modification time) after every read and raises this instead.
    """


class TraceError(MoestreamError):
    """A routing trace or log does not fit the model or is malformed."""

    exit_code = 2


class OutputError(MoestreamError):
    """An output file (log, trace, CSV, plot, model, result) cannot be written there.

    Raised before any work when the path is a directory, a device, a FIFO or a socket, when
    its directory is missing or refuses new files, or when another run holds the log; and
    while writing, when the file system refuses the bytes (full, too large, I/O error).
    """

    exit_code = 2

    def __init__(self, path: object, problem: str, *, what: str | None = None) -> None:
        super().__init__(f"{what} {path}: {problem}" if what else f"{path}: {problem}")
        self.path = path
        self.problem = problem


class StageError(MoestreamError):
    """A pipeline stage failed while running."""


class ReadError(StageError, OSError):
    """A read of expert bytes failed or came back short (also an ``OSError``)."""


class UploadError(StageError):
    """A host-to-device copy failed."""


class DeviceMemoryError(StageError):
    """Device or pinned host memory could not be allocated."""


class ResidencyError(MoestreamError):
    """A page-residency call (mincore, mlock, fadvise) was refused."""


class VerificationError(MoestreamError):
    """Bytes the decoder consumed differ from the model file's bytes."""

    exit_code = 3
