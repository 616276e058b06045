"""How long a sync engine blocked for a loading expert takes to get it once it landed.

An engine on ``open_sync`` that iterates a lease whose next expert is still loading blocks;
the expert lands on the session's loop thread (its arrival put in the lease's queue), and the
engine's thread then has to wake and take the handle. This measures that last stretch, from
the arrival's put to ``next(lease)`` returning, over ``--rounds`` cold misses (each read made
2 ms slow, so that the engine is blocked before it lands), as median and p90 microseconds.

With ``--against DIR`` (another checkout, such as a worktree of an earlier commit) it runs
this measure in that tree and in this one alternately, ``--runs`` processes each, and gives
this tree's median over the other's (``ratio``): the two faces of a change in one run.

    python -m bench.sync_wake [--rounds 300] [--runs 3] [--against DIR] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve()


def measure(rounds: int) -> dict[str, Any]:
    """The wake's microseconds over ``rounds`` blocked misses, in this process's tree."""
    import moestream
    from moestream.pipeline.streaming.loads import Arrivals

    put = Arrivals.put_nowait
    landed: list[float] = []

    def timed_put(self: Any, item: Any) -> None:
        landed.append(time.perf_counter())
        put(self, item)

    Arrivals.put_nowait = timed_put  # type: ignore[method-assign]
    wakes: list[float] = []
    blocked = 0
    tuning = moestream.Tuning(faults="slow_ms=2@1+")
    with moestream.open_sync(None, backend="host", mode="direct", verify=False, budget="12",
                             tuning=tuning) as ms:
        layers, n = ms.model.moe_layers, ms.model.n_experts
        for i in range(rounds):
            layer, expert = layers[i % len(layers)], (i // len(layers) * 7) % n
            landed.clear()
            called = time.perf_counter()
            with ms.fetch(layer, [expert]) as lease:
                next(lease)
                got = time.perf_counter()
            if lease.misses and landed and landed[0] > called:
                blocked += 1
                wakes.append((got - landed[0]) * 1e6)
            if i % len(layers) == len(layers) - 1:
                ms.end_token()
    ordered = sorted(wakes)
    return {"tree": str(Path(moestream.__file__).resolve().parent.parent), "rounds": rounds,
            "blocked": blocked,
            "median_us": round(statistics.median(ordered), 1) if ordered else None,
            "p90_us": round(ordered[int(len(ordered) * 0.9)], 1) if ordered else None}


def _in_tree(tree: Path, rounds: int) -> dict[str, Any]:
    """``measure`` in a process whose ``moestream`` is ``tree``'s."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run([sys.executable, str(_HERE), "--one", "--rounds", str(rounds)],
                          cwd=tree, env=env, capture_output=True, text=True, check=True)
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sync_wake", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--against", type=Path, default=None,
                        help="another checkout to measure alternately")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    if args.one:  # a child of ``_in_tree``: one line of JSON
        print(json.dumps(measure(args.rounds)))
        return 0
    from bench.record import provenance, write_result

    here = _HERE.parent.parent
    trees = [here] if args.against is None else [here, args.against.resolve()]
    runs: dict[str, list[dict[str, Any]]] = {str(t): [] for t in trees}
    for _ in range(args.runs):
        for tree in trees:
            runs[str(tree)].append(_in_tree(tree, args.rounds))
    medians = {tree: statistics.median(r["median_us"] for r in got if r["median_us"])
               for tree, got in runs.items()}
    result: dict[str, Any] = {"bench": "sync_wake", **provenance("bench.sync_wake", argv),
                              "runs": runs, "median_us": medians}
    if args.against is not None:
        result["ratio"] = round(medians[str(here)] / medians[str(trees[1])], 3)
    print(json.dumps(result, indent=2))
    if args.out is not None:
        write_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
