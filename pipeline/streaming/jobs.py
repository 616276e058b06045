"""The streamer's parts and one expert's job from its launch to its delivery.

``ExpertJobs`` is the base of ``ExpertStreamer``: it opens the parts a device's loads go
through (reader, staging ring, upload streams, installer, the reader pool, the mapping's
registrar, the host tier, install digests), and carries a miss's job from its launch on
the loop (``_launch``: a staging slot, the chunks handed to the readers) through the
worker threads (chunks read into the slot, or copies out of the page-cache mapping, then
the upload) and back on the loop (``_job_done``: the slot returned, the entry handed to
decode). The streamer (``streaming.streamer``) plans a layer and chooses between these
jobs and the registered path (``streaming.registered``), which queues whole layers
without jobs.
"""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import numpy.typing as npt

from moestream.gpu.backend import Backend, Event, Kernels, Stream
from moestream.gpu.cache.store import DeviceCache, Entry
from moestream.pipeline.foundation.config import StreamConfig
from moestream.pipeline.foundation.errors import StageError
from moestream.pipeline.foundation.faults import FaultPlan
from moestream.pipeline.foundation.table import ExpertTable
from moestream.pipeline.streaming.loads import (
    IOMode,
    JobMode,
    LayerLoad,
    LoadJob,
    StageTimes,
    WarmGate,
)
from moestream.pipeline.streaming.verify import DigestRows, Digests
from moestream.stages.host_tier import HostTier
from moestream.stages.layout import ExpertLayout, plan_table
from moestream.stages.mapping import ModelMapping
from moestream.stages.reader import ModelReader
from moestream.stages.registration import MappingRegistrar
from moestream.stages.staging import StagingRing, WorkerPool
from moestream.stages.upload import Installer, Uploader

__all__ = ["ExpertJobs"]


class ExpertJobs:
    """A device's loading parts, and the jobs that run through them (arguments: as
    ``ExpertStreamer``'s)."""

    def __init__(
        self,
        config: StreamConfig,
        table: ExpertTable,
        backend: Backend,
        cache: DeviceCache,
        kernels: Kernels,
        faults: FaultPlan | None = None,
        primary: ExpertJobs | None = None,
        *,
        layers_ahead: int = 0,
    ) -> None:
        self._cfg = config
        self._primary = primary
        self._table = table
        self._backend = backend
        self._cache = cache
        self._kernels = kernels
        self.layouts: dict[tuple[int, int], ExpertLayout] = (
            primary.layouts if primary is not None else plan_table(table))
        """Every expert's staging and device layout (planned at open; read only): a miss
        looks its own up."""
        slot_bytes = max(layout.slot_bytes for layout in self.layouts.values())
        self.faults = faults
        self.reader = ModelReader(table.files, direct=True, faults=faults)
        try:
            self.ring = StagingRing(backend, config.staging_slots, slot_bytes, faults)
            self.uploader = Uploader(backend, config.upload_streams, faults)
        except BaseException:
            self.reader.close()  # nobody else holds the streamer yet to close it
            raise
        self.installer = Installer(cache)
        self._pool = WorkerPool(config.queue_depth, "moestream-read")
        self._registrar = MappingRegistrar(table.files, backend, lambda: self.mode == "resident")
        self._resident_inflight = 0
        self.host_tier = HostTier(table, self.reader.drop_ranges)
        self._staged_jobs: set[LoadJob] = set()
        self.launchers: set[asyncio.Task[None]] = set()
        """The layers' launches under way (a task each, ``_launch``): the
        session cancels them at close."""
        self.warm_gate: WarmGate | None = None
        self._resident_idle = asyncio.Event()
        self.mode: IOMode = "direct"
        self.times = StageTimes()
        self._times_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        # the digests one take finds: a token's layers and those loaded ahead of it
        capacity = (len(table.layers) + layers_ahead) * table.top_k
        self.digests = DigestRows(kernels, capacity) if config.verify else None

    @property
    def pinned_bytes(self) -> int:
        """Model bytes page-locked by us right now (registered mapping windows)."""
        return self._registrar.pinned_bytes

    @property
    def mapping(self) -> ModelMapping | None:
        return self._primary.mapping if self._primary is not None else self._registrar.mapping

    def take_digests(self, *, wait: bool = False) -> Digests:
        """The install digests of the experts loaded since the last call whose copies have
        run (``wait``: of all of them; ``DigestRows.take``)."""
        if self.digests is None:
            return Digests.none()
        return self.digests.take(wait=wait)

    def _add_time(self, name: str, since: float) -> None:
        elapsed = (time.perf_counter() - since) * 1000.0
        with self._times_lock:
            setattr(self.times, name, getattr(self.times, name) + elapsed)

    async def _launch(self, load: LayerLoad) -> None:
        """Start every miss of a layer: take slots (direct) and hand work to the pool.

        Whatever stops the launch (a refused allocation, cancellation) is reported for each
        miss not yet started, so the decoder waiting on the layer never waits forever.
        """
        try:
            for entry in load.plan.misses:
                # read per miss: a switch to direct during this launch (it awaits slots) must
                # not send later misses to a mapping that is being released
                mode = self.mode
                layout = self.layouts[entry.key]
                self.host_tier.missed((entry.key,))
                # host tier (partial residency): a hot expert is read through the page cache
                # and its pages kept, the rest stays O_DIRECT
                job_mode: JobMode = ("tier" if mode == "direct"
                                     and entry.key in self.host_tier.keys else mode)
                job = LoadJob(entry, layout, self.uploader.next_stream(), load, job_mode,
                              load.phases[entry.key])
                if self.digests is not None:
                    job.digest_results, job.digest_row = self.digests.reserve(entry.key)
                if mode == "resident" and self._start_resident(job):
                    continue
                # direct, or not registered yet (cold or still being registered): a read
                # into staging (buffered through the page cache when resident); it never
                # waits on a whole window. Every slot holds the largest expert's covers.
                t0 = time.perf_counter()
                job.slot = await self.ring.acquire()
                t1 = time.perf_counter()
                assert load.launch is not None
                load.launch.slot_waits.append((t0, t1))  # later misses of the layer wait too
                job.phases.begin(t1)
                self._staged_jobs.add(job)
                self._add_time("stage_ms", t0)
                reads = layout.reads(self._cfg.chunk_bytes)
                job.remaining = len(reads)
                load.launched += 1
                for file_offset, slot_offset, nbytes in reads:
                    self._pool.submit(self._read_chunk, job, file_offset, slot_offset, nbytes)
        except BaseException as exc:
            for entry in load.plan.misses[load.launched :]:
                self._deliver(load, entry, exc)
            if not isinstance(exc, Exception):
                raise

    def _start_resident(self, job: LoadJob) -> bool:
        """A resident miss read from the mapping without staging, if it can be: on the host
        backend on a worker; on a GPU, once its pages are registered, queued as copies (no
        thread hop). False: it goes through staging."""
        mapping = self.mapping
        if mapping is None:
            return False
        load = job.load
        if not self._backend.registers_host:
            self._resident_inflight += 1
            load.launched += 1
            job.phases.begin()
            self._pool.submit(self._resident_job, job)
            return True
        if not all(mapping.is_registered(s.file_offset, s.nbytes) for s in job.layout.ranges):
            return False
        load.launched += 1
        job.phases.begin()
        event = self._resident_upload(job, mapping)
        job.phases.mark("upload")  # queued; the device copy shows where decode waits
        self._job_done(job, event, counted=False)
        return True

    def _read_chunk(self, job: LoadJob, file_offset: int, slot_offset: int, nbytes: int) -> None:
        """Worker: one chunk into the job's slot; the worker that read a job's last chunk
        uploads the expert (or hands on its failure) and tells the loop."""
        slot = job.slot
        assert slot is not None
        reuse_wait_s = 0.0
        try:
            if job.error is None:
                t0 = time.perf_counter()
                slot.wait_reusable()
                reuse_wait_s = time.perf_counter() - t0
                self._add_time("stage_ms", t0)
                t0 = time.perf_counter()
                dst = slot.buffer.array[slot_offset : slot_offset + nbytes]
                self.reader.read_into(dst, file_offset, direct=job.mode == "direct")
                self._add_time("read_ms", t0)
        except BaseException as exc:  # handed to the loop; the expert is never installed
            job.error = job.error or exc
        with job.lock:
            job.reuse_wait_s = max(job.reuse_wait_s, reuse_wait_s)
            job.remaining -= 1
            if job.remaining:
                return
        # the last chunk: upload the expert and tell the loop
        event: Event | None = None
        # the chunks waited for the slot's last upload, concurrently, then read: the
        # longest wait counts as slot time at the start, the rest as reading
        read_done = time.perf_counter()
        began = job.phases.start if job.phases.start is not None else read_done
        job.phases.mark("slot", min(began + job.reuse_wait_s, read_done))
        job.phases.mark("read", read_done)
        if job.error is None:
            try:
                staged = slot.buffer.array
                pieces = [(at, staged[start:end]) for at, start, end in job.layout.copies]
                event = self._upload(job, pieces)
            except BaseException as exc:
                job.error = exc
            job.phases.mark("upload")
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._job_done, job, event)

    def _resident_job(self, job: LoadJob) -> None:
        """Worker (host backend): copy an expert straight from the page-cache mapping."""
        event: Event | None = None
        try:
            mapping = self.mapping
            if mapping is None:
                raise StageError("resident load started after the mapping was closed")
            t0 = time.perf_counter()
            event = self._resident_upload(job, mapping)
            self._add_time("read_ms", t0)
        except BaseException as exc:
            job.error = exc
        job.phases.mark("upload")  # a copy out of the page cache (waiting for a worker too)
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._job_done, job, event)

    def _resident_upload(self, job: LoadJob, mapping: ModelMapping) -> Event | None:
        """Queue the copies of an expert straight from the mapping (any thread)."""
        pieces = [
            (s.device_offset + at, view)
            for s in job.layout.ranges
            for at, view in mapping.pieces(s.file_offset, s.nbytes)
        ]
        try:
            return self._upload(job, pieces)
        except BaseException as exc:
            job.error = exc
            return None

    def _upload(self, job: LoadJob, pieces: list[tuple[int, npt.NDArray[np.uint8]]]) -> Event:
        t0 = time.perf_counter()
        digest = None
        if job.digest_row >= 0:
            ranges = [(s.device_offset, s.nbytes) for s in job.layout.ranges]

            def digest(stream: Stream) -> None:
                self._kernels.digest3(
                    job.entry.buffer, ranges, job.digest_results, job.digest_row, stream
                )

        with self._backend.activate():  # workers: CUDA's current device is per thread
            event = self.uploader.upload(job.entry, pieces, job.stream, digest)
        self._add_time("upload_ms", t0)
        return event

    def _job_done(self, job: LoadJob, event: Event | None, *, counted: bool = True) -> None:
        """Loop: return the slot (busy until the upload is done) and pass the entry on."""
        if self.digests is not None and job.digest_row >= 0:
            if job.error is None:
                self.digests.complete(job.digest_results, job.digest_row, event)
            else:
                self.digests.drop(job.digest_results, job.digest_row)
        if job.slot is not None:
            self._staged_jobs.discard(job)
            self.ring.release(job.slot, event)
        elif counted:
            self._resident_inflight -= 1
            if self._resident_inflight == 0:
                self._resident_idle.set()
        if job.error is None:
            self.installer.submit((job.entry,))
        self._deliver(job.load, job.entry, job.error)

    def _deliver(self, load: LayerLoad, entry: Entry, error: BaseException | None) -> None:
        """Loop: hand a miss (or its failure) to the decoder; the last one lifts the gate."""
        assert load.arrived is not None
        load.arrived.put_nowait((entry, error))
        if entry.loaded is not None and not entry.loaded.done():
            # a later layer's lookup may be waiting on this load (prefetch, dedup)
            if error is None:
                entry.loaded.set_result(None)
            else:
                entry.loaded.set_exception(StageError(f"load of {entry.key} failed: {error}"))
                entry.loaded.exception()  # retrieved here too: no "never retrieved" warning
        if error is not None and self._cache.get(entry.key) is entry:
            self._cache.drop(entry.key)  # failed: never a hit (its lease, if any, is told)
        self._delivered(load, 1)

    @staticmethod
    def _delivered(load: LayerLoad, n: int) -> None:
        """``n`` more of the load's misses were handed on; the last one lifts the gate."""
        load.delivered += n
        if load.delivered == len(load.plan.misses) and load.gate is not None:
            load.gate.resume()

    def poll_installs(self) -> None:
        if not self.installer.pending:  # the common case when warm: nothing to look at
            return
        t0 = time.perf_counter()
        self.installer.poll()
        self._add_time("install_ms", t0)

    def take_times(self) -> StageTimes:
        with self._times_lock:
            times, self.times = self.times, StageTimes()
        return times
