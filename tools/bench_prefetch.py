"""``python -m tools.bench_prefetch``: next-layer prefetch against no prefetch and the oracle.

One model (scaled ``ds4-flash-q2``), the calibrated synthetic routing that ``pipeline.run``
makes from its seed (preset ``ds4-flash``), a cache budget of ~15% of each layer's experts
and fixed per-layer compute (0.57 ms, ds4 on an H200). For each I/O mode (``--modes``) it
decodes once with each prefetch:

- ``none``: a layer's misses start when the layer is routed;
- ``predict``: while layer L computes, load the experts L+1 is guessed to pick (with trace
  routing the guess is the previous token's choice at L+1);
- ``oracle``: start the loads of the next ``--lookahead`` layers from the routing itself,
  which a trace knows ahead: the upper bound of what prefetch can win.

Live routing (``--router live``): the model's routers on the hidden state; its ``predict``
applies layer L+1's router to the hidden state before layer L runs (the Mixtral-offloading
technique). That guess is a measurement only when the hidden state changes from layer to
layer, which needs ``real`` compute (SwiGLU), which needs F16 experts:

- ``--live-model PATH`` (F16 experts and routers, e.g. a scaled ``ds4-flash-f16``): for each
  mode of ``--live-modes`` it decodes that model with the live router and real compute
  twice, ``none`` and ``predict``, at the same share of each layer's experts; live predict
  over live none, its accuracy and wasted bytes come from real hidden states.
  ``--live-only`` runs only these.
- without it, when the benchmark model has routers, ``predict`` runs once with the live
  router on that model (resident mode, else the first mode), with real compute if its
  experts are F16, else the fixed compute. With fixed compute the hidden state is the
  token embedding at every layer, so the guess is exact by construction: the run is kept,
  its accuracy is not reported as a figure.

Resident runs start with the file in the page cache (read once with ``WarmEngine``); direct
runs need nothing (O_DIRECT bypasses the page cache). Direct runs decode ``--direct-tokens``
(fewer: they run at disk speed), resident runs ``--tokens``, and live-model runs
``--live-direct-tokens`` and ``--live-tokens``; the first tokens of each run (the matching
``--*skip-tokens``) are left out of the figures (cold start).
Figures come from the runs' JSON-lines logs: per run tokens/s, hit rate, stall ms per token,
how many guessed experts were loaded (a guess already cached loads nothing; see
``guess_loads``) and, for ``predict``, accuracy (correct / predicted) and wasted bytes; per
mode the speed-up of predict and oracle over none and the share of the oracle's gain that
predict reaches; per live mode live predict over live none.

The result goes to ``bench/results/prefetch-HOST.json`` with machine, commit and command.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import uvloop
from gguf import GGMLQuantizationType

from pipeline.config import ComputeSpec, Mode, RunConfig
from pipeline.errors import MoestreamError, UsageError
from pipeline.logs import configure_console
from pipeline.machine import machine_info
from pipeline.run import RunSummary, run
from pipeline.table import ExpertTable, open_table
from tools.bench import token_events, window_rate
from tools.benchkit import budget_for, make_resident
from tools.results import git_commit, write_result

__all__ = [
    "RunSpec",
    "gain_figures",
    "guess_loads",
    "main",
    "prefetch_figures",
    "routing_agreement",
]

PROG = "bench_prefetch"
PREFETCHES = ("none", "predict", "oracle")
LIVE_PREFETCHES = ("none", "predict")  # the live router knows nothing ahead: no oracle
MIB = 1 << 20
# A gain below this share of the baseline's tokens/s is noise: no share of it is reported.
_MIN_GAIN_SHARE = 0.01


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


def prefetch_figures(events: Sequence[dict[str, Any]],
                     exact_per_token: int = 0) -> dict[str, Any] | None:
    """Accuracy, guesses loaded and waste of ``predict`` over token events; None when none
    carry them.

    Args:
        events: token events.
        exact_per_token: guesses per token that are right by construction (the live
            router's hash-routed layers pick from the token id, as their guess does); with
            any, ``router_layer_accuracy`` is the accuracy of the others alone.
    """
    stats = [e["prefetch"] for e in events if "prefetch" in e]
    if not stats:
        return None
    predicted = sum(s["predicted"] for s in stats)
    correct = sum(s["correct"] for s in stats)
    wasted = sum(s["wasted_bytes"] for s in stats)
    out: dict[str, Any] = {
        "predicted": predicted,
        "correct": correct,
        "accuracy": round(correct / predicted, 4) if predicted else None,
        "wasted_bytes": wasted,
        "wasted_bytes_per_token": round(wasted / len(stats), 1),
    }
    if all("loaded" in s for s in stats):  # logs from before the field lack it
        out["loaded"] = sum(s["loaded"] for s in stats)
        out["loaded_per_token"] = round(out["loaded"] / len(stats), 2)
    if exact_per_token:
        exact = exact_per_token * len(stats)
        out["router_layer_accuracy"] = (round((correct - exact) / (predicted - exact), 4)
                                        if predicted > exact else None)
    return out


def guess_loads(events: Sequence[dict[str, Any]], summary: dict[str, Any],
                expert_bytes: int | None, *, counts_installs: bool) -> dict[str, Any]:
    """How many guessed experts a run loaded; a guess already in the cache loads nothing.

    Token events count them (``prefetch.loaded``); logs written before they did are read
    through the run's totals: with install checks on (and compute other than ``digest``,
    whose checks also count) every expert installed, a layer's miss or a guess, is checked
    once, so ``verified + mismatches - misses`` are the guesses loaded, bar the last layer's
    wrong guesses still loading when the run ended. That count is kept as a cross-check
    (``installs_beyond_misses``: 0 without prediction). Of the loaded guesses, wasted bytes
    over the expert's device bytes were never used.

    Args:
        events: every token event of the run (skipped tokens too).
        summary: the run's ``RunSummary.as_dict()``.
        expert_bytes: one expert's device bytes (None when layers differ).
        counts_installs: whether ``verified`` counts installs (see above).
    """
    stats = [e["prefetch"] for e in events if "prefetch" in e]
    wasted_bytes = sum(s["wasted_bytes"] for s in stats)
    wasted = wasted_bytes // expert_bytes if expert_bytes else None
    derived = (summary["verified"] + summary["mismatches"] - summary["misses"]
               if counts_installs else None)
    loaded: int | None
    if not stats:
        loaded, source = 0, "no prediction"
    elif all("loaded" in s for s in stats):
        loaded, source = sum(s["loaded"] for s in stats), "token events (prefetch.loaded)"
    elif derived is not None:
        loaded, source = max(0, derived), "run_end: verified + mismatches - misses"
    else:
        loaded, source = None, "not logged (no prefetch.loaded, and --no-verify)"
    return {
        "loaded": loaded,
        "used": None if loaded is None or wasted is None else max(0, loaded - wasted),
        "wasted": wasted,
        "loaded_per_token": (round(loaded / len(events), 2)
                             if loaded is not None and events else None),
        "source": source,
        "installs_beyond_misses": derived,
    }


def _device_expert_bytes(log: Path) -> int | None:
    """One expert's device bytes from the run's header; None when layers differ."""
    with log.open() as f:
        for line in f:
            event = json.loads(line)
            if event.get("event") == "run_start":
                sizes = set(event["model"]["expert_bytes"])
                return sizes.pop() if len(sizes) == 1 else None
    return None


def routing_agreement(a: Sequence[dict[str, Any]], b: Sequence[dict[str, Any]]) -> float | None:
    """Share of (token, layer) choices two runs' token events agree on (as sets of experts);
    None when they share no token."""
    by_token = {e["token"]: e["experts"] for e in b}
    pairs = [(x, y) for e in a if e["token"] in by_token
             for x, y in zip(e["experts"], by_token[e["token"]], strict=True)]
    if not pairs:
        return None
    return round(sum(set(x) == set(y) for x, y in pairs) / len(pairs), 4)


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b > 0 else None


def gain_figures(runs: dict[str, dict[str, Any]], suffix: str = "") -> dict[str, Any]:
    """Per mode, from runs named ``MODE_PREFETCH`` + ``suffix``: predict and oracle over none,
    and the share of the oracle's gain that predict reaches (None when the oracle gains
    nothing)."""
    out: dict[str, Any] = {}
    for mode in dict.fromkeys(r["mode"] for r in runs.values()):
        tps = {p: runs[f"{mode}_{p}{suffix}"]["tokens_per_s"] for p in PREFETCHES
               if f"{mode}_{p}{suffix}" in runs}
        fig: dict[str, Any] = {}
        none = tps.get("none", 0.0)
        if "predict" in tps:
            fig["predict_over_none"] = _ratio(tps["predict"], none)
        if "oracle" in tps:
            fig["oracle_over_none"] = _ratio(tps["oracle"], none)
        if {"none", "predict", "oracle"} <= tps.keys():
            gain = tps["oracle"] - none
            fig["share_of_oracle_gain"] = (
                round((tps["predict"] - none) / gain, 3)
                if none > 0 and gain > _MIN_GAIN_SHARE * none else None)
        predict = runs.get(f"{mode}_predict{suffix}", {})
        if {"none", "predict"} <= tps.keys():
            # misses the guesses turned into hits; ~0 when the guesses were already cached
            fig["predict_hit_rate_gain"] = round(predict["hit_rate"]
                                                 - runs[f"{mode}_none{suffix}"]["hit_rate"], 4)
        pf = predict.get("prefetch_stats")
        if pf is not None:
            fig["predict_accuracy"] = pf["accuracy"]
            if "router_layer_accuracy" in pf:
                fig["predict_router_layer_accuracy"] = pf["router_layer_accuracy"]
            fig["predict_wasted_bytes_per_token"] = pf["wasted_bytes_per_token"]
        if "routing_agreement_with_none" in predict:
            fig["routing_agreement_with_none"] = predict["routing_agreement_with_none"]
        if pf is not None and "loaded_per_token" in pf:
            fig["predict_guesses_loaded_per_token"] = pf["loaded_per_token"]
        out[mode] = fig
    return out


def _exact_guesses(table: ExpertTable) -> int:
    """Live guesses per token that are right by construction: those of hash-routed layers
    (no router: the token id picks, for the guess as for the routing). Layer 0 is never
    guessed."""
    return table.top_k * sum(table.layers[n].router is None for n in table.moe_layers[1:])


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
                events, _exact_guesses(self.table) if live else 0),
            "run_wasted_bytes": sum(e.get("prefetch", {}).get("wasted_bytes", 0)
                                    for e in every),
            "guesses_loaded": guess_loads(
                every, summary.as_dict(), _device_expert_bytes(log),
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


def _has_router(table: ExpertTable) -> bool:
    return any(table.layers[n].router is not None for n in table.moe_layers)


def _is_f16(table: ExpertTable) -> bool:
    f16 = GGMLQuantizationType.F16
    return all(layer.gate_up_type == f16 and layer.down_type == f16
               for layer in table.layers.values())


def _live_compute(table: ExpertTable, fixed: ComputeSpec) -> ComputeSpec:
    """Real compute where the experts are F16: only real compute changes the hidden state
    the live router reads; otherwise the benchmark's fixed compute."""
    return ComputeSpec("real") if _is_f16(table) else fixed


def _open_live_model(path: Path) -> ExpertTable:
    """The ``--live-model``: it must have routers, and F16 experts for real compute.

    Raises:
        UsageError: it has neither.
    """
    table = open_table(path)
    layer = next(iter(table.layers.values()))
    if not _is_f16(table):
        raise UsageError(f"--live-model {path}: experts are {layer.gate_up_type.name}/"
                         f"{layer.down_type.name}; real compute needs F16 "
                         "(make one with tools.make_model --preset ds4-flash-f16)")
    if not _has_router(table):
        raise UsageError(f"--live-model {path}: no router tensors (ffn_gate_inp); scale it "
                         "to more MoE layers than are hash-routed")
    return table


def _run_live(bench: PrefetchBench, spec: RunSpec, compute: ComputeSpec) -> dict[str, Any]:
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


def _live_notes(args: argparse.Namespace, table: ExpertTable,
                runs: dict[str, dict[str, Any]]) -> list[str]:
    """What the live-model runs measured, and how to read them."""
    layer = next(iter(table.layers.values()))
    expert_mib = layer.expert_bytes / MIB
    guessed = len(table.moe_layers) - 1
    exact_layers = _exact_guesses(table) // table.top_k
    notes = [
        f"live runs: {table.path.name} ({len(table.layers)} MoE layers x {table.n_experts} "
        f"experts, F16, {expert_mib:g} MiB an expert), compute real: the hidden state goes "
        "through each layer's SwiGLU experts, so the live router's guess of layer L+1 (its "
        "router on the hidden state before L runs) can miss; none and predict both route "
        "live, so live predict_over_none compares like with like; the live figures are not "
        "comparable with the trace runs' (another model, routing and compute)",
        "its weights are tools.make_model's random ones, routers included: the accuracy "
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


def _notes(args: argparse.Namespace, runs: dict[str, dict[str, Any]],
           live_table: ExpertTable | None, trace_live: dict[str, Any] | None) -> list[str]:
    notes: list[str] = []
    if args.live_only:
        notes.append("--live-only: no trace-routed runs")
    else:
        notes += [
            f"compute fixed:{args.layer_ms} ms per layer: the decoder keeps no hidden state, "
            "so routing is the calibrated synthetic trace and predict guesses layer L+1 from "
            "the previous token's choice at L+1 (TraceRouting.predict)",
            "those guesses are mostly experts the cache still holds from the previous token, "
            "and only absent guesses are loaded: predict_hit_rate_gain (predict's hit rate "
            "minus none's), wasted bytes and guesses loaded near 0 mean predict loaded next "
            "to nothing",
            "oracle runs' token events carry no prefetch field: accuracy is reported for "
            "predict only; a prefetched expert still in flight when its layer runs counts as "
            "a hit",
            f"direct runs decode {args.direct_tokens} tokens and skip "
            f"{args.direct_skip_tokens}, resident runs {args.tokens} and skip "
            f"{args.skip_tokens}: compare runs within a mode",
        ]
    notes.append("before each resident run the file was read into the page cache "
                 "(WarmEngine); direct runs read with O_DIRECT and had nothing done before them")
    notes.append(
        "guesses loaded: a guess already cached loads nothing; prefetch_stats.loaded counts "
        "the others over the figures' tokens, guesses_loaded over all of a run's tokens "
        "(its source says where from: token events' prefetch.loaded, or for logs without "
        "it run_end verified + mismatches - misses), split into used and wasted (wasted "
        "bytes / expert device bytes); installs_beyond_misses is that run_end count, a "
        "cross-check (0 for none and oracle)")
    if args.no_live:
        notes.append("no live-router run: --no-live")
    elif live_table is not None:
        notes += _live_notes(args, live_table, runs)
    elif trace_live is None:
        notes.append("no live-router run: the model has no router tensors (ffn_gate_inp)")
    elif "error" in trace_live:
        notes.append(f"the live-router run failed with compute {trace_live['compute']} "
                     f"({trace_live['error']}): the live router needs a hidden state, which "
                     "only real compute on F16 experts changes layer by layer; pass "
                     "--live-model with an F16 model")
    elif trace_live["exact_by_construction"]:
        notes.append(
            f"live-router predict ran with compute {trace_live['compute']} on the model's own "
            "routing: with fixed compute the hidden state is the token embedding at every "
            "layer, so the guess of layer L+1 (its router on that vector) is its routing: "
            "exact by construction, not a measurement of prediction; its accuracy is not "
            "reported as a figure (--live-model with an F16 model measures it); its tokens/s "
            "is not comparable with the trace runs'")
    else:
        notes.append(f"live-router predict ran with compute {trace_live['compute']} on the "
                     "model's own routing: its tokens/s is not comparable with the trace "
                     "runs'")
    return notes


def _print_table(runs: dict[str, dict[str, Any]], figures: dict[str, Any]) -> None:
    print(f"\n{'run':<24} {'tok/s':>8} {'hit rate':>8} {'stall ms/tok':>12} "
          f"{'accuracy':>8} {'wasted MiB/tok':>14} {'loads/tok':>9}")
    for name, r in runs.items():
        if "error" in r:
            print(f"{name:<24} failed: {r['error'][:60]}")
            continue
        pf = r["prefetch_stats"] or {}
        acc = f"{pf['accuracy']:.3f}" if pf.get("accuracy") is not None else "-"
        if r.get("exact_by_construction"):
            acc = "exact"
        waste = f"{pf['wasted_bytes_per_token'] / MIB:.2f}" if pf else "-"
        loads = f"{pf['loaded_per_token']:.2f}" if "loaded_per_token" in pf else "-"
        print(f"{name:<24} {r['tokens_per_s']:>8.2f} {r['hit_rate']:>8.3f} "
              f"{r['stall_ms_per_token']:>12.2f} {acc:>8} {waste:>14} {loads:>9}")
    for key, fig in figures.items():
        groups = ({f"live {m}": f for m, f in fig.items()} if key == "live"
                  else {key: fig} if isinstance(fig, dict) else {})
        for label, values in groups.items():
            print(f"{label}: " + ", ".join(f"{k} {v}" for k, v in values.items()))
    print(f"budget never exceeded: {figures['budget_never_exceeded']}")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tools.bench_prefetch",
                                description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path,
                   help="GGUF model (ds4-flash-q2 shaped, e.g. 20 layers x 256 experts); "
                   "required unless --live-only")
    p.add_argument("--backend", default="auto", choices=["auto", "host", "cupy"])
    p.add_argument("--modes", default="direct,resident", help="I/O modes (direct,resident)")
    p.add_argument("--tokens", type=int, default=96, help="tokens per resident run (96)")
    p.add_argument("--skip-tokens", type=int, default=8,
                   help="first tokens of a resident run left out of the figures (8)")
    p.add_argument("--direct-tokens", type=int, default=24,
                   help="tokens per direct run (24: they run at disk speed)")
    p.add_argument("--direct-skip-tokens", type=int, default=4,
                   help="first tokens of a direct run left out of the figures (4)")
    p.add_argument("--layer-ms", type=float, default=0.57, help="fixed compute per layer (0.57)")
    p.add_argument("--lookahead", type=int, default=2, help="oracle prefetch depth (2)")
    p.add_argument("--budget-share", type=float, default=0.15,
                   help="cache budget as a share of each layer's experts (0.15)")
    p.add_argument("--seed", type=int, default=0, help="synthetic routing seed (0)")
    p.add_argument("--live-model", type=Path,
                   help="F16 model with routers (e.g. scaled ds4-flash-f16): live-router none "
                   "and predict runs on it with real compute")
    p.add_argument("--live-modes", default="direct,resident",
                   help="I/O modes of the --live-model runs (direct,resident)")
    p.add_argument("--live-tokens", type=int, default=64,
                   help="tokens per resident --live-model run (64)")
    p.add_argument("--live-skip-tokens", type=int, default=8,
                   help="first tokens of a resident --live-model run left out (8)")
    p.add_argument("--live-direct-tokens", type=int, default=12,
                   help="tokens per direct --live-model run (12: F16 misses read 48 MiB "
                   "each at disk speed)")
    p.add_argument("--live-direct-skip-tokens", type=int, default=2,
                   help="first tokens of a direct --live-model run left out (2)")
    p.add_argument("--live-only", action="store_true",
                   help="only the --live-model runs (no trace-routed runs, no --model)")
    p.add_argument("--no-live", action="store_true", help="skip every live-router run")
    p.add_argument("--no-verify", action="store_true",
                   help="skip install digests (the host backend computes them on the CPU)")
    p.add_argument("--out", type=Path,
                   help="result JSON (default bench/results/prefetch-HOST.json)")
    p.add_argument("--debug", action="store_true", help="debug events and tracebacks")
    return p


def _modes(text: str, option: str) -> list[Mode]:
    modes = [m for m in text.split(",") if m]
    bad = [m for m in modes if m not in ("direct", "resident")]
    if not modes or bad:
        raise UsageError(f"{option} takes direct and/or resident, not {text!r}")
    return modes  # type: ignore[return-value]  # checked just above


def _check(args: argparse.Namespace) -> tuple[list[Mode], list[Mode]]:
    """The trace and live modes, once every option is checked."""
    modes = _modes(args.modes, "--modes")
    live_modes = _modes(args.live_modes, "--live-modes")
    if args.live_only and (args.live_model is None or args.no_live):
        raise UsageError("--live-only needs --live-model (and no --no-live)")
    if args.model is None and not args.live_only:
        raise UsageError("--model is required (unless --live-only)")
    for tokens, skip, what in (
            (args.tokens, args.skip_tokens, "--tokens"),
            (args.direct_tokens, args.direct_skip_tokens, "--direct-tokens"),
            (args.live_tokens, args.live_skip_tokens, "--live-tokens"),
            (args.live_direct_tokens, args.live_direct_skip_tokens, "--live-direct-tokens")):
        if skip < 0 or tokens <= skip:
            raise UsageError(f"{what} {tokens} leaves no token after skipping {skip}")
    if args.lookahead < 1:
        raise UsageError(f"--lookahead must be >= 1, not {args.lookahead}")
    if not 0 < args.budget_share <= 1:
        raise UsageError(f"--budget-share must be in (0, 1], not {args.budget_share}")
    return modes, live_modes


def _model_info(table: ExpertTable) -> dict[str, Any]:
    layer = next(iter(table.layers.values()))
    return {"path": str(table.path), "file_bytes": table.file_bytes,
            "layers": len(table.layers), "experts": table.n_experts, "top_k": table.top_k,
            "routers": _has_router(table), "expert_bytes": layer.expert_bytes,
            "expert_types": f"{layer.gate_up_type.name}/{layer.down_type.name}"}


def _tokens(args: argparse.Namespace, mode: Mode, live: bool) -> tuple[int, int]:
    if live:
        return ((args.live_tokens, args.live_skip_tokens) if mode == "resident"
                else (args.live_direct_tokens, args.live_direct_skip_tokens))
    return ((args.tokens, args.skip_tokens) if mode == "resident"
            else (args.direct_tokens, args.direct_skip_tokens))


def _trace_runs(bench: PrefetchBench, modes: list[Mode], warmup: dict[str, Any],
                live: bool) -> dict[str, Any] | None:
    """Every trace-routed run, and (``live``) the live-router predict run on the same model,
    which it returns."""
    args, table = bench.args, bench.table
    live_mode: Mode = "resident" if "resident" in modes else modes[0]
    trace_live: dict[str, Any] | None = None
    for mode in modes:
        tokens, skip = _tokens(args, mode, live=False)
        print(f"{mode} ({tokens} tokens, first {skip} left out):", flush=True)
        for prefetch in PREFETCHES:
            if mode == "resident":
                warmup[f"before_{prefetch}"] = make_resident(table.path)
            lookahead = args.lookahead if prefetch == "oracle" else 1
            bench.run(RunSpec(mode, prefetch, tokens, skip, lookahead))
        if mode == live_mode and live:
            if mode == "resident":
                warmup["before_live"] = make_resident(table.path)
            trace_live = _run_live(bench, RunSpec(mode, "predict", tokens, skip, router="live"),
                                   _live_compute(table, bench.compute))
    return trace_live


def _live_runs(bench: PrefetchBench, modes: list[Mode], warmup: dict[str, Any]) -> None:
    """None and predict with the live router and real compute, per mode, on the live model."""
    table = bench.table
    for mode in modes:
        tokens, skip = _tokens(bench.args, mode, live=True)
        print(f"live {mode} on {table.path.name} ({tokens} tokens, first {skip} left out, "
              f"compute {bench.compute}):", flush=True)
        specs = [RunSpec(mode, prefetch, tokens, skip, router="live")
                 for prefetch in LIVE_PREFETCHES]
        for spec in specs:
            if mode == "resident":
                warmup[f"before_live_{spec.prefetch}"] = make_resident(table.path)
            _run_live(bench, spec, bench.compute)
        none, predict = (bench.runs[s.name] for s in specs)
        if "error" not in none and "error" not in predict:
            # like with like: both runs should route alike (real compute does not depend on
            # the cache; only the order of float sums of hits and misses can differ)
            none["routing_agreement_with_predict"] = predict["routing_agreement_with_none"] = (
                routing_agreement(*(token_events(bench.scratch / f"{s.name}.jsonl")
                                    for s in specs)))


def _bench(args: argparse.Namespace, argv: Sequence[str]) -> int:
    modes, live_modes = _check(args)
    table = None if args.live_only else open_table(args.model)
    live_table = (_open_live_model(args.live_model)
                  if args.live_model is not None and not args.no_live else None)
    first = table or live_table
    assert first is not None  # _check: --model, or --live-only with --live-model
    result: dict[str, Any] = {
        "machine": {"host": platform.node(), "python": sys.version.split()[0],
                    **machine_info(first.path, None),
                    "ram_available_bytes": psutil.virtual_memory().available},
        "commit": git_commit(),
        "command": "python -m tools.bench_prefetch " + " ".join(argv),
        "model": _model_info(table) if table is not None else None,
        "live_model": _model_info(live_table) if live_table is not None else None,
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "warmup": {},
    }
    runs: dict[str, dict[str, Any]] = {}
    trace_live: dict[str, Any] | None = None
    with tempfile.TemporaryDirectory(prefix="moestream-prefetch-") as tmp:
        if table is not None:
            bench = PrefetchBench(args, table, Path(tmp) / "trace")
            result["budget"] = str(bench.budget)
            # the trace model's own live run only when no live model measures it better
            own_live = live_table is None and _has_router(table) and not args.no_live
            trace_live = _trace_runs(bench, modes, result["warmup"], own_live)
            runs.update(bench.runs)
        if live_table is not None:
            live_bench = PrefetchBench(args, live_table, Path(tmp) / "live", ComputeSpec("real"))
            result["live_budget"] = str(live_bench.budget)
            _live_runs(live_bench, live_modes, result["warmup"])
            runs.update(live_bench.runs)
    trace_runs = {n: r for n, r in runs.items() if r["router"] == "trace"}
    figures: dict[str, Any] = gain_figures(trace_runs)
    if live_table is not None:
        figures["live"] = gain_figures({n: r for n, r in runs.items()
                                        if r["router"] == "live" and "error" not in r}, "_live")
    elif trace_live is not None and "error" not in trace_live:
        fig = {"mode": trace_live["mode"], "tokens_per_s": trace_live["tokens_per_s"],
               "compute": trace_live["compute"]}
        if trace_live["exact_by_construction"]:
            fig["exact_by_construction"] = True  # its accuracy (1.0) measures nothing
        else:
            fig["accuracy"] = (trace_live["prefetch_stats"] or {}).get("accuracy")
        figures["live_predict"] = fig
    figures["budget_never_exceeded"] = all(r.get("budget_ok", True) for r in runs.values())
    result["machine"]["device"] = next((r["summary"]["device"] for r in runs.values()
                                        if "summary" in r), None)
    result["runs"] = runs
    result["figures"] = figures
    result["notes"] = _notes(args, runs, live_table, trace_live)
    out = args.out or Path("bench/results") / f"prefetch-{platform.node()}.json"
    write_result(out, result)
    _print_table(runs, figures)
    print(f"written: {out}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point; returns the exit code (2 for bad input)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    configure_console(debug=args.debug)
    try:
        return _bench(args, argv)
    except MoestreamError as exc:
        if args.debug:
            raise
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
