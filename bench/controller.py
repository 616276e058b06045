"""``python -m bench.controller``: direct vs resident vs auto, and a balloon mid-run.

The residency controller's figures, all in one run on one model (scaled ``ds4-flash-q2``,
a budget of ~15% of each layer's experts, fixed per-layer compute):

1. forced direct from a cold page cache (the O_DIRECT default the field report started
   from), forced resident once the file is resident, and auto from cold: auto should pick
   resident, warm the rest in the background and then run within 5% of forced resident;
2. auto with a memory balloon started mid-run (another process taking RAM until the RAM
   the controller may use is below the model): the switch to direct and back, how long it
   took, tokens/s in each phase against forced direct, and whether the balloon survived.

Forced direct runs twice, first and last: the disk's speed drifts between runs, and the
figures divide by the mean of the two (each ratio is in the results too).

``--ram-limit`` caps the RAM the controller believes in, so a balloon of a safe size makes
the RAM < model regime on a large machine. Results go to ``bench/results/controller-HOST.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil
import uvloop

from bench.kit import budget_for, drop_caches, exit_with
from bench.record import provenance, write_result
from moestream.pipeline.cli.run import run
from moestream.pipeline.foundation.config import ComputeSpec, parse_size
from moestream.pipeline.foundation.table import open_table
from moestream.pipeline.foundation.trace import save_trace
from moestream.pipeline.proxy.config import RunConfig
from moestream.pipeline.proxy.synthetic import synthetic_trace

__all__ = ["main"]

GB = 1e9


def _events(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def _ts(event: dict[str, Any]) -> float:
    return datetime.fromisoformat(event["ts"].replace("Z", "+00:00")).timestamp()


def _rate(tokens: Sequence[dict[str, Any]]) -> dict[str, float]:
    wall_s = sum(e["wall_ms"] for e in tokens) / 1000.0
    return {
        "tokens": len(tokens),
        "tokens_per_s": round(len(tokens) / wall_s, 3) if wall_s else 0.0,
        "storage_gbps": round(sum(e["storage_bytes"] for e in tokens) / wall_s / GB, 3)
        if wall_s else 0.0,
        "hit_rate": round(sum(e["hits"] for e in tokens)
                          / max(1, sum(e["hits"] + e["misses"] for e in tokens)), 4),
        "first_token_ms": round(tokens[0]["wall_ms"], 1) if tokens else 0.0,
    }


class Runner:
    def __init__(self, args: argparse.Namespace, scratch: Path, trace_path: Path) -> None:
        self.args = args
        self.scratch = scratch
        self.trace = trace_path
        self.budget = budget_for(open_table(args.model), args.budget_share)

    def run(self, name: str, mode: str, tokens: int, **extra: Any) -> list[dict[str, Any]]:
        log = self.scratch / f"{name}.jsonl"
        cfg = RunConfig(
            model=self.args.model, tokens=tokens, trace=self.trace, mode=mode,  # type: ignore[arg-type]
            budget=self.budget, compute=ComputeSpec("fixed", self.args.layer_ms),
            backend=self.args.backend, queue_depth=16, chunk_bytes=1 << 20, staging_slots=32,
            upload_streams=4, log=log, verify=not self.args.no_verify, **extra,
        )
        t0 = time.perf_counter()
        summary = uvloop.run(run(cfg))
        print(f"  {name}: {summary.tokens_per_s:.2f} tok/s, hit rate {summary.hit_rate:.3f}, "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
        return _events(log)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.controller",
                                description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--backend", default="auto")
    p.add_argument("--tokens", type=int, default=48, help="tokens per direct run")
    p.add_argument("--resident-tokens", type=int, default=400,
                   help="tokens of the resident and auto runs (400: the auto run's ~25 s of "
                   "warm-up take ~60 of them)")
    p.add_argument("--layer-ms", type=float, default=0.57)
    p.add_argument("--budget-share", type=float, default=0.15)
    p.add_argument("--ram-limit", default="64GiB", help="RAM the controller believes in")
    p.add_argument("--balloon-gib", type=int, default=32)
    p.add_argument("--balloon-hold-s", type=float, default=15.0)
    p.add_argument("--balloon-after-s", type=float, default=5.0)
    p.add_argument("--balloon-tokens", type=int, default=1500,
                   help="tokens of the balloon run (1500: at ~40 tok/s resident, 600 ended "
                   "before the balloon was full)")
    p.add_argument("--skip", default="")
    p.add_argument("--partial-ram", help="RAM the controller may use for the partial-"
                   "residency runs (below the model, e.g. 20GiB); default: skip them")
    p.add_argument("--margin", default="2GiB", help="controller margin for those runs")
    p.add_argument("--no-verify", action="store_true",
                   help="skip install digests (the host backend computes them on the CPU)")
    p.add_argument("--keep-logs", type=Path, metavar="DIR",
                   help="copy every run's JSON-lines log here (for moestream.tools.analyze)")
    p.add_argument("--out", type=Path)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    table = open_table(args.model)
    results: dict[str, Any] = {
        **provenance("bench.controller", argv),
        "model": {"path": str(args.model), "file_bytes": table.file_bytes,
                  "layers": len(table.layers), "experts": table.n_experts},
    }
    with tempfile.TemporaryDirectory(prefix="moestream-ctl-") as tmp:
        scratch = Path(tmp)
        trace_path = scratch / "trace.npz"
        n = max(args.tokens, args.resident_tokens, args.balloon_tokens)
        save_trace(synthetic_trace("ds4-flash", n, seed=2, n_layers=len(table.layers),
                                   n_experts=table.n_experts, top_k=table.top_k), trace_path)
        r = Runner(args, scratch, trace_path)
        results["budget"] = str(r.budget)
        if "direct" not in skip:
            results["forced_direct"] = _forced_direct(r, "direct")
        if "auto" not in skip:
            results["auto_cold"], results["forced_resident"] = _auto_and_resident(r)
        if "balloon" not in skip:
            results["balloon"] = _balloon(r, args)
        if args.partial_ram:
            results["partial"] = _partial(r, args)
        if "direct" not in skip:
            # the virtio disk's speed drifts by 10-16% between runs a minute apart: a
            # second reference at the end makes the phase ratios less a coin toss
            results["forced_direct_again"] = _forced_direct(r, "direct_again")
        if args.keep_logs:
            args.keep_logs.mkdir(parents=True, exist_ok=True)
            for log in scratch.glob("*.jsonl"):
                shutil.copy(log, args.keep_logs / log.name)
    results["figures"] = _figures(results)
    out = args.out or Path("bench/results") / f"controller-{platform.node()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_result(out, results)
    print(json.dumps(results["figures"], indent=2))
    print(f"written: {out}")
    return 0


def _auto_and_resident(r: Runner) -> tuple[dict[str, Any], dict[str, float]]:
    """Auto mode from a cold page cache (resident, warmed in the background), then forced
    resident on the file that run left resident."""
    print("auto from cold (resident + background warm-up):", flush=True)
    drop_caches(r.args.model)
    ev = r.run("auto_cold", "auto", r.args.resident_tokens)
    tokens = [e for e in ev if e["event"] == "token"]
    done = [e for e in ev if e["event"] == "warmup_done"]
    after = [e for e in tokens if done and e["token"] > done[0]["token"]]
    auto_cold = {
        "all": _rate(tokens), "after_warmup": _rate(after),
        "first_tokens": _rate(tokens[:5]),
        "warmup": done[0] if done else None,
        "modes": sorted({e["mode"] for e in tokens}),
    }
    print("forced resident, file resident:", flush=True)
    ev = r.run("resident", "resident", r.args.resident_tokens)
    return auto_cold, _rate([e for e in ev if e["event"] == "token"])


def _forced_direct(r: Runner, name: str) -> dict[str, float]:
    """A forced-direct reference run from a cold page cache."""
    print(f"forced direct, cold ({name}):", flush=True)
    drop_caches(r.args.model)
    ev = r.run(name, "direct", r.args.tokens)
    return _rate([e for e in ev if e["event"] == "token"])


def _balloon(r: Runner, args: argparse.Namespace) -> dict[str, Any]:
    """Auto run under a RAM limit; a balloon grows mid-run, holds, and goes away."""
    print(f"auto with a {args.balloon_gib} GiB balloon, --ram-limit {args.ram_limit}:",
          flush=True)
    swap_before = psutil.swap_memory().used
    timeline = r.scratch / "balloon-timeline.jsonl"
    with timeline.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c",
             f"import time; time.sleep({args.balloon_after_s}); import sys; "
             f"from bench.balloon import main; sys.exit(main(['--gib', '{args.balloon_gib}', "
             f"'--hold-s', '{args.balloon_hold_s}']))"],
            stdout=out,
        )
        try:
            ev = r.run("balloon", "auto", args.balloon_tokens,
                       ram_limit=parse_size(args.ram_limit), sample_ms=250.0)
        finally:
            code = proc.wait(timeout=120)
    steps = [json.loads(x) for x in timeline.read_text().splitlines() if x.strip()]
    tokens = [e for e in ev if e["event"] == "token"]
    switches = [e for e in ev if e["event"] == "mode_switch"]
    to_direct = next((s for s in switches if s["to"] == "direct"), None)
    phases: dict[str, list[dict[str, Any]]] = {"before": [], "direct": [], "after": []}
    for e in tokens:
        if to_direct is None or _ts(e) < _ts(to_direct):
            phases["before"].append(e)
        elif e["mode"] == "direct":
            phases["direct"].append(e)
        else:
            phases["after"].append(e)
    full = next((s["t"] for s in steps if s.get("held_bytes") == args.balloon_gib << 30), None)
    return {
        "balloon_exit_code": code,
        "balloon_steps": len(steps),
        "swap_used_growth_bytes": psutil.swap_memory().used - swap_before,
        "switches": [{"to": s["to"], "token": s["token"], "took_ms": s.get("took_ms"),
                      "reason": s["reason"], "t": _ts(s)} for s in switches],
        "balloon_full_t": full,
        # the switch event is written once the release (unregister, unmap, drop) is done;
        # the decision came took_ms earlier (negative: before the balloon was full)
        "switch_logged_after_balloon_full_s": round(_ts(to_direct) - full, 3)
        if to_direct is not None and full is not None else None,
        "switch_decided_after_balloon_full_s":
            round(_ts(to_direct) - to_direct.get("took_ms", 0.0) / 1000.0 - full, 3)
        if to_direct is not None and full is not None else None,
        "phases": {k: _rate(v) for k, v in phases.items()},
        **_step_before(steps, to_direct),
    }


def _partial(r: Runner, args: argparse.Namespace) -> dict[str, Any]:
    """RAM below the model: forced direct vs auto (direct plus a host tier of hot experts).

    ``--partial-ram`` is the available RAM the controller should believe in; ``--ram-limit``
    is derived from the machine's reading so that, alternately, each run starts cold.
    """
    vm = psutil.virtual_memory()
    limit = vm.total - vm.available + parse_size(args.partial_ram)
    out: dict[str, Any] = {"believed_available_bytes": parse_size(args.partial_ram)}
    for rnd in range(2):
        for mode in ("direct", "auto"):
            drop_caches(args.model)
            ev = r.run(f"partial_{mode}_{rnd}", mode, args.tokens, ram_limit=limit,
                       margin_bytes=parse_size(args.margin))
            tokens = [e for e in ev if e["event"] == "token"]
            tiers = [e["bytes"] for e in ev if e["event"] == "host_tier"]
            out.setdefault(mode, []).append(
                {**_rate(tokens), "modes": sorted({e["mode"] for e in tokens}),
                 "tier_bytes_last": tiers[-1] if tiers else 0})
    return out


def _step_before(steps: list[dict[str, Any]], switch: dict[str, Any] | None) -> dict[str, Any]:
    """The balloon's last step before the decision to switch to direct: what it held, and
    how long before the decision (the event is logged after the release, took_ms later)."""
    if switch is None:
        return {}
    t = _ts(switch) - switch.get("took_ms", 0.0) / 1000.0
    before = [s for s in steps if "held_bytes" in s and s["t"] <= t]
    if not before:
        return {}
    return {"held_bytes_at_switch": before[-1]["held_bytes"],
            "decision_after_last_step_s": round(t - before[-1]["t"], 3)}


def _figures(r: dict[str, Any]) -> dict[str, Any]:
    fig: dict[str, Any] = {}
    refs = [x for x in (r.get(k, {}).get("tokens_per_s")
                        for k in ("forced_direct", "forced_direct_again")) if x]
    direct = sum(refs) / len(refs) if refs else None  # the mean of the forced direct runs
    resident = r.get("forced_resident", {}).get("tokens_per_s")
    if direct and resident:
        fig["resident_over_direct"] = round(resident / direct, 3)
        fig["report_gain_for_comparison"] = 1.52
    auto = r.get("auto_cold", {}).get("after_warmup", {}).get("tokens_per_s")
    if auto and resident:
        fig["auto_after_warmup_over_resident"] = round(auto / resident, 3)
    part = r.get("partial")
    if part:
        d = sum(x["tokens_per_s"] for x in part["direct"])
        a = sum(x["tokens_per_s"] for x in part["auto"])  # as many runs of each
        fig["partial_auto_over_direct"] = round(a / d, 3) if d else None
        fig["partial_storage_ratio"] = round(
            sum(x["storage_gbps"] / x["tokens_per_s"] for x in part["auto"])
            / max(1e-9, sum(x["storage_gbps"] / x["tokens_per_s"] for x in part["direct"])), 3)
    b = r.get("balloon")
    if b:
        fig["balloon_switches"] = [s["to"] for s in b["switches"]]
        fig["balloon_survived"] = b["balloon_exit_code"] == 0
        fig["swap_growth_bytes"] = b["swap_used_growth_bytes"]
        pd = b["phases"]["direct"].get("tokens_per_s")
        if pd and direct:
            fig["balloon_direct_phase_over_forced_direct"] = round(pd / direct, 3)
            fig["balloon_direct_phase_over_each_forced_direct"] = [round(pd / x, 3) for x in refs]
    return fig


if __name__ == "__main__":
    exit_with("python -m bench.controller", main)
