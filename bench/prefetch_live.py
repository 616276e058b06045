"""The live-router runs of the prefetch benchmark (``--live-model``, F16 experts).

The live router's ``predict`` applies layer L+1's router to the hidden state before layer L
runs; that is a measurement only with ``real`` compute, which needs F16 experts. Here: the
checks on the ``--live-model``, the compute a live run gets, a live run that records its
failure instead of ending the benchmark, the none and predict runs per mode on the live
model, and the notes on how to read them.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from gguf import GGMLQuantizationType

from bench.kit import make_resident
from bench.prefetch_figures import routing_agreement
from bench.prefetch_runs import MIB, PrefetchBench, RunSpec, exact_guesses, has_router, run_tokens
from bench.rates import token_events
from moestream.pipeline.foundation.config import ComputeSpec, Mode
from moestream.pipeline.foundation.errors import MoestreamError, UsageError
from moestream.pipeline.foundation.table import ExpertTable, open_table

__all__ = [
    "LIVE_PREFETCHES",
    "is_f16",
    "live_compute",
    "live_notes",
    "live_runs",
    "open_live_model",
    "run_live",
]

LIVE_PREFETCHES = ("none", "predict")  # the live router knows nothing ahead: no oracle


def is_f16(table: ExpertTable) -> bool:
    """Whether every layer's experts are F16 (what ``real`` compute needs)."""
    f16 = GGMLQuantizationType.F16
    return all(layer.gate_up_type == f16 and layer.down_type == f16
               for layer in table.layers.values())


def live_compute(table: ExpertTable, fixed: ComputeSpec) -> ComputeSpec:
    """Real compute where the experts are F16: only real compute changes the hidden state
    the live router reads; otherwise the benchmark's fixed compute."""
    return ComputeSpec("real") if is_f16(table) else fixed


def open_live_model(path: Path) -> ExpertTable:
    """The ``--live-model``: it must have routers, and F16 experts for real compute.

    Raises:
        UsageError: it has neither.
    """
    table = open_table(path)
    layer = next(iter(table.layers.values()))
    if not is_f16(table):
        raise UsageError(f"--live-model {path}: experts are {layer.gate_up_type.name}/"
                         f"{layer.down_type.name}; real compute needs F16 "
                         "(make one with moestream.tools.make_model --preset ds4-flash-f16)")
    if not has_router(table):
        raise UsageError(f"--live-model {path}: no router tensors (ffn_gate_inp); scale it "
                         "to more MoE layers than are hash-routed")
    return table


def run_live(bench: PrefetchBench, spec: RunSpec, compute: ComputeSpec) -> dict[str, Any]:
    """A live-router run; a failure is recorded, not fatal (it is an extra)."""
    try:
        return bench.run(spec, compute)
    except (MoestreamError, ValueError, TypeError) as exc:
        # first line only: numpy errors can carry whole arrays
        reason = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        print(f"  {spec.name}: failed with compute {compute}: {reason}", flush=True)
        bench.runs[spec.name] = {"mode": spec.mode, "prefetch": spec.prefetch,
                                 "router": "live", "model": str(bench.table.path),
                                 "compute": str(compute), "error": reason}
        return bench.runs[spec.name]


def live_runs(bench: PrefetchBench, modes: list[Mode], warmup: dict[str, Any]) -> None:
    """None and predict with the live router and real compute, per mode, on the live model."""
    table = bench.table
    for mode in modes:
        tokens, skip = run_tokens(bench.args, mode, live=True)
        print(f"live {mode} on {table.path.name} ({tokens} tokens, first {skip} left out, "
              f"compute {bench.compute}):", flush=True)
        specs = [RunSpec(mode, prefetch, tokens, skip, router="live")
                 for prefetch in LIVE_PREFETCHES]
        for spec in specs:
            if mode == "resident":
                warmup[f"before_live_{spec.prefetch}"] = make_resident(table.path)
            run_live(bench, spec, bench.compute)
        none, predict = (bench.runs[s.name] for s in specs)
        if "error" not in none and "error" not in predict:
            # like with like: both runs should route alike (real compute does not depend on
            # the cache; only the order of float sums of hits and misses can differ)
            none["routing_agreement_with_predict"] = predict["routing_agreement_with_none"] = (
                routing_agreement(*(token_events(bench.scratch / f"{s.name}.jsonl")
                                    for s in specs)))


def live_notes(args: argparse.Namespace, table: ExpertTable,
                runs: dict[str, dict[str, Any]]) -> list[str]:
    """What the live-model runs measured, and how to read them."""
    layer = next(iter(table.layers.values()))
    expert_mib = layer.expert_bytes / MIB
    guessed = len(table.moe_layers) - 1
    exact_layers = exact_guesses(table) // table.top_k
    notes = [
        f"live runs: {table.path.name} ({len(table.layers)} MoE layers x {table.n_experts} "
        f"experts, F16, {expert_mib:g} MiB an expert), compute real: the hidden state goes "
        "through each layer's SwiGLU experts, so the live router's guess of layer L+1 (its "
        "router on the hidden state before L runs) can miss; none and predict both route "
        "live, so live predict_over_none compares like with like; the live figures are not "
        "comparable with the trace runs' (another model, routing and compute)",
        "its weights are moestream.tools.make_model's random ones, routers included: the accuracy "
        "says how the guess fares on this synthetic model, not on ds4's trained weights; "
        "routing_agreement_with_none is the share of layer choices live none and live "
        "predict made alike (1.0 but for float-order ties)",
        f"live direct runs decode {args.live_direct_tokens} tokens and skip "
        f"{args.live_direct_skip_tokens}, live resident runs {args.live_tokens} and skip "
        f"{args.live_skip_tokens}: a miss reads {expert_mib:g} MiB, at disk speed in direct "
        "mode (~1.3 GB/s on the H200, where ~28 misses of 48 MiB, a ds4-flash-f16 token at "
        "this budget, take ~1 s), so direct live runs are kept short",
    ]
    if exact_layers:
        notes.append(
            f"{exact_layers} of the {guessed} layers guessed per token are hash-routed (no "
            "router: the token id picks, for the guess as for the routing): their guesses "
            "are right by construction; predict_router_layer_accuracy leaves them out")
    failed = {n: r["error"] for n, r in runs.items() if r["router"] == "live" and "error" in r}
    if failed:
        notes.append("live runs failed: " + "; ".join(f"{n}: {e}" for n, e in failed.items()))
    return notes
