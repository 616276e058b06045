"""``python -m bench.log``: what the per-token log costs at the default level.

Runs the same decode with and without ``--log`` in alternation (so drift in the machine
affects both alike) and reports the median tokens/s of each and the overhead. Results go to
``bench/results/logging-HOST.json``.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import uvloop

from bench.kit import exit_with
from bench.record import provenance, write_result
from moestream.pipeline.cli.run import run
from moestream.pipeline.foundation.config import Budget, ComputeSpec
from moestream.pipeline.proxy.config import RunConfig

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.log", description=__doc__)
    p.add_argument("--model", type=Path, help="GGUF model (default: the tiny model)")
    p.add_argument("--tokens", type=int, default=400)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--compute", default="fixed:0.57")
    p.add_argument("--budget", type=int, default=80, help="cache budget in experts")
    p.add_argument("--backend", default="auto")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    from moestream.pipeline.foundation.config import parse_compute

    compute: ComputeSpec = parse_compute(args.compute)
    rates: dict[str, list[float]] = {"no_log": [], "log": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name in ("no_log", "log"):
                cfg = RunConfig(model=args.model, tokens=args.tokens, compute=compute,
                                budget=Budget(experts=args.budget), backend=args.backend,
                                log=Path(tmp) / f"{r}.jsonl" if name == "log" else None)
                rates[name].append(uvloop.run(run(cfg)).tokens_per_s)
    med = {k: statistics.median(v) for k, v in rates.items()}
    overhead = 1.0 - med["log"] / med["no_log"]
    emit_us = _emit_cost_us(args.model)
    token_us = 1e6 / med["no_log"]
    result = {
        **provenance("bench.log", argv),
        "tokens_per_s": rates,
        "median_tokens_per_s": med,
        "log_overhead": round(overhead, 4),
        "emit_us_per_token": round(emit_us, 2),
        "emit_share_of_token_time": round(emit_us / token_us, 4),
    }
    out = args.out or Path("bench/results") / f"logging-{platform.node()}.json"
    write_result(out, result)
    print(f"median tok/s: no log {med['no_log']:.2f}, log {med['log']:.2f}; "
          f"A/B overhead {overhead * 100:.2f}%; rendering a token event {emit_us:.1f} us = "
          f"{emit_us / token_us * 100:.2f}% of a token  -> {out}")
    return 0


def _emit_cost_us(model: Path | None, n: int = 5000) -> float:
    """Microseconds to render one token event of this model's shape (the A/B ratio is noisy
    on a shared machine; this is the deterministic part of the cost)."""
    from moestream.pipeline.foundation.table import open_table
    from moestream.pipeline.makers.modelgen import ensure_default_model
    from moestream.pipeline.runlog.write import RunLog

    table = open_table(model or ensure_default_model())
    experts = [list(range(table.top_k)) for _ in table.moe_layers]
    with tempfile.TemporaryDirectory() as tmp:
        log = RunLog(Path(tmp) / "x.jsonl")
        t0 = time.perf_counter()
        for i in range(n):
            log.emit("token", token=i, wall_ms=12.345, read_ms=1.0, stage_ms=0.0,
                     upload_ms=1.0, install_ms=0.1, stall_ms=0.5, compute_ms=2.0, hits=10,
                     misses=10, evictions=3, file_bytes=123456789, cache_bytes=123456789,
                     storage_bytes=0, mode="resident", ram_available_bytes=123456789012,
                     cache_live_bytes=12345678901, cache_parked_bytes=0, experts=experts)
        return (time.perf_counter() - t0) / n * 1e6


if __name__ == "__main__":
    exit_with("python -m bench.log", main)
