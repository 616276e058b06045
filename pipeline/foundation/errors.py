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
"""

from __future__ import annotations

__all__ = [
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
]


class MoestreamError(Exception):
    """Base of every error moestream raises on purpose."""

    exit_code = 1


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
