"""A minimal engine decode loop written only against ``moestream``.

It decodes the FFN-only proxy that ``pipeline.cli.run --compute real --router live`` decodes:
per token, the token's embedding flows through the MoE layers; at each layer the model's
router picks the top-k experts, and the layer's output is the router-weighted sum of their
SwiGLU outputs, computed here from the experts' device views (F16) as each expert becomes
available, hits first, misses as they land; then a residual step and an RMS norm.

    python examples/engine.py                 # the embedded tiny model, host or GPU
    python examples/engine.py -m model.gguf -n 16 --budget 20GiB

Runs without a GPU (numpy views on the host backend) and with one (CuPy views: compute is
queued on the current stream after a device-side wait on each expert's upload event).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
from gguf import GGMLQuantizationType

import moestream

Route = tuple[list[int], list[float]]


def swiglu(x: Any, gate: Any, up: Any, down: Any) -> Any:
    """One expert: down @ (silu(gate @ x) * (up @ x)), in float32."""
    g = gate.astype(np.float32) @ x
    u = up.astype(np.float32) @ x
    return down.astype(np.float32) @ (g / (1.0 + _xp(g).exp(-g)) * u)


def _xp(array: Any) -> Any:
    """numpy, or CuPy for a device array."""
    return np if isinstance(array, np.ndarray) else sys.modules["cupy"]


async def decode(
    model: str | None,
    tokens: int,
    *,
    seed: int = 0,
    budget: str | None = None,
    backend: str = "auto",
    mode: Literal["auto", "direct", "resident"] = "auto",
    queue_depth: int = 8,
    verbose: bool = False,
) -> list[list[Route]]:
    """Decode ``tokens`` tokens; returns each token's routing (experts and weights per MoE
    layer), which is what the hidden state decided at every layer."""
    tuning = moestream.Tuning(queue_depth=queue_depth)
    async with moestream.open(model, budget=budget, backend=backend, mode=mode,
                              tuning=tuning) as ms:
        f16 = GGMLQuantizationType.F16
        if any(info.gate_up_type != f16 or info.down_type != f16 or info.transposed
               or not info.gated for info in ms.model.layers.values()):
            raise moestream.UsageError("this example computes SwiGLU on F16 experts of the "
                                       "(ffn, hidden) layout only")
        router = ms.router(seed)
        routes: list[list[Route]] = []
        for t in range(tokens):
            hidden = router.embedding(t)
            xp = _xp(hidden)
            token: list[Route] = []
            for i, layer in enumerate(ms.model.moe_layers):
                experts, weights = router.route(t, i, hidden)
                token.append((experts, weights))
                weight_of = dict(zip(experts, weights, strict=True))
                acc = xp.zeros(ms.model.hidden, dtype=xp.float32)
                async with ms.fetch(layer, experts) as lease:
                    async for h in lease:  # hits first, then misses as they land
                        h.wait()  # the current stream waits for the upload (device side)
                        acc += weight_of[h.expert] * swiglu(hidden, h.gate.array, h.up.array,
                                                            h.down.array)
                x = hidden + acc
                hidden = x / (xp.sqrt(xp.mean(x * x)) + 1e-6)
            routes.append(token)
            stats = await ms.end_token()
            if verbose:
                print(f"token {t}: {stats.hits} hits, {stats.misses} misses, "
                      f"stall {stats.stall_ms:.2f} ms, experts {[r[0] for r in token]}")
        c = ms.counters()
        if verbose:
            print(f"{c.tokens} tokens on {ms.backend}, mode {c.mode}: hit rate "
                  f"{c.hit_rate:.3f}, verified {c.verified}, mismatches {c.mismatches}")
        return routes


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", help="GGUF model with F16 experts (default: embedded)")
    p.add_argument("-n", "--tokens", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget", help="device cache: N experts or a size (default: all)")
    p.add_argument("--backend", default="auto", choices=["auto", "host", "cupy"])
    p.add_argument("--json", action="store_true", help="print the routing as JSON")
    args = p.parse_args(argv)
    try:
        routes = asyncio.run(decode(args.model, args.tokens, seed=args.seed,
                                    budget=args.budget, backend=args.backend,
                                    verbose=not args.json))
    except moestream.MoestreamError as exc:
        print(f"engine: error: {exc}", file=sys.stderr)
        return exc.exit_code
    if args.json:
        print(json.dumps(routes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
