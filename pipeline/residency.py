"""Page-cache residency of the model file: measure it, fill it, drop it, pin it.

Resident mode (DESIGN.md section 3) only pays off when the model's pages really are in RAM,
and the controller must know how much is, cheaply and often, on a 40+ GB file. This module
is the one place that talks to the kernel about that; the residency controller and the
``tools.warmup`` CLI both go through it:

- ``Residency.of_file`` asks ``mincore`` over a read-only mapping of the file, mapped in
  256 MiB windows (on a few threads) so any file size works, into one numpy vector (no
  per-page Python loop): a fully resident 30 GB file is measured in well under a second.
- ``evict`` drops pages with ``posix_fadvise(DONTNEED)`` and measures what actually left
  (pages still mapped or pinned elsewhere stay).
- ``hint_willneed`` issues ``WILLNEED`` in 8 MiB pieces, because the kernel loads only about
  8 MiB per call.
- ``WarmEngine`` loads ranges into the page cache with a thread pool of ``os.sendfile``
  calls to ``/dev/null`` (the kernel reads the pages, nothing is copied to user space) or
  ``os.preadv`` into reusable per-thread buffers, with ``WILLNEED`` hints issued ahead, a
  byte-rate token bucket, ``pause()``/``resume()`` so decode reads go first, and prompt
  asyncio cancellation.
- ``lock_pages`` pins ranges with ``mlock`` on a mapping, like ``vmtouch -l``, and names
  ``RLIMIT_MEMLOCK`` when the kernel refuses.

Byte ranges are anything with ``offset`` and ``nbytes`` (``pipeline.table.ByteRange`` and
``TensorInfo`` both fit). Ranges need not be page aligned; page-level answers count every
page a range touches, byte-level answers (``resident_bytes``) count only the range's bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import functools
import mmap
import os
import resource
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Literal, Protocol

import numpy as np
import structlog

from pipeline.errors import ReadError, ResidencyError, UsageError
from pipeline.table import ByteRange

__all__ = [
    "HINT_BYTES",
    "PAGE_BYTES",
    "Loader",
    "PageLock",
    "RangeLike",
    "Residency",
    "TokenBucket",
    "WarmEngine",
    "WarmResult",
    "coalesce",
    "default_threads",
    "evict",
    "hint_willneed",
    "lock_pages",
    "resident_pages",
]

PAGE_BYTES = mmap.PAGESIZE
"""The kernel page size: the unit of residency."""

HINT_BYTES = 8 << 20
"""One ``WILLNEED`` call loads about this much; larger hints are split."""

_WINDOW_BYTES = 256 << 20  # mincore mapping window: bounds address space, splits work
_MINCORE_THREADS = min(8, os.cpu_count() or 1)
_MAP_FAILED = ctypes.c_void_p(-1).value

_log = structlog.get_logger("moestream.residency")


class RangeLike(Protocol):
    """A contiguous byte range of a file (``ByteRange``, ``TensorInfo``)."""

    @property
    def offset(self) -> int: ...

    @property
    def nbytes(self) -> int: ...


FileRef = str | os.PathLike[str] | int
"""A path, or an open file descriptor (which stays owned by the caller)."""


class _Libc:
    """The few libc calls Python's ``mmap`` module does not expose, with errno kept."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self.mmap = libc.mmap
        self.mmap.restype = ctypes.c_void_p
        self.mmap.argtypes = [
            ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
            ctypes.c_long,
        ]
        self.munmap = libc.munmap
        self.munmap.restype = ctypes.c_int
        self.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self.mincore = libc.mincore
        self.mincore.restype = ctypes.c_int
        self.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        self.mlock = libc.mlock
        self.mlock.restype = ctypes.c_int
        self.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self.munlock = libc.munlock
        self.munlock.restype = ctypes.c_int
        self.munlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]

    def map_read(self, fd: int, offset: int, length: int, what: str) -> int:
        """Map ``length`` bytes of ``fd`` at page-aligned ``offset``, read-only and shared."""
        addr = self.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, offset)
        if addr is None or addr == _MAP_FAILED:
            err = ctypes.get_errno()
            raise ResidencyError(
                f"{what}: mmap of {length} bytes at offset {offset} failed: {os.strerror(err)}"
            )
        return int(addr)


_libc = _Libc()
libc = _libc  # public: stages.prefetch maps the model through it


def coalesce(ranges: Iterable[RangeLike]) -> list[ByteRange]:
    """The union of ``ranges`` as sorted, disjoint, non-adjacent ``ByteRange``s.

    Empty ranges are dropped.
    """
    spans = sorted((r.offset, r.offset + r.nbytes) for r in ranges if r.nbytes > 0)
    merged: list[list[int]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [ByteRange(start, end - start) for start, end in merged]


def _page_cover(r: RangeLike) -> tuple[int, int]:
    """First page and one past the last page that range ``r`` touches."""
    return r.offset // PAGE_BYTES, -(-(r.offset + r.nbytes) // PAGE_BYTES)


@contextlib.contextmanager
def _opened(target: FileRef) -> Iterator[tuple[int, str]]:
    """An fd for ``target`` and a name for messages; closes only what it opened."""
    if isinstance(target, int):
        yield target, f"fd {target}"
        return
    name = os.fspath(target)
    try:
        fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise ResidencyError(f"{name}: cannot open: {exc.strerror}") from None
    try:
        yield fd, name
    finally:
        os.close(fd)


def _mincore_window(fd: int, start: int, length: int, out_addr: int, what: str) -> None:
    """``mincore`` of one window of the file into the vector at ``out_addr``."""
    addr = _libc.map_read(fd, start, length, what)
    try:
        if _libc.mincore(addr, length, out_addr) != 0:
            err = ctypes.get_errno()
            raise ResidencyError(f"{what}: mincore at offset {start}: {os.strerror(err)}")
    finally:
        _libc.munmap(addr, length)


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
    """

    name: str
    file_bytes: int
    pages: np.ndarray

    @classmethod
    def of_file(cls, target: FileRef) -> Residency:
        """Measure ``target`` (a path or an open fd) with ``mincore``.

        Raises:
            ResidencyError: the file cannot be opened or mapped.
        """
        with _opened(target) as (fd, name):
            file_bytes = os.fstat(fd).st_size
            vec = _mincore(fd, file_bytes, name)
        pages = (vec & 1).astype(bool)
        return cls(name=name, file_bytes=file_bytes, pages=pages)

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
        return full + (tail if self.pages[-1] else 0)

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
            first, stop = _page_cover(r)
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
            first, stop = _page_cover(ByteRange(r.offset, end - r.offset))
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
        Bytes (whole pages) that were resident before and are not after.
    """
    with _opened(target) as (fd, name):
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
        for r in spans:
            first, stop = _page_cover(r)
            start, length = first * PAGE_BYTES, (stop - first) * PAGE_BYTES
            asked += r.nbytes
            _fadvise(fd, start, length, os.POSIX_FADV_DONTNEED, name)
        after = Residency.of_file(fd)
    n = min(before.n_pages, after.n_pages)
    left = int(np.count_nonzero(before.pages[:n] & ~after.pages[:n])) * PAGE_BYTES
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


class TokenBucket:
    """A byte-rate limiter that lets a request run into debt and makes the next one wait.

    ``delay_for(n)`` takes ``n`` bytes now and says how long to wait before they may go, so a
    stream of requests averages ``rate_bytes_per_s`` with bursts of at most ``burst_bytes``.
    The clock is injectable for tests.
    """

    __slots__ = ("_burst", "_clock", "_last", "_rate", "_tokens")

    def __init__(
        self,
        rate_bytes_per_s: float,
        *,
        burst_bytes: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if rate_bytes_per_s <= 0:
            raise UsageError(f"byte rate must be positive, not {rate_bytes_per_s}")
        if burst_bytes < 0:
            raise UsageError(f"burst must be >= 0, not {burst_bytes}")
        self._rate = float(rate_bytes_per_s)
        self._burst = float(burst_bytes)
        self._clock = clock
        self._tokens = self._burst
        self._last = clock()

    @property
    def rate_bytes_per_s(self) -> float:
        return self._rate

    @rate_bytes_per_s.setter
    def rate_bytes_per_s(self, rate: float) -> None:
        if rate <= 0:
            raise UsageError(f"byte rate must be positive, not {rate}")
        self._refill()
        self._rate = float(rate)

    def _refill(self) -> None:
        now = self._clock()
        self._tokens = min(self._burst, self._tokens + (now - self._last) * self._rate)
        self._last = now

    def delay_for(self, nbytes: int) -> float:
        """Take ``nbytes`` and return the seconds to wait before using them."""
        self._refill()
        self._tokens -= nbytes
        return 0.0 if self._tokens >= 0 else -self._tokens / self._rate

    async def take(self, nbytes: int) -> None:
        """Take ``nbytes`` and sleep until they may be used."""
        delay = self.delay_for(nbytes)
        if delay > 0:
            await asyncio.sleep(delay)

    def __repr__(self) -> str:
        return f"TokenBucket(rate_bytes_per_s={self._rate:.0f}, burst_bytes={self._burst:.0f})"


@dataclass(frozen=True, slots=True)
class WarmResult:
    """What one ``WarmEngine.warm`` call did."""

    bytes_read: int
    seconds: float
    pieces: int

    @property
    def gb_per_s(self) -> float:
        return self.bytes_read / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass(frozen=True, slots=True)
class _Piece:
    """One unit of work: a range, and whether it is part of a large sequential stretch."""

    range: ByteRange
    stream: bool


def _pieces(
    ranges: Iterable[RangeLike],
    piece_bytes: int,
    stream_piece_bytes: int,
    stream_min_bytes: int | None,
    file_bytes: int,
) -> list[_Piece]:
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
    out: list[_Piece] = []
    for start, end in joined:
        stream = stream_min_bytes is not None and end - start >= stream_min_bytes
        size = stream_piece_bytes if stream else piece_bytes
        out.extend(
            _Piece(ByteRange(offset, min(size, end - offset)), stream)
            for offset in range(start, end, size)
        )
    return out


Loader = Literal["sendfile", "preadv"]
"""How ``WarmEngine`` pulls a piece into the page cache."""


class _SpliceUnsupported(Exception):
    """The file cannot be spliced (sendfile EINVAL/ENOSYS): use preadv instead."""


def default_threads() -> int:
    """Reader threads for a warm-up: mostly waiting on the disk, so more than the CPUs.

    16 kept a virtio disk at its ceiling on a 2-core machine; more CPUs get up to 32.
    """
    return min(32, max(16, 2 * (os.cpu_count() or 2)))


class WarmEngine:
    """Loads byte ranges of one file into the page cache, in the background, politely.

    Two paths, chosen per stretch of touching ranges:

    - small stretches (experts, single tensors) are loaded *exactly*: through a descriptor
      advised ``FADV_RANDOM`` (no kernel readahead, so a hot-expert selection does not drag
      its neighbours in), in ``piece_bytes`` pieces, each hinted with ``WILLNEED`` (in
      8 MiB calls) together with the piece ``in_flight`` places ahead so the disk's queue
      stays full;
    - stretches of ``stream_min_bytes`` or more (the whole file, whole layers) are
      *streamed*: ``stream_piece_bytes`` pieces through a descriptor with normal,
      sequential readahead and no hints. The kernel's readahead fills the cache with large
      folios: on the dev VM it loaded a cold file as fast as the hinted path at a fifth of
      the CPU (0.05 s/GiB against 0.27). It may load up to one readahead window past the
      end of a stretch.

    Pieces are loaded by a pool of ``threads`` threads with ``os.sendfile`` to
    ``/dev/null`` (or ``os.preadv`` into a reusable per-thread buffer); both release the
    GIL. At most ``in_flight`` exact pieces' worth of bytes are queued or running (a stream
    piece counts for as many exact pieces as it is larger). The async layer only
    orchestrates: it gates each submission on ``pause()``/``resume()`` and the byte rate.

    ``pause()``/``resume()`` (or ``with engine.paused():``) must be called from the event
    loop's thread; they nest. Pieces already running finish, so a pause takes effect within
    ``in_flight * piece_bytes`` bytes.

    Cancelling the task running ``warm`` returns promptly: queued pieces are dropped and
    threads finish the piece they are on. ``aclose()`` waits for them and closes the file.

    Args:
        path: the file to warm.
        threads: loader threads (default ``default_threads()``).
        piece_bytes: bytes per exact piece (4-8 MiB keeps the per-piece cost negligible).
        in_flight: exact pieces (or their bytes' worth) submitted but not finished
            (default ``2 * threads``).
        hint_ahead: issue ``WILLNEED`` for exact pieces.
        stream_min_bytes: the smallest stretch that is streamed; None: load everything
            exactly.
        stream_piece_bytes: bytes per stream piece (a multiple of ``piece_bytes`` is best).
        buffer_bytes: each thread's buffer for the ``preadv`` loader; a piece is read
            through it in several calls, so memory stays at ``threads * buffer_bytes``.
        loader: how a piece is pulled into the page cache. ``"sendfile"`` (default) splices
            it to ``/dev/null``: the kernel reads the pages but copies nothing to user space
            (on the dev VM: 0.6x the CPU of ``preadv`` and 1.7x its speed on pages already
            resident). ``"preadv"`` reads through a per-thread buffer. Where the filesystem
            cannot splice, the engine falls back to ``preadv`` once, with a warning.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        threads: int | None = None,
        piece_bytes: int = 8 << 20,
        in_flight: int | None = None,
        hint_ahead: bool = True,
        stream_min_bytes: int | None = 64 << 20,
        stream_piece_bytes: int = 32 << 20,
        buffer_bytes: int = 1 << 20,
        loader: Loader = "sendfile",
    ) -> None:
        self.path = Path(path)
        self.threads = threads or default_threads()
        if self.threads < 1:
            raise UsageError(f"threads must be >= 1, not {threads}")
        if piece_bytes < PAGE_BYTES or stream_piece_bytes < PAGE_BYTES:
            raise UsageError(f"piece sizes must be >= {PAGE_BYTES}, not {piece_bytes} and "
                             f"{stream_piece_bytes}")
        if loader not in ("sendfile", "preadv"):
            raise UsageError(f"loader must be 'sendfile' or 'preadv', not {loader!r}")
        self.piece_bytes = piece_bytes
        self.stream_piece_bytes = stream_piece_bytes
        self.stream_min_bytes = stream_min_bytes
        self.buffer_bytes = min(max(buffer_bytes, PAGE_BYTES), piece_bytes)
        self.in_flight = in_flight or 2 * self.threads
        self.hint_ahead = hint_ahead
        self.loader: Loader = loader
        fds: list[int] = []
        try:
            for _ in range(2):
                fds.append(os.open(self.path, os.O_RDONLY | os.O_CLOEXEC))
            fds.append(os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC))
        except OSError as exc:
            for fd in fds:
                os.close(fd)
            raise ResidencyError(f"{self.path}: cannot open: {exc.strerror}") from None
        self._fd, self._stream_fd, self._devnull = fds
        # Advice on these open files only: other readers of the model keep their readahead.
        for fd, advice, name in ((self._fd, os.POSIX_FADV_RANDOM, "random"),
                                 (self._stream_fd, os.POSIX_FADV_SEQUENTIAL, "sequential")):
            try:
                os.posix_fadvise(fd, 0, 0, advice)
            except OSError as exc:
                _log.warning("warm.fadvise_refused", path=str(self.path), advice=name,
                             reason=exc.strerror)
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="moestream-warm")
        self._local = threading.local()
        self._pause_depth = 0
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._bucket: TokenBucket | None = None
        self._busy = asyncio.Lock()
        self._closed = False

    def __repr__(self) -> str:
        return (
            f"WarmEngine(path={str(self.path)!r}, threads={self.threads}, "
            f"piece_bytes={self.piece_bytes}, in_flight={self.in_flight}, "
            f"stream_min_bytes={self.stream_min_bytes}, loader={self.loader!r})"
        )

    # --- priority and rate -----------------------------------------------------------------

    def pause(self) -> None:
        """Stop submitting reads until the matching ``resume()`` (calls nest)."""
        self._pause_depth += 1
        self._resumed.clear()

    def resume(self) -> None:
        """Undo one ``pause()``."""
        if self._pause_depth == 0:
            raise UsageError("resume() without a matching pause()")
        self._pause_depth -= 1
        if self._pause_depth == 0:
            self._resumed.set()

    @property
    def paused_now(self) -> bool:
        return self._pause_depth > 0

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Pause for the body of a ``with`` block (decode reads go first)."""
        self.pause()
        try:
            yield
        finally:
            self.resume()

    def set_rate(self, max_bytes_per_s: float | None) -> None:
        """Change the byte rate of the warm-up running now (None: unlimited)."""
        if max_bytes_per_s is None:
            self._bucket = None
        elif self._bucket is None:
            self._bucket = TokenBucket(max_bytes_per_s, burst_bytes=self.piece_bytes)
        else:
            self._bucket.rate_bytes_per_s = max_bytes_per_s

    # --- blocking work, run on the pool ---------------------------------------------------------

    def _buffer(self) -> memoryview:
        buf: memoryview | None = getattr(self._local, "buf", None)
        if buf is None:
            # One buffer per thread, reused for every piece that thread reads; page-aligned
            # anonymous memory so the kernel copies into whole pages.
            buf = memoryview(mmap.mmap(-1, self.buffer_bytes))
            self._local.buf = buf
        return buf

    def _read_piece(
        self, piece: _Piece, hints: tuple[ByteRange, ...], stop: threading.Event
    ) -> int:
        """Hint ``hints``, then load ``piece``; returns the bytes loaded.

        The hints queue the piece's (and a later piece's) I/O at once, so a loader that
        waits on one part after another still keeps the disk busy.
        """
        if stop.is_set():
            return 0
        fd = self._stream_fd if piece.stream else self._fd
        if hints:
            with contextlib.suppress(ResidencyError):  # advice: a failed hint costs nothing
                hint_willneed(fd, hints)
        if self.loader == "sendfile":
            try:
                return self._sendfile(fd, piece.range)
            except _SpliceUnsupported as exc:
                if self.loader == "sendfile":  # first thread to notice says it, once
                    self.loader = "preadv"
                    _log.warning("warm.sendfile_unsupported", path=str(self.path),
                                 reason=str(exc), fallback="preadv")
        return self._preadv(fd, piece.range)

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

    # --- orchestration ---------------------------------------------------------------------

    async def warm(
        self,
        ranges: Iterable[RangeLike],
        *,
        max_bytes_per_s: float | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> WarmResult:
        """Read ``ranges`` (in the order given) so their pages become resident.

        Args:
            ranges: what to load; touching neighbours are joined, the order is kept (put the
                most wanted first). Parts past the end of the file are ignored.
            max_bytes_per_s: a byte-rate cap for this call (``set_rate`` changes it live).
            progress: called on the loop thread as ``progress(done_bytes, total_bytes)``
                after each piece.

        Returns:
            Bytes read, seconds taken and pieces read.

        Raises:
            ReadError: a read failed (the message names the offset).
            asyncio.CancelledError: when cancelled; queued pieces are dropped.
        """
        if self._closed:
            raise UsageError(f"{self!r} is closed")
        async with self._busy:
            return await self._warm(ranges, max_bytes_per_s, progress)

    async def _warm(
        self,
        ranges: Iterable[RangeLike],
        max_bytes_per_s: float | None,
        progress: Callable[[int, int], None] | None,
    ) -> WarmResult:
        loop = asyncio.get_running_loop()
        file_bytes = os.fstat(self._fd).st_size
        pieces = _pieces(ranges, self.piece_bytes, self.stream_piece_bytes,
                         self.stream_min_bytes, file_bytes)
        total = sum(p.range.nbytes for p in pieces)
        stream_weight = min(self.in_flight, max(1, self.stream_piece_bytes // self.piece_bytes))
        self.set_rate(max_bytes_per_s)
        stop = threading.Event()
        slots = asyncio.Semaphore(self.in_flight)
        running: set[asyncio.Future[int]] = set()
        failures: list[BaseException] = []
        done_bytes = 0
        t0 = time.perf_counter()
        _log.debug("warm.start", path=str(self.path), bytes=total, pieces=len(pieces),
                   threads=self.threads, rate=max_bytes_per_s)

        def finished(fut: asyncio.Future[int], weight: int) -> None:
            nonlocal done_bytes
            running.discard(fut)
            for _ in range(weight):
                slots.release()
            if fut.cancelled():
                return
            exc = fut.exception()
            if exc is not None:
                failures.append(exc)
                return
            done_bytes += fut.result()
            if progress is not None:
                progress(done_bytes, total)

        try:
            for i, piece in enumerate(pieces):
                weight = stream_weight if piece.stream else 1
                for _ in range(weight):
                    await slots.acquire()
                if failures:
                    for _ in range(weight):
                        slots.release()
                    break
                if self._pause_depth:
                    await self._resumed.wait()
                if self._bucket is not None:
                    await self._bucket.take(piece.range.nbytes)
                hints: tuple[ByteRange, ...] = ()
                if self.hint_ahead and not piece.stream:
                    ahead = i + self.in_flight
                    later = pieces[ahead] if ahead < len(pieces) else None
                    hints = (piece.range,) if later is None or later.stream else (
                        piece.range, later.range)
                # The load blocks in the kernel (sendfile, preadv release the GIL): run it on
                # the pool.
                fut = loop.run_in_executor(self._pool, self._read_piece, piece, hints, stop)
                running.add(fut)
                fut.add_done_callback(functools.partial(finished, weight=weight))
            if running:
                await asyncio.wait(set(running))
        except BaseException:
            stop.set()
            for fut in list(running):
                fut.cancel()
            raise
        if failures:
            stop.set()
            raise failures[0]
        seconds = time.perf_counter() - t0
        result = WarmResult(bytes_read=done_bytes, seconds=seconds, pieces=len(pieces))
        _log.info("warm.done", path=str(self.path), bytes=done_bytes, seconds=round(seconds, 3),
                  gb_per_s=round(result.gb_per_s, 3))
        return result

    # --- lifetime --------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Wait for running reads to finish, stop the threads and close the file."""
        if self._closed:
            return
        self._closed = True
        # shutdown(wait=True) blocks until the current pieces finish: keep the loop free.
        await asyncio.to_thread(self._pool.shutdown, wait=True, cancel_futures=True)
        for fd in (self._fd, self._stream_fd, self._devnull):
            os.close(fd)

    async def __aenter__(self) -> WarmEngine:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


def _memlock_text(value: int) -> str:
    if value == resource.RLIM_INFINITY:
        return "unlimited"
    return f"{value} bytes ({value / 2**20:.1f} MiB)"


class PageLock:
    """Pages of a file pinned in RAM with ``mlock``; they stay until ``unlock()``.

    The mappings this object holds must stay alive while the pages are to stay pinned;
    ``unlock()`` (or leaving the ``with`` block) unlocks and unmaps them.
    """

    def __init__(self, name: str, maps: list[tuple[int, int]]) -> None:
        self.name = name
        self._maps = maps

    @property
    def locked_bytes(self) -> int:
        return sum(length for _, length in self._maps)

    def unlock(self) -> None:
        """Unlock and unmap every locked range (idempotent)."""
        while self._maps:
            addr, length = self._maps.pop()
            _libc.munlock(addr, length)
            _libc.munmap(addr, length)
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


def lock_pages(target: FileRef, ranges: Iterable[RangeLike] | None = None) -> PageLock:
    """Pin the pages of ``ranges`` (whole file when None) in RAM, loading them first.

    Returns:
        A ``PageLock``; the pages stay pinned until its ``unlock()``.

    Raises:
        ResidencyError: ``mlock`` refused (the message gives ``RLIMIT_MEMLOCK`` and the bytes
            asked), or the file could not be mapped.
    """
    with _opened(target) as (fd, name):
        file_bytes = os.fstat(fd).st_size
        spans = [ByteRange(0, file_bytes)] if ranges is None else coalesce(ranges)
        covers = []
        for r in spans:
            first, stop = _page_cover(r)
            stop = min(stop, -(-file_bytes // PAGE_BYTES))
            if stop > first:
                covers.append((first * PAGE_BYTES, (stop - first) * PAGE_BYTES))
        asked = sum(length for _, length in covers)
        lock = PageLock(name, [])
        try:
            for offset, length in covers:
                addr = _libc.map_read(fd, offset, length, name)
                if _libc.mlock(addr, length) != 0:
                    err = ctypes.get_errno()
                    _libc.munmap(addr, length)
                    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
                    code = errno.errorcode.get(err, str(err))
                    raise ResidencyError(
                        f"{name}: mlock of {asked} bytes ({asked / 2**30:.2f} GiB) refused "
                        f"({code}: {os.strerror(err)}); RLIMIT_MEMLOCK is {_memlock_text(soft)} "
                        f"(hard {_memlock_text(hard)}): raise it (ulimit -l) or run with "
                        "CAP_IPC_LOCK"
                    )
                lock._maps.append((addr, length))
        except BaseException:
            lock.unlock()
            raise
    _log.info("residency.lock", path=name, locked_bytes=asked)
    return lock
