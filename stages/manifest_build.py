"""Computing a digest manifest: every routed expert read once, digested on the host.

``ManifestBuilder`` fills in the experts a ``DigestManifest`` does not know yet, with the
same per-matrix digest the device computes (``pipeline.foundation.digest``), in parallel: a pool of
threads reads the file with ``os.preadv`` (through ``moestream.stages.reader.ModelReader``: O_DIRECT
where allowed, retries, a changed file detected after every read) into per-thread buffers of
``piece_bytes`` and digests as it goes (numpy releases the GIL in the sums). A job is a run
of neighbouring experts of one layer, about ``job_bytes`` of them; their matrices that touch
in the file are read as one stretch, so a layer's gate tensor, say, is read in large pieces
whatever the expert size (the jobs and the work of one: ``moestream.stages.digest_jobs``).

It runs two ways: to completion, for ``tools.warmup --digests``; and in the background of a
run on a file with no digests (``moestream.stages.run_manifest.RunManifest``), where it
yields to decode as the warm-up engine does (``moestream.stages.throttle.Pausable``:
``pause``/``resume`` around layers whose misses are loading; a paused worker stops between
pieces) and does first the experts the verifier is waiting for (``ensure``). Its results
reach the manifest on the event loop's thread only.
"""

from __future__ import annotations

import asyncio
import functools
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import TracebackType

import numpy as np
import numpy.typing as npt
import structlog

from moestream.gpu.backend import PAGE, aligned_host_array
from moestream.gpu.cache.policy import ExpertKey
from moestream.pipeline.foundation.errors import ModelChangedError, StageError, UsageError
from moestream.pipeline.foundation.manifest import DigestManifest, ManifestKey
from moestream.pipeline.foundation.table import ExpertTable
from moestream.stages.digest_jobs import JobResult, digest_job, plan_jobs
from moestream.stages.reader import ModelReader
from moestream.stages.throttle import Pausable
from moestream.stages.warm import ReadResult

__all__ = ["BuildResult", "ManifestBuilder", "default_digest_threads"]

_log = structlog.get_logger("moestream.manifest")


def default_digest_threads() -> int:
    """Reader threads: enough reads in flight for a disk, and one digesting per core."""
    return min(8, max(4, os.cpu_count() or 2))


@dataclass(frozen=True, slots=True)
class BuildResult(ReadResult):
    """What one ``ManifestBuilder.build`` did."""

    experts: int


@dataclass(slots=True)
class _Build:
    """One ``build`` call's jobs in flight, their failures and what they did."""

    slots: asyncio.Semaphore
    total: int
    progress: Callable[[int, int], None] | None
    running: set[asyncio.Future[JobResult]] = field(default_factory=set)
    failures: list[BaseException] = field(default_factory=list)
    done_bytes: int = 0
    experts: int = 0


class ManifestBuilder(Pausable):
    """Fills in a manifest's missing digests from the model file.

    Args:
        table: the model's expert table.
        manifest: what is known so far; ``set`` is called for every expert digested.
        threads: reader threads (default ``default_digest_threads()``).
        piece_bytes: bytes per read (a multiple of the 4096-byte page).
        job_bytes: expert bytes per job (at least one expert).
        direct: whether a job reads with O_DIRECT (leaving the page cache alone: direct
            mode) or through the page cache (resident mode, or a warm file); asked per job.
    """

    def __init__(
        self,
        table: ExpertTable,
        manifest: DigestManifest,
        *,
        threads: int | None = None,
        piece_bytes: int = 8 << 20,
        job_bytes: int = 16 << 20,
        direct: bool | Callable[[], bool] = True,
    ) -> None:
        super().__init__()
        self.threads = threads or default_digest_threads()
        if self.threads < 1:
            raise UsageError(f"threads must be >= 1, not {threads}")
        if piece_bytes < PAGE or piece_bytes % PAGE:
            raise UsageError(f"piece_bytes must be a multiple of {PAGE}, not {piece_bytes}")
        self._table = table
        self.manifest = manifest
        self.piece_bytes = piece_bytes
        self.job_bytes = job_bytes
        self._direct = direct if callable(direct) else (lambda: direct)
        self._reader = ModelReader(table.files, direct=True)
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="moestream-digest")
        self._local = threading.local()
        self._stop = threading.Event()
        self._progressed = asyncio.Event()
        self._urgent: deque[ExpertKey] = deque()
        self._in_flight: set[ExpertKey] = set()
        self.error: BaseException | None = None
        self.finished = False
        self.stopped = False
        self.bytes_read = 0
        self._closed = False

    def __repr__(self) -> str:
        return (f"ManifestBuilder(path={str(self._table.path)!r}, threads={self.threads}, "
                f"piece_bytes={self.piece_bytes}, job_bytes={self.job_bytes})")

    # -- priority ---------------------------------------------------------------------------

    async def ensure(self, keys: Iterable[ExpertKey]) -> None:
        """Digest ``keys`` first and return once the manifest knows them all.

        ``build`` must be running (or have finished). Raises what stopped it, if it failed.
        """
        wanted = [k for k in keys if self.manifest.get(k) is None]
        self._urgent.extend(wanted)
        while True:
            if self.error is not None:
                raise self.error
            if all(self.manifest.get(k) is not None for k in wanted):
                return
            if self.finished or self.stopped:
                raise StageError("the digest manifest's computation stopped before these "
                                 "experts were digested")
            self._progressed.clear()
            await self._progressed.wait()

    # -- work, on the pool ------------------------------------------------------------------

    def _buffer(self) -> npt.NDArray[np.uint8]:
        buf: npt.NDArray[np.uint8] | None = getattr(self._local, "buf", None)
        if buf is None:
            buf = aligned_host_array(self.piece_bytes)  # O_DIRECT needs page alignment
            self._local.buf = buf
        return buf

    def _digest_job(self, layer: int, experts: Sequence[int], direct: bool) -> JobResult:
        """Worker: read and digest ``experts`` of ``layer``; their digests and bytes read."""
        return digest_job(self._table, self._reader, self._buffer(), self.piece_bytes,
                          self._running, self._stop, layer, experts, direct)

    # -- orchestration ----------------------------------------------------------------------

    def _jobs(self) -> Iterator[tuple[int, list[int]]]:
        """(layer, experts) to digest: experts waited for first, then the rest in file order;
        each time only experts neither known nor in flight, neighbours of a layer together."""
        yield from plan_jobs(self._table, self.manifest.missing(), self.job_bytes,
                             self._urgent, self._free)

    def _free(self, key: ExpertKey) -> bool:
        """Neither known nor being digested."""
        return key not in self._in_flight and self.manifest.get(key) is None

    def _check_key(self) -> None:
        """The files are still the ones the manifest is keyed to: the table's, which our
        reader opened against their identity and checks again here."""
        now = ManifestKey.of(self._table)
        if now != self.manifest.key:
            raise ModelChangedError(
                self._table.path, f"changed since its digest manifest was keyed "
                f"({', '.join(now.differences(self.manifest.key))}); no digest computed")
        self._reader.check_unchanged(path=True)

    async def build(self, progress: Callable[[int, int], None] | None = None) -> BuildResult:
        """Digest every expert the manifest does not know; returns what was done.

        Args:
            progress: called on the loop thread as ``progress(done_bytes, total_bytes)`` of
                expert bytes after each job.

        Raises:
            ReadError, ModelChangedError: a read failed, or the file changed (no digest of
                bytes read after the change is recorded).
            asyncio.CancelledError: when cancelled; running jobs stop at their next piece.
        """
        if self._closed:
            raise UsageError(f"{self!r} is closed")
        missing = self.manifest.missing()
        total = sum(self._table.expert_bytes(n) for n, _ in missing)
        state = _Build(asyncio.Semaphore(self.threads), total, progress)
        t0 = time.perf_counter()
        try:
            self._check_key()
            await self._submit(state)
            if state.failures:
                raise state.failures[0]
        except BaseException as exc:
            self._stopped(state, exc)
            raise
        self.finished = True
        self._progressed.set()
        result = BuildResult(bytes_read=self.bytes_read, seconds=time.perf_counter() - t0,
                             experts=state.experts)
        _log.info("digest_manifest_built", path=str(self._table.path), experts=state.experts,
                  bytes=result.bytes_read, seconds=round(result.seconds, 3),
                  gb_per_s=round(result.gb_per_s, 3))
        return result

    async def _submit(self, state: _Build) -> None:
        """Hand jobs to the pool while slots free up, until none is left and none runs."""
        loop = asyncio.get_running_loop()
        jobs = self._jobs()
        while not state.failures:
            await state.slots.acquire()
            await self._wait_resumed()
            job = next(jobs, None) if not state.failures else None
            if job is None:
                state.slots.release()
                if not state.running:
                    break
                # what is left is in flight; urgent keys may still come: wait, retry
                self._progressed.clear()
                await self._progressed.wait()
                jobs = self._jobs()
                continue
            layer, members = job
            self._in_flight.update((layer, e) for e in members)
            fut = loop.run_in_executor(self._pool, self._digest_job, layer, members,
                                       self._direct())
            state.running.add(fut)
            fut.add_done_callback(functools.partial(self._finished, state, layer=layer,
                                                    job=members))
        if state.running:
            await asyncio.wait(set(state.running))

    def _finished(self, state: _Build, fut: asyncio.Future[JobResult], layer: int,
                  job: list[int]) -> None:
        """Loop thread, as a job's future completes: its digests into the manifest."""
        state.running.discard(fut)
        state.slots.release()
        self._in_flight.difference_update((layer, e) for e in job)
        self._progressed.set()
        if fut.cancelled():
            return
        exc = fut.exception()
        if exc is not None:
            state.failures.append(exc)
            return
        results, read = fut.result()
        self.bytes_read += read
        for e, values in results:
            self.manifest.set((layer, e), values)
        state.experts += len(results)
        state.done_bytes += len(results) * self._table.expert_bytes(layer)
        if state.progress is not None:
            state.progress(state.done_bytes, state.total)

    def _stopped(self, state: _Build, exc: BaseException) -> None:
        """``build`` failed or was cancelled: stop the workers, wake whoever waits."""
        self._stop.set()
        self._running.set()
        for fut in list(state.running):
            fut.cancel()
        if not isinstance(exc, asyncio.CancelledError):
            self.error = exc
        self.stopped = True
        self._progressed.set()

    # -- lifetime --------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Stop the workers (each finishes the piece it reads), join them, close the file."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._running.set()
        # joining blocks until the current pieces finish: keep the loop free meanwhile
        await asyncio.to_thread(self._pool.shutdown, wait=True, cancel_futures=True)
        self._reader.close()

    async def __aenter__(self) -> ManifestBuilder:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()
