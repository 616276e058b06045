"""Synthetic run logs for the analysis tests (and ``bench.analyze``'s long run).

A log here is valid against docs/LOG_SCHEMA.md, and its hit counts are what a live
``CacheIndex`` produced on the routing written, so the what-if replay must match them
exactly: the tests build logs of a few hundred tokens with it, ``bench.analyze`` one of
100,000 to time the tools on the long end of what they must handle.
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import numpy.typing as npt

from moestream.gpu.cache.policy import CacheIndex, make_policy
from moestream.pipeline.foundation.errors import UsageError

__all__ = ["SyntheticRun", "routing", "write_synthetic_log"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SyntheticRun:
    """Shape of a synthetic run log.

    Attributes:
        tokens: tokens decoded.
        moe_layers: MoE layers (model indices are 0..moe_layers-1).
        n_experts: routed experts per layer.
        top_k: experts chosen per layer and token.
        expert_bytes: bytes of one expert (every layer).
        budget_experts: cache budget, in experts.
        policy: ``lru`` or ``freq``.
        seed: routing seed.
        switch_at: token at which the mode switches from direct to resident; None: never.
        layer_lines: also write debug ``layer`` lines.
        prefetch: write the optional ``prefetch`` object.
        skew: Zipf exponent of each layer's fixed expert popularity.
        locality: weight of the slowly changing "topic" preference in routing (0: none).
    """

    tokens: int
    moe_layers: int = 43
    n_experts: int = 256
    top_k: int = 6
    expert_bytes: int = 7_077_888  # 6.75 MiB: DeepSeek V4 Flash, Q2
    budget_experts: int = 2522
    policy: str = "lru"
    seed: int = 0
    switch_at: int | None = None
    layer_lines: bool = False
    prefetch: bool = True
    skew: float = 0.7
    locality: float = 1.0

    def __post_init__(self) -> None:
        if self.tokens < 1 or self.moe_layers < 1 or not 0 < self.top_k <= self.n_experts:
            raise UsageError(f"synthetic run needs tokens, layers >= 1 and 0 < top_k <= n: {self}")


def routing(run: SyntheticRun, chunk_tokens: int = 512) -> npt.NDArray[np.int32]:
    """Expert ids per token and layer, ``(tokens, layers, top_k)``, in router order.

    Each layer has a fixed Zipf-like popularity plus a preference that changes every 64
    tokens (a "topic"), so there is the reuse a cache feeds on; top-k is drawn with the
    Gumbel trick, ordered by score as a router orders its choices.
    """
    rng = np.random.default_rng(run.seed)
    layers, n, k = run.moe_layers, run.n_experts, run.top_k
    ranks = np.argsort(rng.random((layers, n)), axis=1) + 1
    base = -run.skew * np.log(ranks).astype(np.float32)
    topics = (run.tokens + 63) // 64
    topic_pref = run.locality * rng.standard_normal((topics, layers, n)).astype(np.float32)
    out = np.empty((run.tokens, layers, k), dtype=np.int32)
    for start in range(0, run.tokens, chunk_tokens):
        stop = min(start + chunk_tokens, run.tokens)
        topic = np.arange(start, stop) // 64
        gumbel = rng.gumbel(size=(stop - start, layers, n)).astype(np.float32)
        scores = base[None] + topic_pref[topic] + gumbel
        top = np.argpartition(-scores, k - 1, axis=2)[:, :, :k]
        order = np.argsort(-np.take_along_axis(scores, top, axis=2), axis=2)
        out[start:stop] = np.take_along_axis(top, order, axis=2)
    return out


def _iso(seconds: float) -> str:
    stamp = dt.datetime(2026, 12, 2, 12, 0, tzinfo=dt.UTC) + dt.timedelta(seconds=seconds)
    return stamp.isoformat().replace("+00:00", "Z")


def _line(out: TextIO, event: str, clock: float, **fields: Any) -> None:
    out.write(json.dumps({"event": event, "schema": 2, "ts": _iso(clock), **fields}) + "\n")


@dataclass(slots=True)
class _Writer:
    """One log being written: the run, its cache emulation, clock, mode and totals."""

    out: TextIO
    run: SyntheticRun
    index: CacheIndex
    budget: int
    readings: dict[str, int] = field(default_factory=lambda: {
        "ram_available_bytes": 8 * 10**9, "model_resident_bytes": 0,
        "model_bytes": 80 * 10**9, "storage_read_bytes": 0})
    totals: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("hits", "misses", "evictions", "file_bytes", "cache_bytes", "storage_bytes"), 0))
    clock: float = 0.0
    peak: int = 0
    mode: str = "direct"

    def start(self) -> None:
        """``run_start`` and the controller's first decision (direct)."""
        run, budget = self.run, self.budget
        _line(self.out, "run_start", self.clock,
              config={"model": "synthetic.gguf", "tokens": run.tokens, "budget_bytes": budget,
                      "mode": "auto", "policy": run.policy, "compute": "emulated",
                      "queue_depth": 8, "seed": run.seed, "backend": "host"},
              model={"path": "synthetic.gguf", "file_bytes": 80 * 10**9,
                     "moe_layers": list(range(run.moe_layers)),
                     "n_experts": run.n_experts, "top_k": run.top_k,
                     "expert_bytes": [run.expert_bytes] * run.moe_layers,
                     "non_routed_bytes": 8_800_000_000},
              machine={"gpu": None, "ram_total_bytes": 24 * 2**30, "cpu_count": 2, "disk": None},
              budget_bytes=budget, policy=run.policy)
        _line(self.out, "controller_decision", self.clock, mode="direct",
              readings=self.readings, reason="ram_available < model: direct I/O", token=0)

    def switch(self, token: int) -> None:
        """RAM frees up: the controller switches to resident mode."""
        self.readings = {**self.readings, "ram_available_bytes": 100 * 10**9}
        reason = "ram_available >= model + margin"
        _line(self.out, "controller_decision", self.clock, mode="resident",
              readings=self.readings, reason=reason, token=token)
        _line(self.out, "mode_switch", self.clock, readings=self.readings, reason=reason,
              token=token, **{"from": "direct", "to": "resident"})
        self.mode = "resident"

    def access(self, token: int, chosen: list[list[int]]) -> tuple[int, int, int]:
        """Each MoE layer's experts through the cache, then ``advance_token``: the token's
        (hits, misses, evictions)."""
        sizes = [self.run.expert_bytes] * self.run.top_k
        hits = misses = evicted = 0
        for pos, ids in enumerate(chosen):
            outcome = self.index.access_layer([(pos, e) for e in ids], sizes)
            hits += len(outcome.hits)
            misses += len(outcome.misses)
            evicted += len(outcome.evicted)
            if self.run.layer_lines:
                _line(self.out, "layer", self.clock, token=token, layer=pos,
                      hits=len(outcome.hits), misses=len(outcome.misses),
                      read_ms=0.1 * len(outcome.misses), stall_ms=0.05 * len(outcome.misses))
        self.index.advance_token()
        return hits, misses, evicted

    def token(self, token: int, chosen: list[list[int]], jitter: float) -> None:
        """One ``token`` line, its times made up from its reads, and the totals."""
        run = self.run
        hits, misses, evicted = self.access(token, chosen)
        file_bytes = misses * run.expert_bytes
        direct = self.mode == "direct"
        storage = file_bytes if direct else file_bytes // 20
        read_ms = file_bytes / (1.5e6 if direct else 12e6)
        compute_ms = 0.57 * run.moe_layers * jitter
        stall_ms = max(0.0, read_ms - 0.5 * compute_ms)
        wall_ms = compute_ms + stall_ms + 0.2
        self.clock += wall_ms / 1000
        self.peak = max(self.peak, self.index.live_bytes)
        fields: dict[str, Any] = {
            "token": token, "wall_ms": round(wall_ms, 3), "read_ms": round(read_ms, 3),
            "stage_ms": round(file_bytes / 20e6, 3) if direct else 0.0,
            "upload_ms": round(file_bytes / 50e6, 3), "install_ms": 0.01 * misses,
            "stall_ms": round(stall_ms, 3), "compute_ms": round(compute_ms, 3),
            "hits": hits, "misses": misses, "evictions": evicted,
            "file_bytes": file_bytes, "cache_bytes": hits * run.expert_bytes,
            "storage_bytes": storage, "mode": self.mode,
            "ram_available_bytes": self.readings["ram_available_bytes"],
            "cache_live_bytes": self.index.live_bytes, "cache_parked_bytes": 0,
            "experts": chosen,
            # the stall is reads in direct mode, copies out of the page cache in resident
            "time": {"compute_ms": round(compute_ms, 3),
                     "read_ms": round(stall_ms, 3) if direct else 0.0,
                     "upload_ms": 0.0 if direct else round(stall_ms, 3),
                     "slot_ms": 0.0, "switch_ms": 0.0,
                     "host_ms": round(round(wall_ms, 3) - round(compute_ms, 3)
                                      - round(stall_ms, 3), 3)},
        }
        if run.prefetch:
            fields["prefetch"] = {"predicted": run.moe_layers, "correct": hits // 6,
                                  "wasted_bytes": run.expert_bytes}
        _line(self.out, "token", self.clock, **fields)
        for name, value in (("hits", hits), ("misses", misses), ("evictions", evicted),
                            ("file_bytes", file_bytes), ("cache_bytes", hits * run.expert_bytes),
                            ("storage_bytes", storage)):
            self.totals[name] += value

    def end(self) -> None:
        """``run_end`` with the run's totals."""
        t = self.totals
        used = t["hits"] + t["misses"]
        _line(self.out, "run_end", self.clock, tokens=self.run.tokens,
              elapsed_s=round(self.clock, 6), tokens_per_s=self.run.tokens / self.clock,
              hits=t["hits"], misses=t["misses"], hit_rate=t["hits"] / used if used else 0.0,
              file_bytes=t["file_bytes"], cache_bytes=t["cache_bytes"],
              storage_bytes=t["storage_bytes"], verified=used, mismatches=0,
              peak_device_bytes=self.peak, budget_bytes=self.budget, exit="ok")


def write_synthetic_log(path: Path, run: SyntheticRun) -> dict[str, int]:
    """Write a schema-2 log whose hits come from a live ``CacheIndex`` run.

    The cache emulation follows the live cache's contract (docs/LOG_SCHEMA.md, "Replay
    exactness"): per token, ``access_layer`` per MoE layer, then ``advance_token``.

    Returns:
        Totals written: ``hits``, ``misses``, ``evictions``, ``budget_bytes``.
    """
    experts = routing(run)
    budget = run.budget_experts * run.expert_bytes
    jitter = np.random.default_rng(run.seed + 1).gamma(20.0, 1 / 20.0, size=run.tokens)
    with path.open("w", encoding="utf-8") as out:
        writer = _Writer(out, run, CacheIndex(budget, make_policy(run.policy)), budget)
        writer.start()
        for token, chosen in enumerate(experts.tolist()):
            if token == run.switch_at:
                writer.switch(token)
            writer.token(token, chosen, float(jitter[token]))
        writer.end()
    t = writer.totals
    return {"hits": t["hits"], "misses": t["misses"], "evictions": t["evictions"],
            "budget_bytes": budget}
