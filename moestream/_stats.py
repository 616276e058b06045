"""What a session counts: one token's ``TokenStats``, the running ``Counters``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from moestream.pipeline.streaming.session import StreamSession

__all__ = ["Counters", "TokenStats", "counters_of", "token_stats"]


@dataclass(frozen=True, slots=True)
class TokenStats:
    """What one token did (the fields of its ``token`` log event, docs/LOG_SCHEMA.md).

    ``compute_ms`` is the token's wall time not spent waiting for experts: the engine's
    own work, as moestream sees it from between the fetches.
    """

    token: int
    wall_ms: float
    stall_ms: float
    compute_ms: float
    hits: int
    misses: int
    evictions: int
    file_bytes: int
    cache_bytes: int
    storage_bytes: int
    mode: str
    experts: tuple[tuple[int, ...], ...]
    """Per MoE layer (``ModelInfo.moe_layers`` order), the experts fetched."""
    time: Mapping[str, float] = field(default_factory=dict)
    """The wall time by what it went to, ms: ``compute_ms``, ``read_ms``, ``upload_ms``,
    ``slot_ms``, ``switch_ms``, ``host_ms`` (the log's ``time`` object; they add up to
    ``wall_ms``)."""
    cpu_ms: float = 0.0
    """CPU time of the session's event-loop thread during the token: ``wall_ms`` well above
    it and its waits means that thread was blocked elsewhere (a full CUDA launch queue, the
    GIL held by another thread), not computing."""


@dataclass(frozen=True, slots=True)
class Counters:
    """Totals since the session opened, the token under way included (a lease counts once
    released, a hint once made).

    Device bytes are summed over the devices.
    """

    tokens: int
    hits: int
    misses: int
    evictions: int
    prefetched: int
    file_bytes: int
    cache_bytes: int
    storage_bytes: int
    stall_ms: float
    verified: int
    mismatches: int
    unverified: int
    mode: str
    switches: int
    budget_bytes: int
    live_bytes: int
    parked_bytes: int
    peak_device_bytes: int
    open_leases: int

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


def token_stats(f: Mapping[str, Any]) -> TokenStats:
    """The stats of the streaming session's token fields (its ``end_token``'s answer)."""
    return TokenStats(
        token=f["token"], wall_ms=f["wall_ms"], stall_ms=f["stall_ms"],
        compute_ms=f["compute_ms"], hits=f["hits"], misses=f["misses"],
        evictions=f["evictions"], file_bytes=f["file_bytes"], cache_bytes=f["cache_bytes"],
        storage_bytes=f["storage_bytes"], mode=f["mode"],
        experts=tuple(tuple(layer) for layer in f["experts"]), time=f["time"],
        cpu_ms=f["cpu_ms"])


def counters_of(streaming: StreamSession) -> Counters:
    """The totals of ``streaming`` now: the tokens done and the one under way."""
    done, now = streaming.counters_now()
    cache, caches = streaming.cache, streaming.caches
    controller = streaming.controller
    return Counters(
        tokens=done.tokens, hits=done.hits + now.hits, misses=done.misses + now.misses,
        evictions=done.evictions + now.evictions,
        prefetched=sum(c.counters.prefetched for c in caches),
        file_bytes=done.file_bytes + now.file_bytes,
        cache_bytes=done.cache_bytes + now.cache_bytes, storage_bytes=done.storage_bytes,
        stall_ms=done.stall_ms + now.stall_ms, verified=done.verified,
        mismatches=done.mismatches, unverified=done.unverified, mode=streaming.mode,
        switches=controller.switches if controller is not None else 0,
        budget_bytes=cache.budget_bytes, live_bytes=cache.live_bytes,
        parked_bytes=cache.parked_bytes,
        peak_device_bytes=sum(c.counters.peak_device_bytes for c in caches),
        open_leases=streaming.open_leases)
