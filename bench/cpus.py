"""``python -m bench.cpus``: how fast each CPU runs the same Python, round by round.

Why: on the H200's host (a 16-vCPU VM) whole processes of one command ran 1.5 x slower
than others with the loop thread on the CPU throughout (``bench/results/pin-h200/``), the
process under ``taskset -c 12`` was fast in four of four runs, and the loop thread pinned
to the highest CPU (15) was slow in one run of two. If some vCPUs are slower than others
(a busy neighbour on the same physical core), a process's speed is where the scheduler
puts it. This times one fixed workload, like the cache's per-miss work (tuple keys in a
dict, an ordered dict's LRU moves, list appends), on every CPU the process may use, in a
shuffled order each round, so a CPU's figure is its own and not the moment's.

Prints each CPU's median and slowest time, and the spread of the medians (slowest /
fastest); ``--out`` writes them as JSON.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.kit import exit_with
from bench.record import provenance, write_result
from moestream.pipeline.foundation.errors import UsageError

__all__ = ["main", "workload_ms"]


def workload_ms(n: int) -> float:
    """Milliseconds for ``n`` LRU misses of a cache-like structure on the calling thread."""
    order: OrderedDict[tuple[int, int], int] = OrderedDict()
    held: dict[tuple[int, int], list[int]] = {}
    t0 = time.perf_counter()
    for i in range(n):
        key = (i % 20, (i * 7) % 512)
        if key in held:
            order.move_to_end(key)
            continue
        if len(held) >= 1024:
            old, _ = order.popitem(last=False)
            del held[old]
        order[key] = i
        held[key] = [i, i + 1, i + 2]
    return (time.perf_counter() - t0) * 1000.0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.cpus",
                                description=__doc__.split("\n")[0] if __doc__ else None)
    p.add_argument("--rounds", type=int, default=5, help="passes over every CPU (5)")
    p.add_argument("--misses", type=int, default=200_000, help="workload size (200000)")
    p.add_argument("--out", type=Path, help="result JSON")
    args = p.parse_args(argv)
    if not hasattr(os, "sched_setaffinity"):
        raise UsageError("this platform cannot run a thread on a chosen CPU")
    if args.rounds < 1 or args.misses < 1:
        raise UsageError("--rounds and --misses must be >= 1")
    before = os.sched_getaffinity(0)
    cpus = sorted(before)
    times: dict[int, list[float]] = {cpu: [] for cpu in cpus}
    try:
        for _ in range(args.rounds):
            order = cpus[:]
            random.shuffle(order)
            for cpu in order:
                os.sched_setaffinity(0, {cpu})
                time.sleep(0.001)  # let the move happen before the clock starts
                times[cpu].append(workload_ms(args.misses))
    finally:
        os.sched_setaffinity(0, before)
    medians = {cpu: statistics.median(t) for cpu, t in times.items()}
    for cpu in cpus:
        print(f"  cpu {cpu:3d}: median {medians[cpu]:7.1f} ms, slowest {max(times[cpu]):7.1f}")
    spread = max(medians.values()) / min(medians.values())
    print(f"  medians, slowest / fastest CPU: {spread:.2f}")
    if args.out is not None:
        result: dict[str, Any] = {
            **provenance("bench.cpus", argv),
            "misses": args.misses, "rounds": args.rounds,
            "ms": {str(cpu): [round(t, 2) for t in times[cpu]] for cpu in cpus},
            "median_ms": {str(cpu): round(m, 2) for cpu, m in medians.items()},
            "spread": round(spread, 3),
        }
        write_result(args.out, result)
        print(f"written: {args.out}")
    return 0


if __name__ == "__main__":
    exit_with("python -m bench.cpus", main)
