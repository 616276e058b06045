"""Resident misses queued a whole layer at once from the registered mapping, and the
choice between the gather kernel and the copy engines for them.

When every miss of a layer lies in mapping windows registered with the device (resident
mode on a GPU, the steady state), ``RegisteredLayers`` queues the layer on the loop thread
under one device activation: each expert's copies, install digest and event, then one
callback hands the layer's misses to decode; no job, worker or thread hop per expert.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import structlog

from moestream.gpu.backend import Backend, Event, Kernels
from moestream.gpu.cache.store import DeviceCache, Entry
from moestream.pipeline.foundation.config import StreamConfig
from moestream.pipeline.foundation.faults import FaultPlan
from moestream.pipeline.foundation.table import ExpertTable
from moestream.pipeline.foundation.timesplit import LoadPhases
from moestream.pipeline.streaming.jobs import ExpertJobs
from moestream.pipeline.streaming.loads import LayerLoad, MappedCopies
from moestream.stages.mapping import ModelMapping
from moestream.stages.upload import gather_rows

__all__ = ["GATHER_BELOW_BYTES", "TRIAL_LAYERS", "PathTrial", "RegisteredLayers"]

_log = structlog.get_logger(__name__)


GATHER_BELOW_BYTES = 2 << 20
"""Resident misses may go through the gather kernel when an expert's matrices average under
2 MiB, and go through the copy engines otherwise. Below that size a layer holds many misses
and the host's work per miss bounds the rate: one gather launch copies and digests a whole
layer, where the copy engines take a batched copy and a digest launch, and the gather
measured faster there on H200s; from 2 MiB up the copy engines match or beat it and leave
the SMs to the engine. The H200 measurements behind the line:
``bench/results/gather-below-bytes.md``. Which of the two is faster below it depends on the
machine (an H100's gather read host memory at 27-34 GB/s against the H200s' 48-50,
``bench/results/gpu-h100-ef5a4ae/``), so there the first layers try both (``PathTrial``)."""

TRIAL_LAYERS = 5
"""Layers whose misses go both ways while the choice is open: the first untimed (the
gather's first launch loads its module), the other four timed, each path first in two."""


def _small_ranges(table: ExpertTable) -> bool:
    """Whether the model's experts are made of matrices small enough for the gather."""
    ranges = table.slices((table.moe_layers[0], 0)).ranges
    return sum(r.nbytes for r in ranges) / len(ranges) < GATHER_BELOW_BYTES


class PathTrial:
    """The choice between the gather kernel and the copy engines for a device's resident
    misses, by measurement: each path's time for the same layers, from queueing a layer to
    its last copy done on the device (the host's work and the device's copies both count,
    as they do in decode)."""

    def __init__(self, layers: int = TRIAL_LAYERS) -> None:
        self.layers = layers
        self.seen = 0
        self.gather_s = 0.0
        self.copy_s = 0.0
        self.nbytes = 0

    def add(self, gather_s: float, copy_s: float, nbytes: int) -> bool | None:
        """One layer's times (the first layer's are not counted); the choice once the trial
        is over (True: the gather), else None."""
        self.seen += 1
        if self.seen > 1:
            self.gather_s += gather_s
            self.copy_s += copy_s
            self.nbytes += nbytes
        if self.seen < self.layers:
            return None
        return self.gather_s < self.copy_s


class RegisteredLayers(ExpertJobs):
    """The registered path of a streamer (arguments: as ``ExpertStreamer``'s)."""

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
        super().__init__(config, table, backend, cache, kernels, faults, primary,
                         layers_ahead=layers_ahead)
        # registered copies by key, valid for the mapping they were cut from: its windows
        # are only ever added while it lives, and a released mapping is never current again
        self._copies: dict[tuple[int, int], MappedCopies] = {}
        self._copies_of: ModelMapping | None = None
        self._gathers = config.gather and backend.maps_host and _small_ranges(table)
        # both serve: the first layers tell which is faster here (not on the host backend,
        # whose "device" copies are memcpy either way, nor under injected faults, which
        # two paths would hit twice)
        self._trial = (PathTrial() if self._gathers and backend.name != "host"
                       and faults is None else None)

    @property
    def registered_path(self) -> str:
        """How this device's resident misses leave the registered mapping: ``"gather"``
        (the kernel on the SMs), ``"copy_engines"``, or ``"trial"`` while both are still
        being timed (``PathTrial``); the run's log says it (``run_end.devices``)."""
        if self._trial is not None:
            return "trial"
        return "gather" if self._gathers else "copy_engines"

    def _registered_copies(self, misses: Sequence[Entry]) -> list[MappedCopies] | None:
        """Every miss's copies from the registered mapping, or None unless all of them can
        copy from it now (resident mode, every range in registered windows). Asked only of
        a backend that registers host memory (a GPU's)."""
        if self.mode != "resident":
            return None
        mapping = self.mapping
        if mapping is None:
            return None
        if self._copies_of is not mapping:
            self._copies.clear()
            self._copies_of = mapping
        out: list[MappedCopies] = []
        for entry in misses:
            copies = self._copies.get(entry.key)
            if copies is None:
                ranges = self.layouts[entry.key].ranges
                if not all(mapping.is_registered(s.file_offset, s.nbytes) for s in ranges):
                    return None
                # only what this streamer's path reads (both while the trial lasts): the
                # gather's copies, the copy engines' pieces and their digest's ranges
                rows: list[int] = []
                pieces: list[tuple[int, int, int]] = []
                digested: list[tuple[int, int]] = []
                if self._gathers:
                    rows = gather_rows([(s.device_offset, mapping.address(s.file_offset),
                                         s.nbytes) for s in ranges])
                if self._trial is not None or not self._gathers:
                    pieces = [(s.device_offset + at, mapping.address(s.file_offset + at), n)
                              for s in ranges
                              for at, n in mapping.spans(s.file_offset, s.nbytes)]
                    digested = [(s.device_offset, s.nbytes) for s in ranges]
                copies = MappedCopies(rows, pieces, digested)
                self._copies[entry.key] = copies
            out.append(copies)
        return out

    def in_place(self, keys: Sequence[tuple[int, int]]
                 ) -> tuple[ModelMapping, list[tuple[int, ...]], list[tuple[int, ...]]] | None:
        """Where each expert's ranges (gate, up, down) lie in the registered mapping, for a
        kernel of the device to read them in place, their sizes, and the mapping they are
        valid in (released only after the whole device has synchronized); None unless every
        range can be read so now (resident mode, a device that maps registered memory,
        every range in registered windows)."""
        mapping = self.mapping
        if self.mode != "resident" or mapping is None or not self._backend.maps_host:
            return None
        rows: list[tuple[int, ...]] = []
        sizes: list[tuple[int, ...]] = []
        for key in keys:
            ranges = self.layouts[key].ranges
            if not all(mapping.is_registered(r.file_offset, r.nbytes) for r in ranges):
                return None
            rows.append(tuple(mapping.address(r.file_offset) for r in ranges))
            sizes.append(tuple(r.nbytes for r in ranges))
        return mapping, rows, sizes

    def _forget_copies(self) -> None:
        """The mapping is being released: no copy may be cut from it any more."""
        self._copies.clear()
        self._copies_of = None

    def _queue_registered(self, load: LayerLoad, mapped: Sequence[MappedCopies],
                          phases: LoadPhases) -> None:
        """Loop: queue a whole layer's misses from the registered mapping, in one pass.

        Where the device reads registered memory in place (``Backend.maps_host``, and
        ``StreamConfig.gather``), the layer is one ``gather`` launch: every range copied and
        digested as it is written, one event for the layer. Otherwise the layer's copies
        are one batched copy on the copy engines, its install digests one launch after
        them, one event (``Uploader.upload_layer``). Either way: the device waits for each
        buffer's last reader first, a failed upload fails that expert only, there is no
        job, worker or ``call_soon_threadsafe`` per expert, and a single callback delivers
        the layer's misses to whoever waits on ``load.arrived`` (it runs after this
        returns, so a lease made meanwhile finds them in the queue it reads). An
        entry is visible only after its upload event.
        """
        digests = self.digests
        misses = load.plan.misses
        outcomes: list[tuple[Entry, BaseException | None]] = []
        landed: list[Entry] = []  # installed once their (shared) event completes
        t0 = time.perf_counter()
        try:
            rows: list[tuple[Any, int]] = []
            phases.begin(t0)
            self.host_tier.missed([entry.key for entry in misses])
            if digests is not None:
                rows = [digests.reserve(entry.key) for entry in misses]
            with self._backend.activate():  # CUDA's current device, once for the layer
                if self._trial is not None:
                    events = self._tried(misses, mapped, rows)
                else:
                    events = (self._gather(misses, mapped, rows) if self._gathers
                              else self._copy(misses, mapped, rows))
            phases.mark("upload", time.perf_counter())  # queued: the device copy shows
            load.launched += len(misses)                 # where decode waits
            for i, (entry, event) in enumerate(zip(misses, events, strict=True)):
                if isinstance(event, Exception):
                    if digests is not None:
                        digests.drop(*rows[i])
                    outcomes.append((entry, event))
                    continue
                if digests is not None:
                    digests.complete(*rows[i], event)
                landed.append(entry)
                outcomes.append((entry, None))
        except BaseException as exc:  # interrupted: every miss not delivered fails with it
            if digests is not None:
                for row in rows[len(outcomes) :]:
                    digests.drop(*row)
            outcomes.extend((entry, exc) for entry in misses[len(outcomes) :])
            raise
        finally:
            self.installer.submit(landed)
            self._add_time("upload_ms", t0)
            assert self._loop is not None
            self._loop.call_soon(self._deliver_layer, load, outcomes)

    def _tried(self, misses: Sequence[Entry], mapped: Sequence[MappedCopies],
               rows: Sequence[tuple[Any, int]]) -> list[Event | Exception]:
        """While the trial lasts: the layer by both paths, each waited for, in turns which
        goes first (the same bytes to the same buffers; the layer's events and digests are
        the second path's: the first digests into rows of its own, dropped, since a digest
        adds to its row). Blocks the loop for both: a few layers, once a device. Once the
        trial is over, the faster path serves alone."""
        trial = self._trial
        digests = self.digests
        assert trial is not None
        # neither path's time includes the compute still reading the buffers they reuse
        _wait([entry.reuse_after for entry in misses if entry.reuse_after is not None])
        paths = [self._gather, self._copy]
        if trial.seen % 2:
            paths.reverse()
        spare = ([digests.reserve(entry.key) for entry in misses]
                 if rows and digests is not None else [])
        seconds = []
        try:
            for path, its_rows in zip(paths, (spare, rows), strict=True):
                t0 = time.perf_counter()
                events = path(misses, mapped, its_rows)
                _wait(events)
                seconds.append(time.perf_counter() - t0)
        finally:  # never left reserved: digests are taken in the order rows were reserved
            for row in spare:
                assert digests is not None
                digests.drop(*row)
        if trial.seen % 2:
            seconds.reverse()
        gathers = trial.add(seconds[0], seconds[1], sum(entry.nbytes for entry in misses))
        if gathers is not None:
            self._gathers, self._trial = gathers, None
            self._copies.clear()  # cut again for the chosen path alone
            _log.info("registered_path_chosen", path=self.registered_path,
                      device=self._backend.device_name,
                      gather_gbps=round(trial.nbytes / max(trial.gather_s, 1e-9) / 1e9, 2),
                      copy_gbps=round(trial.nbytes / max(trial.copy_s, 1e-9) / 1e9, 2))
        return events

    def _gather(self, misses: Sequence[Entry], mapped: Sequence[MappedCopies],
                rows: Sequence[tuple[Any, int]]) -> list[Event | Exception]:
        """One launch: each range's digest goes straight into its results row."""
        digests = self.digests
        ats = ([digests.address(*row) for row in rows] if rows and digests is not None
               else [0] * len(misses))
        return self.uploader.gather(self._kernels, [
            (entry, copies.rows, at)
            for entry, copies, at in zip(misses, mapped, ats, strict=True)])

    def _copy(self, misses: Sequence[Entry], mapped: Sequence[MappedCopies],
              rows: Sequence[tuple[Any, int]]) -> list[Event | Exception]:
        """On the copy engines: the layer's copies as one batched copy on one stream, and
        (verified) their install digests in one launch after them."""
        items = []
        for i, (entry, copies) in enumerate(zip(misses, mapped, strict=True)):
            digests: list[tuple[int, int, int]] = []
            if rows:
                assert self.digests is not None
                at = self.digests.address(*rows[i])
                digests = [(offset, nbytes, at + 16 * m)
                           for m, (offset, nbytes) in enumerate(copies.ranges)]
            items.append((entry, copies.copies, digests))
        return self.uploader.upload_layer(self._kernels, items)

    def _deliver_layer(self, load: LayerLoad,
                       outcomes: Sequence[tuple[Entry, BaseException | None]]) -> None:
        """Loop: hand a queued layer's misses (or their failures) to the decoder at once."""
        if any(error is not None for _, error in outcomes):
            for entry, error in outcomes:
                self._deliver(load, entry, error)
            return
        # all queued (the common case): ``_deliver``'s work without a call a miss
        assert load.arrived is not None
        load.arrived.put_many(outcomes)
        for entry, _ in outcomes:
            loaded = entry.loaded
            if loaded is not None and not loaded.done():
                loaded.set_result(None)  # a later layer's lookup may wait on it
        self._delivered(load, len(outcomes))


def _wait(events: Sequence[Event | Exception]) -> None:
    """Until each queued copy of a layer has run (its failures are the caller's)."""
    for event in {id(e): e for e in events if not isinstance(e, Exception)}.values():
        event.synchronize()
