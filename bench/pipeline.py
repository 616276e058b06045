"""``python -m bench.pipeline``: the streaming pipeline against its limits, in one run.

Every figure is a ratio against references measured in the same run on the same file and
the same expert ranges, because these machines are noisy:

- raw O_DIRECT read of expert ranges at the pipeline's queue depth (cold), and the best
  such read over ``--odirect-threads`` thread counts (on their first 2 GiB);
- parallel page-cache read of the same ranges (warm);
- pinned host-to-device copy (one GiB in one copy: the link's rate);
- each resident path's own rate on the warm-miss sweep's bytes, from the registered
  mapping, back-to-back on one stream: the copy engines one batched copy per layer (one
  copy per range paid ~2.7 us a copy, which held 2 MiB copies at 0.93 x one GiB's on the
  H200, ``bench/results/dsv2-h200-6fff5dd/``), the gather kernel one launch per layer;
- kvikio ``CuFile.pread`` of the same ranges into device buffers, when kvikio is installed;
- a naive baseline: synchronous buffered read, pageable copy, no cache (what ds4's CUDA
  path did before its cache was fixed);
- the compute-only rate: the same per-layer kernels and syncs with no I/O at all;
- the warm-miss run (default path) and, on a GPU, the same on the copy engines, and the
  all-cached run with its compute-only reference, each pair alternating, are repeated
  ``--rounds`` times, and each figure is the median round's: one run of the same code
  swung 0.69-0.95 (warm misses) on the H200, so two paths are compared in one process;
  around each warm-miss round the host's own speed is timed too (``host_ref_ms``, a fixed
  Python workload on the loop's thread), and on a GPU a pinned copy's rate
  (``h2d_ref_gbps``): a slow round on a slow host or a slow bus tells itself apart;
- with ``--ab-verify N``, the same phases with verification on and off, alternating in one
  process: what verification costs, from medians, free of the drift between two runs.

Pipeline runs go through ``pipeline.cli.run.run`` with a log, and figures come from the log's
token events. Miss throughput uses a cyclic sweep over distinct experts with an LRU budget
of half the sweep, so every access in the second pass is a miss (LRU's cyclic worst case,
used on purpose) and window registration happens in the first pass; the later ``--passes``
are measured (three by default: one pass of 8 tokens was 0.2 s on the H200, too short to
tell two runs apart).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import platform
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import uvloop

from bench.copytimes import copy_timeline
from bench.kit import drop_caches, exit_with, make_resident
from bench.rates import token_events, window_rate
from bench.record import provenance, write_result
from bench.references import (
    compute_only_tps,
    kvikio_gbps,
    leading_ranges,
    naive_tps,
    pinned_h2d_gbps,
    raw_read_gbps,
    slice_h2d_gbps,
    with_references,
)
from moestream.gpu.backend import Backend
from moestream.gpu.selection import select_backend
from moestream.pipeline.cli.run import RunSummary, run
from moestream.pipeline.foundation.config import GATHER_BLOCKS, Budget, ComputeSpec
from moestream.pipeline.foundation.table import ExpertTable, open_table
from moestream.pipeline.foundation.trace import Trace, save_trace
from moestream.pipeline.proxy.config import RunConfig

__all__ = ["Bench", "add_run_options", "main"]

GB = 1e9
MIB = 1 << 20


def sweep_trace(n_layers: int, n_experts: int, top_k: int, n_tokens: int, start: int) -> Trace:
    """Token t, layer l picks experts ``start + t*top_k .. +top_k`` (mod n): all distinct."""
    base = (start + np.arange(n_tokens)[:, None] * top_k + np.arange(top_k)[None, :]) % n_experts
    experts = np.broadcast_to(base[:, None, :], (n_tokens, n_layers, top_k)).astype(np.int32)
    weights = np.full(experts.shape, 1.0 / top_k, dtype=np.float32)
    return Trace(np.ascontiguousarray(experts), weights, n_experts, "sweep")


def expert_ranges(table: ExpertTable, trace: Trace) -> list[tuple[int, int]]:
    """(offset, nbytes) of every range of every expert the trace uses, once each."""
    seen: set[tuple[int, int]] = set()
    out: list[tuple[int, int]] = []
    for t in range(trace.n_tokens):
        for i, layer in enumerate(table.moe_layers):
            for e in trace.experts[t, i]:
                key = (layer, int(e))
                if key not in seen:
                    seen.add(key)
                    out.extend((r.offset, r.nbytes) for r in table.slices(key).ranges)
    return out


class Bench:
    """Holds the model, the scratch directory and the common run options."""

    def __init__(self, args: argparse.Namespace, table: ExpertTable, scratch: Path) -> None:
        self.args = args
        self.table = table
        self.scratch = scratch
        self.runs: dict[str, Any] = {}

    def run(self, name: str, trace: Trace, tokens: int, *, mode: str, budget_bytes: int | None,
            layer_ms: float, policy: str = "lru", lookahead: int = 0, gather: bool = True,
            verify: bool | None = None) -> tuple[RunSummary, list[dict[str, Any]]]:
        trace_path = self.scratch / f"{name}.npz"
        save_trace(trace, trace_path)
        log = self.scratch / f"{name}.jsonl"
        cfg = RunConfig(
            model=self.table.path, tokens=tokens, trace=trace_path, mode=mode,  # type: ignore[arg-type]
            budget=Budget(nbytes=budget_bytes) if budget_bytes else None,
            compute=ComputeSpec("fixed", layer_ms), backend=self.args.backend,
            queue_depth=self.args.queue_depth, chunk_bytes=self.args.chunk_mib * MIB,
            staging_slots=self.args.staging_slots, upload_streams=self.args.streams,
            log=log, policy=policy, prefetch="oracle" if lookahead else "none",
            lookahead=lookahead, gather=gather, gather_blocks=self.args.gather_blocks,
            verify=not self.args.no_verify if verify is None else verify,
        )
        summary = uvloop.run(run(cfg))
        events = token_events(log)
        self.runs[name] = {
            "summary": summary.as_dict(),
            "budget_ok": summary.peak_device_bytes <= summary.budget_bytes,
        }
        return summary, events


def _phase(name: str, results: dict[str, Any], fn: Callable[[], Any]) -> Any:
    t0 = time.perf_counter()
    value = fn()
    print(f"  {name}: {value if not isinstance(value, float) else round(value, 3)} "
          f"({time.perf_counter() - t0:.1f} s)", flush=True)
    results[name] = value
    return value


def add_run_options(p: argparse.ArgumentParser) -> None:
    """The pipeline settings ``Bench.run`` reads from its arguments (every bench that runs
    the pipeline through ``Bench`` takes the same ones, with the same defaults)."""
    p.add_argument("--queue-depth", type=int, default=16)
    p.add_argument("--chunk-mib", type=int, default=1)
    p.add_argument("--staging-slots", type=int, default=32)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--gather-blocks", type=int, default=GATHER_BLOCKS,
                   help=f"the gather kernel's blocks per copy, at most ({GATHER_BLOCKS})")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.pipeline", description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, required=True, help="GGUF model or checkpoint directory")
    p.add_argument("--backend", default="auto")
    add_run_options(p)
    p.add_argument("--lookahead", type=int, default=4,
                   help="oracle prefetch depth for the miss-throughput runs (4)")
    p.add_argument("--sweep-tokens", type=int, default=8, help="tokens per sweep pass")
    p.add_argument("--passes", type=int, default=4,
                   help="sweep passes per miss run; all but the first are measured (4)")
    p.add_argument("--tokens", type=int, default=64, help="tokens for the cache-vs-naive runs")
    p.add_argument("--naive-tokens", type=int, default=16)
    p.add_argument("--layer-ms", type=float, default=0.57)
    p.add_argument("--hit50-experts", type=int, default=0,
                   help="budget in experts for ~50%% hits (default 2522 scaled to the layers)")
    p.add_argument("--out", type=Path,
                   help="result JSON (default bench/results/pipeline-HOST.json)")
    p.add_argument("--odirect-threads", type=lambda s: [int(x) for x in s.split(",")],
                   default=[4, 8, 16, 32, 64],
                   help="thread counts of the raw O_DIRECT sweep (the best is the cold reference)")
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds of the warm-miss run and of compute-only + all cached "
                        "(alternating); each figure is the median round's (3)")
    p.add_argument("--ab-verify", type=int, default=0, metavar="N",
                   help="N rounds of verification on and off, alternating, for the warm-miss "
                        "and all-cached phases: the cost of verification within one run")
    p.add_argument("--skip", default="", help="comma list of phases to skip: cold,warm,cache,all")
    p.add_argument("--copy-timeline", action="store_true",
                   help="on a GPU, time each warm-miss round's copies on the device too "
                        "(bench.copytimes: their rate while copying, the share of the span "
                        "they copied; two events a layer)")
    p.add_argument("--no-verify", action="store_true",
                   help="pipeline runs without verification (the cost of the default's)")
    return p


@dataclass
class _Setup:
    """What every phase of one ``main`` run shares: the model, the traces, the budget, and
    where the figures go (``results``, its references in ``ref``)."""

    args: argparse.Namespace
    table: ExpertTable
    backend: Backend
    bench: Bench
    sweep: Trace  # the miss sweep, passes of distinct experts
    ranges_other: list[tuple[int, int]]  # another sweep's ranges: the references read them
    sweep_budget: int  # half the sweep's experts: every access of a later pass misses
    calibrated: Trace  # ds4-flash's calibrated routing, for the cached phases
    results: dict[str, Any]
    ref: dict[str, Any]

    @property
    def gpu(self) -> bool:
        return self.backend.name == "cupy"

    @property
    def cyc(self) -> int:
        """Tokens of a sweep run: every pass after the first is measured."""
        return int(self.args.passes * self.args.sweep_tokens)

    def sweep_run(self, name: str, mode: str, **options: Any) -> dict[str, Any]:
        """A sweep run's rate over its measured passes."""
        _, ev = self.bench.run(name, self.sweep, self.cyc, mode=mode,
                               budget_bytes=self.sweep_budget, layer_ms=0.0, **options)
        return window_rate(ev[self.args.sweep_tokens:])


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    table = open_table(args.model)
    backend = select_backend(args.backend)
    n_layers, n_exp, k = len(table.layers), table.n_experts, table.top_k
    expert_bytes = next(iter(table.layers.values())).expert_bytes
    results: dict[str, Any] = {
        **provenance("bench.pipeline", argv, device=backend.device_name),
        "model": table.summary(),
        "settings": {k2: (str(v) if isinstance(v, Path) else v) for k2, v in vars(args).items()},
    }
    ref: dict[str, Any] = {}
    results["references"] = ref
    with tempfile.TemporaryDirectory(prefix="moestream-bench-") as tmp:
        from moestream.pipeline.proxy.synthetic import synthetic_trace

        other = sweep_trace(n_layers, n_exp, k, args.sweep_tokens, args.sweep_tokens * k)
        s = _Setup(
            args=args, table=table, backend=backend, bench=Bench(args, table, Path(tmp)),
            sweep=sweep_trace(n_layers, n_exp, k, args.sweep_tokens, 0),
            ranges_other=expert_ranges(table, other),
            sweep_budget=n_layers * k * args.sweep_tokens * expert_bytes // 2 + (64 << 20),
            calibrated=synthetic_trace("ds4-flash", args.tokens, seed=1, n_layers=n_layers,
                                       n_experts=n_exp, top_k=k),
            results=results, ref=ref)
        if "warm" not in skip:
            _warm(s)
        if "cold" not in skip:
            _cold(s)
        if "cache" not in skip and s.gpu:
            _cache_vs_naive(s, expert_bytes)
        if "all" not in skip and s.gpu:
            _all_cached(s)
        if args.ab_verify and "warm" not in skip:
            results["verify_ab"] = _verify_ab(s, with_cached=s.gpu and "all" not in skip)
        results["runs"] = s.bench.runs
    figures = _figures(results)
    results["figures"] = figures
    out = args.out or Path("bench/results") / f"pipeline-{platform.node()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_result(out, results)
    print("\nfigures:")
    for name, value in figures.items():
        print(f"  {name}: {value}")
    print(f"written: {out}")
    return 0


def _warm(s: _Setup) -> None:
    """The file in the page cache: the references, then the resident miss runs."""
    args, table, ref, results = s.args, s.table, s.ref, s.results
    print("warm (file in page cache):", flush=True)
    results["warm_file"] = _phase("make_resident", {}, lambda: make_resident(table.files))
    _phase("page_cache_read_gbps", ref, lambda: raw_read_gbps(
        table.files, s.ranges_other, args.queue_depth, args.chunk_mib * MIB, direct=False))
    if s.gpu:
        _phase("pinned_h2d_gbps", ref, pinned_h2d_gbps)
        moved = expert_ranges(table, s.sweep)
        for name, gather in (("slice_h2d_gbps", False), ("slice_gather_gbps", True)):
            _phase(name, ref, functools.partial(slice_h2d_gbps, table, s.backend, moved,
                                                gather))
        _phase("kvikio_warm_gbps", ref, lambda: kvikio_gbps(
            table.files, s.ranges_other, args.queue_depth))
    rate = s.sweep_run("resident_sweep", "resident")
    results["resident_miss_layer_by_layer"] = _phase(
        "resident_miss_layer_by_layer", {}, lambda: rate)
    # the default path's rounds, alternating on a GPU with the same on the copy
    # engines (``--no-gather``): the two compared in one process, round by round
    paths = {"resident_miss": True, **({"resident_miss_copy_engines": False}
                                       if s.gpu else {})}
    by_path: dict[str, list[dict[str, Any]]] = {name: [] for name in paths}
    for _ in range(args.rounds):
        for name, gather in paths.items():
            by_path[name].append(with_references(
                functools.partial(_warm_round, s, name, gather), s.gpu))
    for name in paths:
        results[name] = _phase(name, {}, functools.partial(
            _median_round, by_path[name], "delivered_gbps"))


def _warm_round(s: _Setup, name: str, gather: bool) -> dict[str, Any]:
    """One warm-miss round (oracle prefetch), with its copies' device timeline if asked."""
    with (copy_timeline() if s.gpu and s.args.copy_timeline
          else contextlib.nullcontext()) as timeline:
        rate = s.sweep_run(name, "resident", lookahead=s.args.lookahead, gather=gather)
    measured = (s.cyc - s.args.sweep_tokens) / s.cyc  # the window's share of the calls
    return {**rate, **(timeline.summary(measured) if timeline is not None else {})}


def _cold(s: _Setup) -> None:
    """Caches dropped: the O_DIRECT references, then the direct miss runs."""
    args, table, ref, results = s.args, s.table, s.ref, s.results
    print("cold (caches dropped):", flush=True)
    drop_caches(table.files)
    _phase("odirect_read_gbps", ref, lambda: raw_read_gbps(
        table.files, s.ranges_other, args.queue_depth, args.chunk_mib * MIB, direct=True))
    # the best raw O_DIRECT read of these ranges over thread counts (on 2 GiB of them)
    part = leading_ranges(s.ranges_other, 2 << 30)
    sweep_gbps = {}
    for threads in args.odirect_threads:
        drop_caches(table.files)
        sweep_gbps[threads] = raw_read_gbps(table.files, part, threads,
                                            args.chunk_mib * MIB, direct=True)
    best = max(sweep_gbps, key=lambda n: sweep_gbps[n])
    ref["odirect_threads_gbps"] = {str(n): round(v, 3) for n, v in sweep_gbps.items()}
    _phase("odirect_best_gbps", ref, lambda: sweep_gbps[best])
    ref["odirect_best_threads"] = best
    # the same ranges again: a storage layer below (a VM host's cache) shows here
    _phase("odirect_reread_gbps", ref, lambda: raw_read_gbps(
        table.files, s.ranges_other, args.queue_depth, args.chunk_mib * MIB, direct=True))
    if s.gpu:
        drop_caches(table.files)
        _phase("kvikio_cold_gbps", ref, lambda: kvikio_gbps(
            table.files, s.ranges_other, args.queue_depth))
    drop_caches(table.files)
    rate = s.sweep_run("direct_sweep", "direct")
    results["direct_miss_layer_by_layer"] = _phase(
        "direct_miss_layer_by_layer", {}, lambda: rate)
    drop_caches(table.files)
    rate = s.sweep_run("direct_sweep_ahead", "direct", lookahead=args.lookahead)
    results["direct_miss"] = _phase("direct_miss", {}, lambda: rate)


def _cache_vs_naive(s: _Setup, expert_bytes: int) -> None:
    """From a cold start in direct mode: the naive baseline, then the cache at ~50% hits."""
    args, table = s.args, s.table
    print("cache vs naive (cold start, direct mode):", flush=True)
    hit50 = args.hit50_experts or round(2522 * len(table.layers) / 43)
    drop_caches(table.files)
    _phase("naive_tps", s.ref, lambda: naive_tps(table, s.calibrated, args.naive_tokens,
                                                  args.layer_ms))
    drop_caches(table.files)
    _, ev = s.bench.run("cache_hit50", s.calibrated, args.tokens, mode="direct",
                        budget_bytes=hit50 * (expert_bytes + 1024), layer_ms=args.layer_ms)
    s.results["cache_hit50"] = _phase("cache_hit50", {}, lambda: window_rate(ev))


def _all_cached(s: _Setup) -> None:
    """Every expert cached (the second pass of a replayed trace) against compute only."""
    args, table = s.args, s.table
    print("all cached (second pass of a replayed trace):", flush=True)
    # the cold phases dropped the file's pages: without them the first round's
    # resident-mode run warmed 17 GB in the background beside its measured tokens
    # (H200, fine shape at 40b54b0: 12.7 s of reading and window registration)
    _phase("make_resident", {}, lambda: make_resident(table.files))
    # alternating, so drift between the two (clocks, the host) falls on both alike
    rounds = []
    for _ in range(args.rounds):
        reference = compute_only_tps(len(table.layers), table.top_k, args.layer_ms,
                                     args.tokens)
        _, ev = s.bench.run("all_cached", s.calibrated, 2 * args.tokens, mode="resident",
                            budget_bytes=None, layer_ms=args.layer_ms)
        rounds.append({**window_rate(ev[args.tokens:]), "compute_only_tps": reference})
        rounds[-1]["vs_compute_only"] = rounds[-1]["tokens_per_s"] / reference
    s.results["all_cached"] = _phase("all_cached", {},
                                     lambda: _median_round(rounds, "vs_compute_only"))
    s.ref["compute_only_tps"] = s.results["all_cached"]["compute_only_tps"]


def _verify_ab(s: _Setup, with_cached: bool) -> dict[str, Any]:
    """The warm-miss (and all-cached) phases with verification on and off, alternating:
    what verification costs, from medians, free of the drift between two runs."""
    args = s.args
    print(f"verification A/B ({args.ab_verify} rounds, on and off alternating):", flush=True)
    ab: dict[str, Any] = {}
    phases: dict[str, tuple[Callable[[bool], list[dict[str, Any]]], str]] = {
        "resident_miss": (lambda on: s.bench.run(
            "ab_sweep", s.sweep, s.cyc, mode="resident", budget_bytes=s.sweep_budget,
            layer_ms=0.0, lookahead=args.lookahead, verify=on)[1][args.sweep_tokens:],
            "delivered_gbps"),
    }
    if with_cached:
        phases["all_cached"] = (lambda on: s.bench.run(
            "ab_cached", s.calibrated, 2 * args.tokens, mode="resident",
            budget_bytes=None, layer_ms=args.layer_ms, verify=on)[1][args.tokens:],
            "tokens_per_s")
    for phase, (go, measure) in phases.items():
        rates: dict[str, list[float]] = {"on": [], "off": []}
        for _ in range(args.ab_verify):
            for on in (True, False):
                rates["on" if on else "off"].append(window_rate(go(on))[measure])
        on_med, off_med = (float(np.median(rates[k])) for k in ("on", "off"))
        cost = round(1 - on_med / off_med, 4) if off_med else None  # None: no misses
        ab[phase] = {"measure": measure, **rates, "median_on": on_med,
                     "median_off": off_med, "cost": cost}
        print(f"  {phase}: {measure} on {on_med:.3f} / off {off_med:.3f}: "
              + (f"verification costs {cost:.1%}" if cost is not None
                 else "nothing to compare"), flush=True)
    return ab


def _median_round(rounds: Sequence[dict[str, Any]], key: str) -> dict[str, Any]:
    """The round whose ``key`` is the median (the lower one of an even count), with every
    round's ``key`` beside it: one slow round moves neither the figure nor its context."""
    chosen = sorted(rounds, key=lambda r: r[key])[(len(rounds) - 1) // 2]
    out = {**chosen, "rounds": [round(r[key], 4) for r in rounds]}
    if all("wall_ms_max" in r for r in rounds):  # token walls: (median, longest) per round
        out["rounds_wall_ms"] = [[round(r["wall_ms_median"], 2), round(r["wall_ms_max"], 2)]
                                 for r in rounds]
    for ref in ("host_ref_ms", "h2d_ref_gbps", "copy_device_gbps", "copy_busy_share"):
        if all(ref in r for r in rounds):
            out[f"rounds_{ref}"] = [r[ref] for r in rounds]
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def _figures(r: dict[str, Any]) -> dict[str, Any]:
    ref = r["references"]
    fig: dict[str, Any] = {}
    if "direct_miss" in r:
        fig["1_cold_direct_vs_odirect"] = _ratio(r["direct_miss"]["delivered_gbps"],
                                                 ref.get("odirect_read_gbps"))
        fig["1_cold_direct_vs_best_odirect"] = _ratio(r["direct_miss"]["delivered_gbps"],
                                                      ref.get("odirect_best_gbps"))
        fig["1_cold_direct_vs_odirect_reread"] = _ratio(r["direct_miss"]["delivered_gbps"],
                                                        ref.get("odirect_reread_gbps"))
        fig["1_cold_direct_vs_kvikio"] = _ratio(r["direct_miss"]["delivered_gbps"],
                                                ref.get("kvikio_cold_gbps"))
    if "resident_miss" in r:
        fig["2_warm_resident_vs_pinned_h2d"] = _ratio(r["resident_miss"]["delivered_gbps"],
                                                      ref.get("pinned_h2d_gbps"))
        fig["2_warm_resident_copy_engines_vs_pinned_h2d"] = _ratio(
            r.get("resident_miss_copy_engines", {}).get("delivered_gbps"),
            ref.get("pinned_h2d_gbps"))
        fig["2_warm_resident_vs_copy_engines"] = _ratio(
            r["resident_miss"]["delivered_gbps"],
            r.get("resident_miss_copy_engines", {}).get("delivered_gbps"))
        fig["2_warm_resident_vs_slice_h2d"] = _ratio(r["resident_miss"]["delivered_gbps"],
                                                     ref.get("slice_h2d_gbps"))
        fig["2_warm_resident_vs_slice_gather"] = _ratio(r["resident_miss"]["delivered_gbps"],
                                                        ref.get("slice_gather_gbps"))
        fig["2_warm_resident_vs_kvikio"] = _ratio(r["resident_miss"]["delivered_gbps"],
                                                  ref.get("kvikio_warm_gbps"))
        fig["2_warm_resident_vs_page_cache_read"] = _ratio(
            r["resident_miss"]["delivered_gbps"], ref.get("page_cache_read_gbps"))
    if "cache_hit50" in r:
        fig["3_cache_vs_naive_tps"] = _ratio(r["cache_hit50"]["tokens_per_s"],
                                             ref.get("naive_tps"))
        fig["3_hit_rate"] = round(r["cache_hit50"]["hit_rate"], 3)
    if "all_cached" in r:
        fig["4_all_cached_vs_compute_only"] = round(r["all_cached"]["vs_compute_only"], 3)
    for phase, ab in r.get("verify_ab", {}).items():
        fig[f"6_verify_cost_{phase}"] = ab["cost"]
    fig["5_budget_never_exceeded"] = all(run["budget_ok"] for run in r.get("runs", {}).values())
    return fig


if __name__ == "__main__":
    exit_with("python -m bench.pipeline", main)
