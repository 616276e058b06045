"""The warm-up engine: load byte ranges of the model file into the page cache, politely.

Split out of ``moestream.stages.residency`` so that module keeps to asking the kernel about pages
(``mincore``, ``evict``, ``WILLNEED``) while this one owns the machinery that fills the
cache in the background: a thread pool, a byte-rate limit and pause/resume.
The residency controller and the ``tools.warmup`` CLI both use it.

- ``WarmEngine`` loads ranges with a thread pool of ``os.sendfile`` calls to
  ``/dev/null`` (the kernel reads the pages, nothing is copied to user space) or
  ``os.preadv`` into reusable per-thread buffers, with ``WILLNEED`` hints issued ahead
  (``moestream.stages.residency.hint_willneed``), a byte-rate ``TokenBucket``,
  ``pause()``/``resume()`` so decode reads go first, and prompt asyncio cancellation. The
  loads themselves, on the pool, are ``moestream.stages.warm_load``'s.
- ``WarmResult`` says what one warm-up did.
- ``Pausable``: the nesting ``pause()``/``resume()`` of background reads, shared with the
  digest manifest's builder (``moestream.stages.manifest_build``); it and ``TokenBucket``
  live in ``moestream.stages.throttle``.

Byte ranges are anything with ``offset`` and ``nbytes`` (``moestream.stages.residency.RangeLike``).
"""

from __future__ import annotations

import asyncio
import functools
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import TracebackType

import structlog

from moestream.pipeline.foundation.errors import UsageError
from moestream.pipeline.foundation.files import ModelFile, model_files
from moestream.pipeline.foundation.table import ByteRange
from moestream.pipeline.foundation.warm_threads import STREAM_PIECE_BYTES, default_threads
from moestream.stages.libc import PAGE_BYTES
from moestream.stages.page_ranges import RangeLike
from moestream.stages.throttle import Pausable, TokenBucket
from moestream.stages.warm_load import Loader, Piece, PieceLoader, plan_pieces

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


class _Batch:
    """One ``warm`` call's pieces in flight: the slots they hold, their failures, the bytes
    done. ``finished`` runs on the loop thread as each piece's future completes."""

    def __init__(self, in_flight: int, total: int,
                 progress: Callable[[int, int], None] | None) -> None:
        self.stop = threading.Event()
        self.slots = asyncio.Semaphore(in_flight)
        self.running: set[asyncio.Future[int]] = set()
        self.failures: list[BaseException] = []
        self.done_bytes = 0
        self.total = total
        self.progress = progress

    async def acquire(self, weight: int) -> bool:
        """Take ``weight`` slots; False (and none held) once a piece has failed."""
        for _ in range(weight):
            await self.slots.acquire()
        if self.failures:
            for _ in range(weight):
                self.slots.release()
            return False
        return True

    def track(self, fut: asyncio.Future[int], weight: int) -> None:
        self.running.add(fut)
        fut.add_done_callback(functools.partial(self.finished, weight=weight))

    def finished(self, fut: asyncio.Future[int], weight: int) -> None:
        self.running.discard(fut)
        for _ in range(weight):
            self.slots.release()
        if fut.cancelled():
            return
        exc = fut.exception()
        if exc is not None:
            self.failures.append(exc)
            return
        self.done_bytes += fut.result()
        if self.progress is not None:
            self.progress(self.done_bytes, self.total)

    def cancel(self) -> None:
        """Stop the threads between pieces and drop the pieces queued."""
        self.stop.set()
        for fut in list(self.running):
            fut.cancel()


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
        quiet_s: after decode's last pause ends, how long no new one must come before
            pieces go on (``Pausable``); 0 (default): at once.
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
        quiet_s: float = 0.0,
    ) -> None:
        super().__init__(quiet_s)
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
        self._loads = PieceLoader(self.files, self.path, self.buffer_bytes, loader)
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="moestream-warm")
        self._bucket: TokenBucket | None = None
        self._busy = asyncio.Lock()
        self._closed = False

    @property
    def loader(self) -> Loader:
        """How pieces are loaded now (``sendfile`` falls back to ``preadv`` for good)."""
        return self._loads.loader

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
        pieces = plan_pieces(ranges, self.piece_bytes, self.stream_piece_bytes,
                             self.stream_min_bytes, self.files[-1].end)
        total = sum(p.range.nbytes for p in pieces)
        self.set_rate(max_bytes_per_s)
        batch = _Batch(self.in_flight, total, progress)
        t0 = time.perf_counter()
        _log.debug("warm.start", path=str(self.path), bytes=total, pieces=len(pieces),
                   threads=self.threads, rate=max_bytes_per_s)
        try:
            await self._submit(pieces, batch)
        except BaseException:
            batch.cancel()
            raise
        if batch.failures:
            batch.stop.set()
            raise batch.failures[0]
        seconds = time.perf_counter() - t0
        result = WarmResult(bytes_read=batch.done_bytes, seconds=seconds, pieces=len(pieces))
        _log.info("warm.done", path=str(self.path), bytes=batch.done_bytes,
                  seconds=round(seconds, 3), gb_per_s=round(result.gb_per_s, 3))
        return result

    async def _submit(self, pieces: Sequence[Piece], batch: _Batch) -> None:
        """Hand ``pieces`` to the pool in order, each once its slots, the pause and the byte
        rate allow; then wait for those running."""
        loop = asyncio.get_running_loop()
        stream_weight = min(self.in_flight, max(1, self.stream_piece_bytes // self.piece_bytes))
        for i, piece in enumerate(pieces):
            weight = stream_weight if piece.stream else 1
            if not await batch.acquire(weight):
                break
            await self._wait_resumed()
            if self._bucket is not None:
                await self._bucket.take(piece.range.nbytes)
            # The load blocks in the kernel (sendfile, preadv release the GIL): run it on
            # the pool.
            fut = loop.run_in_executor(self._pool, self._loads.load, piece,
                                       self._hints(pieces, i), batch.stop)
            batch.track(fut, weight)
        if batch.running:
            await asyncio.wait(set(batch.running))

    def _hints(self, pieces: Sequence[Piece], i: int) -> tuple[ByteRange, ...]:
        """What to hint with piece ``i``: itself and the exact piece ``in_flight`` ahead."""
        piece = pieces[i]
        if not self.hint_ahead or piece.stream:
            return ()
        ahead = i + self.in_flight
        later = pieces[ahead] if ahead < len(pieces) else None
        return (piece.range,) if later is None or later.stream else (piece.range, later.range)

    # --- lifetime --------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Wait for running reads to finish, stop the threads and close the file."""
        if self._closed:
            return
        self._closed = True
        # shutdown(wait=True) blocks until the current pieces finish: keep the loop free.
        await asyncio.to_thread(self._pool.shutdown, wait=True, cancel_futures=True)
        self._loads.close()

    async def __aenter__(self) -> WarmEngine:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()
