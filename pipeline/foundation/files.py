"""The model's files, opened once: one identity per run, one address space for all shards.

A model is one GGUF file or the shards of a Hugging Face checkpoint. Each file is opened
once, when the expert table is built from it; its identity (device, inode, size,
modification and change times) is taken from that descriptor with ``fstat``, and every
later open by any part of the run (readers, the resident mapping, the manifest builder, the
warm-up tool) is checked against it with ``open_checked``. A file renamed over the model,
replaced or written in place between the table's read and any later open is therefore
caught, never read at the table's offsets: nothing computed from a second open is trusted.

The shards are laid end to end in one address space, each at a page-aligned base right after
the page-rounded end of the one before. The expert table's offsets are offsets of that
space: a GGUF file is one shard at base 0, so its offsets are plain file offsets, and a range
never spans two shards (a tensor lies in one file). Page alignment keeps O_DIRECT's rules
(a 4096-aligned offset of the space is 4096-aligned in its file) and lets the resident
mapping place every shard's mapping at ``base`` of one reserved region, so an offset is an
address there too.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from moestream.pipeline.foundation.errors import ModelChangedError, ModelFileError
from moestream.pipeline.foundation.inputs import file_kind

__all__ = ["PAGE_BYTES", "FileIdentity", "ModelFile", "Piece", "check_identity", "lay_out",
           "locate", "model_files", "open_checked", "open_identified", "pieces"]

PAGE_BYTES = 4096


@dataclass(frozen=True, slots=True)
class FileIdentity:
    """What must not change while a run uses a file (from one ``fstat``)."""

    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileIdentity:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def change(self, now: FileIdentity, when: str) -> str | None:
        """How ``now`` differs from this identity, in words (``when`` it happened); None when
        it does not."""
        if (now.dev, now.ino) != (self.dev, self.ino):
            return f"replaced by another file {when}"
        if now.size < self.size:
            return f"truncated {when} ({now.size} bytes, was {self.size})"
        if now != self:
            return (f"modified {when} (size {self.size} -> {now.size}, modification or change "
                    "time moved)")
        return None


@dataclass(frozen=True, slots=True)
class ModelFile:
    """One file of the model and where it sits in the model's address space.

    Attributes:
        path: the file.
        base: the offset of its byte 0 in the model's address space (page-aligned).
        identity: the file as the table's open saw it.
        end: the end of its data in the address space.
        span_end: where the next file's base is: the page-rounded end.
    """

    path: Path
    base: int
    identity: FileIdentity
    end: int = field(init=False)
    span_end: int = field(init=False)

    def __post_init__(self) -> None:
        # kept, not worked out again by every read that asks where its file ends
        size = self.identity.size
        object.__setattr__(self, "end", self.base + size)
        object.__setattr__(self, "span_end", self.base + -(-size // PAGE_BYTES) * PAGE_BYTES)

    @property
    def nbytes(self) -> int:
        return self.identity.size


@dataclass(frozen=True, slots=True)
class Piece:
    """The part of a range of the address space that lies in one file."""

    file: ModelFile
    local: int  # offset in the file
    at: int  # offset from the start of the range
    nbytes: int


def open_identified(path: Path, what: str = "model file") -> tuple[int, FileIdentity]:
    """Open ``path`` read-only without blocking, refuse anything but a regular file, and take
    its identity from the descriptor. The caller owns the descriptor.

    Raises:
        ModelFileError: missing, unreadable, or not a regular file.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError as exc:
        raise ModelFileError(path, "no such file") from exc
    except OSError as exc:
        raise ModelFileError(path, f"cannot open: {exc.strerror or exc}") from exc
    try:
        st = os.fstat(fd)
        kind = file_kind(st.st_mode)
        if kind is not None:
            raise ModelFileError(path, f"is {kind}, not a regular file ({what} expected)")
        os.set_blocking(fd, True)
        return fd, FileIdentity.of(st)
    except BaseException:
        os.close(fd)
        raise


def open_checked(file: ModelFile, flags: int = 0) -> int:
    """Open ``file.path`` (``O_RDONLY | flags``) and check it is still the file the table was
    built from. The caller owns the descriptor.

    Raises:
        ModelChangedError: the path now names another file, or the file was written.
        ModelFileError: it cannot be opened any more.
        OSError: ``flags`` refused (O_DIRECT on tmpfs: EINVAL), for the caller to handle.
    """
    try:
        fd = os.open(file.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | flags)
    except FileNotFoundError as exc:
        raise ModelChangedError(file.path, "removed since the run opened it") from exc
    try:
        check_identity(file, fd)
        os.set_blocking(fd, True)
        return fd
    except BaseException:
        os.close(fd)
        raise


def check_identity(file: ModelFile, fd: int) -> None:
    """Raise ``ModelChangedError`` unless ``fd`` is ``file`` as the table saw it."""
    change = file.identity.change(FileIdentity.of(os.fstat(fd)), "since the run read its header")
    if change is not None:
        raise ModelChangedError(file.path, f"{change}; nothing of the changed file is used")


def model_files(model: str | os.PathLike[str] | Sequence[ModelFile]) -> tuple[ModelFile, ...]:
    """The files of ``model``: the table's as they are, or one file identified now."""
    if isinstance(model, (str, os.PathLike)):
        path = Path(model)
        fd, identity = open_identified(path)
        os.close(fd)
        return lay_out([(path, identity)])
    if not model:
        raise ValueError("a model has at least one file")
    return tuple(model)


def lay_out(paths: Sequence[tuple[Path, FileIdentity]]) -> tuple[ModelFile, ...]:
    """The files in the given order, each at the page-rounded end of the one before."""
    out: list[ModelFile] = []
    base = 0
    for path, identity in paths:
        f = ModelFile(path, base, identity)
        out.append(f)
        base = f.span_end
    return tuple(out)


def _base(file: ModelFile) -> int:
    return file.base


def locate(files: Sequence[ModelFile], offset: int) -> ModelFile:
    """The file whose span holds ``offset`` of the address space.

    Raises:
        IndexError: the offset lies in no file.
    """
    # on every read's path: one file is the common case, and no list of bases is built
    i = 0 if len(files) == 1 else bisect.bisect_right(files, offset, key=_base) - 1
    if i < 0 or offset >= files[i].span_end:
        raise IndexError(f"offset {offset} lies in no file of the model")
    return files[i]


def pieces(files: Sequence[ModelFile], offset: int, nbytes: int) -> Iterator[Piece]:
    """The parts of ``[offset, offset + nbytes)`` in each file, in order, each cut at its
    file's data end; the page padding between files is skipped."""
    end = offset + nbytes
    at = offset
    while at < end:
        f = locate(files, at)
        stop = min(end, f.span_end)
        data_stop = min(stop, f.end)
        if data_stop > at:
            yield Piece(f, at - f.base, at - offset, data_stop - at)
        at = stop
