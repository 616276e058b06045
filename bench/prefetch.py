"""``python -m bench.prefetch``: next-layer prefetch against no prefetch and the oracle.

One model (scaled ``ds4-flash-q2``), the calibrated synthetic routing that ``pipeline.cli.run``
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
import platform
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.kit import make_resident, parse_modes, run_command
from bench.prefetch_figures import PREFETCHES, gain_figures
from bench.prefetch_live import live_compute, live_notes, live_runs, open_live_model, run_live
from bench.prefetch_runs import MIB, PrefetchBench, RunSpec, has_router, run_tokens
from bench.record import provenance, write_result
from moestream.pipeline.foundation.config import ComputeSpec, Mode
from moestream.pipeline.foundation.errors import UsageError
from moestream.pipeline.foundation.machine import machine_info
from moestream.pipeline.foundation.table import ExpertTable, open_table

__all__ = ["main"]

PROG = "bench_prefetch"


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
        notes += live_notes(args, live_table, runs)
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
    p = argparse.ArgumentParser(prog="python -m bench.prefetch",
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


def _check(args: argparse.Namespace) -> tuple[list[Mode], list[Mode]]:
    """The trace and live modes, once every option is checked."""
    modes = parse_modes(args.modes)
    live_modes = parse_modes(args.live_modes, "--live-modes")
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
            "routers": has_router(table), "expert_bytes": layer.expert_bytes,
            "expert_types": f"{layer.gate_up_type.name}/{layer.down_type.name}"}


def _trace_runs(bench: PrefetchBench, modes: list[Mode], warmup: dict[str, Any],
                live: bool) -> dict[str, Any] | None:
    """Every trace-routed run, and (``live``) the live-router predict run on the same model,
    which it returns."""
    args, table = bench.args, bench.table
    live_mode: Mode = "resident" if "resident" in modes else modes[0]
    trace_live: dict[str, Any] | None = None
    for mode in modes:
        tokens, skip = run_tokens(args, mode, live=False)
        print(f"{mode} ({tokens} tokens, first {skip} left out):", flush=True)
        for prefetch in PREFETCHES:
            if mode == "resident":
                warmup[f"before_{prefetch}"] = make_resident(table.path)
            lookahead = args.lookahead if prefetch == "oracle" else 1
            bench.run(RunSpec(mode, prefetch, tokens, skip, lookahead))
        if mode == live_mode and live:
            if mode == "resident":
                warmup["before_live"] = make_resident(table.path)
            trace_live = run_live(bench, RunSpec(mode, "predict", tokens, skip, router="live"),
                                   live_compute(table, bench.compute))
    return trace_live


def _bench(args: argparse.Namespace, argv: Sequence[str]) -> int:
    modes, live_modes = _check(args)
    table = None if args.live_only else open_table(args.model)
    live_table = (open_live_model(args.live_model)
                  if args.live_model is not None and not args.no_live else None)
    first = table or live_table
    assert first is not None  # _check: --model, or --live-only with --live-model
    result: dict[str, Any] = {
        **provenance("bench.prefetch", argv, **machine_info(first.path, None)),
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
            own_live = live_table is None and has_router(table) and not args.no_live
            trace_live = _trace_runs(bench, modes, result["warmup"], own_live)
            runs.update(bench.runs)
        if live_table is not None:
            live_bench = PrefetchBench(args, live_table, Path(tmp) / "live", ComputeSpec("real"))
            result["live_budget"] = str(live_bench.budget)
            live_runs(live_bench, live_modes, result["warmup"])
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
    return run_command(PROG, _parser(), _bench, argv)


if __name__ == "__main__":
    sys.exit(main())
