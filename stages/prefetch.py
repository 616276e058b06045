"""Prefetch: read an expert's gate/up/down byte ranges from the model file.

Direct mode reads the 4096-aligned cover of each range with O_DIRECT straight into a
staging slot (pinned on a GPU), in chunks spread over a thread pool: ``os.preadv`` releases
the GIL, so the pool keeps ``queue_depth`` requests in flight. Where the filesystem refuses
O_DIRECT (tmpfs: EINVAL at open or at the first read) the reader falls back to buffered
reads, once and loudly, and drops the pages it read so direct mode still leaves RAM alone.

Resident mode reads nothing: the file's read-only mapping is the source of the upload.
``ModelMapping`` maps the file and, on a GPU, page-locks it window by window
(``cudaHostRegister``, read-only) so the copy engine DMAs straight from the page cache.
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import structlog

from gpu.backend import PAGE, Backend
from pipeline.errors import ModelFileError, ReadError
from pipeline.residency import libc
from pipeline.table import ExpertSlices
from stages.faults import FaultPlan

__all__ = [
    "ExpertLayout",
    "ModelMapping",
    "ModelReader",
    "StagedRange",
    "aligned_cover",
    "plan_expert",
]

_log = structlog.get_logger("moestream.prefetch")
DEVICE_ALIGN = 256  # each matrix starts 256-aligned in the device buffer (kernels read words)
_DIRECT_REFUSED = (errno.EINVAL, errno.EOPNOTSUPP, errno.EFAULT)


def aligned_cover(offset: int, nbytes: int, align: int = PAGE) -> tuple[int, int]:
    """The smallest ``align``-aligned (start, length) that contains ``[offset, offset+nbytes)``."""
    start = offset - offset % align
    end = offset + nbytes
    end += (-end) % align
    return start, end - start


@dataclass(frozen=True, slots=True)
class StagedRange:
    """Where one of an expert's ranges goes: file cover -> slot -> device buffer.

    The cover ``[cover_start, cover_start + cover_bytes)`` is read into the slot at
    ``slot_offset``; the range's own bytes start ``skip`` bytes later and are copied to
    ``device_offset`` in the expert's device buffer.
    """

    file_offset: int
    nbytes: int
    cover_start: int
    cover_bytes: int
    slot_offset: int
    device_offset: int

    @property
    def skip(self) -> int:
        return self.file_offset - self.cover_start


@dataclass(frozen=True, slots=True)
class ExpertLayout:
    """An expert's three ranges laid out in a staging slot and in a device buffer."""

    ranges: tuple[StagedRange, ...]
    slot_bytes: int
    device_bytes: int


def plan_expert(slices: ExpertSlices, align: int = PAGE) -> ExpertLayout:
    """Lay out ``slices`` (gate, up, down): aligned covers back to back in the slot,
    ranges 256-aligned in the device buffer."""
    staged: list[StagedRange] = []
    slot_at = 0
    device_at = 0
    for r in slices.ranges:
        start, length = aligned_cover(r.offset, r.nbytes, align)
        staged.append(StagedRange(r.offset, r.nbytes, start, length, slot_at, device_at))
        slot_at += length
        device_at += r.nbytes + (-r.nbytes) % DEVICE_ALIGN
    return ExpertLayout(tuple(staged), slot_at, device_at)


def iter_chunks(start: int, length: int, chunk_bytes: int) -> Iterator[tuple[int, int]]:
    """(offset, length) pieces of at most ``chunk_bytes`` covering ``[start, start+length)``."""
    done = 0
    while done < length:
        n = min(chunk_bytes, length - done)
        yield start + done, n
        done += n


class ModelReader:
    """Reads byte ranges of the model file, O_DIRECT where allowed, else buffered.

    Thread-safe: the pool's workers call ``read_into`` concurrently on their own slots.

    Args:
        path: the model file.
        direct: try O_DIRECT (direct mode); False reads through the page cache.
    """

    def __init__(self, path: Path, *, direct: bool = True, faults: FaultPlan | None = None) -> None:
        self.path = path
        self._faults = faults or FaultPlan()
        try:
            self._buffered_fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            raise ModelFileError(path, f"cannot open: {exc.strerror}") from exc
        self.file_bytes = os.fstat(self._buffered_fd).st_size
        self._direct_fd: int | None = None
        self.direct_refused: str | None = None
        self._lock = threading.Lock()
        if direct:
            self._open_direct()

    def _open_direct(self) -> None:
        try:
            self._direct_fd = os.open(self.path, os.O_RDONLY | os.O_DIRECT)
        except OSError as exc:
            self._refuse_direct(f"open with O_DIRECT failed: {exc.strerror}")

    def _refuse_direct(self, reason: str) -> None:
        with self._lock:
            if self.direct_refused is None:
                self.direct_refused = reason
                _log.warning("o_direct_fallback", path=str(self.path), reason=reason,
                             action="buffered reads for the rest of the run")
            if self._direct_fd is not None:
                os.close(self._direct_fd)
                self._direct_fd = None

    @property
    def direct(self) -> bool:
        return self._direct_fd is not None

    def read_into(self, dst: npt.NDArray[np.uint8], offset: int, *, direct: bool) -> int:
        """Fill ``dst`` from ``offset`` (short only at end of file); returns bytes read.

        ``dst`` and ``offset`` must be 4096-aligned for a direct read. Raises ReadError on
        an I/O error or a read that comes back short before the end of the file.
        """
        need = min(dst.size, self.file_bytes - offset)
        fd = self._direct_fd if direct else None
        got = 0
        while got < need:
            use_fd = fd if fd is not None else self._buffered_fd
            try:
                if self._faults:
                    self._inject(fd is not None)
                n = os.preadv(use_fd, [dst[got:].data], offset + got)
                if self._faults and n > 0 and self._faults.hit("short") is not None:
                    n = 0
            except OSError as exc:
                if fd is not None and exc.errno in _DIRECT_REFUSED:
                    self._refuse_direct(f"O_DIRECT read refused: {exc.strerror}")
                    fd = None
                    continue
                raise ReadError(
                    f"{self.path}: read of {dst.size} bytes at offset {offset + got} failed: "
                    f"{exc.strerror}"
                ) from exc
            if n == 0:
                raise ReadError(
                    f"{self.path}: short read at offset {offset + got}: file ended "
                    f"({got} of {need} bytes)"
                )
            got += n
        if fd is None and direct:
            # buffered stand-in for a direct read: leave no page behind
            os.posix_fadvise(self._buffered_fd, offset, need, os.POSIX_FADV_DONTNEED)
        return got

    def _inject(self, direct: bool) -> None:
        """Raise or delay as the fault plan says (tests and ``--inject`` only)."""
        plan = self._faults
        if direct and plan.hit("odirect_einval") is not None:
            raise OSError(errno.EINVAL, "Invalid argument (injected)")
        if plan.hit("read_eio") is not None:
            raise OSError(errno.EIO, "Input/output error (injected)")
        delay_ms = plan.hit("slow_ms")
        if delay_ms is not None:
            time.sleep(delay_ms / 1000.0)  # an injected latency spike, by request

    def drop_pages(self) -> None:
        """Ask the kernel to drop the file's cached pages (those not mapped or locked)."""
        os.posix_fadvise(self._buffered_fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def read_range(self, offset: int, nbytes: int) -> bytes:
        """A plain buffered read (references and verification of foreign files)."""
        data = os.pread(self._buffered_fd, nbytes, offset)
        if len(data) != nbytes:
            raise ReadError(f"{self.path}: short read of {nbytes} bytes at offset {offset}")
        return data

    def close(self) -> None:
        if self._direct_fd is not None:
            os.close(self._direct_fd)
            self._direct_fd = None
        if self._buffered_fd >= 0:
            os.close(self._buffered_fd)
            self._buffered_fd = -1

    def __enter__(self) -> ModelReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ModelMapping:
    """A read-only shared mapping of the model, registered with the device in windows.

    Registration page-locks (and, for pages not yet resident, faults in) a window; it is
    done once per window on first use. ``close`` unregisters, then unmaps: the pages can
    only be dropped after both (DESIGN.md: DONTNEED leaves registered or mapped pages).

    Args:
        path: the model file.
        backend: registers windows (a no-op on the host backend).
        window_bytes: registration granularity.
    """

    def __init__(self, path: Path, backend: Backend, window_bytes: int = 256 << 20) -> None:
        self._backend = backend
        self._window = window_bytes
        fd = os.open(path, os.O_RDONLY)
        try:
            self.file_bytes = os.fstat(fd).st_size
            # mapped through libc, not Python's mmap: numpy views of a Python mmap pin it
            # (close raises while any view lives), and the lifetime here is explicit
            self._addr = libc.map_read(fd, 0, self.file_bytes, str(path))
        finally:
            os.close(fd)
        self.array: npt.NDArray[np.uint8] = np.ctypeslib.as_array(
            (ctypes.c_uint8 * self.file_bytes).from_address(self._addr)
        )
        self._registered: dict[int, npt.NDArray[np.uint8]] = {}
        self._refused: set[int] = set()
        self._lock = threading.Lock()
        self.registered_bytes = 0

    def ensure_registered(self, offset: int, nbytes: int) -> bool:
        """Register the windows covering the range; False if the device refused one."""
        first = offset // self._window
        last = (offset + nbytes - 1) // self._window
        ok = True
        for w in range(first, last + 1):
            if w in self._registered:
                continue
            with self._lock:
                if w in self._registered or w in self._refused:
                    ok = ok and w in self._registered
                    continue
                start = w * self._window
                window = self.array[start : min(start + self._window, self.file_bytes)]
                if self._backend.register_host(window):
                    self._registered[w] = window
                    self.registered_bytes += window.size
                else:
                    self._refused.add(w)
                    ok = False
        return ok

    def is_registered(self, offset: int, nbytes: int) -> bool:
        """Every window covering the range is registered (a lock-free read)."""
        first = offset // self._window
        last = (offset + nbytes - 1) // self._window
        return all(w in self._registered for w in range(first, last + 1))

    def pieces(self, offset: int, nbytes: int) -> list[tuple[int, npt.NDArray[np.uint8]]]:
        """(offset within the range, view) pieces of a range, split at window boundaries.

        One copy may not span two registrations, so each piece lies in one window.
        """
        out = []
        at = offset
        end = offset + nbytes
        while at < end:
            stop = min(end, (at // self._window + 1) * self._window)
            out.append((at - offset, self.array[at:stop]))
            at = stop
        return out

    def close(self) -> None:
        """Unregister every window, then unmap."""
        with self._lock:
            for window in self._registered.values():
                self._backend.unregister_host(window)
            self._registered.clear()
            self.registered_bytes = 0
        self.array = np.empty(0, dtype=np.uint8)
        if self._addr:
            libc.munmap(self._addr, self.file_bytes)
            self._addr = 0

    def __enter__(self) -> ModelMapping:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
