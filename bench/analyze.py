"""Benchmark command for log analysis: how long ``analyze`` and a what-if take on a long run.

A decode of 100,000 tokens through 43 MoE layers is the long end of what the tools must
handle; this command writes such a log (synthetic, but valid against docs/LOG_SCHEMA.md and
with hit counts that a live ``CacheIndex`` produced, so the what-if replay must match them
exactly), then times the summary and an LRU what-if at the run's budget as a user would run
them: ``python -m tools.analyze`` in a fresh process (Belady at the same budget too, the
simulator's most expensive replay). The result goes to
``bench/results/analyze-<host>.json`` with the machine, commit and command.

The generator is the tests' own (``tests/synthetic_logs.py``), which build their logs with
it at a few hundred tokens.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from bench.record import provenance, write_result
from moestream.pipeline.foundation.errors import MoestreamError
from tests.synthetic_logs import SyntheticRun, write_synthetic_log

# the generator stays importable from here for the scripts kept with their results
__all__ = ["SyntheticRun", "main", "write_synthetic_log"]

_REPO = Path(__file__).resolve().parent.parent


def _timed(command: list[str]) -> tuple[float, str]:
    start = time.perf_counter()
    done = subprocess.run(command, cwd=_REPO, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise MoestreamError(f"{' '.join(command)} exited {done.returncode}: {done.stderr.strip()}")
    return seconds, done.stdout


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m bench.analyze",
        description="Time moestream-analyze on a synthetic long run log.")
    parser.add_argument("--tokens", type=int, default=100_000, help="tokens in the log")
    parser.add_argument("--layers", type=int, default=43, help="MoE layers")
    parser.add_argument("--out", type=Path, default=_REPO / "bench" / "results",
                        help="directory for analyze-<host>.json")
    args = parser.parse_args(argv)
    try:
        run = SyntheticRun(tokens=args.tokens, moe_layers=args.layers, switch_at=args.tokens // 2)
        with tempfile.TemporaryDirectory(prefix="moestream-bench-") as tmp:
            log_path = Path(tmp) / "run.jsonl"
            start = time.perf_counter()
            written = write_synthetic_log(log_path, run)
            generate_s = time.perf_counter() - start
            log_mb = log_path.stat().st_size / 1e6
            summary_cmd = [sys.executable, "-m", "tools.analyze", str(log_path)]
            # The summary is the figure with a limit (15 s): median of three, as machines
            # shared with other work swing by 2x from run to run.
            summary_runs = sorted(_timed(summary_cmd)[0] for _ in range(3))
            summary_s = summary_runs[1]
            budget = f"{written['budget_bytes']}B"
            # --target 1: no bisection for a target budget, so each command is one replay
            whatif = ["--what-if", "--budgets", budget, "--target", "1", "--jobs", "1", "--json"]
            lru_s, out = _timed([*summary_cmd, *whatif, "--policies", "lru"])
            belady_s, belady_out = _timed([*summary_cmd, *whatif, "--policies", "belady"])
        exact = json.loads(out)["what_if"][0]["exact"]
        belady_rate = json.loads(belady_out)["what_if"][0]["results"][0]["hit_rate"]
        flags = " ".join(whatif).replace(budget, "BUDGET")
        result = {
            "benchmark": "analyze",
            **provenance("bench.analyze", argv),
            "log": {"tokens": run.tokens, "moe_layers": run.moe_layers, "top_k": run.top_k,
                    "n_experts": run.n_experts, "mb": round(log_mb, 1),
                    "budget_bytes": written["budget_bytes"]},
            "seconds": {"generate": round(generate_s, 2), "analyze_summary": round(summary_s, 2),
                        "analyze_summary_runs": [round(x, 2) for x in summary_runs],
                        "what_if_lru_one_budget": round(lru_s, 2),
                        "what_if_belady_one_budget": round(belady_s, 2)},
            "timed_commands": {
                "analyze_summary": "python -m tools.analyze LOG (median of 3)",
                "what_if_lru_one_budget": f"python -m tools.analyze LOG {flags} --policies lru",
                "what_if_belady_one_budget":
                    f"python -m tools.analyze LOG {flags} --policies belady",
            },
            "what_if_exact": exact["matches"],
            "hit_rate": {"lru": exact["hit_rate"], "belady": belady_rate},
        }
    except MoestreamError as exc:
        sys.stderr.write(f"bench_analyze: {exc}\n")
        return exc.exit_code
    target = args.out / f"analyze-{result['machine']['host']}.json"
    write_result(target, result)
    sys.stdout.write(json.dumps(result["seconds"]) + f"\nwrote {target}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
