"""What the device cache holds and counts: its entries, a layer's lookup, the running totals.

Kept apart from ``moestream.gpu.cache.store``, which holds the buffers behind them under the
budget: the stages and the streaming session pass these records around and read them on
their own (``store`` re-exports them).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from moestream.gpu.backend import DeviceBuffer, Event
from moestream.gpu.cache.policy import ExpertKey

__all__ = ["CacheCounters", "Entry", "LayerPlan"]


@dataclass(slots=True, eq=False)
class Entry:
    """One cached expert: its device buffer and the events that order its use.

    ``reuse_after``: the upload into ``buffer`` must wait for it (the previous owner's last
    compute). ``upload``: completes when all bytes are on the device. ``last_use``: the
    last compute queued on this entry; the buffer outlives it.
    """

    key: ExpertKey
    buffer: DeviceBuffer
    nbytes: int
    reuse_after: Event | None = None
    upload: Event | None = None
    last_use: Event | None = None
    ready: bool = False
    pins: int = 0
    loaded: asyncio.Future[None] | None = None


@dataclass(slots=True)
class CacheCounters:
    """Running totals; the run loop takes per-token deltas."""

    lookups: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes_from_cache: int = 0
    bytes_from_file: int = 0
    allocations: int = 0
    frees: int = 0
    peak_device_bytes: int = 0
    prefetched: int = 0
    bytes_prefetched: int = 0
    budget_shrinks: int = 0


@dataclass(slots=True)
class LayerPlan:
    """One layer's lookup: entries already cached (or in flight), and new ones to load."""

    hits: list[Entry] = field(default_factory=list)
    misses: list[Entry] = field(default_factory=list)
    evicted: int = 0
