"""The blocking half of a warm-up: the pieces it is cut into and how one is loaded.

``WarmEngine`` (``moestream.stages.warm``) orchestrates on the event loop; the work runs on
its thread pool, here. ``plan_pieces`` cuts the ranges asked for into pieces, exact ones for
small stretches and stream ones for long stretches. ``PieceLoader`` owns the model's
descriptors (per file one advised ``FADV_RANDOM`` for exact pieces, one ``FADV_SEQUENTIAL``
for stream pieces, so other readers of the model keep their readahead) and pulls a piece
into the page cache with ``os.sendfile`` to ``/dev/null`` (the kernel reads the pages,
nothing is copied to user space) or ``os.preadv`` into a reusable per-thread buffer; both
release the GIL.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import structlog

from moestream.pipeline.foundation.errors import ReadError, ResidencyError
from moestream.pipeline.foundation.files import ModelFile, open_checked
from moestream.pipeline.foundation.files import pieces as file_parts
from moestream.pipeline.foundation.table import ByteRange
from moestream.stages.page_ranges import RangeLike
from moestream.stages.residency import hint_willneed

__all__ = ["Loader", "Piece", "PieceLoader", "plan_pieces"]

_log = structlog.get_logger("moestream.warm")

Loader = Literal["sendfile", "preadv"]
"""How ``WarmEngine`` pulls a piece into the page cache."""


@dataclass(frozen=True, slots=True)
class Piece:
    """One unit of work: a range, and whether it is part of a large sequential stretch."""

    range: ByteRange
    stream: bool


def plan_pieces(
    ranges: Iterable[RangeLike],
    piece_bytes: int,
    stream_piece_bytes: int,
    stream_min_bytes: int | None,
    file_bytes: int,
) -> list[Piece]:
    """Ranges clipped to the file, touching neighbours joined, cut into pieces, in order.

    A joined stretch of at least ``stream_min_bytes`` is cut into ``stream_piece_bytes``
    stream pieces; anything smaller into ``piece_bytes`` exact pieces.
    """
    joined: list[list[int]] = []
    for r in ranges:
        start, end = r.offset, min(r.offset + r.nbytes, file_bytes)
        if end <= start:
            continue
        if joined and joined[-1][1] == start:
            joined[-1][1] = end
        else:
            joined.append([start, end])
    out: list[Piece] = []
    for start, end in joined:
        stream = stream_min_bytes is not None and end - start >= stream_min_bytes
        size = stream_piece_bytes if stream else piece_bytes
        out.extend(
            Piece(ByteRange(offset, min(size, end - offset)), stream)
            for offset in range(start, end, size)
        )
    return out


class _SpliceUnsupported(Exception):
    """The file cannot be spliced (sendfile EINVAL/ENOSYS): use preadv instead."""


class PieceLoader:
    """Loads pieces of a model's files into the page cache, on the calling thread.

    Args:
        files: the model's files, each opened against the identity its table saw.
        path: the model's path, for messages.
        buffer_bytes: each thread's buffer for the ``preadv`` loader.
        loader: ``"sendfile"`` or ``"preadv"``; where the filesystem cannot splice, the
            first thread to notice switches to ``preadv`` for good, with a warning.
    """

    def __init__(self, files: Sequence[ModelFile], path: Path, buffer_bytes: int,
                 loader: Loader) -> None:
        self.files = files
        self.path = path
        self.buffer_bytes = buffer_bytes
        self.loader: Loader = loader
        # per file, by base: one descriptor for pieces, one for long stretches
        self._fds: dict[int, tuple[int, int]] = {}
        self._devnull = -1
        try:
            for f in files:
                fd = open_checked(f)
                try:
                    self._fds[f.base] = (fd, open_checked(f))
                except BaseException:
                    os.close(fd)
                    raise
            self._devnull = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
        except BaseException:
            self.close()
            raise
        self._advise()
        self._local = threading.local()

    def _advise(self) -> None:
        """Advice on these open files only: other readers of the model keep their readahead."""
        for fd, stream_fd in self._fds.values():
            for one, advice, name in ((fd, os.POSIX_FADV_RANDOM, "random"),
                                      (stream_fd, os.POSIX_FADV_SEQUENTIAL, "sequential")):
                try:
                    os.posix_fadvise(one, 0, 0, advice)
                except OSError as exc:
                    _log.warning("warm.fadvise_refused", path=str(self.path), advice=name,
                                 reason=exc.strerror)

    def _buffer(self) -> memoryview:
        buf: memoryview | None = getattr(self._local, "buf", None)
        if buf is None:
            # One buffer per thread, reused for every piece that thread reads; page-aligned
            # anonymous memory so the kernel copies into whole pages.
            buf = memoryview(mmap.mmap(-1, self.buffer_bytes))
            self._local.buf = buf
        return buf

    def load(self, piece: Piece, hints: tuple[ByteRange, ...], stop: threading.Event) -> int:
        """Hint ``hints``, then load ``piece``; returns the bytes loaded.

        The hints queue the piece's (and a later piece's) I/O at once, so a loader that
        waits on one part after another still keeps the disk busy.
        """
        if stop.is_set():
            return 0
        if hints:
            with contextlib.suppress(ResidencyError):  # advice: a failed hint costs nothing
                for hint in hints:
                    for part in file_parts(self.files, hint.offset, hint.nbytes):
                        hint_willneed(self._fds[part.file.base][0],
                                      [ByteRange(part.local, part.nbytes)])
        done = 0
        for part in file_parts(self.files, piece.range.offset, piece.range.nbytes):
            fds = self._fds[part.file.base]
            done += self._load_local(fds[1] if piece.stream else fds[0],
                                     ByteRange(part.local, part.nbytes))
        return done

    def _load_local(self, fd: int, local: ByteRange) -> int:
        """Load one range of one file (``fd``'s offsets)."""
        if self.loader == "sendfile":
            try:
                return self._sendfile(fd, local)
            except _SpliceUnsupported as exc:
                if self.loader == "sendfile":  # first thread to notice says it, once
                    self.loader = "preadv"
                    _log.warning("warm.sendfile_unsupported", path=str(self.path),
                                 reason=str(exc), fallback="preadv")
        return self._preadv(fd, local)

    def _sendfile(self, fd: int, piece: ByteRange) -> int:
        done = 0
        while done < piece.nbytes:
            try:
                n = os.sendfile(self._devnull, fd, piece.offset + done,
                                piece.nbytes - done)
            except OSError as exc:
                if done == 0 and exc.errno in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                    raise _SpliceUnsupported(exc.strerror or str(exc)) from None
                raise self._read_error(piece, done, exc) from None
            if n == 0:
                break  # the file shrank under us: nothing more to load
            done += n
        return done

    def _preadv(self, fd: int, piece: ByteRange) -> int:
        buf = self._buffer()
        done = 0
        while done < piece.nbytes:
            want = min(len(buf), piece.nbytes - done)
            try:
                n = os.preadv(fd, [buf[:want]], piece.offset + done)
            except OSError as exc:
                raise self._read_error(piece, done, exc) from None
            if n == 0:
                break
            done += n
        return done

    def _read_error(self, piece: ByteRange, done: int, exc: OSError) -> ReadError:
        return ReadError(
            f"{self.path}: loading {piece.nbytes - done} bytes at offset "
            f"{piece.offset + done} failed: {exc.strerror}"
        )

    def close(self) -> None:
        """Close every descriptor (idempotent)."""
        for pair in self._fds.values():
            for fd in pair:
                if fd >= 0:
                    os.close(fd)
        self._fds.clear()
        if self._devnull >= 0:
            os.close(self._devnull)
            self._devnull = -1
