"""A run's totals: what ``moestream.pipeline.cli.run`` returns, logs as ``run_end`` and prints."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from moestream.pipeline.foundation.errors import printable
from moestream.pipeline.foundation.sizes import size_text
from moestream.pipeline.foundation.timesplit import TimeSplit

__all__ = ["RunSummary", "TokenTotals", "print_summary", "size_text"]


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
    """The experts as stored: their format and bytes each (``describe_experts``)."""
    exit: str = "ok"
    first_mismatch: str = ""
    stall_ms: float = 0.0
    compute_ms: float = 0.0
    modes: dict[str, int] = field(default_factory=dict)
    devices: list[dict[str, int]] = field(default_factory=list)

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


def print_summary(summary: RunSummary, as_json: bool) -> None:
    if as_json:
        print(json.dumps(summary.as_dict(), indent=2))
        return
    print(
        f"model      {printable(summary.model)}"
        f"{f' ({summary.experts})' if summary.experts else ''}\n"
        f"backend    {summary.backend} ({summary.device}), mode {summary.mode}"
        f"{f', {summary.switches} switches' if summary.switches else ''}\n"
        f"decoded    {summary.tokens} tokens in {summary.elapsed_s:.2f} s: "
        f"{summary.tokens_per_s:.2f} tok/s\n"
        f"cache      hit rate {summary.hit_rate:.3f} ({summary.hits} hits, {summary.misses} "
        f"misses, {summary.evictions} evictions), budget {size_text(summary.budget_bytes)},"
        f" peak {size_text(summary.peak_device_bytes)}\n"
        f"bytes      {size_text(summary.file_bytes)} read from file, "
        f"{size_text(summary.cache_bytes)} served from cache, "
        f"{size_text(summary.storage_bytes)} from storage\n"
        f"verified: {_count(summary.verified, 'expert')}, "
        f"{_count(summary.mismatches, 'mismatch', 'mismatches')}"
        f"{f', {summary.unverified} not verified' if summary.unverified else ''}"
        f" (digests: {summary.digests})"
    )


def describe_experts(layers: Iterable[Any]) -> str:
    """The experts as a miss reads them: format and bytes each, from MoE layer descriptions
    (``MoeLayer`` or ``LayerInfo``: ``gate_up_type``, ``down_type``, ``expert_bytes``,
    ``quant``), e.g. ``fp8 blocks 128x128, 4.50 MiB an expert as stored``."""
    layers = list(layers)
    if not layers:
        return ""
    first = layers[0]
    if first.quant is not None and first.quant.method == "fp8":
        bm, bn = first.quant.block
        kind = f"fp8 blocks {bm}x{bn}"
    elif first.quant is not None:  # E2M1 pairs, a power-of-two scale per 32 values
        kind = f"{first.quant.method} (E2M1, an E8M0 scale per 32)"
    else:
        kinds = {first.gate_up_type.name, first.down_type.name}
        kind = "/".join(sorted(kinds))
    sizes = sorted({layer.expert_bytes for layer in layers})
    each = size_text(sizes[0])
    if len(sizes) > 1:
        each += f" to {size_text(sizes[-1])}"
    return f"experts {kind}, {each} an expert as stored"


def _count(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and ``noun``, plural unless ``n`` is one (``1 expert``, ``0 mismatches``)."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"
