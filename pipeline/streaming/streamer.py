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

The streamer's parts and a miss's job on the workers are ``streaming.jobs``; the registered
path and the gather's choice ``streaming.registered``; what a load is made of
``streaming.loads``.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Sequence

from moestream.gpu.cache.store import LayerPlan
from moestream.pipeline.foundation.errors import StageError
from moestream.pipeline.foundation.timesplit import LaunchTimes, LoadPhases
from moestream.pipeline.streaming.arrivals import Arrivals
from moestream.pipeline.streaming.loads import (
    IOMode,
    JobMode,
    LayerLoad,
    LoadJob,
    StageTimes,
    WarmGate,
)
from moestream.pipeline.streaming.registered import GATHER_BELOW_BYTES, RegisteredLayers
from moestream.stages.layout import iter_chunks

__all__ = ["GATHER_BELOW_BYTES", "ExpertStreamer", "IOMode", "LayerLoad", "StageTimes",
           "WarmGate"]


class ExpertStreamer(RegisteredLayers):
    """Owns the reader, mapping, staging ring, upload streams and the reader pool.

    Args:
        config: the library's settings (reader, staging, uploads, gather, verify).
        table: the model's expert table.
        backend: the device.
        cache: the device cache the experts go into.
        kernels: decode kernels (used here for install-time verification digests).
        faults: injected faults for the reader, staging ring and uploader (tests and
            ``--inject`` only); None injects nothing.
        primary: on a run over several devices, the first device's streamer: it owns the
            model mapping (registered once, portable, for every device), and this one
            borrows it in resident mode.
        layers_ahead: layers whose experts a client loads ahead of the token it decodes
            (the session's ``layers_in_flight`` beyond the one fetched): sizes the install
            digests' rows, a token's and those.
    """

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


    # -- loading ---------------------------------------------------------------------------

    def start_layer(self, layer: int, experts: Sequence[int]) -> LayerLoad:
        """Plan a layer in the cache and start loading its misses (returns at once)."""
        keys = [(layer, int(e)) for e in experts]
        # every expert of a layer takes the same device bytes
        plan = self._cache.plan_layer(keys, [self.layout((layer, 0)).device_bytes] * len(keys))
        if not plan.misses:  # all cached (the common case when warm): nothing to start
            return LayerLoad(plan)
        return self._start(plan)

    def start_prefetch(self, layer: int, experts: Sequence[int]) -> LayerLoad:
        """Start loading guessed experts of a later layer (those absent and fitting)."""
        keys = [(layer, int(e)) for e in experts]
        size = self.layout((layer, 0)).device_bytes
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
        # a GPU in resident mode may copy the whole layer from registered windows
        sources = (self._registered_sources(plan.misses) if self._backend.registers_host
                   else None)
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
        load.launcher = task = loop.create_task(self._launch(load))
        self.launchers.add(task)
        task.add_done_callback(self.launchers.discard)
        return load

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
            job = LoadJob(entry, layout, self.uploader.next_stream(), load, job_mode,
                       load.phases[entry.key])
            if self.digests is not None:
                job.digest_results, job.digest_row = self.digests.reserve(entry.key)
            mapping = self.mapping if mode == "resident" else None
            if mapping is not None:
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
                    self._job_done(job, event, counted=False)
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
