"""What one API call costs on the host, async face against sync face.

Every call measured here never waits: all experts are cached and landed before timing.
Per call it runs many rounds and reports the median and p90 in microseconds:

- ``layer``: ``fetch`` of top-k cached experts + ``gather`` + ``release`` of one layer;
- ``layer_available``: the same with ``available()`` (the warm-layer path);
- ``ready``, ``counters``: the pure queries.

The async face runs its calls in a coroutine on the session's loop (uvloop); the sync face
calls ``open_sync``'s session from the main thread. ``ratio`` is sync over async. Prints
one JSON object.

    python -m bench.api_calls [MODEL] [--rounds 3000] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import uvloop

import moestream
from bench.record import provenance

CALLS = ("layer", "layer_available", "ready", "counters")


def _summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {"median_us": round(statistics.median(ordered), 2),
            "p90_us": round(ordered[int(len(ordered) * 0.9)], 2)}


def _timed(fn: Callable[[], Any], rounds: int) -> list[float]:
    out = []
    clock = time.perf_counter
    for _ in range(rounds):
        t0 = clock()
        fn()
        out.append((clock() - t0) * 1e6)
    return out


def _sync_face(model: Path | None, rounds: int) -> dict[str, dict[str, float]]:
    with moestream.open_sync(model, backend="host", mode="direct", verify=False) as ms:
        layer, k = ms.model.moe_layers[0], ms.model.top_k
        experts = list(range(k))
        with ms.fetch(layer, experts) as lease:
            lease.gather()
        ms.end_token()

        def one_layer() -> None:
            with ms.fetch(layer, experts) as lease:
                lease.gather()

        def one_layer_available() -> None:
            with ms.fetch(layer, experts) as lease:
                lease.available()

        calls: dict[str, Callable[[], Any]] = {
            "layer": one_layer, "layer_available": one_layer_available,
            "ready": lambda: ms.ready(layer, experts), "counters": ms.counters}
        out = {}
        for name in CALLS:
            _timed(calls[name], rounds // 10)  # warm-up
            out[name] = _summary(_timed(calls[name], rounds))
            ms.end_token()
        return out


async def _async_face(model: Path | None, rounds: int) -> dict[str, dict[str, float]]:
    async with moestream.open(model, backend="host", mode="direct", verify=False) as ms:
        layer, k = ms.model.moe_layers[0], ms.model.top_k
        experts = list(range(k))
        async with ms.fetch(layer, experts) as lease:
            await lease.gather()
        await ms.end_token()
        clock = time.perf_counter

        async def timed(name: str, n: int) -> list[float]:
            out = []
            for _ in range(n):
                t0 = clock()
                if name == "layer":
                    with ms.fetch(layer, experts) as lease:
                        await lease.gather()
                elif name == "layer_available":
                    with ms.fetch(layer, experts) as lease:
                        lease.available()
                elif name == "ready":
                    ms.ready(layer, experts)
                else:
                    ms.counters()
                out.append((clock() - t0) * 1e6)
            return out

        result = {}
        for name in CALLS:
            await timed(name, rounds // 10)
            result[name] = _summary(await timed(name, rounds))
            await ms.end_token()
        return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.api_calls", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", type=Path, default=None,
                        help="a GGUF file (default: the embedded tiny model)")
    parser.add_argument("--rounds", type=int, default=3000)
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    async_face = uvloop.run(_async_face(args.model, args.rounds))
    sync_face = _sync_face(args.model, args.rounds)
    ratio = {name: round(sync_face[name]["median_us"] / async_face[name]["median_us"], 2)
             for name in CALLS}
    result = {
        "bench": "api_calls", **provenance("bench.api_calls", argv),
        "model": str(args.model) if args.model else "embedded tiny", "rounds": args.rounds,
        "async": async_face, "sync": sync_face, "sync_over_async": ratio,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
