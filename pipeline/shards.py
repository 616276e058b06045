"""Several devices as one: each device owns a share of the experts, and the run sees one
streamer, one decoder and one cache.

A ``Shard`` is one device's full pipeline: its backend, cache (its part of the budget),
streamer (reader pool, staging ring, upload streams) and decoder (compute stream). A
placement (``gpu.placement``) names the device of every (layer, expert); a layer's experts
load and run where they live, concurrently (a lease per device,
``StreamSession.lease_per_device``), and their outputs are combined on the first
device (the home), which keeps the hidden state: each other device's weighted sum of its
experts' outputs is copied over (a few KiB, a peer copy on GPUs), added, and the new hidden
state is copied back to every device for the next layer.

The group classes offer what the decode loop, the controller and ``pipeline.run`` use of a
single device's objects, so a one-device run uses those objects themselves, unchanged
(``pipeline.session`` chooses; ``open_backends`` opens one backend per device of the run).
Resident mode maps the model once: the home streamer owns the mapping (registered portable,
for every device) and the others borrow it; so entering resident switches the home first,
and leaving switches it last.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

from gpu.backend import Backend, Kernels
from gpu.cache import DeviceCache
from gpu.selection import select_backend, visible_devices
from pipeline.decode import Decoder, LayerResult
from pipeline.foundation.config import RunConfig
from pipeline.lease import LayerLease
from pipeline.streamer import ExpertStreamer, IOMode, StageTimes, WarmGate
from pipeline.verify import Digests
from stages.reader import ModelReader

__all__ = ["CacheGroup", "DeviceCounters", "Shard", "ShardedDecoder", "StreamerGroup",
           "open_backends"]


@dataclass(slots=True)
class Shard:
    """One device's part of the run."""

    backend: Backend
    kernels: Kernels
    cache: DeviceCache
    streamer: ExpertStreamer
    decoder: Decoder


@dataclass(slots=True)
class DeviceCounters:
    """One device's share of a token (the token event's ``devices`` list)."""

    hits: int = 0
    misses: int = 0
    file_bytes: int = 0
    stall_ms: float = 0.0
    compute_ms: float = 0.0

    def add(self, r: LayerResult) -> None:
        self.hits += r.hits
        self.misses += r.misses
        self.file_bytes += r.file_bytes
        self.stall_ms += r.stall_ms
        self.compute_ms += r.compute_ms


class StreamerGroup:
    """Every device's streamer behind one, for the controller and the token's accounting:
    modes switched in order, counters summed. Loads start per device (``pipeline.lease``'s
    ``plan_parts``, by placement).

    Args:
        streamers: one per device, the home (mapping owner) first.
    """

    def __init__(self, streamers: Sequence[ExpertStreamer]) -> None:
        self._all = list(streamers)

    @property
    def mode(self) -> IOMode:
        return self._all[0].mode

    @property
    def reader(self) -> ModelReader:
        return self._all[0].reader

    @property
    def pinned_bytes(self) -> int:
        return self._all[0].pinned_bytes  # one mapping, registered once

    @property
    def warm_gate(self) -> WarmGate | None:
        return self._all[0].warm_gate

    @warm_gate.setter
    def warm_gate(self, gate: WarmGate | None) -> None:
        for s in self._all:
            s.warm_gate = gate

    @property
    def tier_bytes(self) -> int:
        return sum(s.tier_bytes for s in self._all)

    @property
    def tier(self) -> frozenset[tuple[int, int]]:
        return frozenset().union(*(s.tier for s in self._all))

    async def set_mode(self, mode: IOMode) -> None:
        home, others = self._all[0], self._all[1:]
        if mode == "resident":
            await home.set_mode(mode)
        for s in others:
            await s.set_mode(mode)
        if mode == "direct":
            await home.set_mode(mode)

    def register_resident(self) -> None:
        self._all[0].register_resident()

    async def registered(self) -> None:
        await self._all[0].registered()

    async def set_tier_bytes(self, nbytes: int) -> int:
        """Each device's tier gets an equal share (the placement balances bytes)."""
        share = nbytes // len(self._all)
        return sum([await s.set_tier_bytes(share) for s in self._all])

    def poll_installs(self) -> None:
        for s in self._all:
            s.poll_installs()

    def take_digests(self, *, wait: bool = False) -> Digests:
        return Digests.join(s.take_digests(wait=wait) for s in self._all)

    def take_times(self) -> StageTimes:
        total = StageTimes()
        for s in self._all:
            total.add(s.take_times())
        return total

    async def aclose(self) -> None:
        for s in reversed(self._all):  # the home, which owns the mapping, last
            await s.aclose()


class ShardedDecoder:
    """Runs each layer on the devices its experts live on and combines on the home device.

    Args:
        shards: one per device, the home first; their decoders made with ``partial=True``.
    """

    def __init__(self, shards: Sequence[Shard]) -> None:
        self._shards = list(shards)
        self._home = self._shards[0].decoder
        self.compute = self._home.compute
        self.counters = [DeviceCounters() for _ in self._shards]

    @property
    def hidden(self) -> Any:
        return self._home.hidden

    def set_hidden(self, hidden: Any) -> None:
        self._home.set_hidden(hidden)
        for shard in self._shards[1:]:
            shard.decoder.set_hidden(None if hidden is None else shard.backend.adopt(hidden))

    def take_use_digests(self) -> Digests:
        return Digests.join(s.decoder.take_use_digests() for s in self._shards)

    def take_device_counters(self) -> list[dict[str, Any]]:
        out = [{"device": s.backend.device, "hits": c.hits, "misses": c.misses,
                "file_bytes": c.file_bytes, "stall_ms": round(c.stall_ms, 3),
                "compute_ms": round(c.compute_ms, 3),
                "cache_live_bytes": s.cache.live_bytes}
               for s, c in zip(self._shards, self.counters, strict=True)]
        self.counters = [DeviceCounters() for _ in self._shards]
        return out

    async def run_layer(
        self,
        leases: Sequence[LayerLease],
        experts: Sequence[int],
        weights: Sequence[float],
        prefetched: Sequence[LayerLease] = (),
        meanwhile: Callable[[], None] | None = None,
    ) -> LayerResult:
        """Every device with work in this layer (its lease, or guesses to release) runs its
        part concurrently; then the partial sums are combined on the home device.

        Args:
            leases: one per device that holds some of the layer's experts.
            experts, weights: the layer's experts and their router weights.
            prefetched: the guesses made for this layer, one lease per device.
            meanwhile: the caller's host work, run by the first device's part while its
                device computes.

        Raises:
            StageError (or the failed device's own error): after every device finished
                its part, so no device keeps pins or loads of this layer.
        """
        weight_of = {int(e): float(w) for e, w in zip(experts, weights, strict=True)}
        mine = {lease.parts[0].device: lease for lease in leases}
        guessed = {guess.parts[0].device: guess for guess in prefetched}
        runs: list[Coroutine[Any, Any, LayerResult]] = []
        used = []
        for i, shard in enumerate(self._shards):
            lease, guess = mine.get(i), guessed.get(i)
            if lease is None and (guess is None or not guess.misses):
                continue
            own = list(lease.experts) if lease is not None else []
            runs.append(shard.decoder.run_layer([lease] if lease is not None else [], own,
                                                [weight_of[e] for e in own],
                                                [guess] if guess is not None else [],
                                                None if runs else meanwhile))
            used.append(i)
        results = await asyncio.gather(*runs, return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        merged = LayerResult(0, 0, 0, 0, 0, 0.0, 0.0)
        slowest = -1.0
        for i, r in zip(used, results, strict=True):
            assert isinstance(r, LayerResult)
            self.counters[i].add(r)
            merged.hits += r.hits
            merged.misses += r.misses
            merged.evictions += r.evictions
            merged.file_bytes += r.file_bytes
            merged.cache_bytes += r.cache_bytes
            merged.stall_ms = max(merged.stall_ms, r.stall_ms)  # the devices waited together
            merged.compute_ms = max(merged.compute_ms, r.compute_ms)
            # the layer waited for every device: its time went where the slowest one's did
            # (the devices' waits overlap, so theirs cannot be added)
            if r.time.measured_ms > slowest:
                slowest, merged.time = r.time.measured_ms, r.time
        self._combine(used)
        return merged

    def _combine(self, used: Sequence[int]) -> None:
        home = self._shards[0].backend
        total: Any = None
        for i in used:
            part = self._shards[i].decoder.partial_sum
            if part is None:
                continue  # digest or fixed compute: no hidden state to carry
            part = part if i == 0 else home.adopt(part)
            total = part if total is None else total + part
        if total is None:
            return
        self._home.advance(total)
        hidden = self._home.hidden
        for shard in self._shards[1:]:
            shard.decoder.set_hidden(shard.backend.adopt(hidden))


class CacheGroup:
    """Every device's cache, summed for the loop's log and the run's summary."""

    def __init__(self, caches: Sequence[DeviceCache]) -> None:
        self.caches = list(caches)

    def advance_token(self) -> None:
        for c in self.caches:
            c.advance_token()

    @property
    def live_bytes(self) -> int:
        return sum(c.live_bytes for c in self.caches)

    @property
    def parked_bytes(self) -> int:
        return sum(c.parked_bytes for c in self.caches)

    @property
    def budget_bytes(self) -> int:
        return sum(c.budget_bytes for c in self.caches)

    def close(self) -> None:
        for c in self.caches:
            c.close()


def open_backends(cfg: RunConfig) -> list[Backend]:
    """One backend per device of the run, the home device (the first named) first."""
    home = select_backend(cfg.backend, cfg.devices[0] if cfg.devices else 0)
    devices = cfg.devices or tuple(range(visible_devices(home.name)))
    return [home, *(select_backend(home.name, d) for d in devices[1:])]
