"""The session's per-token accounting: the token's clock, what its leases counted, the
engine's share of its wall time, and the ``token`` log line's figures.

``TokenLedger`` is the bottom of ``StreamSession``'s classes (``LeaseDesk`` counts into
it, the session ends each token through it); it holds no device parts of its own. All
methods run on the event loop's thread that opened the session.
"""

from __future__ import annotations

import operator
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from moestream.gpu.backend import Backend
from moestream.gpu.cache.entries import Entry
from moestream.gpu.cache.store import DeviceCache
from moestream.pipeline.foundation.machine import process_read_bytes
from moestream.pipeline.streaming.lease import LayerLease
from moestream.pipeline.streaming.loads import StageTimes
from moestream.pipeline.streaming.streamer import ExpertStreamer
from moestream.pipeline.streaming.summary import TokenTotals

__all__ = ["DeviceTotals", "TokenLedger"]

_log = structlog.get_logger("moestream.session")

_NBYTES = operator.attrgetter("nbytes")


@dataclass(slots=True)
class DeviceTotals:
    """One device's share of a token (the token event's ``devices`` list)."""

    hits: int = 0
    misses: int = 0
    file_bytes: int = 0
    stall_ms: float = 0.0
    compute_ms: float = 0.0


class TokenLedger:
    """The token under way: its clock, its totals, the experts each layer used."""

    def __init__(self) -> None:
        self._token = 0
        self._token_t0: float | None = None
        self._first_t0: float | None = None
        self._token_cpu0 = (0.0, 0.0)  # this thread's and the process's CPU at the start
        self._totals = TokenTotals()
        self._devices: list[DeviceTotals] = []  # per device, with several
        self._experts: list[list[int]] = []
        # by layer, this token's first lease, or once there were more, what they counted
        self._counted: dict[int, LayerLease | dict[int, bool]] = {}
        self._position: dict[int, int] = {}
        self._unexplained_ms = 0.0  # this token's stall not charged to a phase (host)
        self._clamped = False  # an engine's compute_ms above the wall time was logged
        self._read_bytes = 0

    @property
    def token(self) -> int:
        """The index of the token being decoded (tokens ended so far)."""
        return self._token

    def _clock(self) -> None:
        """The token's clock runs from the first fetch, hint or lease use in it (a layer
        fetched ahead, then first used, may be the first thing a token touches)."""
        if self._token_t0 is None:
            self._token_t0 = time.perf_counter()
            self._token_cpu0 = (time.thread_time(), time.process_time())
            if self._first_t0 is None:
                self._first_t0 = self._token_t0

    def _count(self, lease: LayerLease) -> None:
        """A lease's release: its figures go to the token under way."""
        before = self._counted.get(lease.layer)
        if before:
            self._count_again(lease, before)
            return
        totals, devices = self._totals, self._devices
        for part in lease.parts:
            plan = part.load.plan
            totals.hits += len(plan.hits)
            totals.misses += len(plan.misses)
            totals.evictions += plan.evicted
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
        was_miss = self._was_miss(lease.layer, before)
        totals, devices = self._totals, self._devices
        totals.evictions += lease.evicted
        for part in lease.parts:
            device = devices[part.device] if devices else DeviceTotals()
            self._first_hits(part.load.plan.hits, was_miss, device)
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
        self._seen(lease.layer, lease.experts)

    def _seen(self, layer: int, experts: Sequence[int]) -> None:
        """The token's log line lists ``experts`` of ``layer``, each once."""
        seen = self._experts[self._position[layer]]
        seen.extend(e for e in experts if e not in seen)

    def _uses(self, layer: int) -> dict[int, bool]:
        """What the token's uses of ``layer`` so far counted (expert: was a miss), kept in
        that form from now on: empty before any."""
        before = self._counted.get(layer)
        if before is not None:
            return self._was_miss(layer, before)
        was_miss: dict[int, bool] = {}
        self._counted[layer] = was_miss
        return was_miss

    def _was_miss(self, layer: int, before: LayerLease | dict[int, bool]) -> dict[int, bool]:
        """What the token's uses of ``layer`` so far counted (expert: was a miss), kept
        from now on in that form."""
        if isinstance(before, dict):
            return before
        was_miss: dict[int, bool] = {}
        for part in before.parts:
            for entry in part.load.plan.hits:
                was_miss[entry.key[1]] = False
            for entry in part.load.plan.misses:
                was_miss[entry.key[1]] = True
        self._counted[layer] = was_miss
        return was_miss

    def _count_hits(self, layer: int, experts: Sequence[int], hits: Sequence[Entry],
                    nbytes: int) -> None:
        """A layer's experts, all hits on the one device (``nbytes`` in all), used with no
        lease (``LeaseDesk.use_cached``): counted as their lease's release would count
        them, each expert once in the token."""
        if layer not in self._counted:  # the layer's first use in the token: all first hits
            self._counted[layer] = dict.fromkeys(experts, False)
            self._experts[self._position[layer]].extend(experts)
            totals = self._totals
            totals.hits += len(hits)
            totals.cache_bytes += nbytes
            return
        self._first_hits(hits, self._uses(layer), DeviceTotals())
        self._seen(layer, experts)

    def _count_in_place(self, layer: int, experts: Sequence[int], nbytes: int) -> None:
        """A layer's experts read in place by the engine (``LeaseDesk.use_in_place``):
        each a miss of its ``nbytes``, once in the token, unless a lease counted it
        already."""
        was_miss = self._uses(layer)
        totals = self._totals
        for expert in experts:
            if expert not in was_miss:
                was_miss[expert] = True
                totals.misses += 1
                totals.file_bytes += nbytes
        self._seen(layer, experts)

    def _first_hits(self, hits: Sequence[Entry], was_miss: dict[int, bool],
                    device: DeviceTotals) -> None:
        """Count the hits whose experts the token has not counted yet (in ``was_miss``,
        marked now), in the totals and ``device``'s."""
        totals = self._totals
        for entry in hits:
            if entry.key[1] not in was_miss:
                was_miss[entry.key[1]] = False
                totals.hits += 1
                device.hits += 1
                totals.cache_bytes += entry.nbytes

    def _charge_engine(self, room: float, compute_ms: float | Sequence[float] | None,
                       upload_ms: float) -> None:
        """Charge the engine's time: its own measure (``end_token``'s arguments), never
        more than ``room`` (the wall time moestream's waits leave), the rest ``host``;
        without a measure all of ``room`` is the engine's compute."""
        totals = self._totals
        if compute_ms is None:
            # the engine computes between its fetches: its time is the rest
            totals.compute_ms = room
            totals.time.charge("compute", totals.compute_ms / 1000.0)
            return
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

    def _token_line(self, mode: str, streamers: Sequence[ExpertStreamer], cache: Any,
                    ram_available: int | None, compute_ms: float | Sequence[float] | None,
                    upload_ms: float, wall_ms: float | None = None
                    ) -> tuple[dict[str, Any], float]:
        """The ``token`` line's fields, the engine's time charged (``_charge_engine``),
        and the time it was taken at; ``cache``: the session's cache (or caches');
        ``wall_ms``: the engine's measure of the token's wall time (None: the token's clock,
        from its first fetch, hint or use to now)."""
        assert self._token_t0 is not None
        totals = self._totals
        read_bytes = process_read_bytes()
        storage, self._read_bytes = read_bytes - self._read_bytes, read_bytes
        times = StageTimes()
        for streamer in streamers:
            times.add(streamer.take_times())
        now = time.perf_counter()
        if wall_ms is None:
            wall_ms = (now - self._token_t0) * 1000.0
        totals.wall_ms = wall_ms
        thread_cpu0, process_cpu0 = self._token_cpu0
        # what neither moestream's waits (experts, the controller) nor its stalls explain
        room = max(0.0, wall_ms - totals.time.measured_ms - self._unexplained_ms)
        self._unexplained_ms = 0.0
        self._charge_engine(room, compute_ms, upload_ms)
        fields: dict[str, Any] = {
            "token": self._token, "wall_ms": round(wall_ms, 3),
            "read_ms": round(times.read_ms, 3), "stage_ms": round(times.stage_ms, 3),
            "upload_ms": round(times.upload_ms, 3), "install_ms": round(times.install_ms, 3),
            "stall_ms": round(totals.stall_ms, 3), "compute_ms": round(totals.compute_ms, 3),
            "hits": totals.hits, "misses": totals.misses, "evictions": totals.evictions,
            "file_bytes": totals.file_bytes, "cache_bytes": totals.cache_bytes,
            "storage_bytes": storage, "mode": mode,
            "ram_available_bytes": ram_available,
            "cache_live_bytes": cache.live_bytes,
            "cache_parked_bytes": cache.parked_bytes,
            "experts": self._experts,
            "time": totals.time.record(wall_ms),
            "cpu_ms": round((time.thread_time() - thread_cpu0) * 1000.0, 3),
            "process_cpu_ms": round((time.process_time() - process_cpu0) * 1000.0, 3),
        }
        return fields, now

    def _device_lines(self, backends: Sequence[Backend],
                      caches: Sequence[DeviceCache]) -> list[dict[str, Any]]:
        """Each device's share of the token (the ``devices`` field), its totals reset."""
        lines = [
            {"device": b.device, "hits": d.hits, "misses": d.misses,
             "file_bytes": d.file_bytes, "stall_ms": round(d.stall_ms, 3),
             "compute_ms": round(d.compute_ms, 3), "cache_live_bytes": c.live_bytes}
            for b, c, d in zip(backends, caches, self._devices, strict=True)]
        self._devices = [DeviceTotals() for _ in backends]
        return lines

    def _next_token(self, layers: int) -> None:
        """The token was logged: the next one starts from nothing (its clock at its first
        fetch)."""
        self._token += 1
        self._token_t0 = None
        self._totals = TokenTotals()
        self._experts = [[] for _ in range(layers)]
        self._counted = {}
