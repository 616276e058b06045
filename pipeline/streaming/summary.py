"""A run's totals: what the session fills in and logs as ``run_end``, and
``moestream.pipeline.cli.run`` returns and prints (``pipeline.cli.summary``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from moestream.pipeline.foundation.timesplit import TimeSplit

__all__ = ["RunSummary", "TokenTotals"]


@dataclass(slots=True)
class TokenTotals:
    """What one token did, summed over its layers; ``wall_ms`` and ``time``: its wall time
    and what that time was charged to (``host`` is the rest)."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0
    file_bytes: int = 0
    cache_bytes: int = 0
    stall_ms: float = 0.0
    compute_ms: float = 0.0
    predicted: int = 0
    correct: int = 0
    loaded: int = 0
    wasted_bytes: int = 0
    wall_ms: float = 0.0
    time: TimeSplit = field(default_factory=TimeSplit)


@dataclass(slots=True)
class RunSummary:
    """The run's totals (also the ``run_end`` log event and ``--json`` output)."""

    tokens: int = 0
    elapsed_s: float = 0.0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    file_bytes: int = 0
    cache_bytes: int = 0
    storage_bytes: int = 0
    verified: int = 0
    mismatches: int = 0
    unverified: int = 0
    digests: str = "none"
    manifest_bytes: int = 0
    peak_device_bytes: int = 0
    budget_bytes: int = 0
    final_budget_bytes: int = 0
    allocations: int = 0
    frees: int = 0
    mode: str = "direct"
    switches: int = 0
    backend: str = "host"
    device: str = "host"
    model: str = ""
    experts: str = ""
    """The experts as stored: their format and bytes each (``pipeline.foundation.describe``)."""
    exit: str = "ok"
    first_mismatch: str = ""
    stall_ms: float = 0.0
    compute_ms: float = 0.0
    modes: dict[str, int] = field(default_factory=dict)
    devices: list[dict[str, int | str]] = field(default_factory=list)

    def add(self, totals: TokenTotals, storage_bytes: int, mode: str) -> None:
        """Count one decoded token."""
        self.tokens += 1
        self.hits += totals.hits
        self.misses += totals.misses
        self.evictions += totals.evictions
        self.file_bytes += totals.file_bytes
        self.cache_bytes += totals.cache_bytes
        self.storage_bytes += storage_bytes
        self.stall_ms += totals.stall_ms
        self.compute_ms += totals.compute_ms
        self.mode = mode

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "elapsed_s": round(self.elapsed_s, 4),
            "tokens_per_s": round(self.tokens_per_s, 3),
            "hits": self.hits,
            "misses": self.misses,
            "hit_rate": round(self.hit_rate, 4),
            "evictions": self.evictions,
            "file_bytes": self.file_bytes,
            "cache_bytes": self.cache_bytes,
            "storage_bytes": self.storage_bytes,
            "verified": self.verified,
            "mismatches": self.mismatches,
            "unverified": self.unverified,
            "digests": self.digests,
            "manifest_bytes": self.manifest_bytes,
            "peak_device_bytes": self.peak_device_bytes,
            "budget_bytes": self.budget_bytes,
            "final_budget_bytes": self.final_budget_bytes,
            "allocations": self.allocations,
            "frees": self.frees,
            "stall_ms": round(self.stall_ms, 3),
            "compute_ms": round(self.compute_ms, 3),
            "mode": self.mode,
            "modes": self.modes,
            "switches": self.switches,
            "backend": self.backend,
            "device": self.device,
            "model": self.model,
            "experts": self.experts,
            "exit": self.exit,
            "devices": self.devices,
        }
