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

When the model has router tensors, ``predict`` also runs once with ``--router live`` (the
model's router applied to the hidden state), in resident mode (else the first mode). Its
routing differs from the trace's, so only its own figures are reported.

Resident runs start with the file in the page cache (read once with ``WarmEngine``); direct
runs need nothing (O_DIRECT bypasses the page cache). Direct runs decode ``--direct-tokens``
(fewer: they run at disk speed), resident runs ``--tokens``; the first tokens of each run
(``--skip-tokens``, ``--direct-skip-tokens``) are left out of the figures (cold start).
Figures come from the runs' JSON-lines logs: per run tokens/s, hit rate, stall ms per token
and, for ``predict``, accuracy (correct / predicted) and wasted bytes; per mode the speed-up
of predict and oracle over none and the share of the oracle's gain that predict reaches.

The result goes to ``bench/results/prefetch-HOST.json`` with machine, commit and command.
"""

from __future__ import annotations

import argparse
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

from pipeline.config import Budget, ComputeSpec, Mode, RunConfig
from pipeline.errors import MoestreamError, UsageError
from pipeline.logs import configure_console
from pipeline.machine import machine_info
from pipeline.residency import Residency
from pipeline.run import RunSummary, run
from pipeline.table import ByteRange, ExpertTable, open_table
from pipeline.warm import WarmEngine
from tools.bench import token_events, window_rate
from tools.results import git_commit, write_result
from tools.warmup import PsutilMemory, check_ram

__all__ = [
    "RunSpec",
    "budget_for",
    "gain_figures",
    "main",
    "make_resident",
    "prefetch_figures",
]

PROG = "bench_prefetch"
PREFETCHES = ("none", "predict", "oracle")
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


def budget_for(table: ExpertTable, share: float) -> Budget:
    """``share`` of each layer's experts (at least top-k), over all MoE layers."""
    per_layer = max(table.top_k, round(share * table.n_experts))
    return Budget(experts=per_layer * len(table.layers))


def make_resident(path: Path, file_bytes: int) -> dict[str, Any]:
    """Read the file's non-resident pages once, so a resident run starts warm.

    Raises:
        UsageError: the missing pages do not fit in available RAM minus a margin.
    """
    missing = Residency.of_file(path).missing([ByteRange(0, file_bytes)])
    check_ram(sum(r.nbytes for r in missing), PsutilMemory(), "warm")

    async def warm() -> int:
        async with WarmEngine(path) as engine:
            return (await engine.warm(missing)).bytes_read

    t0 = time.perf_counter()
    read_bytes = uvloop.run(warm()) if missing else 0
    return {
        "read_bytes": read_bytes,
        "seconds": round(time.perf_counter() - t0, 3),
        "resident_share": round(Residency.of_file(path).fraction, 4),
    }


def prefetch_figures(events: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """Accuracy and waste of ``predict`` over token events; None when none carry them."""
    stats = [e["prefetch"] for e in events if "prefetch" in e]
    if not stats:
        return None
    predicted = sum(s["predicted"] for s in stats)
    correct = sum(s["correct"] for s in stats)
    wasted = sum(s["wasted_bytes"] for s in stats)
    return {
        "predicted": predicted,
        "correct": correct,
        "accuracy": round(correct / predicted, 4) if predicted else None,
        "wasted_bytes": wasted,
        "wasted_bytes_per_token": round(wasted / len(stats), 1),
    }


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b > 0 else None


def gain_figures(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per mode, from runs named ``MODE_PREFETCH``: predict and oracle over none, and the
    share of the oracle's gain that predict reaches (None when the oracle gains nothing)."""
    out: dict[str, Any] = {}
    for mode in dict.fromkeys(r["mode"] for r in runs.values()):
        tps = {p: runs[f"{mode}_{p}"]["tokens_per_s"] for p in PREFETCHES
               if f"{mode}_{p}" in runs}
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
        if {"none", "predict"} <= tps.keys():
            # misses the guesses turned into hits; ~0 when the guesses were already cached
            fig["predict_hit_rate_gain"] = round(runs[f"{mode}_predict"]["hit_rate"]
                                                 - runs[f"{mode}_none"]["hit_rate"], 4)
        pf = runs.get(f"{mode}_predict", {}).get("prefetch_stats")
        if pf is not None:
            fig["predict_accuracy"] = pf["accuracy"]
            fig["predict_wasted_bytes_per_token"] = pf["wasted_bytes_per_token"]
        out[mode] = fig
    return out


class PrefetchBench:
    """The model, the budget, the scratch directory and the runs done so far.

    Args:
        args: the command line.
        table: the model.
        scratch: where the run logs go.
    """

    def __init__(self, args: argparse.Namespace, table: ExpertTable, scratch: Path) -> None:
        self.args = args
        self.table = table
        self.scratch = scratch
        self.budget = budget_for(table, args.budget_share)
        self.compute = ComputeSpec("fixed", args.layer_ms)
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
        figures = {
            "mode": spec.mode, "prefetch": spec.prefetch, "router": spec.router,
            "lookahead": spec.lookahead if spec.prefetch == "oracle" else None,
            "compute": str(compute), "skipped_tokens": spec.skip, **window,
            "prefetch_stats": prefetch_figures(events),
            "run_wasted_bytes": sum(e.get("prefetch", {}).get("wasted_bytes", 0)
                                    for e in every),
            "budget_ok": summary.peak_device_bytes <= summary.budget_bytes,
            "seconds": round(seconds, 2), "summary": summary.as_dict(),
        }
        self.runs[spec.name] = figures
        pf = figures["prefetch_stats"]
        acc = f", accuracy {pf['accuracy']}" if pf else ""
        print(f"  {spec.name}: {window['tokens_per_s']:.2f} tok/s, hit rate "
              f"{window['hit_rate']:.3f}, stall {window['stall_ms_per_token']:.1f} ms/token"
              f"{acc}, {seconds:.1f} s", flush=True)
        return figures


def _has_router(table: ExpertTable) -> bool:
    return any(table.layers[n].router is not None for n in table.moe_layers)


def _live_compute(table: ExpertTable, fixed: ComputeSpec) -> ComputeSpec:
    """Real compute where the experts are F16: only real compute carries a hidden state for
    the live router; otherwise the benchmark's fixed compute (which may not route live)."""
    f16 = GGMLQuantizationType.F16
    layer = next(iter(table.layers.values()))
    return ComputeSpec("real") if layer.gate_up_type == f16 and layer.down_type == f16 else fixed


def _run_live(bench: PrefetchBench, spec: RunSpec) -> dict[str, Any]:
    """The live-router predict run; a failure is recorded, not fatal (it is an extra)."""
    compute = _live_compute(bench.table, bench.compute)
    try:
        return bench.run(spec, compute)
    except (MoestreamError, ValueError, TypeError) as exc:
        reason = f"{type(exc).__name__}: {exc}"
        print(f"  {spec.name}: failed with compute {compute}: {reason}", flush=True)
        bench.runs[spec.name] = {"mode": spec.mode, "prefetch": spec.prefetch,
                                 "router": "live", "compute": str(compute), "error": reason}
        return bench.runs[spec.name]


def _notes(args: argparse.Namespace, live: dict[str, Any] | None) -> list[str]:
    notes = [
        f"compute fixed:{args.layer_ms} ms per layer: the decoder keeps no hidden state, so "
        "routing is the calibrated synthetic trace and predict guesses layer L+1 from the "
        "previous token's choice at L+1 (TraceRouting.predict)",
        "those guesses are mostly experts the cache still holds from the previous token, and "
        "only absent guesses are loaded: predict_hit_rate_gain (predict's hit rate minus "
        "none's) and wasted bytes near 0 mean predict loaded next to nothing",
        "oracle runs' token events carry no prefetch field: accuracy is reported for predict "
        "only; a prefetched expert still in flight when its layer runs counts as a hit",
        f"direct runs decode {args.direct_tokens} tokens and skip {args.direct_skip_tokens}, "
        f"resident runs {args.tokens} and skip {args.skip_tokens}: compare runs within a mode",
        "before each resident run the file was read into the page cache (WarmEngine); direct "
        "runs read with O_DIRECT and had nothing done before them",
    ]
    if live is None:
        notes.append("no live-router run: " + ("--no-live" if args.no_live else
                                               "the model has no router tensors (ffn_gate_inp)"))
    elif "error" in live:
        notes.append(f"the live-router run failed with compute {live['compute']} "
                     f"({live['error']}): the live router needs the hidden state that only "
                     "real compute on F16 experts keeps")
    else:
        notes.append(f"live-router predict ran with compute {live['compute']} on the model's "
                     "own routing: its tokens/s is not comparable with the trace runs'")
    return notes


def _print_table(runs: dict[str, dict[str, Any]], figures: dict[str, Any]) -> None:
    print(f"\n{'run':<24} {'tok/s':>8} {'hit rate':>8} {'stall ms/tok':>12} "
          f"{'accuracy':>8} {'wasted MiB/tok':>14}")
    for name, r in runs.items():
        if "error" in r:
            print(f"{name:<24} failed: {r['error'][:60]}")
            continue
        pf = r["prefetch_stats"] or {}
        acc = f"{pf['accuracy']:.3f}" if pf.get("accuracy") is not None else "-"
        waste = f"{pf['wasted_bytes_per_token'] / MIB:.2f}" if pf else "-"
        print(f"{name:<24} {r['tokens_per_s']:>8.2f} {r['hit_rate']:>8.3f} "
              f"{r['stall_ms_per_token']:>12.2f} {acc:>8} {waste:>14}")
    for mode, fig in figures.items():
        if isinstance(fig, dict):
            print(f"{mode}: " + ", ".join(f"{k} {v}" for k, v in fig.items()))
    print(f"budget never exceeded: {figures['budget_never_exceeded']}")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tools.bench_prefetch",
                                description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, required=True,
                   help="GGUF model (ds4-flash-q2 shaped, e.g. 20 layers x 256 experts)")
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
    p.add_argument("--no-live", action="store_true", help="skip the live-router predict run")
    p.add_argument("--no-verify", action="store_true",
                   help="skip install digests (the host backend computes them on the CPU)")
    p.add_argument("--out", type=Path,
                   help="result JSON (default bench/results/prefetch-HOST.json)")
    p.add_argument("--debug", action="store_true", help="debug events and tracebacks")
    return p


def _check(args: argparse.Namespace) -> list[Mode]:
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in ("direct", "resident")]
    if not modes or bad:
        raise UsageError(f"--modes takes direct and/or resident, not {args.modes!r}")
    for tokens, skip, what in ((args.tokens, args.skip_tokens, "--tokens"),
                               (args.direct_tokens, args.direct_skip_tokens, "--direct-tokens")):
        if skip < 0 or tokens <= skip:
            raise UsageError(f"{what} {tokens} leaves no token after skipping {skip}")
    if args.lookahead < 1:
        raise UsageError(f"--lookahead must be >= 1, not {args.lookahead}")
    if not 0 < args.budget_share <= 1:
        raise UsageError(f"--budget-share must be in (0, 1], not {args.budget_share}")
    return modes


def _bench(args: argparse.Namespace, argv: Sequence[str]) -> int:
    modes = _check(args)
    table = open_table(args.model)
    result: dict[str, Any] = {
        "machine": {"host": platform.node(), "python": sys.version.split()[0],
                    **machine_info(table.path, None),
                    "ram_available_bytes": psutil.virtual_memory().available},
        "commit": git_commit(),
        "command": "python -m tools.bench_prefetch " + " ".join(argv),
        "model": {"path": str(table.path), "file_bytes": table.file_bytes,
                  "layers": len(table.layers), "experts": table.n_experts,
                  "top_k": table.top_k, "routers": _has_router(table)},
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "warmup": {},
    }
    live_mode: Mode = "resident" if "resident" in modes else modes[0]
    live: dict[str, Any] | None = None
    with tempfile.TemporaryDirectory(prefix="moestream-prefetch-") as tmp:
        bench = PrefetchBench(args, table, Path(tmp))
        result["budget"] = str(bench.budget)
        for mode in modes:
            tokens, skip = ((args.tokens, args.skip_tokens) if mode == "resident"
                            else (args.direct_tokens, args.direct_skip_tokens))
            print(f"{mode} ({tokens} tokens, first {skip} left out):", flush=True)
            for prefetch in PREFETCHES:
                if mode == "resident":
                    result["warmup"][f"before_{prefetch}"] = make_resident(table.path,
                                                                           table.file_bytes)
                lookahead = args.lookahead if prefetch == "oracle" else 1
                bench.run(RunSpec(mode, prefetch, tokens, skip, lookahead))
            if mode == live_mode and _has_router(table) and not args.no_live:
                if mode == "resident":
                    result["warmup"]["before_live"] = make_resident(table.path, table.file_bytes)
                live = _run_live(bench, RunSpec(mode, "predict", tokens, skip, router="live"))
    runs = bench.runs
    trace_runs = {n: r for n, r in runs.items() if r["router"] == "trace"}
    figures: dict[str, Any] = gain_figures(trace_runs)
    if live is not None and "error" not in live:
        figures["live_predict"] = {"mode": live["mode"], "tokens_per_s": live["tokens_per_s"],
                                   "accuracy": (live["prefetch_stats"] or {}).get("accuracy")}
    figures["budget_never_exceeded"] = all(r.get("budget_ok", True) for r in runs.values())
    result["machine"]["device"] = next((r["summary"]["device"] for r in runs.values()
                                        if "summary" in r), None)
    result["runs"] = runs
    result["figures"] = figures
    result["notes"] = _notes(args, live)
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
