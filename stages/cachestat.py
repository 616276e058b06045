"""Resident bytes of byte ranges from the kernel's ``cachestat`` (Linux 6.5+).

Why: ``mincore`` fills one byte per page and looks each page up on its own; on a fully
resident 3.4 GiB file that is 60-70 ms on the dev VM, 0.1 s for 6.8 GiB on the H200's
host, where the warm-up command's last check after reading sat on its critical path (the
command timed against ``vmtouch -t``). ``cachestat`` counts a range's cached pages inside
the kernel, a large folio at a time: 5 ms for the same 3.4 GiB. It answers counts, not
which pages, so ``stages.residency.Residency`` (``mincore``) stays for everything that needs
the page map (what is missing, per-expert reports).

Where the kernel lacks the call (before 6.5, gVisor) or a sandbox refuses it, ``cached_bytes``
returns None and the caller measures with ``mincore``.
"""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Iterable

__all__ = ["cached_bytes"]

_SYS_CACHESTAT = 451  # the same number on every architecture (the generic syscall table)
_PAGE = mmap.PAGESIZE


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in
                ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")]


_syscall = ctypes.CDLL(None, use_errno=True).syscall
_available: bool | None = None  # learnt at the first call


def _cached_pages(fd: int, offset: int, length: int) -> int | None:
    """Cached pages among those that ``[offset, offset + length)`` touches (length > 0)."""
    global _available
    if _available is False:
        return None
    span, stat = _Range(offset, length), _Stat()
    if _syscall(_SYS_CACHESTAT, fd, ctypes.byref(span), ctypes.byref(stat), 0) != 0:
        _available = False  # ENOSYS, EPERM from a sandbox, or EBADF/EOPNOTSUPP: mincore copes
        return None
    _available = True
    return int(stat.nr_cache)


def cached_bytes(fd: int, ranges: Iterable[tuple[int, int]]) -> int | None:
    """Resident bytes inside ``(offset, nbytes)`` ranges of an open file, counted as
    ``Residency.resident_bytes_each`` counts them: a resident page adds the bytes of it that
    the range covers. Ranges lie inside the file and are disjoint (a byte in two counts
    twice; ``moestream.stages.page_ranges.ranges_by_file`` gives such ranges).

    Returns:
        The sum, or None where the kernel has no ``cachestat`` (use ``mincore``).
    """
    total = 0
    for offset, nbytes in ranges:
        if nbytes <= 0:
            continue
        end = offset + nbytes
        first, last = offset // _PAGE, (end - 1) // _PAGE
        if first == last:
            pages = _cached_pages(fd, first * _PAGE, _PAGE)
            if pages is None:
                return None
            total += nbytes * pages
            continue
        head = _cached_pages(fd, first * _PAGE, _PAGE)
        tail = _cached_pages(fd, last * _PAGE, _PAGE)
        middle = (_cached_pages(fd, (first + 1) * _PAGE, (last - first - 1) * _PAGE)
                  if last > first + 1 else 0)
        if head is None or tail is None or middle is None:
            return None
        total += ((first + 1) * _PAGE - offset) * head + middle * _PAGE
        total += (end - last * _PAGE) * tail
    return total
