"""The expert streamer: one layer's misses from the file into the device cache.

Per layer the run loop asks ``start_layer``; the cache decides hits and misses, and every
miss is started at once:

- direct mode: a staging slot is taken from the ring, the expert's aligned covers are split
  into chunks and handed to the reader pool (``queue_depth`` reads in flight); the worker
  that finishes an expert's last chunk queues its upload on the next stream and records its
  event, then tells the loop (``call_soon_threadsafe``), which returns the slot with that
  event and hands the entry to decode;
- resident mode: copies straight from the page-cache mapping (registered with the device,
  so the copy engine reads it with no CPU copy). When every miss of the layer lies in
  registered windows (the steady state), ``_start`` queues the whole layer at once on the
  loop thread, under one device activation: each expert's copies, install digest and event,
  then a single callback hands the layer's misses to decode: no task, worker or thread hop
  per expert (``_queue_registered``). Otherwise (windows not registered yet, or the host
  backend) one pool job per expert.

All-hit layers (every expert cached, the common case once warm) plan in the cache's fast
path and start nothing: ``start_layer`` returns the plan in a bare ``LayerLoad``.

Scheduling cost stays per layer: one task launches a layer's misses; chunks are executor
jobs, not asyncio tasks. Decode waits on each expert's upload event on the device.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, Protocol

import numpy as np
import numpy.typing as npt
import structlog

from moestream.gpu.backend import Backend, Event, Kernels, Stream
from moestream.gpu.cache.store import DeviceCache, Entry, LayerPlan
from moestream.pipeline.foundation.config import RunConfig
from moestream.pipeline.foundation.errors import StageError
from moestream.pipeline.foundation.faults import FaultPlan
from moestream.pipeline.foundation.table import ExpertTable
from moestream.pipeline.foundation.timesplit import LaunchTimes, LoadPhases
from moestream.pipeline.streaming.arrivals import Arrivals
from moestream.pipeline.streaming.verify import DigestRows, Digests
from moestream.stages.host_tier import HostTier
from moestream.stages.install import Installer
from moestream.stages.layout import ExpertLayout, iter_chunks, largest_slot_bytes, plan_expert
from moestream.stages.mapping import ModelMapping
from moestream.stages.reader import ModelReader
from moestream.stages.registration import MappingRegistrar
from moestream.stages.staging import StagingRing, StagingSlot
from moestream.stages.upload import Uploader, gather_rows
from moestream.stages.workers import WorkerPool

__all__ = ["ExpertStreamer", "LayerLoad", "StageTimes"]

_log = structlog.get_logger("moestream.streamer")


GATHER_BELOW_BYTES = 2 << 20
"""Resident misses go through the gather kernel when an expert's matrices average under
2 MiB, and through the copy engines otherwise. On the H200 (PCIe gen5), delivered / pinned
H2D, gather against copy engines: 0.74 against 0.39 with 0.84 MiB matrices (Qwen3-30B-A3B's
Q4_K), 0.73 against 0.38 with 0.56 MiB (fine-grained, three runs), where the copy engines'
per-matrix host work bounds them; from 2 MiB up they match or beat it: 0.87 against 0.88
with 2.06 MiB (DeepSeek-V2-Lite's Q5_K shape, three runs each; on a later lease 0.87 against
0.92, where verification's digest launch per expert made the copy engines' difference: 0.95
without verification, ``bench/results/shapes-h200-1952d34/``; one digest launch a layer,
``Uploader.upload_layer``, took them to 0.91-0.95: the copy engines' own rate for
2 MiB copies, which beat the gather's on the same bytes, 51.6 against 48.7 GB/s,
``bench/results/shapes-h200-e5ddd6d/``), 0.96 against 0.96
(ds4-flash-q2, 2.1-2.6 MiB), 0.78 against 0.94 (bf16 per-expert checkpoint, 3 MiB). The
copy engines also leave the SMs to the engine: beside the gather an engine's bf16 GEMM kept
0.36-0.53 of its rate and a decode-like GEMV 0.09-0.25, beside the copy engines 0.93-0.98
(``bench.contention``, ``bench/results/shapes-h200-b322dfe/``).

Since the copy engines take a layer's copies as one batched call (``moestream.gpu.batchcopy``, CUDA
12.8+), DeepSeek-V2-Lite's warm misses reach 1.00-1.02 x pinned H2D, and the copy engines
move the smaller shapes' bytes faster than the gather too (the fine-grained shape's: 54.6
against 47.8 GB/s, ``bench/results/shapes-h200-bbcc026/``). But those shapes are
host-bound (10-20 misses a layer), and the gather costs the host less (one launch copies
and digests, where the copy engines take a batched copy and a digest launch): with the
copy engines by default Qwen3-30B-A3B's warm misses read 0.58, 0.58, 0.89 x pinned (63262e7)
where the gather read 0.85-0.97 in every run of three earlier sessions. Compared round by
round in one process (``bench.pipeline``'s alternating warm-miss rounds,
``bench/results/shapes-h200-24dccb3/``) the gather beat the batched copy engines by
1.06-1.28 x on the fine-grained shape in three runs and 0.97 and 1.40 x on Qwen's in two:
the gather stays the default for small experts, and ``gather=False`` gives an engine every
SM at 0.5-0.9 x pinned there."""


def _small_ranges(table: ExpertTable) -> bool:
    """Whether the model's experts are made of matrices small enough for the gather."""
    ranges = table.slices((table.moe_layers[0], 0)).ranges
    return sum(r.nbytes for r in ranges) / len(ranges) < GATHER_BELOW_BYTES


class WarmGate(Protocol):
    """Something that reads in the background and yields to decode (a ``WarmEngine``)."""

    def pause(self) -> None: ...

    def resume(self) -> None: ...
IOMode = Literal["direct", "resident"]
JobMode = Literal["direct", "resident", "tier"]
"""How one expert is read: O_DIRECT, from the mapping, or buffered with pages kept."""


@dataclass(slots=True)
class StageTimes:
    """Busy milliseconds per stage, summed over workers (may exceed wall time)."""

    read_ms: float = 0.0
    stage_ms: float = 0.0
    upload_ms: float = 0.0
    install_ms: float = 0.0

    def add(self, other: StageTimes) -> None:
        self.read_ms += other.read_ms
        self.stage_ms += other.stage_ms
        self.upload_ms += other.upload_ms
        self.install_ms += other.install_ms


@dataclass(slots=True)
class LayerLoad:
    """A layer in flight: its plan, and a queue yielding misses as their uploads are queued.

    ``phases``: what each miss's load did over time, by key, so that a wait for one is
    charged to its read, upload or slot (``pipeline.foundation.timesplit``); ``launch``: the launch
    they waited behind.
    """

    plan: LayerPlan
    arrived: Arrivals[tuple[Entry, BaseException | None]] | None = None
    launcher: asyncio.Task[None] | None = None
    pending: int = 0
    launched: int = 0
    delivered: int = 0
    gate: WarmGate | None = None
    prefetch: bool = False
    launch: LaunchTimes | None = None
    phases: dict[tuple[int, int], LoadPhases] = field(default_factory=dict)


class _Source(NamedTuple):
    """A registered miss's copies, computed once per expert and mapping, for the path the
    streamer takes: for the gather (which reads across windows) its launch rows, one per
    range (``gather_rows``); for the copy engines (device offset, mapping address,
    bytes), one per window piece (a copy may not span two registrations); and for the
    copy engines the (device offset, bytes) ranges its install digest reads."""

    rows: list[int]
    copies: list[tuple[int, int, int]]
    ranges: list[tuple[int, int]]


@dataclass(slots=True, eq=False)
class _Job:
    """One expert being loaded; ``remaining`` chunks count down on worker threads.

    ``reuse_wait_s``: the longest any chunk waited for the slot's last upload to finish.
    """

    entry: Entry
    layout: ExpertLayout
    stream: Stream
    load: LayerLoad
    mode: JobMode
    phases: LoadPhases
    slot: StagingSlot | None = None
    remaining: int = 0
    reuse_wait_s: float = 0.0
    error: BaseException | None = None
    digest_row: int = -1
    digest_results: Any = None
    lock: threading.Lock = field(default_factory=threading.Lock)


class ExpertStreamer:
    """Owns the reader, mapping, staging ring, upload streams and the reader pool.

    Args:
        config: the run's configuration.
        table: the model's expert table.
        backend: the device.
        cache: the device cache the experts go into.
        kernels: decode kernels (used here for install-time verification digests).
        faults: injected faults for the reader, staging ring and uploader (tests and
            ``--inject`` only); None injects nothing.
        primary: on a run over several devices, the first device's streamer: it owns the
            model mapping (registered once, portable, for every device), and this one
            borrows it in resident mode.
    """

    def __init__(
        self,
        config: RunConfig,
        table: ExpertTable,
        backend: Backend,
        cache: DeviceCache,
        kernels: Kernels,
        faults: FaultPlan | None = None,
        primary: ExpertStreamer | None = None,
    ) -> None:
        self._cfg = config
        self._primary = primary
        self._table = table
        self._backend = backend
        self._cache = cache
        self._kernels = kernels
        self._layouts: dict[tuple[int, int], ExpertLayout] = {}
        slot_bytes = largest_slot_bytes(table)
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
        self._staged_jobs: set[_Job] = set()
        self.warm_gate: WarmGate | None = None
        self._resident_idle = asyncio.Event()
        self.mode: IOMode = "direct"
        self.times = StageTimes()
        self._times_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        # registered copies by key, valid for the mapping they were cut from: its windows
        # are only ever added while it lives, and a released mapping is never current again
        self._sources: dict[tuple[int, int], _Source] = {}
        self._sources_of: ModelMapping | None = None
        ahead = config.lookahead if config.prefetch == "oracle" else 0
        capacity = (len(table.layers) + ahead) * table.top_k
        self.digests = DigestRows(kernels, capacity) if config.verify else None
        self._gathers = config.gather and backend.maps_host and _small_ranges(table)

    def layout(self, key: tuple[int, int]) -> ExpertLayout:
        """The staging/device layout of an expert (cached: offsets never change)."""
        layout = self._layouts.get(key)
        if layout is None:
            layout = plan_expert(self._table.slices(key))
            self._layouts[key] = layout
        return layout

    def device_bytes(self, layer: int) -> int:
        return self.layout((layer, 0)).device_bytes

    # -- mode ------------------------------------------------------------------------------

    async def set_mode(self, mode: IOMode) -> None:
        """Switch I/O mode for misses started from now on; in-flight ones finish as begun.

        Entering resident mode returns once the windows already resident are registered:
        registering the 34 GiB model took 3.0-3.7 s on the H200 and slows the copies queued
        meanwhile to a quarter (``bench.register``), so a run that starts on a warm
        file pays it once before its first token rather than beside decode.

        Leaving resident mode waits for in-flight loads from the mapping, then unregisters,
        unmaps and drops the model's pages, in that order: registered or mapped pages
        survive DONTNEED.
        """
        if mode == self.mode:
            return
        if self._primary is not None:  # the mapping is the primary's: switched around us
            self.mode = mode
            if mode == "direct":
                self._forget_sources()  # nothing of ours may read the mapping once it is released
                await self._resident_drained()
                loop = asyncio.get_running_loop()
                await loop.run_in_executor(None, self.uploader.synchronize)
            return
        if mode == "resident":
            self._registrar.open()
            self.mode = "resident"
            self.register_resident()
            await self.registered()
            return
        self.mode = "direct"
        self._forget_sources()
        await self._registrar.stop()
        await self._resident_drained()  # no worker may read the mapping once it is released
        await self._registrar.release(self.uploader.synchronize, self.reader.drop_pages)

    async def _resident_drained(self) -> None:
        """Wait until no load reads from the mapping on a worker (host backend)."""
        while self._resident_inflight:
            self._resident_idle.clear()
            await self._resident_idle.wait()

    def register_resident(self) -> None:
        """Register, in the background, every mapping window whose pages are all resident
        (``MappingRegistrar``); the warm-up calls this again once it has loaded the rest."""
        self._registrar.register_resident()

    async def registered(self) -> None:
        """Wait for the registration passes under way or asked for."""
        await self._registrar.registered()

    async def set_tier_bytes(self, nbytes: int) -> int:
        """Size the host tier (direct mode, ``HostTier``); returns its bytes."""
        return await self.host_tier.resize(nbytes)

    @property
    def tier(self) -> frozenset[tuple[int, int]]:
        return self.host_tier.keys

    @property
    def tier_bytes(self) -> int:
        return self.host_tier.nbytes

    @property
    def miss_counts(self) -> dict[tuple[int, int], int]:
        return self.host_tier.miss_counts

    @property
    def pinned_bytes(self) -> int:
        """Model bytes page-locked by us right now (registered mapping windows)."""
        return self._registrar.pinned_bytes

    @property
    def mapping(self) -> ModelMapping | None:
        return self._primary.mapping if self._primary is not None else self._registrar.mapping

    # -- verification -----------------------------------------------------------------------

    def take_digests(self, *, wait: bool = False) -> Digests:
        """The install digests of the experts loaded since the last call whose copies have
        run (``wait``: of all of them; ``DigestRows.take``)."""
        if self.digests is None:
            return Digests.none()
        return self.digests.take(wait=wait)

    # -- loading ---------------------------------------------------------------------------

    def start_layer(self, layer: int, experts: Sequence[int]) -> LayerLoad:
        """Plan a layer in the cache and start loading its misses (returns at once)."""
        keys = [(layer, int(e)) for e in experts]
        plan = self._cache.plan_layer(keys, [self.device_bytes(layer)] * len(keys))
        if not plan.misses:  # all cached (the common case when warm): nothing to start
            return LayerLoad(plan)
        return self._start(plan)

    def start_prefetch(self, layer: int, experts: Sequence[int]) -> LayerLoad:
        """Start loading guessed experts of a later layer (those absent and fitting)."""
        keys = [(layer, int(e)) for e in experts]
        size = self.device_bytes(layer)
        load = self._start(self._cache.prefetch(keys, [size] * len(keys)))
        load.prefetch = True
        return load

    def _start(self, plan: LayerPlan) -> LayerLoad:
        loop = asyncio.get_running_loop()
        self._loop = loop
        load = LayerLoad(plan, pending=len(plan.misses))
        if not plan.misses:  # all-hit layers (the common case when warm) create nothing more
            return load
        load.launch = LaunchTimes(time.perf_counter())
        load.arrived = Arrivals()
        for entry in plan.misses:
            entry.loaded = loop.create_future()
        sources = self._registered_sources(plan.misses)
        if sources is not None:  # nothing to read: no gate, task or worker
            # queued together, in one pass: the layer's misses share one timeline
            shared = LoadPhases(load.launch)
            load.phases = {entry.key: shared for entry in plan.misses}
            self._queue_registered(load, sources, shared)
            return load
        load.phases = {entry.key: LoadPhases(load.launch) for entry in plan.misses}
        load.gate = self.warm_gate
        if load.gate is not None:
            load.gate.pause()  # decode reads first: background warm-up waits
        load.launcher = loop.create_task(self._launch(load))
        return load

    def _registered_sources(self, misses: Sequence[Entry]) -> list[_Source] | None:
        """Every miss's copies from the registered mapping, or None unless all of them can
        copy from it now (resident mode, a GPU, every range in registered windows)."""
        if self.mode != "resident" or not self._backend.registers_host:
            return None
        mapping = self.mapping
        if mapping is None:
            return None
        if self._sources_of is not mapping:
            self._sources.clear()
            self._sources_of = mapping
        out: list[_Source] = []
        for entry in misses:
            source = self._sources.get(entry.key)
            if source is None:
                ranges = self.layout(entry.key).ranges
                if not all(mapping.is_registered(s.file_offset, s.nbytes) for s in ranges):
                    return None
                # only what this streamer's path reads: the gather's copies, or the copy
                # engines' pieces and their digest's ranges
                if self._gathers:
                    source = _Source(gather_rows(
                        [(s.device_offset, mapping.address(s.file_offset), s.nbytes)
                         for s in ranges]), [], [])
                else:
                    source = _Source(
                        [], [(s.device_offset + at, mapping.address(s.file_offset + at), n)
                         for s in ranges for at, n in mapping.spans(s.file_offset, s.nbytes)],
                        [(s.device_offset, s.nbytes) for s in ranges])
                self._sources[entry.key] = source
            out.append(source)
        return out

    def _forget_sources(self) -> None:
        """The mapping is being released: no copy may be cut from it any more."""
        self._sources.clear()
        self._sources_of = None

    def _queue_registered(self, load: LayerLoad, sources: Sequence[_Source],
                          phases: LoadPhases) -> None:
        """Loop: queue a whole layer's misses from the registered mapping, in one pass.

        Where the device reads registered memory in place (``Backend.maps_host``, and
        ``RunConfig.gather``), the layer is one ``gather`` launch: every range copied and
        digested as it is written, one event for the layer. Otherwise the layer's copies
        are one batched copy on the copy engines, its install digests one launch after
        them, one event (``Uploader.upload_layer``). Either way: the device waits for each
        buffer's last reader first, a failed upload fails that expert only, there is no
        job, worker or ``call_soon_threadsafe`` per expert, and a single callback delivers
        the layer's misses to whoever waits on ``load.arrived`` (it runs after this
        returns, so a caller may still swap that queue, as ``pipeline.streaming.lease`` does). An
        entry is visible only after its upload event.
        """
        digests = self.digests
        misses = load.plan.misses
        arrived: list[tuple[Entry, BaseException | None]] = []
        landed: list[Entry] = []  # installed once their (shared) event completes
        t0 = time.perf_counter()
        try:
            rows: list[tuple[Any, int]] = []
            phases.begin(t0)
            self.host_tier.missed([entry.key for entry in misses])
            if digests is not None:
                rows = [digests.reserve(entry.key) for entry in misses]
            with self._backend.activate():  # CUDA's current device, once for the layer
                events = (self._gather(misses, sources, rows) if self._gathers
                          else self._copy(misses, sources, rows))
            phases.mark("upload", time.perf_counter())  # queued: the device copy shows
            load.launched += len(misses)                 # where decode waits
            for i, (entry, event) in enumerate(zip(misses, events, strict=True)):
                if isinstance(event, Exception):
                    if digests is not None:
                        digests.drop(*rows[i])
                    arrived.append((entry, event))
                    continue
                if digests is not None:
                    digests.complete(*rows[i], event)
                landed.append(entry)
                arrived.append((entry, None))
        except BaseException as exc:  # interrupted: every miss not delivered fails with it
            if digests is not None:
                for row in rows[len(arrived) :]:
                    digests.drop(*row)
            arrived.extend((entry, exc) for entry in misses[len(arrived) :])
            raise
        finally:
            self.installer.submit(landed)
            self._add_time("upload_ms", t0)
            assert self._loop is not None
            self._loop.call_soon(self._deliver_layer, load, arrived)

    def _gather(self, misses: Sequence[Entry], sources: Sequence[_Source],
                rows: Sequence[tuple[Any, int]]) -> list[Event | Exception]:
        """One launch: each range's digest goes straight into its results row."""
        digests = self.digests
        ats = ([digests.address(*row) for row in rows] if rows and digests is not None
               else [0] * len(misses))
        return self.uploader.gather(self._kernels, [
            (entry, source.rows, at)
            for entry, source, at in zip(misses, sources, ats, strict=True)])

    def _copy(self, misses: Sequence[Entry], sources: Sequence[_Source],
              rows: Sequence[tuple[Any, int]]) -> list[Event | Exception]:
        """On the copy engines: the layer's copies as one batched copy on one stream, and
        (verified) their install digests in one launch after them."""
        items = []
        for i, (entry, source) in enumerate(zip(misses, sources, strict=True)):
            digests: list[tuple[int, int, int]] = []
            if rows:
                assert self.digests is not None
                at = self.digests.address(*rows[i])
                digests = [(offset, nbytes, at + 16 * m)
                           for m, (offset, nbytes) in enumerate(source.ranges)]
            items.append((entry, source.copies, digests))
        return self.uploader.upload_layer(self._kernels, items)

    def _deliver_layer(self, load: LayerLoad,
                       arrived: Sequence[tuple[Entry, BaseException | None]]) -> None:
        """Loop: hand a queued layer's misses (or their failures) to the decoder at once."""
        if any(error is not None for _, error in arrived):
            for entry, error in arrived:
                self._deliver(load, entry, error)
            return
        # all queued (the common case): ``_deliver``'s work without a call a miss
        assert load.arrived is not None
        load.arrived.put_many(arrived)
        for entry, _ in arrived:
            loaded = entry.loaded
            if loaded is not None and not loaded.done():
                loaded.set_result(None)  # a later layer's lookup may wait on it
        self._delivered(load, len(arrived))

    async def _launch(self, load: LayerLoad) -> None:
        """Start every miss of a layer: take slots (direct) and hand work to the pool.

        Whatever stops the launch (a refused allocation, cancellation) is reported for each
        miss not yet started, so the decoder waiting on the layer never waits forever.
        """
        try:
            await self._launch_misses(load)
        except BaseException as exc:
            for entry in load.plan.misses[load.launched :]:
                self._deliver(load, entry, exc)
            if not isinstance(exc, Exception):
                raise

    async def _launch_misses(self, load: LayerLoad) -> None:
        for entry in load.plan.misses:
            # read per miss: a switch to direct during this launch (it awaits slots) must
            # not send later misses to a mapping that is being released
            mode = self.mode
            layout = self.layout(entry.key)
            self.host_tier.missed((entry.key,))
            # host tier (partial residency): a hot expert is read through the page cache and
            # its pages kept, the rest stays O_DIRECT
            job_mode: JobMode = ("tier" if mode == "direct" and entry.key in self.host_tier.keys
                                 else mode)
            job = _Job(entry, layout, self.uploader.next_stream(), load, job_mode,
                       load.phases[entry.key])
            if self.digests is not None:
                job.digest_results, job.digest_row = self.digests.reserve(entry.key)
            mapping = self.mapping
            if mode == "resident" and mapping is not None:
                if not self._backend.registers_host:
                    # host backend: the mapping is read directly, on a worker
                    self._resident_inflight += 1
                    load.launched += 1
                    job.phases.begin()
                    self._pool.submit(self._resident_job, job)
                    continue
                if all(mapping.is_registered(s.file_offset, s.nbytes) for s in layout.ranges):
                    # registered: queuing the copies costs microseconds, no thread hop
                    load.launched += 1
                    job.phases.begin()
                    event = self._resident_upload(job, mapping)
                    job.phases.mark("upload")  # queued; the device copy shows where decode waits
                    self._arrived(job, event, counted=False)
                    continue
                # not registered yet (cold or still being registered): a buffered read
                # through the page cache into staging; it never waits on a whole window
            if layout.slot_bytes > self.ring.slot_bytes:  # never cut a copy short
                raise StageError(f"layer {entry.key[0]} expert {entry.key[1]}: its cover needs "
                                 f"{layout.slot_bytes} bytes, staging slots hold "
                                 f"{self.ring.slot_bytes}")
            t0 = time.perf_counter()
            job.slot = await self.ring.acquire()
            t1 = time.perf_counter()
            assert load.launch is not None
            load.launch.slot_waits.append((t0, t1))  # later misses of the layer wait too
            job.phases.begin(t1)
            self._staged_jobs.add(job)
            self._add_time("stage_ms", t0)
            chunks = [
                (staged, off, n)
                for staged in layout.ranges
                for off, n in iter_chunks(staged.cover_start, staged.cover_bytes,
                                          self._cfg.chunk_bytes)
            ]
            job.remaining = len(chunks)
            load.launched += 1
            for staged, off, n in chunks:
                dst_at = staged.slot_offset + (off - staged.cover_start)
                self._pool.submit(self._read_chunk, job, off, dst_at, n)

    def _add_time(self, name: str, since: float) -> None:
        elapsed = (time.perf_counter() - since) * 1000.0
        with self._times_lock:
            setattr(self.times, name, getattr(self.times, name) + elapsed)

    def _read_chunk(self, job: _Job, file_offset: int, slot_offset: int, nbytes: int) -> None:
        """Worker: one chunk into the job's slot; the last chunk of a job uploads it."""
        assert job.slot is not None
        reuse_wait_s = 0.0
        try:
            if job.error is None:
                t0 = time.perf_counter()
                job.slot.wait_reusable()
                reuse_wait_s = time.perf_counter() - t0
                self._add_time("stage_ms", t0)
                t0 = time.perf_counter()
                dst = job.slot.array[slot_offset : slot_offset + nbytes]
                self.reader.read_into(dst, file_offset, direct=job.mode == "direct")
                self._add_time("read_ms", t0)
        except BaseException as exc:  # handed to the loop; the expert is never installed
            job.error = job.error or exc
        with job.lock:
            job.reuse_wait_s = max(job.reuse_wait_s, reuse_wait_s)
            job.remaining -= 1
            last = job.remaining == 0
        if last:
            self._finish(job)

    def _finish(self, job: _Job) -> None:
        """Worker: upload a fully read (or failed) expert and tell the loop."""
        event: Event | None = None
        # the chunks waited for the slot's last upload, concurrently, then read: the
        # longest wait counts as slot time at the start, the rest as reading
        read_done = time.perf_counter()
        began = job.phases.start if job.phases.start is not None else read_done
        job.phases.mark("slot", min(began + job.reuse_wait_s, read_done))
        job.phases.mark("read", read_done)
        if job.error is None:
            try:
                assert job.slot is not None
                slot = job.slot.array
                pieces = [
                    (s.device_offset,
                     slot[s.slot_offset + s.skip : s.slot_offset + s.skip + s.nbytes])
                    for s in job.layout.ranges
                ]
                event = self._upload(job, pieces)
            except BaseException as exc:
                job.error = exc
            job.phases.mark("upload")
        self._notify(job, event)

    def _resident_job(self, job: _Job) -> None:
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
        self._notify(job, event)

    def _resident_upload(self, job: _Job, mapping: ModelMapping) -> Event | None:
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

    def _upload(self, job: _Job, pieces: list[tuple[int, npt.NDArray[np.uint8]]]) -> Event:
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

    def _notify(self, job: _Job, event: Event | None) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._arrived, job, event)

    def _arrived(self, job: _Job, event: Event | None, *, counted: bool = True) -> None:
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

    # -- lifetime --------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Let in-flight work finish, then release threads, slots, streams and mapping."""
        await self._registrar.stop()
        # joining the readers blocks: do it off the loop, which keeps serving signals and
        # the workers' last notifications meanwhile
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(
            None, functools.partial(self._pool.shutdown, cancel=True)
        )
        await asyncio.sleep(0)  # deliver the workers' last notifications
        for job in list(self._staged_jobs):  # reads dropped by the shutdown never finished
            assert job.slot is not None
            self.ring.release(job.slot, None)
        self._staged_jobs.clear()
        self._forget_sources()
        self.uploader.close()
        self.installer.drain()
        self.ring.close()
        self.reader.close()
        self._registrar.close()
