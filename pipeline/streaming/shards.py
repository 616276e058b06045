"""Several devices as one: each device owns a share of the experts, and the session sees
one streamer and one cache.

Each device has its own backend, cache (its part of the budget) and streamer (reader pool,
staging ring, upload streams). A placement (``gpu.cache.placement``) names the device of every
(layer, expert); a fetch loads each expert where it lives (``moestream.pipeline.streaming.desk``'s
``LeaseDesk._start_parts``), and its handles name their device: an engine computes each expert there
(``moestream.pipeline.proxy.decode`` combines the devices' outputs on the first, the home).

The group classes offer what the controller and the session's token accounting use of a
single device's objects, so a one-device session uses those objects themselves, unchanged
(``pipeline.streaming.session`` chooses; ``open_backends`` opens one backend per device of the run).
Resident mode maps the model once: the home streamer owns the mapping (registered portable,
for every device) and the others borrow it; so entering resident switches the home first,
and leaving switches it last.
"""

from __future__ import annotations

from collections.abc import Sequence

from moestream.gpu.backend import Backend
from moestream.gpu.cache.store import DeviceCache
from moestream.gpu.selection import select_backend, visible_devices
from moestream.pipeline.foundation.config import StreamConfig
from moestream.pipeline.streaming.loads import IOMode, StageTimes, WarmGate
from moestream.pipeline.streaming.streamer import ExpertStreamer
from moestream.pipeline.streaming.verify import Digests
from moestream.stages.reader import ModelReader

__all__ = ["CacheGroup", "StreamerGroup", "open_backends"]


class StreamerGroup:
    """Every device's streamer behind one, for the controller and the token's accounting:
    modes switched in order, counters summed. Loads start per device (``LeaseDesk._start_parts``, by
    placement).

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


def open_backends(cfg: StreamConfig) -> list[Backend]:
    """One backend per device of the run, the home device (the first named) first."""
    home = select_backend(cfg.backend, cfg.devices[0] if cfg.devices else 0)
    devices = cfg.devices or tuple(range(visible_devices(home.name)))
    return [home, *(select_backend(home.name, d) for d in devices[1:])]
