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

The streamer's parts and a miss's job from its launch (``_launch``) to its delivery are
``streaming.jobs``; the registered path and the gather's choice ``streaming.registered``;
what a load is made of ``streaming.loads``.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Sequence

from moestream.gpu.cache.store import Entry
from moestream.pipeline.foundation.timesplit import LaunchTimes, LoadPhases
from moestream.pipeline.streaming.loads import Arrivals, IOMode, LayerLoad, StageTimes, WarmGate
from moestream.pipeline.streaming.registered import GATHER_BELOW_BYTES, RegisteredLayers

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
                self._forget_copies()  # nothing of ours may read the mapping once it is released
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
        self._forget_copies()
        await self._registrar.stop()
        await self._resident_drained()  # no worker may read the mapping once it is released
        await self._registrar.release(self._idle, self.reader.drop_pages)

    def _idle(self) -> None:
        """No copy and no kernel reads the mapping any more: an engine may have queued
        kernels that read experts in place from it (``in_place``), so the whole device."""
        self.uploader.synchronize()
        self._backend.synchronize()

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

    def start_layer(self, layer: int, experts: Sequence[int],
                    arrived: Arrivals[tuple[Entry, BaseException | None]] | None = None,
                    *, prefetch: bool = False) -> LayerLoad:
        """Plan a layer in the cache and start loading its misses (returns at once); they
        are delivered into ``arrived`` (None: a queue of the load's own), once this has
        returned. ``prefetch``: guessed experts of a later layer, only those absent and
        fitting, admitted without a lookup (``DeviceCache.prefetch``)."""
        keys = [(layer, int(e)) for e in experts]
        sizes = [self.layouts[(layer, 0)].device_bytes] * len(keys)  # a layer's experts alike
        plan = (self._cache.prefetch(keys, sizes) if prefetch
                else self._cache.plan_layer(keys, sizes))
        load = LayerLoad(plan, pending=len(plan.misses), prefetch=prefetch)
        if not plan.misses:  # all cached (the common case when warm): nothing to start
            return load
        loop = asyncio.get_running_loop()
        self._loop = loop
        load.launch = LaunchTimes(time.perf_counter())
        load.arrived = arrived if arrived is not None else Arrivals()
        for entry in plan.misses:
            entry.loaded = loop.create_future()
        # a GPU in resident mode may copy the whole layer from registered windows
        mapped = (self._registered_copies(plan.misses) if self._backend.registers_host
                   else None)
        if mapped is not None:  # nothing to read: no gate, task or worker
            # queued together, in one pass: the layer's misses share one timeline
            shared = LoadPhases(load.launch)
            load.phases = {entry.key: shared for entry in plan.misses}
            self._queue_registered(load, mapped, shared)
            return load
        load.phases = {entry.key: LoadPhases(load.launch) for entry in plan.misses}
        load.gate = self.warm_gate
        if load.gate is not None:
            load.gate.pause()  # decode reads first: background warm-up waits
        load.launcher = task = loop.create_task(self._launch(load))
        self.launchers.add(task)
        task.add_done_callback(self.launchers.discard)
        return load

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
        self._forget_copies()
        self.uploader.close()
        self.installer.drain()
        self.ring.close()
        self.reader.close()
        if self._registrar.mapping is not None:
            self._backend.synchronize()  # an engine's kernel may read the mapping in place
        self._registrar.close()
