"""Benchmark command for log analysis: how long ``analyze`` and a what-if take on a long run.

A decode of 100,000 tokens through 43 MoE layers is the long end of what the tools must
handle; this command writes such a log (synthetic, but valid against docs/LOG_SCHEMA.md and
with hit counts that a live ``CacheIndex`` produced, so the what-if replay must match them
exactly), then times the summary and an LRU what-if at the run's budget as a user would run
them: ``python -m tools.analyze`` in a fresh process (Belady at the same budget too, the
simulator's most expensive replay). The result goes to
``bench/results/analyze-<host>.json`` with the machine, commit and command.

The generator is also what the tests use to build logs, at a few hundred tokens.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import numpy.typing as npt

from bench.record import provenance, write_result
from moestream.gpu.cache.policy import CacheIndex, make_policy
from moestream.pipeline.foundation.errors import MoestreamError, UsageError

__all__ = ["SyntheticRun", "main", "routing", "write_synthetic_log"]

_REPO = Path(__file__).resolve().parent.parent


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


def write_synthetic_log(path: Path, run: SyntheticRun) -> dict[str, int]:
    """Write a schema-2 log whose hits come from a live ``CacheIndex`` run.

    The cache emulation follows the live cache's contract (docs/LOG_SCHEMA.md, "Replay
    exactness"): per token, ``access_layer`` per MoE layer, then ``advance_token``.

    Returns:
        Totals written: ``hits``, ``misses``, ``evictions``, ``budget_bytes``.
    """
    experts = routing(run)
    budget = run.budget_experts * run.expert_bytes
    index = CacheIndex(budget, make_policy(run.policy))
    layers = list(range(run.moe_layers))
    sizes = [run.expert_bytes] * run.top_k
    readings = {"ram_available_bytes": 8 * 10**9, "model_resident_bytes": 0,
                "model_bytes": 80 * 10**9, "storage_read_bytes": 0}
    totals = {"hits": 0, "misses": 0, "evictions": 0, "file_bytes": 0, "cache_bytes": 0,
              "storage_bytes": 0}
    jitter = np.random.default_rng(run.seed + 1).gamma(20.0, 1 / 20.0, size=run.tokens)
    clock = 0.0
    peak = 0
    with path.open("w", encoding="utf-8") as out:
        _line(out, "run_start", clock,
              config={"model": "synthetic.gguf", "tokens": run.tokens, "budget_bytes": budget,
                      "mode": "auto", "policy": run.policy, "compute": "emulated",
                      "queue_depth": 8, "seed": run.seed, "backend": "host"},
              model={"path": "synthetic.gguf", "file_bytes": 80 * 10**9, "moe_layers": layers,
                     "n_experts": run.n_experts, "top_k": run.top_k,
                     "expert_bytes": [run.expert_bytes] * run.moe_layers,
                     "non_routed_bytes": 8_800_000_000},
              machine={"gpu": None, "ram_total_bytes": 24 * 2**30, "cpu_count": 2, "disk": None},
              budget_bytes=budget, policy=run.policy)
        _line(out, "controller_decision", clock, mode="direct", readings=readings,
              reason="ram_available < model: direct I/O", token=0)
        mode = "direct"
        for token, chosen in enumerate(experts.tolist()):
            if token == run.switch_at:
                readings = {**readings, "ram_available_bytes": 100 * 10**9}
                reason = "ram_available >= model + margin"
                _line(out, "controller_decision", clock, mode="resident", readings=readings,
                      reason=reason, token=token)
                _line(out, "mode_switch", clock, readings=readings, reason=reason, token=token,
                      **{"from": "direct", "to": "resident"})
                mode = "resident"
            hits = misses = evicted = 0
            for pos, ids in enumerate(chosen):
                outcome = index.access_layer([(pos, e) for e in ids], sizes)
                hits += len(outcome.hits)
                misses += len(outcome.misses)
                evicted += len(outcome.evicted)
                if run.layer_lines:
                    _line(out, "layer", clock, token=token, layer=pos, hits=len(outcome.hits),
                          misses=len(outcome.misses), read_ms=0.1 * len(outcome.misses),
                          stall_ms=0.05 * len(outcome.misses))
            index.advance_token()
            file_bytes = misses * run.expert_bytes
            direct = mode == "direct"
            storage = file_bytes if direct else file_bytes // 20
            read_ms = file_bytes / (1.5e6 if direct else 12e6)
            compute_ms = 0.57 * run.moe_layers * float(jitter[token])
            stall_ms = max(0.0, read_ms - 0.5 * compute_ms)
            wall_ms = compute_ms + stall_ms + 0.2
            clock += wall_ms / 1000
            peak = max(peak, index.live_bytes)
            fields: dict[str, Any] = {
                "token": token, "wall_ms": round(wall_ms, 3), "read_ms": round(read_ms, 3),
                "stage_ms": round(file_bytes / 20e6, 3) if direct else 0.0,
                "upload_ms": round(file_bytes / 50e6, 3), "install_ms": 0.01 * misses,
                "stall_ms": round(stall_ms, 3), "compute_ms": round(compute_ms, 3),
                "hits": hits, "misses": misses, "evictions": evicted,
                "file_bytes": file_bytes, "cache_bytes": hits * run.expert_bytes,
                "storage_bytes": storage, "mode": mode,
                "ram_available_bytes": readings["ram_available_bytes"],
                "cache_live_bytes": index.live_bytes, "cache_parked_bytes": 0,
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
            _line(out, "token", clock, **fields)
            totals["hits"] += hits
            totals["misses"] += misses
            totals["evictions"] += evicted
            totals["file_bytes"] += file_bytes
            totals["cache_bytes"] += hits * run.expert_bytes
            totals["storage_bytes"] += storage
        used = totals["hits"] + totals["misses"]
        _line(out, "run_end", clock, tokens=run.tokens, elapsed_s=round(clock, 6),
              tokens_per_s=run.tokens / clock, hits=totals["hits"], misses=totals["misses"],
              hit_rate=totals["hits"] / used if used else 0.0, file_bytes=totals["file_bytes"],
              cache_bytes=totals["cache_bytes"], storage_bytes=totals["storage_bytes"],
              verified=used, mismatches=0, peak_device_bytes=peak, budget_bytes=budget,
              exit="ok")
    return {"hits": totals["hits"], "misses": totals["misses"],
            "evictions": totals["evictions"], "budget_bytes": budget}


def _timed(command: list[str]) -> tuple[float, str]:
    start = time.perf_counter()
    done = subprocess.run(command, cwd=_REPO, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise MoestreamError(f"{' '.join(command)} exited {done.returncode}: {done.stderr.strip()}")
    return seconds, done.stdout


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m bench.analyze",
        description="Time moestream-analyze on a synthetic long run log.")
    parser.add_argument("--tokens", type=int, default=100_000, help="tokens in the log")
    parser.add_argument("--layers", type=int, default=43, help="MoE layers")
    parser.add_argument("--out", type=Path, default=_REPO / "bench" / "results",
                        help="directory for analyze-<host>.json")
    args = parser.parse_args(argv)
    try:
        run = SyntheticRun(tokens=args.tokens, moe_layers=args.layers, switch_at=args.tokens // 2)
        with tempfile.TemporaryDirectory(prefix="moestream-bench-") as tmp:
            log_path = Path(tmp) / "run.jsonl"
            start = time.perf_counter()
            written = write_synthetic_log(log_path, run)
            generate_s = time.perf_counter() - start
            log_mb = log_path.stat().st_size / 1e6
            summary_cmd = [sys.executable, "-m", "tools.analyze", str(log_path)]
            # The summary is the figure with a limit (15 s): median of three, as machines
            # shared with other work swing by 2x from run to run.
            summary_runs = sorted(_timed(summary_cmd)[0] for _ in range(3))
            summary_s = summary_runs[1]
            budget = f"{written['budget_bytes']}B"
            # --target 1: no bisection for a target budget, so each command is one replay
            whatif = ["--what-if", "--budgets", budget, "--target", "1", "--jobs", "1", "--json"]
            lru_s, out = _timed([*summary_cmd, *whatif, "--policies", "lru"])
            belady_s, belady_out = _timed([*summary_cmd, *whatif, "--policies", "belady"])
        exact = json.loads(out)["what_if"][0]["exact"]
        belady_rate = json.loads(belady_out)["what_if"][0]["results"][0]["hit_rate"]
        flags = " ".join(whatif).replace(budget, "BUDGET")
        result = {
            "benchmark": "analyze",
            **provenance("bench.analyze", argv),
            "log": {"tokens": run.tokens, "moe_layers": run.moe_layers, "top_k": run.top_k,
                    "n_experts": run.n_experts, "mb": round(log_mb, 1),
                    "budget_bytes": written["budget_bytes"]},
            "seconds": {"generate": round(generate_s, 2), "analyze_summary": round(summary_s, 2),
                        "analyze_summary_runs": [round(x, 2) for x in summary_runs],
                        "what_if_lru_one_budget": round(lru_s, 2),
                        "what_if_belady_one_budget": round(belady_s, 2)},
            "timed_commands": {
                "analyze_summary": "python -m tools.analyze LOG (median of 3)",
                "what_if_lru_one_budget": f"python -m tools.analyze LOG {flags} --policies lru",
                "what_if_belady_one_budget":
                    f"python -m tools.analyze LOG {flags} --policies belady",
            },
            "what_if_exact": exact["matches"],
            "hit_rate": {"lru": exact["hit_rate"], "belady": belady_rate},
        }
    except MoestreamError as exc:
        sys.stderr.write(f"bench_analyze: {exc}\n")
        return exc.exit_code
    target = args.out / f"analyze-{result['machine']['host']}.json"
    write_result(target, result)
    sys.stdout.write(json.dumps(result["seconds"]) + f"\nwrote {target}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
