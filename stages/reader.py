"""Reading an expert's byte ranges from the model file.

Direct mode reads the 4096-aligned cover of each range with O_DIRECT straight into a
staging slot (pinned on a GPU), in chunks spread over a thread pool: ``os.preadv`` releases
the GIL, so the pool keeps ``queue_depth`` requests in flight. Where the filesystem refuses
O_DIRECT (tmpfs: EINVAL at open or at the first read) the reader falls back to buffered
reads, once and loudly, and drops the pages it read so direct mode still leaves RAM alone.
Transient read errors are retried with backoff; a file truncated, modified or replaced
under the run is detected after every read and stops it (``ModelReader``).
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import numpy.typing as npt
import structlog

from moestream.pipeline.foundation.errors import ModelChangedError, ReadError
from moestream.pipeline.foundation.faults import FaultPlan
from moestream.pipeline.foundation.files import (
    PAGE_BYTES,
    FileIdentity,
    ModelFile,
    model_files,
    open_checked,
    pieces,
)
from moestream.pipeline.foundation.table import ByteRange

__all__ = ["READ_ATTEMPTS", "RETRY_BACKOFF_MS", "ModelReader"]

_log = structlog.get_logger("moestream.reader")
_DIRECT_REFUSED = (errno.EINVAL, errno.EOPNOTSUPP, errno.EFAULT)
READ_ATTEMPTS = 4
"""Tries per read: a transient error is retried three times before it is a ReadError."""
RETRY_BACKOFF_MS = 10.0
"""The wait before the first retry; each later one waits 4x longer (10, 40, 160 ms)."""
_PATH_CHECK_S = 0.5  # a stat of the path, to see a replacement, at most this often


class _Opened:
    """The descriptors of one model file: buffered, and O_DIRECT while allowed."""

    __slots__ = ("buffered", "direct", "file", "retired")

    def __init__(self, file: ModelFile) -> None:
        self.file = file
        self.buffered = open_checked(file)
        self.direct: int | None = None
        self.retired: int | None = None  # a refused direct fd, closed only in close()

    def close(self) -> None:
        for fd in (self.direct, self.retired, self.buffered):
            if fd is not None and fd >= 0:
                os.close(fd)
        self.direct = self.retired = None
        self.buffered = -1


class ModelReader:
    """Reads byte ranges of the model's files, O_DIRECT where allowed, else buffered.

    Offsets are offsets of the model's address space (``moestream.pipeline.foundation.files``): a
    GGUF file's own offsets, or a checkpoint's shards end to end; a read that spans the
    padding between two shards reads each shard's part and zeroes the padding.

    Thread-safe: the pool's workers call ``read_into`` concurrently on their own slots.

    Failures are handled where they happen, on the reader thread:

    - O_DIRECT refused (EINVAL at open or at a read): buffered reads for the rest of the
      run, logged once;
    - a transient error (EIO and other I/O errors, a read that comes back empty before the
      end of the file): retried up to ``attempts`` times in all, with exponential backoff,
      each retry logged (``read_retry``); then ``ReadError``;
    - a file changed under the run (truncated, written, or its path now names another
      file): ``ModelChangedError``, never retried. Every file is opened against the identity
      (device, inode, size, modification and change times) the expert table's own open saw,
      and compared with it after every read, so bytes of a file other than the one the
      table describes are never returned; the paths are checked on every failure and at
      least every ``_PATH_CHECK_S`` seconds.

    Args:
        model: the model's files as the table lists them (``ExpertTable.files``); a path
            stands for a one-file model identified by this open.
        direct: try O_DIRECT (direct mode); False reads through the page cache.
        faults: injected faults (tests and ``--inject`` only).
        attempts: tries per read before a transient error becomes a ``ReadError``.
        backoff_ms: the wait before the first retry; each later one waits 4x longer.
    """

    def __init__(
        self,
        model: Path | Sequence[ModelFile],
        *,
        direct: bool = True,
        faults: FaultPlan | None = None,
        attempts: int = READ_ATTEMPTS,
        backoff_ms: float = RETRY_BACKOFF_MS,
    ) -> None:
        if attempts < 1:
            raise ValueError(f"need at least one read attempt, got {attempts}")
        self.files = model_files(model)
        self.path = self.files[0].path
        self._faults = faults if faults else None  # an empty plan injects nothing either
        self.attempts = attempts
        self.backoff_ms = backoff_ms
        self._open: list[_Opened] = []
        try:
            for f in self.files:
                opened = _Opened(f)
                self._open.append(opened)
                # buffered reads are of exact expert ranges: readahead past them (128 KiB
                # by default) is storage traffic for pages nobody asked for
                os.posix_fadvise(opened.buffered, 0, 0, os.POSIX_FADV_RANDOM)
        except BaseException:
            self.close()
            raise
        self._by_base = {opened.file.base: opened for opened in self._open}
        self.file_bytes = self.files[-1].end
        self._path_checked = time.monotonic()
        self.direct_refused: str | None = None
        self._lock = threading.Lock()
        self.retries = 0
        # what injected ``truncate`` / ``replace`` make the reader believe (never the file)
        self._seen_size: int | None = None
        self._seen_replaced = False
        self._direct_on = False
        if direct:
            self._open_direct()

    def _open_direct(self) -> None:
        try:
            for opened in self._open:
                opened.direct = open_checked(opened.file, os.O_DIRECT)
            self._direct_on = True
        except OSError as exc:
            self._refuse_direct(f"open with O_DIRECT failed: {exc.strerror}")

    def _refuse_direct(self, reason: str) -> None:
        with self._lock:
            if self.direct_refused is None:
                self.direct_refused = reason
                _log.warning("o_direct_fallback", path=str(self.path), reason=reason,
                             action="buffered reads for the rest of the run")
            self._direct_on = False
            for opened in self._open:
                if opened.direct is not None:
                    # not closed yet: other workers may be reading with it right now, and a
                    # closed number can be reused by the next open (a read of another file)
                    opened.retired, opened.direct = opened.direct, None

    @property
    def direct(self) -> bool:
        return self._direct_on

    def read_into(self, dst: npt.NDArray[np.uint8], offset: int, *, direct: bool) -> int:
        """Fill ``dst`` from ``offset`` (short only at the end of the model); returns bytes
        read (the padding between shards counts, zeroed).

        ``dst`` and ``offset`` must be 4096-aligned for a direct read. Blocks (retries
        sleep): call it on a reader thread, never on the event loop.

        Raises:
            ReadError: an I/O error or an early end of file that outlived the retries.
            ModelChangedError: a file was truncated, modified or replaced.
        """
        need = max(0, min(dst.size, self.file_bytes - offset))
        done = 0
        touched = []
        for piece in pieces(self.files, offset, need):
            if piece.at > done:
                dst[done : piece.at] = 0
            opened = self._by_base[piece.file.base]
            touched.append(opened)
            end = piece.at + piece.nbytes
            # an O_DIRECT read asks for whole pages: the page past a file's end comes back short
            room = min(dst.size, piece.at + -(-piece.nbytes // PAGE_BYTES) * PAGE_BYTES)
            self._read_piece(opened, dst[piece.at : room], piece.nbytes, piece.local, direct)
            done = end
        if done < need:  # the range ends in the padding after a file's data
            dst[done:need] = 0
            done = need
        now = time.monotonic()
        check_path = self._seen_replaced or now - self._path_checked >= _PATH_CHECK_S
        # the files read from, and every file's path now and then
        self.check_unchanged(path=check_path, files=None if check_path else touched)
        if check_path:
            self._path_checked = now
        return done

    def _read_piece(self, opened: _Opened, dst: npt.NDArray[np.uint8], need: int, offset: int,
                    direct: bool) -> None:
        """``need`` bytes from ``offset`` of one file into ``dst`` (which may be larger)."""
        fd = opened.direct if direct else None
        got = 0
        failures = 0
        while got < need:
            use_fd = fd if fd is not None else opened.buffered
            cause: OSError | None = None
            try:
                if self._faults is not None:
                    n = self._faulty_preadv(use_fd, dst[got:], offset + got, fd is not None)
                else:
                    n = os.preadv(use_fd, [dst[got:].data], offset + got)
            except OSError as exc:
                if fd is not None and exc.errno in _DIRECT_REFUSED:
                    self._refuse_direct(f"O_DIRECT read refused: {exc.strerror}")
                    fd = None
                    continue
                if exc.errno == errno.EBADF:  # closed under us: a bug, never transient
                    raise ReadError(f"{opened.file.path}: read after the reader was "
                                    "closed") from exc
                cause, reason = exc, str(exc.strerror)
            else:
                if n > 0:
                    got += n
                    continue
                reason = f"short read: file ended early ({got} of {need} bytes)"
            failures += 1
            self.check_unchanged(path=True)  # a changed file is reported, not retried
            if failures >= self.attempts:
                raise ReadError(
                    f"{opened.file.path}: read of {need} bytes at offset {offset + got} failed "
                    f"after {failures} attempts: {reason}"
                ) from cause
            self._backoff(failures, offset + got, reason)
        if fd is None and direct:
            # buffered stand-in for a direct read: leave no page behind
            os.posix_fadvise(opened.buffered, offset, need, os.POSIX_FADV_DONTNEED)

    def _backoff(self, failures: int, offset: int, reason: str) -> None:
        """Log a retry and wait before it (on the reader thread)."""
        delay_ms = self.backoff_ms * 4 ** (failures - 1)
        with self._lock:
            self.retries += 1
        _log.warning("read_retry", path=str(self.path), offset=offset, attempt=failures,
                     attempts=self.attempts, backoff_ms=delay_ms, reason=reason)
        time.sleep(delay_ms / 1000.0)

    def _faulty_preadv(
        self, fd: int, dst: npt.NDArray[np.uint8], offset: int, direct: bool
    ) -> int:
        """``os.preadv`` as the fault plan bends it (tests and ``--inject`` only)."""
        plan = self._faults
        assert plan is not None
        if direct and plan.hit("odirect_einval") is not None:
            raise OSError(errno.EINVAL, "Invalid argument (injected)")
        if plan.hit("read_eio") is not None:
            raise OSError(errno.EIO, "Input/output error (injected)")
        delay_ms = plan.hit("slow_ms")
        if delay_ms is not None:
            time.sleep(delay_ms / 1000.0)  # an injected latency spike, by request
        if plan.hit("truncate") is not None:
            self._seen_size = offset  # the file now seems to end where this read starts
        if plan.hit("replace") is not None:
            self._seen_replaced = True
        if self._seen_size is not None and offset >= self._seen_size:
            return 0
        n = os.preadv(fd, [dst.data], offset)
        if n > 0 and plan.hit("short") is not None:
            return 0
        return n

    def check_unchanged(self, *, path: bool = True, files: Sequence[_Opened] | None = None) -> None:
        """Raise ``ModelChangedError`` if an open file (of ``files``; all when None), or with
        ``path`` the file a path names, is no longer the one the table saw (a ``fstat``, plus
        a ``stat`` with ``path``)."""
        for opened in self._open if files is None else files:
            was = opened.file.identity
            now = FileIdentity.of(os.fstat(opened.buffered))
            if self._seen_size is not None:
                now = replace(now, size=min(now.size, self._seen_size),
                              mtime_ns=now.mtime_ns + 1)
            change = was.change(now, "while running")
            if change is None and not path:
                continue
            try:
                st = os.stat(opened.file.path)
            except FileNotFoundError:
                raise ModelChangedError(opened.file.path, "removed while running") from None
            if (st.st_dev, st.st_ino) != (was.dev, was.ino) or self._seen_replaced:
                # before the descriptor's own change: unlinking a file moves its change time
                raise ModelChangedError(
                    opened.file.path, "replaced by another file while running; the run read "
                    "only the file it opened, and stops rather than decode a model that is gone")
            if change is not None:
                raise ModelChangedError(opened.file.path, f"{change}; no byte read after the "
                                                          "change was used")

    def drop_ranges(self, ranges: Sequence[ByteRange]) -> None:
        """Drop the cached pages of these ranges (experts leaving the host tier)."""
        for r in ranges:
            for piece in pieces(self.files, r.offset, r.nbytes):
                opened = self._by_base[piece.file.base]
                os.posix_fadvise(opened.buffered, piece.local, piece.nbytes,
                                 os.POSIX_FADV_DONTNEED)

    def drop_pages(self) -> None:
        """Ask the kernel to drop the files' cached pages (those not mapped or locked)."""
        for opened in self._open:
            os.posix_fadvise(opened.buffered, 0, 0, os.POSIX_FADV_DONTNEED)

    def read_range(self, offset: int, nbytes: int) -> bytes:
        """A plain buffered read (references and verification of foreign files)."""
        out = bytearray(nbytes)
        for piece in pieces(self.files, offset, nbytes):
            opened = self._by_base[piece.file.base]
            data = os.pread(opened.buffered, piece.nbytes, piece.local)
            if len(data) != piece.nbytes:
                self.check_unchanged(path=True)
                raise ReadError(f"{piece.file.path}: short read of {piece.nbytes} bytes at "
                                f"offset {piece.local}")
            out[piece.at : piece.at + piece.nbytes] = data
        if sum(p.nbytes for p in pieces(self.files, offset, nbytes)) != nbytes:
            raise ReadError(f"{self.path}: read of {nbytes} bytes at {offset} runs past the "
                            "model's end")
        self.check_unchanged(path=False)
        return bytes(out)

    def close(self) -> None:
        for opened in self._open:
            opened.close()

    def __enter__(self) -> ModelReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
