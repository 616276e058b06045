"""``python -m bench.hostpath``: the streaming layers' own host time, with a free device.

What the Python around the copies costs, isolated from them: the cache and the streamer
run as under a decode (per layer ``ExpertStreamer.start_layer``, a wait for each miss's
arrival, a compute event and the release of the layer's pins; per token installs, the
cache's token advance and the digest read-back), on a stand-in device whose copies,
kernels and events cost nothing (``NullDevice``, ``NullKernels``). It registers the
model's mapping like a GPU does, so resident misses take the registered-mapping path that
the CuPy backend takes. Decode's own per-expert work (the kernels it queues, its lease
bookkeeping) is not in these figures: that layer is being rebuilt on the lease API. Two
phases per model:

- ``hit``: every layer's experts are cached (a warm-up pass made them): host microseconds
  per layer. This is what all-cached decode spends beside compute (the aim: at
  most 20 us per layer on the ds4 shape).
- ``resident_miss``: a cyclic sweep with a budget of a few layers' experts, resident mode,
  so every lookup misses, evicts and copies from the registered mapping: host microseconds
  per layer and per miss (~24 us per expert on the H200 at first).

Each phase is timed ``--repeats`` times; the median and the least are reported (two cores
shared with other work make single runs noisy: the least is the cost without interference).
The figures are Python time on this machine's CPU; on a GPU each copy, event and kernel
launch adds its own CUDA call time on top (``bench.pipeline`` measures the whole).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import uvloop

from bench.kit import exit_with, make_resident
from bench.record import provenance, write_result
from moestream.gpu.backend import DeviceArray, DeviceBuffer, Stream
from moestream.gpu.cache.store import DeviceCache
from moestream.gpu.host import HostBackend
from moestream.gpu.kernels import HostKernels
from moestream.pipeline.foundation.config import Budget, ComputeSpec
from moestream.pipeline.foundation.table import ExpertTable, open_table
from moestream.pipeline.proxy.config import RunConfig
from moestream.pipeline.streaming.streamer import ExpertStreamer
from moestream.stages.layout import plan_expert

__all__ = ["NullDevice", "NullKernels", "main"]


class NullDevice(HostBackend):
    """Host memory standing in for a GPU that registers the mapping; copies cost nothing.

    ``registers_host`` is True (every window "registers"), so resident misses take the
    CuPy backend's path: copies queued from the mapping on the loop thread. Copies are not
    made (``copies`` and ``bytes_copied`` count them): the bench times the Python around them.
    """

    name = "null"
    registers_host = True

    def __init__(self, device: int = 0) -> None:
        super().__init__(device)
        self.device_name = "null (host, copies skipped)"
        self.copies = 0
        self.bytes_copied = 0

    def register_host(self, array: npt.NDArray[np.uint8]) -> bool:
        return True

    def copy_h2d(self, dst: DeviceBuffer, dst_offset: int, src: npt.NDArray[np.uint8],
                 stream: Stream) -> None:
        self.copies += 1
        self.bytes_copied += int(src.size)

    def copy_h2d_batch(self, copies: npt.NDArray[np.uint64], stream: Stream) -> None:
        self.copies += copies.shape[1]
        self.bytes_copied += int(copies[2].sum())


class NullKernels(HostKernels):
    """Kernels that do nothing: digests stay zero, ``busy`` returns at once."""

    def digest3(self, buf: DeviceBuffer, ranges: Sequence[tuple[int, int]],
                results: Any, row: int, stream: Stream) -> None:
        pass

    def busy(self, ms: float, data: DeviceArray | None, stream: Stream) -> None:
        pass

    def gather(self, copies: npt.NDArray[np.uint64], stream: Stream) -> None:
        pass


def _routes(table: ExpertTable, tokens: int, start: int) -> list[list[list[int]]]:
    """Token t, every layer: experts ``start + t*k .. + k`` (mod n), distinct per token."""
    n, k = table.n_experts, table.top_k
    return [[[(start + t * k + j) % n for j in range(k)] for _ in table.moe_layers]
            for t in range(tokens)]


async def _register(streamer: ExpertStreamer, table: ExpertTable) -> float:
    """Resident mode with every window of the mapping registered; the share registered."""
    await streamer.set_mode("resident")
    for _ in range(5):  # a window with a page evicted meanwhile (another process
        # dropping caches) is not registered: its misses would be read, not copied
        if streamer.pinned_bytes >= table.file_bytes:
            break
        await asyncio.to_thread(make_resident, table.path)
        streamer.register_resident()
        await streamer.registered()
    return streamer.pinned_bytes / table.file_bytes


async def _decode(streamer: ExpertStreamer, cache: DeviceCache, compute: Stream,
                  layers: Sequence[int], routes: list[list[list[int]]]) -> float:
    """Seconds to run ``routes`` through the streamer as decode does, with no compute."""
    t0 = time.perf_counter()
    for route in routes:
        for layer, experts in zip(layers, route, strict=True):
            load = streamer.start_layer(layer, experts)
            for _ in range(load.pending):  # what decode does per miss, at least
                assert load.arrived is not None
                entry, error = await load.arrived.get()
                if error is not None:
                    raise error
                if entry.upload is not None:
                    compute.wait(entry.upload)
            done = compute.record()
            cache.release([*load.plan.hits, *load.plan.misses], done)
        streamer.poll_installs()
        cache.advance_token()
        streamer.take_digests()
    return time.perf_counter() - t0


async def _phase(table: ExpertTable, *, resident_miss: bool, tokens: int, repeats: int,
                 verify: bool, gather: bool) -> dict[str, Any]:
    """Time ``tokens`` tokens ``repeats`` times; returns per-layer and per-miss medians."""
    k = table.top_k
    layers = table.moe_layers
    size = plan_expert(table.slices((layers[0], 0))).device_bytes
    # misses: two tokens' worth of experts under LRU on a sweep that never repeats within
    # n_experts / k tokens, so every lookup misses; hits: room for everything used
    budget = Budget(experts=2 * k * len(layers)) if resident_miss else None
    cfg = RunConfig(model=table.path, compute=ComputeSpec("fixed", 0.57), verify=verify,
                    gather=gather,
                    upload_streams=4, budget=budget)
    backend = NullDevice()
    kernels = NullKernels()
    nbytes = budget.resolve(size) if budget is not None else size * k * len(layers) * 2
    cache = DeviceCache(backend, nbytes, "lru", min_bytes=k * size)
    streamer = ExpertStreamer(cfg, table, backend, cache, kernels)
    compute = backend.new_stream()
    sweep = table.n_experts // k
    samples: list[float] = []
    try:
        registered_share = await _register(streamer, table)
        warm = _routes(table, 1, 0)
        # hits: make them cached; misses: warm the code paths
        await _decode(streamer, cache, compute, layers, warm)
        misses0 = cache.counters.misses
        hits0 = cache.counters.hits
        for r in range(repeats):
            routes = (_routes(table, tokens, (1 + r * tokens) % sweep * k) if resident_miss
                      else warm * tokens)
            samples.append(await _decode(streamer, cache, compute, layers, routes))
        counters = cache.counters
        misses = counters.misses - misses0
        hits = counters.hits - hits0
    finally:
        await streamer.aclose()
        cache.close()
    out: dict[str, Any] = {
        "tokens": tokens, "repeats": repeats, "layers": len(layers), "top_k": k,
        "hits": hits, "misses": misses, "registered_share": round(registered_share, 4),
        **_per_layer(samples, tokens * len(layers)),
    }
    if resident_miss:
        layer_calls = tokens * len(layers)
        out["host_us_per_miss"] = round(statistics.median(samples) / layer_calls * 1e6 / k, 2)
        out["host_us_per_miss_least"] = round(min(samples) / layer_calls * 1e6 / k, 2)
        out["copies_per_miss"] = round(backend.copies / max(1, misses + k * len(layers)), 2)
    return out


def _per_layer(samples: Sequence[float], layer_calls: int) -> dict[str, Any]:
    """The host's microseconds a layer: the median run's, the least run's and every run's."""
    return {
        "host_us_per_layer": round(statistics.median(samples) / layer_calls * 1e6, 2),
        "host_us_per_layer_least": round(min(samples) / layer_calls * 1e6, 2),
        "host_us_per_layer_all": [round(s / layer_calls * 1e6, 2) for s in samples],
    }


def bench_model(path: Path, tokens: int, repeats: int, verify: bool,
                gather: bool = True) -> dict[str, Any]:
    table = open_table(path)
    # resident: every window of the mapping "registers" (a window with a page missing is
    # read through staging instead, which this bench is not about)
    result: dict[str, Any] = {"model": table.summary(), "warm_file": make_resident(path)}
    for name, miss in (("hit", False), ("resident_miss", True)):
        result[name] = uvloop.run(_phase(table, resident_miss=miss, tokens=tokens,
                                         repeats=repeats, verify=verify, gather=gather))
        r = result[name]
        if r["registered_share"] < 1.0:
            print(f"  warning: only {r['registered_share']:.2%} of the mapping registered: "
                  "some misses were read through staging", flush=True)
        print(f"  {name}: {r['host_us_per_layer']} us/layer (least {r['host_us_per_layer_least']})"
              + (f", {r['host_us_per_miss']} us/miss (least {r['host_us_per_miss_least']})"
                 if miss else ""), flush=True)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.hostpath",
                                description=__doc__.split("\n")[0] if __doc__ else None)
    p.add_argument("--model", type=Path, action="append", required=True,
                   help="GGUF model; repeat for several shapes")
    p.add_argument("--tokens", type=int, default=40, help="tokens per timed repeat (40)")
    p.add_argument("--repeats", type=int, default=7, help="timed repeats per phase (7)")
    p.add_argument("--no-verify", action="store_true", help="no install digests")
    p.add_argument("--no-gather", action="store_true",
                   help="resident misses through the copy engines' batched copy, not one "
                        "gather per layer")
    p.add_argument("--label", default="", help="a word stored with the result (before/after)")
    p.add_argument("--out", type=Path, help="result JSON (default: print only)")
    args = p.parse_args(argv)
    results: dict[str, Any] = {
        **provenance("bench.hostpath", argv),
        "label": args.label,
        "models": {},
    }
    for path in args.model:
        print(f"{path}:", flush=True)
        results["models"][path.name] = bench_model(path, args.tokens, args.repeats,
                                                   not args.no_verify, not args.no_gather)
    if args.out is not None:
        write_result(args.out, results)
        print(f"written: {args.out}")
    return 0


if __name__ == "__main__":
    exit_with("python -m bench.hostpath", main)
