"""``python -m bench.soak``: decode for a fixed wall time while a balloon squeezes RAM.

One run in auto mode decodes for ``--seconds`` while ``bench.balloon`` processes take
``--balloon-gib`` GiB, hold it and give it back, in cycles. ``--ram-limit`` (by default
computed from the RAM in use now, the model size, the margin and the balloon) makes the
controller's view of RAM cross its thresholds as the balloon grows and shrinks, so the run
switches between resident and direct modes under load. At the end the run is cancelled as a
library caller would (which exercises the cancellation cleanup too), and the figures are:

- tokens decoded, mode switches (and tokens per mode);
- verification mismatches (must be 0; every installed expert, and with ``digest`` compute
  every consumed one, is checked against the file);
- peak device bytes against the budget, allocations against frees;
- RSS: anonymous memory after warm-up (once both modes have run, so every staging slot
  and cache buffer has been touched) and at the end (a leak shows as growth), at the start
  of each balloon, and the largest RSS seen;
- processes killed: the balloons' exit codes and the kernel's ``oom_kill`` counter.

The result goes to ``bench/results/soak-HOST.json`` with the commit and the command.

On the GPU machine (a model larger than a few GiB makes the RAM figures meaningful)::

    python -m tools.make_model /data/q2.gguf --preset ds4-flash-q2 --layers 16
    python -m bench.soak --model /data/q2.gguf --backend cupy --seconds 600 --balloon-gib 24
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import uvloop

from bench.kit import exit_with
from bench.record import provenance, write_result
from moestream.pipeline.cli.run import RunSummary, run
from moestream.pipeline.foundation.config import Budget, parse_compute, parse_size
from moestream.pipeline.foundation.table import open_table
from moestream.pipeline.foundation.trace import save_trace
from moestream.pipeline.proxy.config import RunConfig
from moestream.pipeline.proxy.synthetic import synthetic_trace

__all__ = ["SoakPlan", "main", "soak"]

GIB = 1 << 30
MIB = 1 << 20
_REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True, slots=True)
class SoakPlan:
    """What the soak does; every duration in seconds.

    Attributes:
        seconds: wall time of decoding.
        balloon_gib: GiB each balloon takes (in 1 GiB steps, ``step_s`` apart).
        hold_s: how long a balloon holds it all.
        rest_s: pause between balloons (RAM given back).
        first_s: decoding before the first balloon.
        keep_gib: a balloon never leaves less available RAM than this.
        sample_s: how often RSS is sampled.
    """

    seconds: float = 120.0
    balloon_gib: int = 4
    step_s: float = 1.0
    hold_s: float = 12.0
    rest_s: float = 12.0
    first_s: float = 10.0
    keep_gib: float = 2.0
    sample_s: float = 1.0

    @property
    def cycle_s(self) -> float:
        """One balloon from start to exit (at most)."""
        return self.balloon_gib * self.step_s + self.hold_s + 2.0


@dataclass(slots=True)
class _Balloon:
    started_s: float
    proc: asyncio.subprocess.Process
    held_max: int = 0
    stopped_at_floor: bool = False
    returncode: int | None = None
    ended_s: float = 0.0


@dataclass(slots=True)
class _Samples:
    t_s: list[float] = field(default_factory=list)
    rss_anon: list[int] = field(default_factory=list)
    rss: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    available: list[int] = field(default_factory=list)


def _status_bytes(key: str) -> int:
    """A ``kB`` field of /proc/self/status, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _oom_kills() -> int:
    """The kernel's count of processes the OOM killer killed (-1 if not reported)."""
    for line in Path("/proc/vmstat").read_text().splitlines():
        if line.startswith("oom_kill "):
            return int(line.split()[1])
    return -1


async def _start_balloon(plan: SoakPlan, t_s: float) -> _Balloon:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.balloon", "--gib", str(plan.balloon_gib),
        "--step-s", str(plan.step_s), "--hold-s", str(plan.hold_s),
        "--keep-gib", str(plan.keep_gib),
        cwd=_REPO, stdout=asyncio.subprocess.PIPE,
    )
    return _Balloon(t_s, proc)


async def _finish_balloon(b: _Balloon, t_s: float) -> None:
    out, _ = await b.proc.communicate()
    for line in out.decode().splitlines():
        event = json.loads(line)
        b.held_max = max(b.held_max, int(event.get("held_bytes", 0)))
        b.stopped_at_floor = b.stopped_at_floor or "stopped" in event
    b.returncode = b.proc.returncode
    b.ended_s = t_s


async def soak(cfg: RunConfig, plan: SoakPlan) -> dict[str, Any]:
    """Decode under ``cfg`` for ``plan.seconds`` with balloons; the figures."""
    summary = RunSummary()
    oom_before = _oom_kills()
    task = asyncio.ensure_future(run(cfg, summary=summary))
    t0 = time.monotonic()
    samples = _Samples()
    balloons: list[_Balloon] = []
    current: _Balloon | None = None
    next_balloon_s = plan.first_s
    try:
        while (now := time.monotonic() - t0) < plan.seconds and not task.done():
            if current is not None and current.proc.returncode is not None:
                await _finish_balloon(current, now)
                current, next_balloon_s = None, now + plan.rest_s
            if (current is None and now >= next_balloon_s
                    and plan.seconds - now > plan.cycle_s):
                current = await _start_balloon(plan, now)
                balloons.append(current)
            samples.t_s.append(round(now, 2))
            samples.rss_anon.append(_status_bytes("RssAnon"))
            samples.rss.append(_status_bytes("VmRSS"))
            samples.tokens.append(summary.tokens)
            samples.available.append(int(psutil.virtual_memory().available))
            await asyncio.sleep(plan.sample_s)
    finally:
        if current is not None:
            await _finish_balloon(current, time.monotonic() - t0)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task  # a run that failed raises its error here
    return _figures(cfg, plan, summary, samples, balloons, oom_before)


def _figures(cfg: RunConfig, plan: SoakPlan, summary: RunSummary, samples: _Samples,
             balloons: list[_Balloon], oom_before: int) -> dict[str, Any]:
    # Warm-up ends once both modes have run: after the first balloon, the staging slots and
    # the cache's buffers have all been touched once (first touches are not a leak).
    warm_s = balloons[0].ended_s if balloons and balloons[0].ended_s else 0.15 * plan.seconds
    warm = [i for i, t in enumerate(samples.t_s) if t >= warm_s]
    window = max(1, min(10, len(warm) // 4))
    first = warm[:window] or [0]
    last = warm[-window:] or [len(samples.t_s) - 1]
    anon_first = statistics.median(samples.rss_anon[i] for i in first)
    anon_last = statistics.median(samples.rss_anon[i] for i in last)
    switches: list[dict[str, Any]] = []
    if cfg.log is not None:
        for line in cfg.log.read_text().splitlines():
            event = json.loads(line)
            if event["event"] == "mode_switch":
                switches.append({"to": event["to"], "token": event["token"],
                                 "reason": event["reason"], "took_ms": event.get("took_ms")})
    oom_after = _oom_kills()
    return {
        "tokens": summary.tokens,
        "tokens_per_s": round(summary.tokens_per_s, 2),
        "exit": summary.exit,
        "mode_switches": summary.switches,
        "tokens_per_mode": summary.modes,
        "switches": switches,
        "verified": summary.verified,
        "mismatches": summary.mismatches,
        "peak_device_bytes": summary.peak_device_bytes,
        "budget_bytes": summary.budget_bytes,
        "allocations": summary.allocations,
        "frees": summary.frees,
        "warmup_s": round(warm_s, 1),
        "rss_anon_after_warmup_mib": round(anon_first / MIB, 1),
        "rss_anon_at_end_mib": round(anon_last / MIB, 1),
        "rss_anon_growth_mib": round((anon_last - anon_first) / MIB, 1),
        "rss_max_mib": round(max(samples.rss, default=0) / MIB, 1),
        "rss_anon_at_balloon_starts_mib": [
            round(samples.rss_anon[_nearest(samples.t_s, b.started_s)] / MIB, 1)
            for b in balloons if samples.t_s],
        "available_min_gib": round(min(samples.available, default=0) / GIB, 2),
        "balloons": [{"started_s": round(b.started_s, 1), "ended_s": round(b.ended_s, 1),
                      "held_max_gib": round(b.held_max / GIB, 2), "exit_code": b.returncode,
                      "stopped_at_floor": b.stopped_at_floor} for b in balloons],
        "processes_killed": sum(1 for b in balloons if b.returncode is None or b.returncode < 0)
        + (oom_after - oom_before if oom_before >= 0 and oom_after >= 0 else 0),
        "oom_kills_during": oom_after - oom_before if oom_before >= 0 else None,
        "samples": {"t_s": samples.t_s, "rss_anon_mib":
                    [round(x / MIB, 1) for x in samples.rss_anon], "tokens": samples.tokens},
    }


def _nearest(times: list[float], t: float) -> int:
    """The index of the sample taken closest to ``t``."""
    return min(range(len(times)), key=lambda i: abs(times[i] - t))


def _default_ram_limit(model_bytes: int, margin: int, balloon_bytes: int) -> int:
    """A RAM cap under which an empty balloon leaves the model + margin + half the balloon
    usable (resident) and a full one leaves the model - balloon/2 + margin (direct when
    the balloon is larger than twice the margin)."""
    vm = psutil.virtual_memory()
    in_use = int(vm.total - vm.available)
    return in_use + model_bytes + margin + balloon_bytes // 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path,
                   help="model (default: ds4-flash-q2 sizes, 4 layers x 32 experts, ~0.9 GiB)")
    p.add_argument("--seconds", type=float, default=120.0)
    p.add_argument("--balloon-gib", type=int, default=4)
    p.add_argument("--hold-s", type=float, default=12.0)
    p.add_argument("--rest-s", type=float, default=12.0)
    p.add_argument("--backend", default="auto", choices=["auto", "host", "cupy"])
    p.add_argument("--compute", default="digest", help="digest (verifies every use) or fixed:MS")
    p.add_argument("--budget-share", type=float, default=0.25,
                   help="cache budget as a share of all experts (0.25)")
    p.add_argument("--margin", default="1GiB", help="controller margin (1GiB)")
    p.add_argument("--ram-limit", help="controller RAM cap (default: computed, see --help)")
    p.add_argument("--out", type=Path, help="result JSON (default bench/results/soak-HOST.json)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Command line; prints the figures; exit 1 if a soak invariant broke."""
    args = _parser().parse_args(argv)
    plan = SoakPlan(seconds=args.seconds, balloon_gib=args.balloon_gib, hold_s=args.hold_s,
                    rest_s=args.rest_s)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from moestream.pipeline.makers.modelgen import spec_for, write_model

            model = write_model(spec_for("ds4-flash-q2", layers=4, experts=32),
                                Path(tmp) / "soak.gguf")
        table = open_table(model)
        margin = parse_size(args.margin)
        ram_limit = (parse_size(args.ram_limit) if args.ram_limit
                     else _default_ram_limit(table.file_bytes, margin, plan.balloon_gib * GIB))
        experts = max(table.top_k, round(args.budget_share * table.n_experts))
        # routing replays cyclically: a few thousand tokens of it serve any duration
        trace = Path(tmp) / "routing.npz"
        save_trace(synthetic_trace("ds4-flash", 4096, n_layers=len(table.layers),
                                   n_experts=table.n_experts, top_k=table.top_k), trace)
        cfg = RunConfig(model=model, tokens=10**9, trace=trace, mode="auto",
                        backend=args.backend,
                        compute=parse_compute(args.compute),
                        budget=Budget(experts=experts * len(table.layers)),
                        log=Path(tmp) / "soak.jsonl", ram_limit=ram_limit, margin_bytes=margin)
        figures = uvloop.run(soak(cfg, plan))
    result = {
        **provenance("bench.soak", argv),
        "model": {"path": str(args.model or "generated ds4-flash-q2 4x32"),
                  "bytes": table.file_bytes},
        "plan": {"seconds": plan.seconds, "balloon_gib": plan.balloon_gib,
                 "hold_s": plan.hold_s, "rest_s": plan.rest_s,
                 "ram_limit_gib": round(ram_limit / GIB, 2),
                 "margin_gib": round(margin / GIB, 2), "backend": args.backend,
                 "compute": args.compute, "budget_experts": experts * len(table.layers)},
        **figures,
    }
    out = args.out or _REPO / "bench" / "results" / f"soak-{platform.node() or 'host'}.json"
    write_result(out, result)
    shown = {k: v for k, v in result.items() if k not in ("samples",)}
    print(json.dumps(shown, indent=2))
    broken = (result["mismatches"] or result["processes_killed"]
              or result["peak_device_bytes"] > result["budget_bytes"]
              or result["allocations"] != result["frees"])
    return 1 if broken else 0


if __name__ == "__main__":
    exit_with("python -m bench.soak", main)
