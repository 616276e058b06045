"""Pages of a file pinned in RAM with ``mlock``, like ``vmtouch -l``.

An operator pins a model (``tools.warmup --lock``) so that memory pressure cannot take its
pages back in the middle of a resident run. The kernel pins pages of a mapping, so the lock
holds the mappings for as long as the pages are to stay; when the kernel refuses, the error
names ``RLIMIT_MEMLOCK``, the usual cause.
"""

from __future__ import annotations

import ctypes
import errno
import os
import resource
from collections.abc import Iterable
from types import TracebackType

import structlog

from moestream.pipeline.foundation.errors import ResidencyError
from moestream.pipeline.foundation.table import ByteRange
from moestream.stages.libc import PAGE_BYTES, FileRef, libc, opened
from moestream.stages.page_ranges import RangeLike, coalesce, page_cover

__all__ = ["PageLock", "lock_pages"]

_log = structlog.get_logger("moestream.residency")


class PageLock:
    """Pages of a file pinned in RAM with ``mlock``; they stay until ``unlock()``.

    The mappings this object holds must stay alive while the pages are to stay pinned;
    ``unlock()`` (or leaving the ``with`` block) unlocks and unmaps them.
    """

    def __init__(self, name: str, maps: list[tuple[int, int]]) -> None:
        self.name = name
        self._maps = maps

    @classmethod
    def joined(cls, name: str, locks: Iterable[PageLock]) -> PageLock:
        """One lock holding what ``locks`` held (a model's files locked one by one)."""
        return cls(name, [m for lock in locks for m in lock._maps])

    @property
    def locked_bytes(self) -> int:
        return sum(length for _, length in self._maps)

    def unlock(self) -> None:
        """Unlock and unmap every locked range (idempotent)."""
        while self._maps:
            addr, length = self._maps.pop()
            libc.munlock(addr, length)
            libc.munmap(addr, length)
        _log.debug("residency.unlock", path=self.name)

    def __enter__(self) -> PageLock:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.unlock()

    def __repr__(self) -> str:
        return f"PageLock(name={self.name!r}, locked_bytes={self.locked_bytes})"


def _memlock_text(value: int) -> str:
    if value == resource.RLIM_INFINITY:
        return "unlimited"
    return f"{value} bytes ({value / 2**20:.1f} MiB)"


def _page_spans(ranges: Iterable[RangeLike], file_bytes: int) -> list[tuple[int, int]]:
    """(offset, length) of the whole pages ``ranges`` touch, clipped to the file's pages."""
    covers = []
    for r in ranges:
        first, stop = page_cover(r)
        stop = min(stop, -(-file_bytes // PAGE_BYTES))
        if stop > first:
            covers.append((first * PAGE_BYTES, (stop - first) * PAGE_BYTES))
    return covers


def _refused(name: str, asked: int) -> ResidencyError:
    """``mlock`` said no (errno still set): the limit, and how to raise it."""
    err = ctypes.get_errno()
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    code = errno.errorcode.get(err, str(err))
    return ResidencyError(
        f"{name}: mlock of {asked} bytes ({asked / 2**30:.2f} GiB) refused "
        f"({code}: {os.strerror(err)}); RLIMIT_MEMLOCK is {_memlock_text(soft)} "
        f"(hard {_memlock_text(hard)}): raise it (ulimit -l) or run with "
        "CAP_IPC_LOCK"
    )


def lock_pages(target: FileRef, ranges: Iterable[RangeLike] | None = None) -> PageLock:
    """Pin the pages of ``ranges`` (whole file when None) in RAM, loading them first.

    Returns:
        A ``PageLock``; the pages stay pinned until its ``unlock()``.

    Raises:
        ResidencyError: ``mlock`` refused (the message gives ``RLIMIT_MEMLOCK`` and the bytes
            asked), or the file could not be mapped.
    """
    with opened(target) as (fd, name):
        file_bytes = os.fstat(fd).st_size
        spans = [ByteRange(0, file_bytes)] if ranges is None else coalesce(ranges)
        covers = _page_spans(spans, file_bytes)
        asked = sum(length for _, length in covers)
        lock = PageLock(name, [])
        try:
            for offset, length in covers:
                addr = libc.map_read(fd, offset, length, name)
                if libc.mlock(addr, length) != 0:
                    error = _refused(name, asked)
                    libc.munmap(addr, length)
                    raise error
                lock._maps.append((addr, length))
        except BaseException:
            lock.unlock()
            raise
    _log.info("residency.lock", path=name, locked_bytes=asked)
    return lock
