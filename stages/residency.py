"""Page-cache residency of the model file: measure it, fill it, drop it.

Resident mode (DESIGN.md section 3) only pays off when the model's pages really are in RAM,
and the controller must know how much is, cheaply and often, on a 40+ GB file. This module
is the one place that asks the kernel about that; the residency controller and the
``tools.warmup`` CLI both go through it:

- ``Residency.of_file`` asks ``mincore`` over a read-only mapping of the file, mapped in
  256 MiB windows (on a few threads) so any file size works, into one numpy vector (no
  per-page Python loop): a fully resident 30 GB file is measured in well under a second.
- ``evict`` drops pages with ``posix_fadvise(DONTNEED)`` and measures what actually left
  (pages still mapped or pinned elsewhere stay).
- ``hint_willneed`` issues ``WILLNEED`` in 8 MiB pieces, because the kernel loads only about
  8 MiB per call.

Pinning pages (``lock_pages``, ``PageLock``) lives in ``moestream.stages.pagelock``, the libc
calls in ``moestream.stages.libc`` and the range arithmetic in ``moestream.stages.page_ranges``;
their names are importable from here too. Filling the cache in the background
(``WarmEngine``: threads, byte rate, pause/resume) lives in ``moestream.stages.warm``, which
builds on the hints here.

Byte ranges are anything with ``offset`` and ``nbytes`` (``pipeline.foundation.table.ByteRange`` and
``TensorInfo`` both fit). Ranges need not be page aligned; page-level answers count every
page a range touches, byte-level answers (``resident_bytes``) count only the range's bytes.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import structlog

from moestream.pipeline.foundation.errors import ResidencyError
from moestream.pipeline.foundation.files import ModelFile, open_checked
from moestream.pipeline.foundation.table import ByteRange
from moestream.stages.cachestat import cached_bytes
from moestream.stages.libc import PAGE_BYTES, FileRef, libc, opened
from moestream.stages.page_ranges import (
    RangeLike,
    coalesce,
    file_ranges,
    page_cover,
    ranges_by_file,
)
from moestream.stages.pagelock import PageLock, lock_pages

__all__ = [
    "HINT_BYTES",
    "PAGE_BYTES",
    "FileRef",
    "PageLock",
    "RangeLike",
    "Residency",
    "coalesce",
    "evict",
    "file_ranges",
    "hint_willneed",
    "libc",
    "lock_pages",
    "ranges_by_file",
    "resident_bytes_of",
    "resident_pages",
]

HINT_BYTES = 8 << 20
"""One ``WILLNEED`` call loads about this much; larger hints are split."""

_WINDOW_BYTES = 256 << 20  # mincore mapping window: bounds address space, splits work
_MINCORE_THREADS = min(8, os.cpu_count() or 1)

_log = structlog.get_logger("moestream.residency")


def _mincore_window(fd: int, start: int, length: int, out_addr: int, what: str) -> None:
    """``mincore`` of one window of the file into the vector at ``out_addr``."""
    addr = libc.map_read(fd, start, length, what)
    try:
        libc.mincore_into(addr, length, out_addr, f"{what} at offset {start}")
    finally:
        libc.munmap(addr, length)


def _mincore(fd: int, file_bytes: int, what: str) -> np.ndarray:
    """One byte per page of the file from ``mincore``, window by window.

    The kernel looks up every page (about 0.1 us each: 0.8 s for 30 GB on one core), and
    ctypes releases the GIL during the call, so windows run on a few threads.
    """
    n_pages = -(-file_bytes // PAGE_BYTES)
    vec = np.zeros(n_pages, dtype=np.uint8)
    base = vec.ctypes.data
    windows = [
        (start, min(_WINDOW_BYTES, file_bytes - start))
        for start in range(0, file_bytes, _WINDOW_BYTES)
    ]
    workers = min(len(windows), _MINCORE_THREADS)
    if workers <= 1:
        for start, length in windows:
            _mincore_window(fd, start, length, base + start // PAGE_BYTES, what)
        return vec
    with ThreadPoolExecutor(workers, thread_name_prefix="moestream-mincore") as pool:
        futures = [
            pool.submit(_mincore_window, fd, start, length, base + start // PAGE_BYTES, what)
            for start, length in windows
        ]
        for fut in futures:
            fut.result()
    return vec


@dataclass(frozen=True, eq=False)
class Residency:
    """Which pages of a file were in the page cache when it was measured.

    Attributes:
        name: the path (or ``fd N``) measured, for messages.
        file_bytes: the file's size then.
        pages: one bool per page (``PAGE_BYTES``), True where resident.
        short_pages: (page, data bytes) of pages before the last that hold less than a page
            of data (the ends of a model's files but the last).
    """

    name: str
    file_bytes: int
    pages: np.ndarray
    short_pages: tuple[tuple[int, int], ...] = ()

    @classmethod
    def of_file(cls, target: FileRef) -> Residency:
        """Measure ``target`` (a path or an open fd) with ``mincore``.

        Raises:
            ResidencyError: the file cannot be opened or mapped.
        """
        with opened(target) as (fd, name):
            file_bytes = os.fstat(fd).st_size
            vec = _mincore(fd, file_bytes, name)
        pages = (vec & 1).astype(bool)
        return cls(name=name, file_bytes=file_bytes, pages=pages)

    @classmethod
    def of_files(cls, files: Sequence[ModelFile]) -> Residency:
        """Measure a model's files as its address space lays them out (a page per page of
        that space; the padding after each file counts as not resident). Each file is
        opened against the identity its table saw.

        Raises:
            ResidencyError: a file cannot be mapped.
            ModelChangedError: a file is no longer the one the table read.
        """
        vec = np.zeros(files[-1].span_end // PAGE_BYTES, dtype=np.uint8)
        for f in files:
            fd = open_checked(f)
            try:
                got = _mincore(fd, f.nbytes, str(f.path))
            finally:
                os.close(fd)
            vec[f.base // PAGE_BYTES : f.base // PAGE_BYTES + got.size] = got
        short = tuple((f.span_end // PAGE_BYTES - 1, f.nbytes % PAGE_BYTES)
                      for f in files[:-1] if f.nbytes % PAGE_BYTES)
        return cls(name=str(files[0].path), file_bytes=files[-1].end,
                   pages=(vec & 1).astype(bool), short_pages=short)

    @property
    def n_pages(self) -> int:
        return int(self.pages.size)

    @property
    def resident_page_count(self) -> int:
        return int(np.count_nonzero(self.pages))

    @property
    def file_resident_bytes(self) -> int:
        """Resident bytes of the whole file (the last page counted up to the file's end)."""
        if not self.n_pages:
            return 0
        tail = self.file_bytes - (self.n_pages - 1) * PAGE_BYTES
        full = int(np.count_nonzero(self.pages[:-1])) * PAGE_BYTES
        # the last pages of a model's other files hold data only up to their ends
        short = sum(PAGE_BYTES - n for page, n in self.short_pages if self.pages[page])
        return full + (tail if self.pages[-1] else 0) - short

    @property
    def fraction(self) -> float:
        return self.file_resident_bytes / self.file_bytes if self.file_bytes else 1.0

    def _cumulative(self) -> np.ndarray:
        cum = self.__dict__.get("_cum")
        if cum is None:
            cum = np.zeros(self.n_pages + 1, dtype=np.int64)
            np.cumsum(self.pages, out=cum[1:])
            object.__setattr__(self, "_cum", cum)
        return cum

    def resident_bytes_each(self, ranges: Sequence[RangeLike]) -> np.ndarray:
        """Resident bytes of each range, counting only bytes inside it (vectorized).

        Ranges are clipped to the file; overlapping ranges each count their own bytes.
        """
        if not ranges:
            return np.zeros(0, dtype=np.int64)
        start = np.fromiter((r.offset for r in ranges), dtype=np.int64, count=len(ranges))
        size = np.fromiter((r.nbytes for r in ranges), dtype=np.int64, count=len(ranges))
        end = np.minimum(start + size, self.file_bytes)
        start = np.minimum(start, end)
        out = np.zeros(len(ranges), dtype=np.int64)
        live = end > start
        if not live.any():
            return out
        s, e = start[live], end[live]
        res = self.pages
        cum = self._cumulative()
        first, last = s // PAGE_BYTES, (e - 1) // PAGE_BYTES
        one = first == last
        head = np.where(one, e - s, (first + 1) * PAGE_BYTES - s) * res[first]
        tail = np.where(one, 0, (e - last * PAGE_BYTES) * res[last])
        middle = np.where(one, 0, (cum[last] - cum[np.minimum(first + 1, last)]) * PAGE_BYTES)
        out[live] = head + tail + middle
        return out

    def resident_bytes(self, ranges: Iterable[RangeLike] | None = None) -> int:
        """Resident bytes of the union of ``ranges`` (the whole file when None)."""
        if ranges is None:
            return self.file_resident_bytes
        return int(self.resident_bytes_each(coalesce(ranges)).sum())

    def page_mask(self, ranges: Iterable[RangeLike]) -> np.ndarray:
        """A bool per page: True for every page some range touches."""
        mask = np.zeros(self.n_pages, dtype=bool)
        for r in coalesce(ranges):
            first, stop = page_cover(r)
            mask[first:min(stop, self.n_pages)] = True
        return mask

    def resident_pages_in(self, ranges: Iterable[RangeLike]) -> int:
        """Resident pages among the pages ``ranges`` touch (each page counted once)."""
        return int(np.count_nonzero(self.pages & self.page_mask(ranges)))

    def missing(self, ranges: Iterable[RangeLike]) -> list[ByteRange]:
        """The parts of ``ranges`` on pages not resident, in the order of the ranges.

        Each non-resident run of pages becomes one range clipped to the range it lies in,
        so warming the result loads exactly what is absent. Overlaps are not merged.
        """
        out: list[ByteRange] = []
        for r in ranges:
            end = min(r.offset + r.nbytes, self.file_bytes)
            if end <= r.offset:
                continue
            first, stop = page_cover(ByteRange(r.offset, end - r.offset))
            absent = ~self.pages[first:stop]
            if not absent.any():
                continue
            edges = np.flatnonzero(np.diff(np.concatenate(([0], absent.view(np.int8), [0]))))
            for run_start, run_stop in zip(edges[0::2], edges[1::2], strict=True):
                lo = max(r.offset, (first + int(run_start)) * PAGE_BYTES)
                hi = min(end, (first + int(run_stop)) * PAGE_BYTES)
                out.append(ByteRange(lo, hi - lo))
        return out


def resident_pages(target: FileRef, ranges: Iterable[RangeLike] | None = None) -> int:
    """Resident pages of ``target`` within ``ranges`` (the whole file when None)."""
    residency = Residency.of_file(target)
    if ranges is None:
        return residency.resident_page_count
    return residency.resident_pages_in(ranges)


def _fadvise(fd: int, offset: int, length: int, advice: int, what: str) -> None:
    try:
        os.posix_fadvise(fd, offset, length, advice)
    except OSError as exc:
        raise ResidencyError(
            f"{what}: posix_fadvise at offset {offset}, {length} bytes: {exc.strerror}"
        ) from None


def evict(
    target: FileRef, ranges: Iterable[RangeLike] | None = None, *, sync: bool = True
) -> int:
    """Drop the pages of ``ranges`` (whole file when None) from the page cache.

    Every page a range touches is dropped, so a page shared with a neighbouring range goes
    too. Pages mapped by another process or pinned (``mlock``, ``cudaHostRegister``) stay;
    the return value says what really left.

    Args:
        target: a path or an open fd.
        ranges: what to drop.
        sync: ``fdatasync`` first, because ``DONTNEED`` skips dirty pages (a model file
            just written or copied has them; on a clean file the call is nearly free).

    Returns:
        Bytes (whole pages of ``ranges``) that were resident before and are not after.
    """
    with opened(target) as (fd, name):
        if sync:
            try:
                os.fdatasync(fd)
            except OSError as exc:
                raise ResidencyError(f"{name}: fdatasync before evicting: {exc.strerror}") from None
        before = Residency.of_file(fd)
        spans = (
            [ByteRange(0, before.file_bytes)] if ranges is None else coalesce(ranges)
        )
        asked = 0
        covered = np.zeros(before.n_pages, dtype=bool)
        for r in spans:
            first, stop = page_cover(r)
            start, length = first * PAGE_BYTES, (stop - first) * PAGE_BYTES
            asked += r.nbytes
            covered[first:stop] = True
            _fadvise(fd, start, length, os.POSIX_FADV_DONTNEED, name)
        after = Residency.of_file(fd)
    n = min(before.n_pages, after.n_pages)
    # only the pages asked for: the kernel may reclaim others of the file meanwhile
    gone = before.pages[:n] & ~after.pages[:n] & covered[:n]
    left = int(np.count_nonzero(gone)) * PAGE_BYTES
    _log.info("residency.evict", path=name, asked_bytes=asked, left_bytes=left,
              resident_after_bytes=after.file_resident_bytes)
    return left


def hint_willneed(fd: int, ranges: Iterable[RangeLike], *, piece_bytes: int = HINT_BYTES) -> int:
    """Ask the kernel to start loading ``ranges``, one ``WILLNEED`` per ``piece_bytes``.

    Returns:
        The number of hint calls made.
    """
    calls = 0
    for r in ranges:
        for offset in range(r.offset, r.offset + r.nbytes, piece_bytes):
            length = min(piece_bytes, r.offset + r.nbytes - offset)
            _fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED, f"fd {fd}")
            calls += 1
    return calls


def resident_bytes_of(files: Sequence[ModelFile],
                      *selections: Iterable[RangeLike]) -> list[int]:
    """Resident bytes of the union of each selection of a model's address space.

    Counts only, so the kernel's ``cachestat`` answers where it has it (``stages.cachestat``:
    about 12 x faster than ``mincore`` on a resident file); else one ``Residency.of_files``
    measures every selection.

    Raises:
        ModelChangedError: a file is no longer the one the table read.
        ResidencyError: ``mincore`` failed (without ``cachestat``).
    """
    wanted = [coalesce(s) for s in selections]
    per_file = [ranges_by_file(files, w) for w in wanted]
    fds: dict[int, int] = {}
    try:
        counts: list[int] = []
        for parts in per_file:
            total = 0
            for f, local in parts:
                if f.base not in fds:
                    fds[f.base] = open_checked(f)
                got = cached_bytes(fds[f.base], ((r.offset, r.nbytes) for r in local))
                if got is None:
                    residency = Residency.of_files(files)
                    return [residency.resident_bytes(w) for w in wanted]
                total += got
            counts.append(total)
        return counts
    finally:
        for fd in fds.values():
            os.close(fd)

