"""``python -m bench.plan_table``: what planning every expert at open costs a streamer.

A streamer plans every expert's staging and device layout once, at open
(``stages.layout.plan_table``), so that a miss only looks its own up. This times that plan
and measures the memory it keeps, on the expert tables of large checkpoints built from their
shapes (no file: a table's layers are arithmetic), beside the in-run reference of one
expert's plan as a miss used to make it (``plan_expert`` of its slices).

    python -m bench.plan_table --out bench/results/plan_table-vm.json
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
import tracemalloc
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gguf import GGMLQuantizationType

from bench.kit import exit_with
from bench.record import provenance, report
from moestream.pipeline.foundation.experts import MoeLayer
from moestream.stages.layout import plan_expert, plan_table

__all__ = ["main"]

SHAPES = {  # MoE layers, experts, hidden, expert ffn, bytes a weight (as shipped)
    "deepseek-v3": (58, 256, 7168, 2048, 1),
    "kimi-k2": (60, 384, 7168, 2048, 1),
    "qwen3-235b-a22b": (94, 128, 4096, 1536, 2),
}


def _table(layers: int, experts: int, hidden: int, ffn: int, width: int) -> Any:
    """An expert table's layers as a checkpoint of this shape lays them (fused gate and up,
    each layer's tensors at an odd offset after the last)."""
    matrix = hidden * ffn * width
    out, base = {}, 4096 * 7
    for i in range(1, layers + 1):
        out[i] = MoeLayer(
            index=i, n_experts=experts, gate_up_type=GGMLQuantizationType.F16,
            down_type=GGMLQuantizationType.F16, gate_offset=base, up_offset=base + matrix,
            down_offset=base + 2 * matrix * experts, gate_bytes=matrix, up_bytes=matrix,
            down_bytes=matrix, gate_up_stride=2 * matrix, fused_gate_up=True, router=None,
            shape=(hidden, ffn))
        base += 3 * matrix * experts + 777
    return types.SimpleNamespace(layers=out)


def _measure(table: Any, repeats: int) -> dict[str, Any]:
    seconds = []
    for _ in range(repeats):
        gc.collect()
        t0 = time.perf_counter()
        plans = plan_table(table)
        seconds.append(time.perf_counter() - t0)
        del plans
    gc.collect()
    tracemalloc.start()
    plans = plan_table(table)
    kept, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    moe = next(iter(table.layers.values()))
    t0 = time.perf_counter()
    for e in range(moe.n_experts):
        plan_expert(moe.slices(e))
    one_us = (time.perf_counter() - t0) / moe.n_experts * 1e6
    return {"experts": len(plans), "open_ms": round(min(seconds) * 1e3, 1),
            "open_ms_median": round(statistics.median(seconds) * 1e3, 1),
            "kept_mib": round(kept / 2**20, 1), "kept_bytes_per_expert": round(kept / len(plans)),
            "one_plan_us": round(one_us, 2)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.plan_table", description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shapes", default=",".join(SHAPES),
                        help=f"which tables, comma-separated (of {', '.join(SHAPES)})")
    parser.add_argument("--out", type=Path, required=True, help="write the result here as JSON")
    args = parser.parse_args(argv)
    result: dict[str, Any] = provenance("bench.plan_table", argv)
    for name in args.shapes.split(","):
        if name not in SHAPES:
            parser.error(f"unknown shape {name!r} (known: {', '.join(SHAPES)})")
        result[name] = _measure(_table(*SHAPES[name]), args.repeats)
    report(args.out, result)
    return 0


if __name__ == "__main__":
    exit_with("bench.plan_table", main)
