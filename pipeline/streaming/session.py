"""A streaming session: the one setup and teardown of a run's parts, for any decode loop.

An engine drives its own decode loop and asks for experts layer by layer; ``pipeline.cli.run``
drives moestream's proxy decode. Both open their parts here: ``StreamSession`` opens the
model's expert table, one backend, kernels, cache and streamer per device, the verifier
(and the digest manifest of a file without digests), the mode controller and the run log
with its ``run_start`` header, and closes everything in one order (``run_end`` last). For
an engine it also hands out layer leases (``streaming.lease``) and prefetch hints, keeps the
per-token accounting and writes it in the run log's schema (``docs/LOG_SCHEMA.md``). The
public face over it is ``moestream``.

All methods run on the event loop's thread that opened the session.
"""

from __future__ import annotations

import asyncio
import contextlib
import operator
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import structlog

from moestream.gpu.backend import Backend, Event, Kernels
from moestream.gpu.cache.placement import balanced_placement, split_budget
from moestream.gpu.cache.store import DeviceCache, Entry
from moestream.gpu.kernels import make_kernels
from moestream.pipeline.foundation.compute import resolve_compute
from moestream.pipeline.foundation.config import ComputeSpec, RunConfig
from moestream.pipeline.foundation.errors import (
    DeviceMemoryError,
    ModelChangedError,
    MoestreamError,
    UsageError,
    VerificationError,
)
from moestream.pipeline.foundation.faults import FaultPlan, parse_faults
from moestream.pipeline.foundation.machine import machine_info, process_read_bytes
from moestream.pipeline.foundation.table import ExpertTable, open_table
from moestream.pipeline.runlog.write import RunLog
from moestream.pipeline.streaming.closing import close_devices, finish
from moestream.pipeline.streaming.controller import ModeController, Sampler
from moestream.pipeline.streaming.lease import (
    EventJoiner,
    LayerLease,
    LeasePart,
    plan_parts,
    unpin_when_landed,
)
from moestream.pipeline.streaming.shards import CacheGroup, StreamerGroup, open_backends
from moestream.pipeline.streaming.streamer import ExpertStreamer, LayerLoad, StageTimes
from moestream.pipeline.streaming.summary import RunSummary, TokenTotals, describe_experts
from moestream.pipeline.streaming.verify import Verifier
from moestream.stages.layout import plan_expert
from moestream.stages.manifest_build import RunManifest

__all__ = ["StreamSession"]

_log = structlog.get_logger("moestream.session")

_NBYTES = operator.attrgetter("nbytes")

LastUse = Callable[[LeasePart], Event | None]
"""The event after which a released lease's buffers on a part's device may be reused."""


@dataclass(slots=True)
class _DeviceTotals:
    """One device's share of a token (the token event's ``devices`` list)."""

    hits: int = 0
    misses: int = 0
    file_bytes: int = 0
    stall_ms: float = 0.0
    compute_ms: float = 0.0


class StreamSession:
    """The parts an engine's fetches go through, for one model, from ``open`` to ``aclose``.

    Args:
        config: model, budget, mode, policy, backend, devices, reader and staging sizes,
            verification, log and controller settings (``tokens`` and ``compute`` are not
            used: the engine decodes).
        layers_in_flight: how many layers' experts may be pinned at once (a fetched layer
            and a prefetched one, or concurrent fetches); the budget must hold that many.
        sampler: machine readings for the controller (tests feed their own).
        faults: injected faults (default: those ``config.faults`` names, usually none).
        summary: the totals to fill in as the session goes (default: a new one), so a
            caller has them even when opening or decoding raises.
        table: the model's table, when the caller opened it already (``config.model``
            is then not opened again).
        compute: what the client's decode does with the experts (``moestream.pipeline.cli.run``'s
            proxy decode); None: an engine's own compute, unknown here. ``digest``
            compute needs the file's digests even without ``config.verify``; the log
            header names it and the whole ``config``.
    """

    def __init__(
        self,
        config: RunConfig,
        *,
        layers_in_flight: int = 2,
        sampler: Sampler | None = None,
        faults: FaultPlan | None = None,
        summary: RunSummary | None = None,
        table: ExpertTable | None = None,
        compute: ComputeSpec | None = None,
    ) -> None:
        if layers_in_flight < 1:
            raise UsageError(f"layers_in_flight must be >= 1, got {layers_in_flight}")
        self.config = config
        self._layers_in_flight = layers_in_flight
        self._sampler = sampler
        self.faults = faults if faults is not None else parse_faults(config.faults)
        self.table: ExpertTable | None = table
        self.compute = compute
        self.backends: list[Backend] = []
        self.kernels: list[Kernels] = []
        self.caches: list[DeviceCache] = []
        self.streamers: list[ExpertStreamer] = []
        self._joiners: list[EventJoiner] = []
        self._place: Callable[[tuple[int, int]], int] = lambda key: 0
        self.streamer: Any = None  # the one streamer, or a StreamerGroup (the controller's)
        self.cache: Any = None  # the one cache, or a CacheGroup
        self.controller: ModeController | None = None
        self.verifier: Verifier | None = None
        self.manifest: RunManifest | None = None
        self.runlog = RunLog(config.log)
        self.summary = summary if summary is not None else RunSummary()
        self.opened = False
        self._settled = False
        self.closed = False
        self.default_last_use: LastUse = lambda part: None
        """What a lease released by the session itself (token end, close) ends with."""
        self._leases: set[LayerLease] = set()
        self._hints: dict[int, list[tuple[list[int], list[LeasePart]]]] = {}
        self._guess_loads: dict[int, list[LayerLoad]] = {}  # a fetched layer's hints' loads
        self._hints_of: dict[LayerLease, list[tuple[list[int], list[LeasePart]]]] = {}
        self._devices: list[_DeviceTotals] = []  # per device, with several
        self._holds: set[int] = set()  # leases and hints whose loads pause the background
        self._background: Any = None  # the digest manifest's builder, while it reads
        self._hinted = False  # a prefetch was asked for: token lines carry ``prefetch``
        self._launchers: set[asyncio.Task[None]] = set()
        self._token = 0
        self._token_t0: float | None = None
        self._first_t0: float | None = None
        self._token_cpu0 = (0.0, 0.0)  # this thread's and the process's CPU at the start
        self._totals = TokenTotals()
        self._experts: list[list[int]] = []
        # by layer, this token's first lease, or once there were more, what they counted
        self._counted: dict[int, LayerLease | dict[int, bool]] = {}
        self._hinted_now: set[int] = set()  # layers hinted this token (carried over once)
        self._build_reported = False  # the manifest builder's failure was raised
        self._unexplained_ms = 0.0  # this token's stall not charged to a phase (host)
        self._clamped = False  # an engine's compute_ms above the wall time was logged
        self._settle_error: BaseException | None = None
        self._position: dict[int, int] = {}
        self._read_bytes = 0
        self._reported = 0  # mismatches end_token has raised for

    # -- open ------------------------------------------------------------------------------

    async def open(self) -> None:
        """Open the model, the devices' caches and streamers, the log and the controller.

        Raises:
            UsageError: a bad setting (budget below ``layers_in_flight`` layers, devices).
            ModelFileError: the model cannot be used. StageError: a device or pinned
            allocation failed (``DeviceMemoryError``, a ``MemoryError`` met while opening
            too). OutputError: the log cannot be written. Whatever was opened is closed
            again before the error propagates.
        """
        if self.opened:
            raise UsageError("the session is already open")
        self.opened = True
        try:
            await self._open()
            return
        except MemoryError as exc:
            where = traceback.extract_tb(exc.__traceback__)[-1]
            await finish(self._close(outcome="failed to open: out of memory", settle=False))
        except BaseException as exc:
            await finish(self._close(outcome=_outcome(exc), settle=False))
            raise
        # raised here, out of the handler: the MemoryError's frames (what was half made when
        # memory ran out) are let go with it, not kept alive as this error's context
        raise DeviceMemoryError(f"memory ran out while opening the session (at "
                                f"{Path(where.filename).name}:{where.lineno}); everything "
                                "opened was released")

    async def _open(self) -> None:
        cfg = self.config
        if cfg.log is not None:
            from moestream.pipeline.foundation.outputs import check_output

            check_output(cfg.log, what="log", in_place=True)
        if self.table is None:
            if cfg.model is None:  # the caller chooses a default model, never the session
                raise UsageError("no model: the session needs a model path or an opened table")
            self.table = open_table(cfg.model)
        table = self.table
        self._position = {layer: i for i, layer in enumerate(table.moe_layers)}
        self._experts = [[] for _ in table.moe_layers]
        self.backends = open_backends(cfg)
        home = self.backends[0]
        summary = self.summary
        summary.backend, summary.model = home.name, str(table.path)
        summary.experts = describe_experts(table.layers.values())
        summary.device = " + ".join(b.device_name for b in self.backends)
        await finish(self.runlog.open())
        layers = table.moe_layers
        device_sizes = {n: plan_expert(table.slices((n, 0))).device_bytes for n in layers}
        if cfg.budget is not None:
            budget = cfg.budget.resolve(max(device_sizes.values()))
        else:  # default: every routed expert
            budget = sum(size * table.layers[n].n_experts for n, size in device_sizes.items())
        min_bytes = self._layers_in_flight * table.top_k * max(device_sizes.values())
        self._check_budget(budget, min_bytes, max(device_sizes.values()))
        # by device memory; the host backend's emulated devices share one RAM, whose free
        # bytes move between two readings: split evenly (a tight budget split by two
        # readings a few KiB apart left one device short of a layer, a flaky refusal)
        weights = ([1.0] * len(self.backends) if home.name == "host"
                   else [float(b.device_free_bytes()) for b in self.backends])
        for backend, share in zip(self.backends, split_budget(budget, weights), strict=True):
            with backend.activate():
                kernels = make_kernels(backend.name, cfg.gather_blocks)
                self.kernels.append(kernels)
                cache = DeviceCache(backend, share, cfg.policy, min_bytes=min_bytes,
                                    faults=self.faults)
                self.caches.append(cache)
                self.streamers.append(ExpertStreamer(
                    cfg, table, backend, cache, kernels, self.faults,
                    primary=self.streamers[0] if self.streamers else None))
                self._joiners.append(EventJoiner(backend.new_stream(), backend.activate))
        if len(self.backends) == 1:
            self.streamer, self.cache = self.streamers[0], self.caches[0]
        else:
            self._devices = [_DeviceTotals() for _ in self.backends]
            sizes = {n: (table.layers[n].n_experts, device_sizes[n]) for n in layers}
            self._place = balanced_placement(sizes, weights)
            self.streamer = StreamerGroup(self.streamers)
            self.cache = CacheGroup(self.caches)
        if self.compute is not None:  # refused here, before the log header, if it cannot run
            self.compute = resolve_compute(self.compute, table)
        checks = cfg.verify or (self.compute is not None and self.compute.kind == "digest")
        if checks and table.digests is None:
            # no digests in the file: its manifest, computed in the background if need be
            group = self.streamer
            self.manifest = await RunManifest.open(table, lambda: group.mode == "direct")
            self._background = self.manifest.builder
        self.verifier = Verifier(table, self.manifest.manifest if self.manifest else None)
        summary.digests = ("off" if not checks else "file" if self.manifest is None
                           else self.manifest.source)
        self.controller = ModeController(cfg, table, self.streamer, self.runlog,
                                         sampler=self._sampler)
        summary.budget_bytes = self.cache.budget_bytes
        compute = str(self.compute) if self.compute is not None else "engine"
        self.runlog.emit(
            "run_start",
            config=(cfg.describe() if self.compute is not None
                    else {**cfg.describe(), "tokens": None, "compute": compute}),
            model={**table.summary(), "expert_bytes": [device_sizes[n] for n in layers]},
            machine=machine_info(table.path, home.device_name if home.name == "cupy"
                                 else None),
            budget_bytes=summary.budget_bytes,
            devices=[{"device": b.device, "name": b.device_name, "budget_bytes": c.budget_bytes}
                     for b, c in zip(self.backends, self.caches, strict=True)],
            policy=cfg.policy,
            compute=compute,
            backend=home.name,
            **({"limits": cfg.limits.record()} if cfg.limits is not None else {}),
        )
        await self.controller.start()  # its first decision follows the header
        self._read_bytes = process_read_bytes()

    def _check_budget(self, budget: int, min_bytes: int, expert_bytes: int) -> None:
        """Refuse a budget that cannot pin ``layers_in_flight`` layers' top-k experts on
        every device, in the caller's terms (experts and bytes)."""
        devices = len(self.backends)
        if budget >= min_bytes * devices:
            return
        assert self.table is not None
        experts = min_bytes // expert_bytes * devices
        given = self.config.budget
        asked = (f"{_count(given.experts, 'expert')} ({_count(budget, 'byte')})"
                 if given is not None and given.experts is not None
                 else _count(budget, "byte"))
        in_flight = (f"each of the {self._layers_in_flight} layers in flight"
                     if self._layers_in_flight > 1 else "the one layer in flight")
        raise UsageError(
            f"cache budget of {asked} cannot hold one layer's "
            f"top-{_count(self.table.top_k, 'expert')} for {in_flight}"
            + (f" on each of {devices} devices" if devices > 1 else "")
            + f" ({_count(experts, 'expert')}, {_count(min_bytes * devices, 'byte')}; it holds "
            f"{_count(budget // expert_bytes, 'expert')} of {_count(expert_bytes, 'byte')} each): "
            f"give a budget of at least {_count(experts, 'expert')}")

    # -- fetch -----------------------------------------------------------------------------

    def _check_open(self) -> ExpertTable:
        if self.closed:
            raise UsageError("the session is closed")
        if self.table is None:
            raise UsageError("the session is not open yet")
        return self.table

    def _check_layer(self, layer: int, experts: Sequence[int]) -> list[int]:
        table = self._check_open()
        info = table.layers.get(layer)
        if info is None:
            raise UsageError(f"layer {layer} is not a MoE layer (MoE layers: "
                             f"{table.moe_layers[0]}..{table.moe_layers[-1]})")
        chosen = [int(e) for e in experts]
        bad = [e for e in chosen if not 0 <= e < info.n_experts]
        if bad:
            raise UsageError(f"layer {layer} has experts 0..{info.n_experts - 1}, not {bad[0]}")
        if len(set(chosen)) != len(chosen):
            raise UsageError(f"layer {layer}: experts {chosen} name one expert twice")
        return chosen

    def _track(self, parts: Sequence[LeasePart]) -> None:
        for part in parts:
            task = part.load.launcher
            if task is not None and not task.done():
                self._launchers.add(task)
                task.add_done_callback(self._launchers.discard)

    def _clock(self) -> None:
        if self._token_t0 is None:
            self._token_t0 = time.perf_counter()
            self._token_cpu0 = (time.thread_time(), time.process_time())
            if self._first_t0 is None:
                self._first_t0 = self._token_t0

    def fetch(self, layer: int, experts: Sequence[int]) -> LayerLease:
        """Pin ``experts`` of ``layer`` on their devices and start loading the misses.

        The lease counts (hits, misses, bytes, the experts of the token's log line) when it
        is released, in the token it was used in: a layer fetched ahead, during the token
        before, counts in its own, and the counting runs while the engine's device
        computes, off the path between two layers. The hints made for ``layer`` go with
        the lease and end at its release (what it used of them it pins itself meanwhile).

        Raises:
            UsageError: the session is closed; ``layer`` is not a MoE layer; an expert is
                out of range or named twice; the pinned experts no longer fit the budget
                (more layers held at once than ``layers_in_flight``).
            DeviceMemoryError: the device refused memory even after the budget shrank.
        """
        chosen = self._check_layer(layer, experts)
        self._clock()
        for streamer in self.streamers:
            streamer.poll_installs()
        parts = plan_parts(layer, chosen, self.streamers, self.caches, self._joiners,
                           self._place)
        self._track(parts)
        lease = LayerLease(layer, tuple(chosen), parts, on_wait=self._waited,
                           on_use=self._used)
        self._leases.add(lease)
        if self._background is not None and lease.misses:
            self._hold(lease)
        hints = self._hints.pop(layer, None)
        if hints is not None:
            self._hints_of[lease] = hints
            loads = self._guess_loads.setdefault(layer, [])
            for guess, hint_parts in hints:
                self._totals.correct += len(set(guess) & set(chosen))
                loads.extend(hint.load for hint in hint_parts)
        return lease

    def _used(self, lease: LayerLease) -> None:
        """A lease's first use (an expert handed out, or its release): its token's clock
        runs (a layer fetched ahead may be the first thing a token touches)."""
        self._clock()

    def _count(self, lease: LayerLease) -> None:
        """A lease's release: its figures go to the token under way."""
        before = self._counted.get(lease.layer)
        if before:
            self._count_again(lease, before)
            return
        totals, devices = self._totals, self._devices
        totals.hits += lease.hits
        totals.misses += lease.misses
        totals.evictions += lease.evicted
        for part in lease.parts:
            plan = part.load.plan
            file_bytes = sum(map(_NBYTES, plan.misses)) if plan.misses else 0
            totals.file_bytes += file_bytes
            totals.cache_bytes += sum(map(_NBYTES, plan.hits))
            if devices:
                device = devices[part.device]
                device.hits += len(plan.hits)
                device.misses += len(plan.misses)
                device.file_bytes += file_bytes
        self._counted[lease.layer] = lease
        self._experts[self._position[lease.layer]].extend(lease.experts)

    def _count_again(self, lease: LayerLease, before: LayerLease | dict[int, bool]) -> None:
        """A second lease of a layer in one token: each expert counts once in the token
        (the log's ``experts`` is the union, ``hits + misses`` its length), a miss if any
        lease of the token loaded it; a second read of one (evicted meanwhile) counts its
        bytes only. ``before``: the token's first lease of the layer, or what the leases
        so far counted (expert: was a miss)."""
        if isinstance(before, dict):
            was_miss = before
        else:
            was_miss = {}
            for part in before.parts:
                for entry in part.load.plan.hits:
                    was_miss[entry.key[1]] = False
                for entry in part.load.plan.misses:
                    was_miss[entry.key[1]] = True
            self._counted[lease.layer] = was_miss
        totals, devices = self._totals, self._devices
        totals.evictions += lease.evicted
        for part in lease.parts:
            device = devices[part.device] if devices else _DeviceTotals()
            for entry in part.load.plan.hits:
                if entry.key[1] not in was_miss:
                    was_miss[entry.key[1]] = False
                    totals.hits += 1
                    device.hits += 1
                    totals.cache_bytes += entry.nbytes
            for entry in part.load.plan.misses:
                before_miss = was_miss.get(entry.key[1])
                totals.file_bytes += entry.nbytes
                device.file_bytes += entry.nbytes
                if before_miss is None or not before_miss:
                    totals.misses += 1
                    device.misses += 1
                if before_miss is False:  # counted a hit (another lease's load): a miss
                    totals.hits -= 1
                    device.hits -= 1
                    totals.cache_bytes -= entry.nbytes
                was_miss[entry.key[1]] = True
        seen = self._experts[self._position[lease.layer]]
        seen.extend(e for e in lease.experts if e not in seen)

    def _hold(self, owner: object) -> None:
        """``owner``'s loads are decode's: background reads (the digest manifest's builder)
        pause until it ends (``_unhold``)."""
        if id(owner) not in self._holds:
            self._holds.add(id(owner))
            self._background.pause()

    def _unhold(self, owner: object) -> None:
        if id(owner) in self._holds:
            self._holds.discard(id(owner))
            self._background.resume()

    def all_ready(self, layer: int, experts: Sequence[int]) -> bool:
        """Every one of ``experts`` is cached on its device and its upload has landed: a
        lease of them now would load nothing and wait for nothing."""
        caches, place = self.caches, self._place
        keys = [(layer, int(e)) for e in experts]
        found = (caches[0].get_many(keys) if len(caches) == 1
                 else [caches[place(key)].get(key) for key in keys])
        for entry in found:
            if entry is None:
                return False
            if entry.ready:
                continue
            # landed (a lease's miss or a hint, this token) but not yet marked: a lease
            # hands it out at once, as ``LayerLease`` does
            loaded = entry.loaded
            if loaded is not None and (not loaded.done() or loaded.cancelled()
                                       or loaded.exception() is not None):
                return False
        return True

    def prefetch(self, layer: int, experts: Sequence[int]) -> int:
        """Start loading guessed experts of a later layer: those not cached, if they fit.

        Held until the lease of that layer's next fetch is released, or until the token
        ends if the layer is not fetched. Returns the loads started (their reads count in
        this token's ``file_bytes``, their evictions in its ``evictions``).

        Raises:
            UsageError: as ``fetch``.
        """
        chosen = self._check_layer(layer, experts)
        self._clock()
        parts = plan_parts(layer, chosen, self.streamers, self.caches, self._joiners,
                           self._place, prefetch=True)
        self._track(parts)
        self._hints.setdefault(layer, []).append((chosen, parts))
        self._hinted_now.add(layer)
        self._hinted = True
        started = sum(len(p.load.plan.misses) for p in parts)
        if started and self._background is not None:
            self._hold(parts)
        totals = self._totals
        totals.predicted += len(chosen)
        totals.loaded += started
        totals.file_bytes += sum(e.nbytes for p in parts for e in p.load.plan.misses)
        totals.evictions += sum(p.load.plan.evicted for p in parts)
        return started

    def release(self, lease: LayerLease, last_use: LastUse, reason: str = "", *,
                ordered: bool = False) -> None:
        """Release ``lease`` (idempotent); see ``LayerLease.release``."""
        lease.release(last_use, reason, ordered=ordered)
        if lease not in self._leases:
            return  # released before
        self._leases.discard(lease)
        self._count(lease)
        self._unhold(lease)
        for _, parts in self._hints_of.pop(lease, ()):  # its layer's hints end with it
            self._end_hint(parts, lease.experts)

    def _end_hint(self, parts: Sequence[LeasePart], used: Sequence[int] = ()) -> None:
        """Unpin a hint's loads (each once it has landed); those ``used`` by no fetch were
        wasted reads."""
        for hint in parts:
            guessed = hint.load.plan.misses
            self._totals.wasted_bytes += sum(e.nbytes for e in guessed if e.key[1] not in used)
            for entry in guessed:
                unpin_when_landed(hint, entry)
        self._unhold(parts)

    def _waited(self, entry: Entry | None, load: LayerLoad | None, start: float,
                end: float) -> None:
        """The engine waited for an expert: a stall, charged to what its load was doing
        (``foundation.timesplit``); a load the session did not start for it counts as read."""
        totals = self._totals
        totals.stall_ms += (end - start) * 1000.0
        phases = None
        if entry is not None:
            if self._devices:
                self._devices[self._place(entry.key)].stall_ms += (end - start) * 1000.0
            # the lease's own load, or the hint that loads it
            for source in (load, *self._guess_loads.get(entry.key[0], ())):
                phases = source.phases.get(entry.key) if source is not None else None
                if phases is not None:
                    break
        if phases is not None:
            charged = totals.time.measured_ms
            phases.charge(totals.time, start, end)
            # the part of the wait its load's phases leave as ``host`` (its launch not yet
            # begun, its arrival's hop to the engine): a stall all the same, never compute
            self._unexplained_ms += (end - start) * 1000.0 - (totals.time.measured_ms - charged)
        else:
            totals.time.charge("read", end - start)

    def _drop_hints(self, *, carry: bool = False) -> None:
        """End the hints no fetch took; with ``carry`` (a token's end) those made during
        this token are kept for the next one (a hint for the next token's first layers)."""
        kept = {n: self._hints[n] for n in self._hinted_now if n in self._hints} if carry else {}
        for layer, hints in self._hints.items():
            if layer not in kept:
                for _, parts in hints:
                    self._end_hint(parts)
        self._hints = kept
        self._hinted_now = set()
        self._guess_loads.clear()

    @property
    def mode(self) -> str:
        return str(self.streamer.mode) if self.streamer is not None else "direct"

    @property
    def token(self) -> int:
        """The index of the token being decoded (tokens ended so far)."""
        return self._token

    @property
    def open_leases(self) -> int:
        return len(self._leases)

    def leases(self) -> list[LayerLease]:
        """The leases held now (not released), in no particular order."""
        return list(self._leases)

    def hinted_layers(self) -> list[int]:
        """The layers whose prefetch hints are held now (pinned until used or ended)."""
        return sorted(self._hints)

    # -- token boundary --------------------------------------------------------------------

    async def end_token(self, *, compute_ms: float | Sequence[float] | None = None,
                        upload_ms: float = 0.0) -> dict[str, Any]:
        """End the token: release what is still held, verify what was loaded, let the
        controller look at the machine, log the token; returns the token's log fields.

        A lease used during the token and still held is released here; one not used yet
        (a later layer fetched ahead, across the boundary) stays held for its own token.

        Args:
            compute_ms: the engine's own measure of its compute this token (its waits for
                its devices' work included), or one per device (``backends`` order), adding
                up to it; the rest of the wall time that moestream's waits do not explain
                is then charged to ``host``. None: that rest is the engine's compute.
            upload_ms: the part of the engine's device waits its compute stream spent
                waiting on expert upload events (charged to ``upload``).

        Raises:
            UsageError: the session is closed.
            VerificationError: an expert loaded during this token differs from the file.
            OutputError: the log file stopped taking lines.
        """
        table = self._check_open()
        assert self.controller is not None and self.verifier is not None
        self._clock()
        assert self._token_t0 is not None
        for lease in list(self._leases):  # a pin never outlives the token it was used in
            if lease.on_use is not None:
                continue  # fetched ahead for a later token, not used yet
            _log.warning("lease_released_at_token_end", layer=lease.layer, token=self._token,
                         hint="release leases (a with block) before end_token")
            self.release(lease, self.default_last_use, "at the end of its token")
        self._drop_hints(carry=True)
        for streamer in self.streamers:
            streamer.poll_installs()
        self.cache.advance_token()
        mismatches = self.verifier.mismatches
        for streamer in self.streamers:
            self.verifier.check(streamer.take_digests())
        mode = self.mode
        t_controller = time.perf_counter()
        await self.controller.at_token(self._token)
        totals = self._totals
        totals.time.charge("switch", time.perf_counter() - t_controller)
        read_bytes = process_read_bytes()
        storage, self._read_bytes = read_bytes - self._read_bytes, read_bytes
        times = StageTimes()
        for streamer in self.streamers:
            times.add(streamer.take_times())
        now = time.perf_counter()
        wall_ms = totals.wall_ms = (now - self._token_t0) * 1000.0
        thread_cpu0, process_cpu0 = self._token_cpu0
        # what neither moestream's waits (experts, the controller) nor its stalls explain
        room = max(0.0, wall_ms - totals.time.measured_ms - self._unexplained_ms)
        self._unexplained_ms = 0.0
        if compute_ms is not None:  # the engine measured its compute: the rest is host
            figures = None if isinstance(compute_ms, (int, float)) else list(compute_ms)
            given = float(compute_ms) if isinstance(compute_ms, (int, float)) else sum(
                figures or ())
            # never more than the token's wall time leaves: the parts add up to it
            scale = min(1.0, room / (given + upload_ms)) if given + upload_ms > 0 else 1.0
            if scale < 1.0 and not self._clamped:
                self._clamped = True
                _log.warning("engine_time_clamped", token=self._token,
                             compute_ms=round(given, 3), upload_ms=round(upload_ms, 3),
                             room_ms=round(room, 3),
                             reason="more than the token's wall time leaves beside "
                                    "moestream's waits (logged once)")
            for device, ms in zip(self._devices, figures or (), strict=False):
                device.compute_ms += ms * scale
            totals.compute_ms = given * scale
            totals.time.charge("compute", totals.compute_ms / 1000.0)
            totals.time.charge("upload", upload_ms * scale / 1000.0)
        else:
            # the engine computes between its fetches: its time is the rest
            totals.compute_ms = room
            totals.time.charge("compute", totals.compute_ms / 1000.0)
        fields: dict[str, Any] = {
            "token": self._token, "wall_ms": round(wall_ms, 3),
            "read_ms": round(times.read_ms, 3), "stage_ms": round(times.stage_ms, 3),
            "upload_ms": round(times.upload_ms, 3), "install_ms": round(times.install_ms, 3),
            "stall_ms": round(totals.stall_ms, 3), "compute_ms": round(totals.compute_ms, 3),
            "hits": totals.hits, "misses": totals.misses, "evictions": totals.evictions,
            "file_bytes": totals.file_bytes, "cache_bytes": totals.cache_bytes,
            "storage_bytes": storage, "mode": mode,
            "ram_available_bytes": self.controller.last_ram_available,
            "cache_live_bytes": self.cache.live_bytes,
            "cache_parked_bytes": self.cache.parked_bytes,
            "experts": self._experts,
            "time": totals.time.record(wall_ms),
            "cpu_ms": round((time.thread_time() - thread_cpu0) * 1000.0, 3),
            "process_cpu_ms": round((time.process_time() - process_cpu0) * 1000.0, 3),
        }
        if self._devices:
            fields["devices"] = [
                {"device": b.device, "hits": d.hits, "misses": d.misses,
                 "file_bytes": d.file_bytes, "stall_ms": round(d.stall_ms, 3),
                 "compute_ms": round(d.compute_ms, 3), "cache_live_bytes": c.live_bytes}
                for b, c, d in zip(self.backends, self.caches, self._devices, strict=True)]
            self._devices = [_DeviceTotals() for _ in self.backends]
        if self._hinted:
            fields["prefetch"] = {"predicted": totals.predicted, "correct": totals.correct,
                                  "loaded": totals.loaded, "wasted_bytes": totals.wasted_bytes}
        self.runlog.emit("token", **fields)
        summary = self.summary
        summary.add(totals, storage, mode)
        assert self._first_t0 is not None
        summary.elapsed_s = now - self._first_t0
        self.record_verification()
        self._token += 1
        self._token_t0 = None
        self._totals = TokenTotals()
        self._experts = [[] for _ in table.moe_layers]
        self._counted = {}
        self.runlog.raise_if_failed()
        self._reported = self.verifier.mismatches
        if self.verifier.mismatches > mismatches:
            raise VerificationError(
                f"{self.verifier.mismatches - mismatches} experts loaded during token "
                f"{self._token - 1} differ from the file, first: {self.verifier.first_mismatch}")
        failed = self._manifest_failure()
        if isinstance(failed, ModelChangedError) and not self._build_reported:
            # the file changed: what is read now is not the file verified (a failed read
            # leaves the experts unverified, which the close raises for)
            self._build_reported = True
            raise failed
        return fields

    def _manifest_failure(self, error: BaseException | None = None) -> MoestreamError | None:
        """What to raise when the digest manifest's computation stopped (``error``, or the
        builder's): the experts waiting for it can never be verified. A changed file is a
        ``ModelChangedError``; any other stop a ``VerificationError``."""
        builder = self.manifest.builder if self.manifest is not None else None
        error = error or (builder.error if builder is not None else None)
        if error is None:
            return None
        waiting = self.verifier.unverified if self.verifier is not None else 0
        if isinstance(error, ModelChangedError):
            return ModelChangedError(error.path, f"{error.problem}; {waiting} expert checks "
                                     "wait for digests that will never be computed")
        return VerificationError(f"{waiting} expert checks can never be compared with the "
                                 f"file: the digest manifest's computation stopped ({error})")

    def record_verification(self) -> None:
        """Copy the verifier's counts into the summary (after each token, and at close)."""
        assert self.verifier is not None
        s = self.summary
        s.verified, s.mismatches = self.verifier.verified, self.verifier.mismatches
        s.first_mismatch, s.unverified = self.verifier.first_mismatch, self.verifier.unverified

    # -- close -----------------------------------------------------------------------------

    async def settle(self) -> None:
        """Compare what still waits for its digests (a file without recorded digests: its
        manifest is being computed), decoding done; the summary then has the final counts.
        Once; ``aclose`` does it when it was not done.

        Raises:
            StageError: the manifest's reads failed (the experts stay unverified).
        """
        self._settled = True
        self._take_last_digests()
        if self.manifest is not None and self.verifier is not None:
            await self.manifest.settle(self.verifier)
        if self.verifier is not None:
            self.record_verification()

    def _take_last_digests(self) -> None:
        """Compare the install digests a token's end left (``DigestRows.take`` never waits
        there): loads started ahead, still copying then, and never consumed since."""
        if self.verifier is not None:
            for streamer in self.streamers:
                self.verifier.check(streamer.take_digests(wait=True))

    async def aclose(self, *, outcome: str = "ok", check: bool = True) -> None:
        """Release every lease and hint, stop the loads, close everything, log ``run_end``.

        Idempotent; finishes even if cancelled meanwhile. With ``outcome="ok"`` and
        ``check`` the experts still waiting for their digests (a file without them) are
        compared first, unless ``settle`` did.

        Args:
            outcome: how the client's decode ended (``run_end``'s ``exit``).
            check: raise for what closing found; False: the caller reads the mismatches
                from ``summary`` and a log error from ``runlog.error`` (``pipeline.cli.run``).

        Raises:
            VerificationError: a mismatch no ``end_token`` raised for (found by that last
                comparison, or in a token never ended).
            OutputError: the log's last lines could not be written.
        """
        if self.closed or not self.opened:
            self.closed = True
            return
        settle = check and outcome == "ok" and not self._settled
        await finish(self._close(outcome=outcome, settle=settle))
        if not check:
            return
        if self.runlog.error is not None:
            raise self.runlog.error
        found = self.summary.mismatches - self._reported
        if outcome == "ok" and found:  # compared at close: not yet raised by end_token
            raise VerificationError(f"{found} experts differ from the file, "
                                    f"first: {self.summary.first_mismatch}")
        if outcome == "ok" and self.summary.unverified:
            # never a clean close with experts consumed but not compared with the file
            raise (self._manifest_failure(self._settle_error) or VerificationError(
                f"{self.summary.unverified} expert checks were never compared with the file"))

    async def _close(self, *, outcome: str, settle: bool) -> None:
        self.closed = True
        summary = self.summary
        for lease in list(self._leases):
            self.release(lease, self.default_last_use, "the session was closed")
        self._drop_hints()
        for task in list(self._launchers):  # loads still waiting for staging slots
            task.cancel()
        for task in list(self._launchers):
            with contextlib.suppress(BaseException):
                await task
        if settle:
            try:
                self._take_last_digests()
            except Exception as exc:  # a broken device: the run is failing anyway
                _log.warning("install_digests_unread", reason=str(exc))
        if self.manifest is not None:
            if settle and self.verifier is not None:
                try:
                    await self.manifest.settle(self.verifier)
                except Exception as exc:  # what stopped the builder: ``aclose`` raises it
                    self._settle_error = exc
                    _log.warning("digest_manifest_unsettled", reason=str(exc))
            await self.manifest.aclose()
            summary.manifest_bytes = self.manifest.bytes_read
        if self.verifier is not None:
            self.record_verification()
        if self.controller is not None:
            await self.controller.aclose()
            summary.switches = self.controller.switches
            summary.modes = self.controller.tokens_in_mode
        await close_devices(summary, self.streamers, self.caches)
        summary.exit = outcome
        if self.table is not None:
            self.runlog.emit("run_end", **summary.as_dict(), hit_rate_final=summary.hit_rate)
        await self.runlog.aclose()

    def counters_now(self) -> tuple[RunSummary, TokenTotals]:
        """The totals of the tokens ended so far, and those of the token under way."""
        return replace(self.summary), replace(self._totals)


def _outcome(exc: BaseException) -> str:
    """``run_end``'s ``exit`` for what stopped the open: a cancel, or the error's words."""
    if isinstance(exc, asyncio.CancelledError):
        return "cancelled"
    if isinstance(exc, MoestreamError):
        return str(exc)
    return f"failed to open: {type(exc).__name__}"


def _count(n: int, noun: str) -> str:
    """``n`` and ``noun``, plural unless ``n`` is one (``1 expert``, ``48 experts``)."""
    return f"{n} {noun}{'' if n == 1 else 's'}"
