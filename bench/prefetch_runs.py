"""One decode of the prefetch benchmark with a log, and the figures read from it.

``RunSpec`` says what to decode (I/O mode, prefetch, routing, token counts);
``PrefetchBench`` holds the model, the cache budget and the scratch directory, decodes each
spec with ``pipeline.cli.run`` and keeps its figures (``bench.prefetch_figures``) by run name.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvloop

from bench.kit import budget_for
from bench.prefetch_figures import device_expert_bytes, guess_loads, prefetch_figures
from bench.rates import token_events, window_rate
from moestream.pipeline.cli.run import RunSummary, run
from moestream.pipeline.foundation.config import ComputeSpec, Mode
from moestream.pipeline.foundation.table import ExpertTable
from moestream.pipeline.proxy.config import RunConfig

__all__ = ["MIB", "PrefetchBench", "RunSpec", "exact_guesses", "has_router", "run_tokens"]

MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class RunSpec:
    """One decode of the benchmark: its I/O mode, prefetch, routing and token counts."""

    mode: Mode
    prefetch: str
    tokens: int
    skip: int
    lookahead: int = 1
    router: str = "trace"

    @property
    def name(self) -> str:
        return f"{self.mode}_{self.prefetch}" + ("_live" if self.router == "live" else "")


def has_router(table: ExpertTable) -> bool:
    """Whether any MoE layer of the model has a router (``ffn_gate_inp``)."""
    return any(table.layers[n].router is not None for n in table.moe_layers)


def exact_guesses(table: ExpertTable) -> int:
    """Live guesses per token that are right by construction: those of hash-routed layers
    (no router: the token id picks, for the guess as for the routing). Layer 0 is never
    guessed."""
    return table.top_k * sum(table.layers[n].router is None for n in table.moe_layers[1:])


def run_tokens(args: argparse.Namespace, mode: Mode, live: bool) -> tuple[int, int]:
    """Tokens to decode and tokens to leave out of the figures, for a run in ``mode``
    (``live``: on the ``--live-model``), from the command line."""
    if live:
        return ((args.live_tokens, args.live_skip_tokens) if mode == "resident"
                else (args.live_direct_tokens, args.live_direct_skip_tokens))
    return ((args.tokens, args.skip_tokens) if mode == "resident"
            else (args.direct_tokens, args.direct_skip_tokens))


class PrefetchBench:
    """The model, the budget, the scratch directory and the runs done so far.

    Args:
        args: the command line.
        table: the model.
        scratch: where the run logs go (made if absent).
        compute: the runs' compute (default: fixed ``--layer-ms`` per layer).
    """

    def __init__(self, args: argparse.Namespace, table: ExpertTable, scratch: Path,
                 compute: ComputeSpec | None = None) -> None:
        self.args = args
        self.table = table
        self.scratch = scratch
        scratch.mkdir(parents=True, exist_ok=True)
        self.budget = budget_for(table, args.budget_share)
        self.compute = compute or ComputeSpec("fixed", args.layer_ms)
        self.runs: dict[str, dict[str, Any]] = {}

    def run(self, spec: RunSpec, compute: ComputeSpec | None = None) -> dict[str, Any]:
        """Decode ``spec`` with a log; returns (and keeps) its figures."""
        compute = compute or self.compute
        log = self.scratch / f"{spec.name}.jsonl"
        cfg = RunConfig(
            model=self.table.path, tokens=spec.tokens, mode=spec.mode, budget=self.budget,
            compute=compute, backend=self.args.backend, queue_depth=16, chunk_bytes=1 * MIB,
            staging_slots=32, upload_streams=4, prefetch=spec.prefetch,
            lookahead=spec.lookahead, router=spec.router, seed=self.args.seed, log=log,
            verify=not self.args.no_verify,
        )
        t0 = time.perf_counter()
        summary: RunSummary = uvloop.run(run(cfg))
        seconds = time.perf_counter() - t0
        every = token_events(log)
        events = [e for e in every if e["token"] >= spec.skip]
        window = {k: round(v, 4) if isinstance(v, float) else v
                  for k, v in window_rate(events).items()}
        live = spec.router == "live"
        figures = {
            "mode": spec.mode, "prefetch": spec.prefetch, "router": spec.router,
            "model": str(self.table.path),
            "lookahead": spec.lookahead if spec.prefetch == "oracle" else None,
            "compute": str(compute), "skipped_tokens": spec.skip, **window,
            "prefetch_stats": prefetch_figures(
                events, exact_guesses(self.table) if live else 0),
            "run_wasted_bytes": sum(e.get("prefetch", {}).get("wasted_bytes", 0)
                                    for e in every),
            "guesses_loaded": guess_loads(
                every, summary.as_dict(), device_expert_bytes(log),
                counts_installs=not self.args.no_verify and compute.kind != "digest"),
            "budget_ok": summary.peak_device_bytes <= summary.budget_bytes,
            "seconds": round(seconds, 2), "summary": summary.as_dict(),
        }
        if live:
            # fixed compute never changes the hidden state: L+1's router sees what L's saw
            figures["exact_by_construction"] = compute.kind != "real"
        self.runs[spec.name] = figures
        pf = figures["prefetch_stats"]
        acc = f", accuracy {pf['accuracy']}" if pf else ""
        guesses = f", {pf['loaded']} guesses loaded" if pf and "loaded" in pf else ""
        print(f"  {spec.name}: {window['tokens_per_s']:.2f} tok/s, hit rate "
              f"{window['hit_rate']:.3f}, stall {window['stall_ms_per_token']:.1f} ms/token"
              f"{acc}{guesses}, {seconds:.1f} s", flush=True)
        return figures
