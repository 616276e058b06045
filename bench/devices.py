"""``python -m bench.devices``: what a second device adds, in copy bandwidth and tokens/s.

Two parts, each a ratio against a reference measured in the same run:

- **host-to-device copies** (``bench.h2d_copies``; CuPy only; on the host backend the part
  is skipped with a note, its "copies" being memcpy): per device, a pinned host buffer
  allocated under that device (``Backend.alloc_host``, so it is page-locked for that
  device's context) and a device
  buffer of the same size; ``--h2d-copies`` copies of it queued on one stream of that device
  and synchronized, first on each device alone, then on every device at once, one thread
  per device started together by a barrier. Aggregate GB/s is all devices' bytes over the
  wall time from the first start to the last finish; the figure is aggregate over the best
  single device (the aim: >= 1.8 with two devices). ``--h2d-rounds`` rounds; medians.
- **decode**: ``pipeline.cli.run.run`` on the model, for each mode of ``--modes``, once on the
  first device of ``--devices`` and once on all of them, at the same budget per device
  (``benchkit.budget_for`` of ``--budget-share`` for one device; N times those experts in
  total for N devices, which the run splits by free device memory), fixed compute
  (``--layer-ms`` per layer) and the calibrated synthetic routing of ``--seed``. Before a
  direct run the file is dropped from the page cache; before a resident run it is read
  into it. Figures come from the runs' JSON-lines logs over the tokens after the first
  ``--*skip-tokens``: tokens/s (from ``wall_ms``), hit rate, and per device hits, misses and
  file bytes (the token events' ``devices`` lists), their balance (largest device's file
  bytes over the mean) and whether each device's peak stayed within its budget.

The result goes to ``bench/results/devices-HOST.json`` with machine (device names
included), commit and command.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvloop

from bench.h2d_copies import H2D_TARGET, h2d_figures
from bench.kit import budget_for, drop_caches, make_resident, parse_modes, run_command
from bench.rates import window_rate
from bench.record import provenance, write_result
from moestream.gpu.selection import select_backend
from moestream.pipeline.cli.run import RunSummary, run
from moestream.pipeline.foundation.config import Budget, ComputeSpec, Mode, parse_devices
from moestream.pipeline.foundation.errors import UsageError
from moestream.pipeline.foundation.machine import machine_info
from moestream.pipeline.foundation.table import ExpertTable, open_table
from moestream.pipeline.proxy.config import RunConfig
from moestream.tools.analyze.device_report import device_balance

__all__ = ["RunSpec", "device_window", "main"]

PROG = "bench_devices"
GB = 1e9
MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class RunSpec:
    """One decode: its I/O mode, devices and token counts."""

    mode: Mode
    devices: tuple[int, ...]
    tokens: int
    skip: int

    @property
    def name(self) -> str:
        return f"{self.mode}_{len(self.devices)}dev"


def _read_log(log: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The run_start event and the token events of a run log."""
    start: dict[str, Any] = {}
    tokens: list[dict[str, Any]] = []
    with log.open() as f:
        for event in map(json.loads, f):
            if event.get("event") == "run_start":
                start = event
            elif event.get("event") == "token":
                tokens.append(event)
    return start, tokens


def _counts_add_up(events: Sequence[dict[str, Any]]) -> bool | None:
    """Whether every token's device entries add up to its hits, misses and file bytes;
    None when the tokens carry none (a one-device run)."""
    with_devices = [e for e in events if "devices" in e]
    if not with_devices:
        return None
    return len(with_devices) == len(events) and all(
        sum(d[k] for d in e["devices"]) == e[k]
        for e in with_devices for k in ("hits", "misses", "file_bytes"))


def device_window(events: Sequence[dict[str, Any]], start: dict[str, Any],
                  summary: dict[str, Any]) -> list[dict[str, Any]]:
    """Per device over ``events``: hits, misses, hit rate, file bytes and their share,
    stall and compute per token; budget (at the start, and final) and peak.

    A one-device run's tokens carry no ``devices`` list: its one device has the tokens'
    own figures.

    Args:
        events: the token events of the window.
        start: the run's ``run_start`` event (its ``devices`` give each start budget).
        summary: the run's ``RunSummary.as_dict()`` (its ``devices`` give peaks).
    """
    starts = {d["device"]: d for d in start.get("devices", [])}
    ends = {d["device"]: d for d in summary["devices"]}
    order = list(starts) or list(ends)
    totals = {d: {"hits": 0, "misses": 0, "file_bytes": 0, "stall_ms": 0.0,
                  "compute_ms": 0.0} for d in order}
    for e in events:
        for entry in e.get("devices") or [{"device": order[0], **e}]:
            row = totals.setdefault(entry["device"], dict.fromkeys(totals[order[0]], 0))
            for k in row:
                row[k] += entry[k]
    file_all = sum(t["file_bytes"] for t in totals.values())
    rows = []
    for device, t in totals.items():
        looks = t["hits"] + t["misses"]
        budget = starts.get(device, {}).get("budget_bytes")
        end = ends.get(device, {})
        peak = end.get("peak_device_bytes")
        rows.append({
            "device": device, "name": starts.get(device, {}).get("name"),
            "hits": t["hits"], "misses": t["misses"],
            "hit_rate": round(t["hits"] / looks, 4) if looks else None,
            "file_bytes": t["file_bytes"],
            "file_share": round(t["file_bytes"] / file_all, 4) if file_all else None,
            "stall_ms_per_token": round(t["stall_ms"] / max(1, len(events)), 3),
            "compute_ms_per_token": round(t["compute_ms"] / max(1, len(events)), 3),
            "budget_bytes": budget, "final_budget_bytes": end.get("budget_bytes"),
            "peak_device_bytes": peak,
            # against the budget it started with: a device OOM can only shrink it later
            "peak_within_budget": (None if peak is None
                                   else peak <= (budget or end.get("budget_bytes", 0))),
        })
    return rows


class DevicesBench:
    """The model, the per-device budget, where logs go, and the runs done so far.

    Args:
        args: the command line.
        table: the model.
        backend: the backend name every run uses (``host`` or ``cupy``).
        log_dir: where the run logs go (made if absent).
    """

    def __init__(self, args: argparse.Namespace, table: ExpertTable, backend: str,
                 log_dir: Path) -> None:
        self.args = args
        self.table = table
        self.backend = backend
        self.log_dir = log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        self.device_budget = budget_for(table, args.budget_share)
        self.runs: dict[str, dict[str, Any]] = {}

    def budget(self, devices: int) -> Budget:
        """The run's total: the one-device budget's experts on each device."""
        assert self.device_budget.experts is not None  # budget_for counts experts
        return Budget(experts=devices * self.device_budget.experts)

    def run(self, spec: RunSpec) -> dict[str, Any]:
        """Put the file in the mode's state, decode ``spec`` with a log; returns (and
        keeps) its figures."""
        if spec.mode == "resident":
            before: dict[str, Any] = {"warmed": make_resident(self.table.path)}
        else:
            drop_caches(self.table.path)
            before = {"dropped": True}
        log = self.log_dir / f"{spec.name}.jsonl"
        budget = self.budget(len(spec.devices))
        cfg = RunConfig(
            model=self.table.path, tokens=spec.tokens, mode=spec.mode, budget=budget,
            compute=ComputeSpec("fixed", self.args.layer_ms), backend=self.backend,
            devices=spec.devices, queue_depth=16, chunk_bytes=1 * MIB, staging_slots=32,
            upload_streams=4, seed=self.args.seed, log=log, verify=not self.args.no_verify,
        )
        t0 = time.perf_counter()
        summary: RunSummary = uvloop.run(run(cfg))
        seconds = time.perf_counter() - t0
        start, every = _read_log(log)
        events = [e for e in every if e["token"] >= spec.skip]
        window = {k: round(v, 4) if isinstance(v, float) else v
                  for k, v in window_rate(events).items()}
        totals = summary.as_dict()
        devices = device_window(events, start, totals)
        figures = {
            "mode": spec.mode, "devices": list(spec.devices), "budget": str(budget),
            "compute": str(cfg.compute), "skipped_tokens": spec.skip, **window,
            "per_device": devices,
            "device_balance": _rounded(device_balance(devices)),
            "device_counts_add_up": _counts_add_up(every),
            "budget_never_exceeded": all(d["peak_within_budget"] for d in devices),
            "before": before,
            "log": str(log) if self.args.log_dir is not None else None,
            "seconds": round(seconds, 2),
            "summary": totals,
        }
        self.runs[spec.name] = figures
        print(f"  {spec.name} on {','.join(map(str, spec.devices))}: "
              f"{window['tokens_per_s']:.2f} tok/s, hit rate {window['hit_rate']:.3f}, "
              f"balance {figures['device_balance']}, {seconds:.1f} s", flush=True)
        return figures


def _rounded(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def mode_figures(runs: dict[str, dict[str, Any]], n_devices: int) -> dict[str, Any]:
    """Per mode: all devices over the first alone in tokens/s, hit rates, per-device hit
    rates and budgets, and the balance of file bytes over the devices."""
    out: dict[str, Any] = {}
    for mode in dict.fromkeys(r["mode"] for r in runs.values()):
        one, every = runs.get(f"{mode}_1dev"), runs.get(f"{mode}_{n_devices}dev")
        if one is None or every is None:
            continue
        tps_one, tps_all = one["tokens_per_s"], every["tokens_per_s"]
        out[mode] = {
            "devices": n_devices,
            "tokens_per_s_one": tps_one, "tokens_per_s_all": tps_all,
            "all_over_one": round(tps_all / tps_one, 3) if tps_one > 0 else None,
            "hit_rate_one": one["hit_rate"], "hit_rate_all": every["hit_rate"],
            "device_hit_rates": {str(d["device"]): d["hit_rate"]
                                 for d in every["per_device"]},
            "file_bytes_balance": every["device_balance"],
            "budget_bytes_one": one["per_device"][0]["budget_bytes"],
            "budget_bytes_per_device": {str(d["device"]): d["budget_bytes"]
                                        for d in every["per_device"]},
        }
    return out


def _check(args: argparse.Namespace) -> tuple[list[Mode], tuple[int, ...]]:
    """The modes and devices, once every option is checked."""
    modes = parse_modes(args.modes)
    devices = parse_devices(args.devices)
    if len(devices) < 2 or len(set(devices)) != len(devices) or min(devices) < 0:
        raise UsageError(f"--devices needs at least two distinct device indices (two devices "
                         f"are compared with one), not {args.devices!r}")
    for tokens, skip, what in ((args.tokens, args.skip_tokens, "--tokens"),
                               (args.direct_tokens, args.direct_skip_tokens,
                                "--direct-tokens")):
        if skip < 0 or tokens <= skip:
            raise UsageError(f"{what} {tokens} leaves no token after skipping {skip}")
    if not 0 < args.budget_share <= 1:
        raise UsageError(f"--budget-share must be in (0, 1], not {args.budget_share}")
    if args.h2d_mib < 1 or args.h2d_copies < 1 or args.h2d_rounds < 1:
        raise UsageError("--h2d-mib, --h2d-copies and --h2d-rounds must be >= 1")
    return modes, devices


def _notes(args: argparse.Namespace, backend: str, devices: tuple[int, ...],
           h2d: dict[str, Any] | None) -> list[str]:
    n = len(devices)
    notes = [
        f"decode: each mode runs on device {devices[0]} alone and on {n} devices "
        f"({','.join(map(str, devices))}) with the same budget per device: "
        f"{args.budget_share:g} of each layer's experts ({n}x that many experts in total for "
        f"{n} devices, which the run splits by free device memory, so a device's budget can "
        "differ slightly from the one-device run's: budget_bytes_per_device); the devices "
        "together cache more experts, so all_over_one combines a higher hit rate with "
        "loads spread over the devices' links",
        f"compute fixed:{args.layer_ms} ms per layer and the calibrated synthetic routing "
        f"(seed {args.seed}): both runs of a mode route the same tokens alike",
        "before each direct run the file was dropped from the page cache (drop_caches: "
        "vm.drop_caches when root, and fadvise DONTNEED); before each resident run it was "
        "read into it (WarmEngine); in direct mode every device's misses read the same "
        "storage, so its gain is bounded by the disk",
        f"direct runs decode {args.direct_tokens} tokens and skip {args.direct_skip_tokens}, "
        f"resident runs {args.tokens} and skip {args.skip_tokens}: compare runs within a "
        "mode; device_balance is the largest device's file bytes over the devices' mean "
        "(1.0: even)",
        "budget_never_exceeded: every device's peak (cache entries plus parked buffers) "
        "within the budget it started with (run_start.devices)",
    ]
    if backend == "host":
        notes.append("host backend: the emulated devices share this machine's CPUs and "
                     "memory, so its ratios check the command, not a multi-GPU machine")
    if h2d is None:
        notes.append(f"host-to-device part skipped: backend {backend} has no host-to-device "
                     "link (its copies are memcpy in host memory); run with --backend cupy "
                     "on a machine with the GPUs")
    else:
        notes.append(
            f"host-to-device: {h2d['copies']} copies of {h2d['bytes_per_copy'] // MIB} MiB "
            "per measurement from pinned memory allocated under each device, one stream per "
            "device, wall time from queueing the first copy to the stream's synchronize; "
            "together: one thread per device released by a barrier, aggregate = all bytes "
            "over first start to last finish; medians of the rounds. Pinned buffers land "
            "on the NUMA node of the allocating thread, not necessarily each GPU's")
    return notes


def _print_table(runs: dict[str, dict[str, Any]], figures: dict[str, Any]) -> None:
    print(f"\n{'run':<16} {'devices':>8} {'tok/s':>8} {'hit rate':>8} {'stall ms/tok':>12} "
          f"{'balance':>7} {'budget ok':>9}")
    for name, r in runs.items():
        balance = "-" if r["device_balance"] is None else f"{r['device_balance']:.3f}"
        print(f"{name:<16} {','.join(map(str, r['devices'])):>8} {r['tokens_per_s']:>8.2f} "
              f"{r['hit_rate']:>8.3f} {r['stall_ms_per_token']:>12.2f} {balance:>7} "
              f"{r['budget_never_exceeded']!s:>9}")
    h2d = figures["h2d"]
    if "skipped" in h2d:
        print(f"h2d: skipped ({h2d['skipped']})")
    else:
        alone = ", ".join(f"device {d} {g:.1f}" for d, g in h2d["single_gbps"].items())
        print(f"h2d GB/s: alone {alone}; together {h2d['aggregate_gbps']:.1f} = "
              f"{h2d['aggregate_over_best_single']}x the best single (target {H2D_TARGET})")
    for mode, fig in figures["modes"].items():
        print(f"{mode}: {fig['devices']} devices over 1: {fig['all_over_one']}x tokens/s, "
              f"hit rate {fig['hit_rate_one']:.3f} -> {fig['hit_rate_all']:.3f}, "
              f"file bytes balance {fig['file_bytes_balance']}")
    print(f"budget never exceeded: {figures['budget_never_exceeded']}")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.devices",
                                description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, required=True,
                   help="GGUF model (ds4-flash-q2 shaped, e.g. 20 layers x 256 experts)")
    p.add_argument("--backend", default="auto", choices=["auto", "host", "cupy"])
    p.add_argument("--devices", default="0,1",
                   help="devices compared with the first alone (0,1; on the host backend "
                   "indices emulate devices)")
    p.add_argument("--modes", default="direct,resident", help="I/O modes (direct,resident)")
    p.add_argument("--tokens", type=int, default=96, help="tokens per resident run (96)")
    p.add_argument("--skip-tokens", type=int, default=8,
                   help="first tokens of a resident run left out of the figures (8)")
    p.add_argument("--direct-tokens", type=int, default=24,
                   help="tokens per direct run (24: they run at disk speed)")
    p.add_argument("--direct-skip-tokens", type=int, default=4,
                   help="first tokens of a direct run left out of the figures (4)")
    p.add_argument("--layer-ms", type=float, default=0.57, help="fixed compute per layer (0.57)")
    p.add_argument("--budget-share", type=float, default=0.15,
                   help="cache budget per device as a share of each layer's experts (0.15)")
    p.add_argument("--seed", type=int, default=0, help="synthetic routing seed (0)")
    p.add_argument("--h2d-mib", type=int, default=1024,
                   help="pinned buffer per device for the copy part, MiB (1024)")
    p.add_argument("--h2d-copies", type=int, default=8, help="copies per measurement (8)")
    p.add_argument("--h2d-rounds", type=int, default=3,
                   help="rounds of alone + together measurements (3)")
    p.add_argument("--no-verify", action="store_true",
                   help="skip install digests (the host backend computes them on the CPU)")
    p.add_argument("--log-dir", type=Path,
                   help="keep the runs' JSON-lines logs here (default: a temporary "
                   "directory, removed); moestream.tools.analyze reads them")
    p.add_argument("--out", type=Path,
                   help="result JSON (default bench/results/devices-HOST.json)")
    p.add_argument("--debug", action="store_true", help="debug events and tracebacks")
    return p


def _tokens(args: argparse.Namespace, mode: Mode) -> tuple[int, int]:
    return ((args.tokens, args.skip_tokens) if mode == "resident"
            else (args.direct_tokens, args.direct_skip_tokens))


@contextmanager
def _log_dir(path: Path | None) -> Iterator[Path]:
    if path is not None:
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="moestream-devices-") as tmp:
        yield Path(tmp)


def _bench(args: argparse.Namespace, argv: Sequence[str]) -> int:
    modes, devices = _check(args)
    table = open_table(args.model)
    with ExitStack() as stack:
        backends = [select_backend(args.backend, d) for d in devices]
        for b in backends:
            stack.callback(b.close)
        backend = backends[0].name
        gpu = backends[0].device_name if backend == "cupy" else None
        result: dict[str, Any] = {
            **provenance("bench.devices", argv, **machine_info(table.path, gpu),
                         backend=backend,
                         devices={str(b.device): b.device_name for b in backends}),
            "settings": {k: str(v) if isinstance(v, Path) else v
                         for k, v in vars(args).items()},
        }
        h2d = None
        if backend == "cupy":
            print(f"host-to-device copies ({args.h2d_copies} x {args.h2d_mib} MiB, "
                  f"{args.h2d_rounds} rounds):", flush=True)
            h2d = h2d_figures(backends, args.h2d_mib * MIB, args.h2d_copies, args.h2d_rounds)
    with _log_dir(args.log_dir) as log_dir:
        bench = DevicesBench(args, table, backend, log_dir)
        result["budget_per_device"] = str(bench.device_budget)
        for mode in modes:
            tokens, skip = _tokens(args, mode)
            print(f"{mode} ({tokens} tokens, first {skip} left out):", flush=True)
            for devs in ((devices[0],), devices):
                bench.run(RunSpec(mode, devs, tokens, skip))
    runs = bench.runs
    figures: dict[str, Any] = {
        "h2d": h2d if h2d is not None else {"skipped": f"backend {backend}"},
        "modes": mode_figures(runs, len(devices)),
        "budget_never_exceeded": all(r["budget_never_exceeded"] for r in runs.values()),
    }
    result["runs"] = runs
    result["figures"] = figures
    result["notes"] = _notes(args, backend, devices, h2d)
    out = args.out or Path("bench/results") / f"devices-{platform.node()}.json"
    write_result(out, result)
    _print_table(runs, figures)
    print(f"written: {out}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point; returns the exit code (2 for bad input)."""
    return run_command(PROG, _parser(), _bench, argv)


if __name__ == "__main__":
    sys.exit(main())
