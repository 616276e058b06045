"""The warm-up engine: load byte ranges of the model file into the page cache, politely.

Split out of ``moestream.stages.residency`` so that module keeps to asking the kernel about pages
(``mincore``, ``evict``, ``WILLNEED``, ``mlock``) while this one owns the machinery that
fills the cache in the background: a thread pool, a byte-rate limit and pause/resume.
The residency controller and the ``tools.warmup`` CLI both use it.

- ``WarmEngine`` loads ranges with a thread pool of ``os.sendfile`` calls to
  ``/dev/null`` (the kernel reads the pages, nothing is copied to user space) or
  ``os.preadv`` into reusable per-thread buffers, with ``WILLNEED`` hints issued ahead
  (``moestream.stages.residency.hint_willneed``), a byte-rate ``TokenBucket``,
  ``pause()``/``resume()`` so decode reads go first, and prompt asyncio cancellation.
- ``WarmResult`` says what one warm-up did.
- ``Pausable``: the nesting ``pause()``/``resume()`` of background reads, shared with the
  digest manifest's builder (``moestream.stages.manifest_build``).

Byte ranges are anything with ``offset`` and ``nbytes`` (``moestream.stages.residency.RangeLike``).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import TracebackType
from typing import Literal

import structlog

from moestream.pipeline.foundation.errors import ReadError, ResidencyError, UsageError
from moestream.pipeline.foundation.files import ModelFile, model_files, open_checked
from moestream.pipeline.foundation.files import pieces as file_parts
from moestream.pipeline.foundation.table import ByteRange
from moestream.pipeline.foundation.warm_threads import STREAM_PIECE_BYTES, default_threads
from moestream.stages.residency import PAGE_BYTES, RangeLike, hint_willneed

__all__ = [
    "Loader",
    "Pausable",
    "ReadResult",
    "TokenBucket",
    "WarmEngine",
    "WarmResult",
    "default_threads",
]

_log = structlog.get_logger("moestream.warm")


class Pausable:
    """Background reads that yield to decode: ``pause()``/``resume()`` that nest.

    The warm-up engine and the digest manifest's builder share it. Call ``pause``/``resume``
    (or ``with x.paused():``) from the event loop's thread. The loop side waits on
    ``_resumed`` before it submits more work; a worker thread that should stop between
    pieces waits on ``_running`` (both are set whenever no pause is held).
    """

    def __init__(self) -> None:
        self._pause_depth = 0
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._running = threading.Event()
        self._running.set()

    def pause(self) -> None:
        """Stop reading until the matching ``resume()`` (calls nest)."""
        self._pause_depth += 1
        self._resumed.clear()
        self._running.clear()

    def resume(self) -> None:
        """Undo one ``pause()``."""
        if self._pause_depth == 0:
            raise UsageError("resume() without a matching pause()")
        self._pause_depth -= 1
        if self._pause_depth == 0:
            self._resumed.set()
            self._running.set()

    @property
    def paused_now(self) -> bool:
        """A pause is held."""
        return self._pause_depth > 0

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Pause for the body of a ``with`` block (decode reads go first)."""
        self.pause()
        try:
            yield
        finally:
            self.resume()

    async def _wait_resumed(self) -> None:
        """Loop side: return once no pause is held."""
        if self._pause_depth:
            await self._resumed.wait()


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
class ReadResult:
    """The bytes a background read took in and the seconds it took."""

    bytes_read: int
    seconds: float

    @property
    def gb_per_s(self) -> float:
        """Read rate in GB/s (0 when no time passed)."""
        return self.bytes_read / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass(frozen=True, slots=True)
class WarmResult(ReadResult):
    """What one ``WarmEngine.warm`` call did."""

    pieces: int


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


class WarmEngine(Pausable):
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
        model: the file to warm, or a model's files (``ExpertTable.files``, each opened
            against the identity its table saw); ranges are offsets of the model's address
            space.
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
        model: str | os.PathLike[str] | Sequence[ModelFile],
        *,
        threads: int | None = None,
        piece_bytes: int = 8 << 20,
        in_flight: int | None = None,
        hint_ahead: bool = True,
        stream_min_bytes: int | None = 64 << 20,
        stream_piece_bytes: int = STREAM_PIECE_BYTES,
        buffer_bytes: int = 1 << 20,
        loader: Loader = "sendfile",
    ) -> None:
        super().__init__()
        self.files = model_files(model)
        self.path = self.files[0].path
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
        # per file, by base: one descriptor for pieces, one for long stretches
        self._fds: dict[int, tuple[int, int]] = {}
        try:
            for f in self.files:
                fd = open_checked(f)
                try:
                    self._fds[f.base] = (fd, open_checked(f))
                except BaseException:
                    os.close(fd)
                    raise
            self._devnull = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
        except BaseException:
            self._close_fds()
            raise
        # Advice on these open files only: other readers of the model keep their readahead.
        for fd, stream_fd in self._fds.values():
            for one, advice, name in ((fd, os.POSIX_FADV_RANDOM, "random"),
                                      (stream_fd, os.POSIX_FADV_SEQUENTIAL, "sequential")):
                try:
                    os.posix_fadvise(one, 0, 0, advice)
                except OSError as exc:
                    _log.warning("warm.fadvise_refused", path=str(self.path), advice=name,
                                 reason=exc.strerror)
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="moestream-warm")
        self._local = threading.local()
        self._bucket: TokenBucket | None = None
        self._busy = asyncio.Lock()
        self._closed = False

    def __repr__(self) -> str:
        return (
            f"WarmEngine(path={str(self.path)!r}, threads={self.threads}, "
            f"piece_bytes={self.piece_bytes}, in_flight={self.in_flight}, "
            f"stream_min_bytes={self.stream_min_bytes}, loader={self.loader!r})"
        )

    # --- rate ------------------------------------------------------------------------------

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
        file_bytes = self.files[-1].end
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
                await self._wait_resumed()
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
        self._close_fds()

    def _close_fds(self) -> None:
        for pair in self._fds.values():
            for fd in pair:
                if fd >= 0:
                    os.close(fd)
        self._fds.clear()
        if getattr(self, "_devnull", -1) >= 0:
            os.close(self._devnull)
            self._devnull = -1

    async def __aenter__(self) -> WarmEngine:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()
