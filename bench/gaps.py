"""``python -m bench.gaps``: where the device idles in all-cached decode, and why.

All-cached decode falls short of the compute-only rate by the host time the device spends
idle: from the moment the host sees one layer's work finish to the moment it queues the
next layer's first kernel (the host then launches the rest while the device works). This
runs ``bench.pipeline``'s all-cached phase (a replayed calibrated trace, the second pass
measured) and times those gaps directly, split in two:

- **within a token**: between two layers of one token (routing, the fetch, handing out);
- **at a token boundary**: between a token's last layer and the next token's first one
  (``end_token``: verification, the controller, the log line; the loop's yield; all of
  them run beside the last layer's compute when it loaded nothing, ``pipeline.proxy.loop``).

It also times ``end_token`` and the run log's ``emit`` on their own. The wrapping is done
on this run's objects' classes for this process only; each timer adds one
``perf_counter`` call (~0.1 us) to what it measures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from unittest import mock

import uvloop

from bench.kit import exit_with, make_resident
from moestream.gpu import kernels as kernel_module
from moestream.pipeline.cli.run import run
from moestream.pipeline.foundation.config import ComputeSpec
from moestream.pipeline.foundation.table import open_table
from moestream.pipeline.foundation.trace import save_trace
from moestream.pipeline.proxy import decode
from moestream.pipeline.proxy.config import RunConfig
from moestream.pipeline.proxy.synthetic import synthetic_trace
from moestream.pipeline.runlog import write as logs
from moestream.pipeline.streaming import session as session_module

__all__ = ["main"]


class _Clock:
    """The gap from each layer's end to the next layer's first kernel, by kind."""

    def __init__(self, n_layers: int) -> None:
        self.n_layers = n_layers
        self.layers = 0  # layers waited for so far
        self.layer_end: float | None = None
        self.boundary = False  # the last layer waited for was a token's last
        self.gaps: dict[str, list[float]] = {"within": [], "boundary": []}
        self.calls: dict[str, list[float]] = {"end_token": [], "emit": []}

    def first_kernel(self) -> None:
        if self.layer_end is not None:
            self.gaps["boundary" if self.boundary else "within"].append(
                time.perf_counter() - self.layer_end)
            self.layer_end = None

    def timed(self, name: str, fn: Callable[..., Any], is_async: bool) -> Callable[..., Any]:
        calls = self.calls[name]
        if is_async:
            async def wrapped_async(*args: Any, **kwargs: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return await fn(*args, **kwargs)
                finally:
                    calls.append(time.perf_counter() - t0)
            return wrapped_async

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                calls.append(time.perf_counter() - t0)
        return wrapped


def _patches(clock: _Clock) -> list[Any]:
    wait_for_layer = decode.Decoder.wait_for_layer
    busy_of: dict[type, Callable[..., None]] = {
        cls: cls.busy for cls in (kernel_module.CudaKernels, kernel_module.HostKernels)}

    def waited(self: decode.Decoder, done: Any, split: Any) -> None:
        wait_for_layer(self, done, split)
        clock.layer_end = time.perf_counter()
        clock.layers += 1
        clock.boundary = clock.layers % clock.n_layers == 0

    def busy_for(cls: type) -> Callable[..., None]:
        def busy(self: Any, ms: float, data: Any, stream: Any) -> None:
            clock.first_kernel()
            busy_of[cls](self, ms, data, stream)
        return busy

    return [
        mock.patch.object(decode.Decoder, "wait_for_layer", waited),
        *(mock.patch.object(cls, "busy", busy_for(cls)) for cls in busy_of),
        mock.patch.object(session_module.StreamSession, "end_token", clock.timed(
            "end_token", session_module.StreamSession.end_token, True)),
        mock.patch.object(logs.RunLog, "emit", clock.timed("emit", logs.RunLog.emit, False)),
    ]


def _us(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)
    return {"n": len(ordered), "median_us": round(statistics.median(ordered) * 1e6, 2),
            "mean_us": round(statistics.fmean(ordered) * 1e6, 2),
            "p90_us": round(ordered[int(0.9 * (len(ordered) - 1))] * 1e6, 2),
            "max_us": round(ordered[-1] * 1e6, 2)}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gaps", description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--backend", default="auto")
    p.add_argument("--tokens", type=int, default=128, help="tokens per pass (two passes)")
    p.add_argument("--layer-ms", type=float, default=0.57)
    p.add_argument("--no-verify", action="store_true")
    p.add_argument("--no-log", action="store_true", help="run without a run log")
    p.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = p.parse_args(argv)
    table = open_table(args.model)
    make_resident(table.files)
    clock = _Clock(len(table.moe_layers))
    with tempfile.TemporaryDirectory(prefix="moestream-gaps-") as tmp:
        trace_path, log = Path(tmp) / "trace.npz", Path(tmp) / "run.jsonl"
        save_trace(synthetic_trace("ds4-flash", args.tokens, seed=1, n_layers=len(table.layers),
                                   n_experts=table.n_experts, top_k=table.top_k), trace_path)
        cfg = RunConfig(model=table.path, tokens=2 * args.tokens, trace=trace_path,
                        mode="resident", compute=ComputeSpec("fixed", args.layer_ms),
                        backend=args.backend, verify=not args.no_verify,
                        log=None if args.no_log else log)
        patches = _patches(clock)
        for patch in patches:
            patch.start()
        try:
            summary = uvloop.run(run(cfg))
        finally:
            for patch in patches:
                patch.stop()
        wall = [e["wall_ms"] for e in map(json.loads, log.open())
                if e.get("event") == "token"][args.tokens:] if not args.no_log else []
    half = {k: v[len(v) // 2:] for k, v in {**clock.gaps, **clock.calls}.items()}
    n_layers = len(table.layers)
    result: dict[str, Any] = {
        "model": table.summary(), "settings": vars(args) | {"model": str(args.model)},
        "hits": summary.as_dict().get("hits"),
        "wall_ms_per_token": round(statistics.fmean(wall), 4) if wall else None,
        **{k: _us(v) for k, v in half.items()},
    }
    per_token = (n_layers - 1) * result["within"].get("mean_us", 0.0) + result[
        "boundary"].get("mean_us", 0.0)
    result["idle_us_per_token"] = round(per_token, 1)
    print(f"{table.path.name}: {n_layers} layers x top-{table.top_k}; second half of the run")
    for k in ("within", "boundary", "end_token", "emit"):
        print(f"  {k:9s} {result[k]}")
    print(f"  device idle ~{per_token:.0f} us a token"
          + (f" of {result['wall_ms_per_token']} ms wall" if wall else ""))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    exit_with("python -m bench.gaps", main)
