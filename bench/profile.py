"""``python -m bench.profile``: where a run's host time goes, function by function.

The pipeline bench says how far a phase is from its limit; this says which Python spends
the difference. It runs ``pipeline.cli.run`` on one of two phases of ``bench.pipeline`` (the
same traces and budgets) under ``cProfile`` and prints the wall time per layer and per
miss from the run's log, then the functions with the most time of their own:

- ``all-cached``: a replayed trace whose second pass hits every expert;
- ``resident-miss``: the cyclic sweep under half its experts' budget, resident mode, so
  every lookup misses and copies from the registered mapping;
- ``direct-miss``: the same sweep in direct mode: every miss read with O_DIRECT into
  staging and uploaded from there (the path of a cold start and of a model larger than
  RAM), where the loop shares the GIL with the reader threads.

``--null`` runs on ``bench.hostpath``'s stand-in device (copies and kernels cost nothing)
to isolate the Python from the device calls; without it the run uses ``--backend``.
Profiling slows Python down about twice: read the shares, not the absolute times.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import pstats
import tempfile
from collections.abc import Sequence
from pathlib import Path
from unittest import mock

import uvloop

from bench.kit import exit_with, make_resident
from bench.pipeline import sweep_trace
from moestream.pipeline.cli.run import run
from moestream.pipeline.foundation.config import Budget, ComputeSpec
from moestream.pipeline.foundation.table import open_table
from moestream.pipeline.foundation.trace import save_trace
from moestream.pipeline.proxy.config import RunConfig
from moestream.pipeline.proxy.synthetic import synthetic_trace

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.profile",
                                description=__doc__.split("\n")[0] if __doc__ else None)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--phase", choices=("all-cached", "resident-miss", "direct-miss"),
                   default="all-cached")
    p.add_argument("--backend", default="auto")
    p.add_argument("--null", action="store_true", help="the stand-in device of bench.hostpath")
    p.add_argument("--no-verify", action="store_true")
    p.add_argument("--no-gather", action="store_true")
    p.add_argument("--tokens", type=int, default=64,
                   help="tokens: all-cached replays this many twice; resident-miss sweeps them "
                        "(the first 8 not counted) (64)")
    p.add_argument("--layer-ms", type=float, default=0.57)
    p.add_argument("--top", type=int, default=30, help="functions listed (30)")
    p.add_argument("--no-profile", action="store_true",
                   help="time only: the per-layer and per-miss figures without cProfile")
    args = p.parse_args(argv)
    with contextlib.ExitStack() as stack:
        if args.null:
            import bench.hostpath as hostpath
            import moestream.pipeline.proxy.decode as client
            import moestream.pipeline.streaming.session as session

            # the session's names for them, swapped for this run only (put back after it:
            # a caller in the same process, a test, gets the real devices again)
            stack.enter_context(mock.patch.object(
                session, "open_backends", lambda cfg: [hostpath.NullDevice()]))
            for module in (session, client):  # the streamer's kernels and the decode's
                stack.enter_context(mock.patch.object(
                    module, "make_kernels", lambda backend_name, *_: hostpath.NullKernels()))
        _profile(args)
    return 0


def _profile(args: argparse.Namespace) -> None:
    table = open_table(args.model)
    if args.phase != "direct-miss":
        make_resident(table.path)  # resident misses copy from registered windows, all of them
    n_layers, k = len(table.layers), table.top_k
    expert_bytes = next(iter(table.layers.values())).expert_bytes
    with tempfile.TemporaryDirectory(prefix="moestream-profile-") as tmp:
        trace_path, log = Path(tmp) / "trace.npz", Path(tmp) / "run.jsonl"
        if args.phase == "all-cached":
            trace = synthetic_trace("ds4-flash", args.tokens, seed=1, n_layers=n_layers,
                                    n_experts=table.n_experts, top_k=k)
            budget, tokens, layer_ms, skip = None, 2 * args.tokens, args.layer_ms, args.tokens
        else:
            sweep = 8
            trace = sweep_trace(n_layers, table.n_experts, k, sweep, 0)
            budget = Budget(nbytes=n_layers * k * sweep * expert_bytes // 2 + (64 << 20))
            tokens, layer_ms, skip = max(args.tokens, 2 * sweep), 0.0, sweep
        save_trace(trace, trace_path)
        cfg = RunConfig(
            model=table.path, tokens=tokens, trace=trace_path,
            mode="direct" if args.phase == "direct-miss" else "resident", budget=budget,
            compute=ComputeSpec("fixed", layer_ms), backend="host" if args.null else args.backend,
            upload_streams=4, prefetch="none" if args.phase == "all-cached" else "oracle",
            # the stand-in device copies nothing: no bytes to verify (its digests are zero)
            lookahead=8, verify=not (args.no_verify or args.null), gather=not args.no_gather,
            log=log,
        )
        profile = None if args.no_profile else cProfile.Profile()
        if profile is not None:
            profile.enable()
        uvloop.run(run(cfg))
        if profile is not None:
            profile.disable()
        with log.open() as f:
            events = [e for e in map(json.loads, f) if e.get("event") == "token"][skip:]
    wall_ms = sum(e["wall_ms"] for e in events) / len(events)
    misses = sum(e["misses"] for e in events) / len(events)
    # the loop thread's CPU against the wall: equal when it never sleeps (busy, or spinning
    # in a CUDA wait), lower when it waits in the kernel (a read, a blocking sync)
    cpu_ms = sum(e.get("cpu_ms", 0.0) for e in events) / len(events)
    under = "" if profile is None else " under the profiler"
    print(f"{args.phase}: {wall_ms * 1000 / n_layers:.1f} us/layer{under}"
          + (f", {wall_ms * 1000 / misses:.1f} us/miss" if misses else "")
          + f", loop thread CPU {cpu_ms / wall_ms:.2f} x wall"
          + f" = {cpu_ms * 1000 / n_layers:.1f} us a layer"
          + f" ({len(events)} tokens, {misses:.1f} misses a token)")
    if profile is not None:
        pstats.Stats(profile).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    exit_with("python -m bench.profile", main)
