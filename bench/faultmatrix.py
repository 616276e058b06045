"""``python -m bench.faultmatrix``: every injectable fault at its stage, and what became of the run.

Each case decodes a few tokens of a small model on the host backend with one fault plan
(``moestream.pipeline.foundation.faults``) and records, besides the exit status, the invariants the
faults must not break, observed when the run closes its parts:

- every installed expert came from complete, correct bytes: verification (digest compute,
  every consumed expert) found no mismatch, every entry left in the cache is ready (its
  upload completed), and the expert whose load failed is not in the cache; bytes damaged
  on purpose (``corrupt``) are found: at least one mismatch, exit 3 as the CLI gives;
- the accounting is exact: device allocations equal frees after close, the peak of live +
  parked bytes stayed within the budget;
- every staging slot was back in the ring when it closed.

The test suite (``tests/test_faults.py``) runs the same cases; this command prints them as
the table in ``docs/RELIABILITY.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from moestream.pipeline.foundation.outputs import check_output, write_atomic
from tests.fault_matrix import CASES, CaseResult, run_case

# the matrix is the test suite's (tests/fault_matrix.py): this command prints it
__all__ = ["main", "markdown"]


def markdown(results: Sequence[CaseResult]) -> str:
    """The results as the table of docs/RELIABILITY.md."""
    lines = [
        "| fault | stage | mode | fired | outcome | exit | tokens | verified / mismatches "
        "| slots back | alloc = free | invariants |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        o = r.observed
        slots = f"{o.slots_free_at_close}/{o.n_slots}" if o.n_slots >= 0 else "(none made)"
        lines.append(
            f"| `{r.case.spec}` | {r.case.stage} | {r.case.mode} | {sum(r.fired.values())} "
            f"| {r.case.outcome} | {r.exit_code} | {r.summary['tokens']} "
            f"| {r.summary['verified']} / {r.summary['mismatches']} | {slots} "
            f"| {o.allocations} = {o.frees_after_close} "
            f"| {'ok' if not r.problems() else '; '.join(r.problems())} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the matrix; prints a markdown table (or JSON); exit 1 if any case broke."""
    p = argparse.ArgumentParser(prog="python -m bench.faultmatrix", description=__doc__)
    p.add_argument("--model", type=Path, help="model (default: a 4-layer, 16-expert tiny one)")
    p.add_argument("--tokens", type=int, default=6)
    p.add_argument("--backend", default="host", choices=["host", "cupy"])
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args(argv)
    if args.json is not None:
        check_output(args.json, what="--json")  # before the cases run, not after
    import structlog

    structlog.configure(  # the injected faults' events would drown the table: errors only
        wrapper_class=structlog.make_filtering_bound_logger(40),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
    )
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from moestream.pipeline.makers.modelgen import spec_for, write_model

            model = write_model(spec_for("tiny", layers=4, experts=16), Path(tmp) / "tiny.gguf")
        results = [run_case(case, model, args.tokens, args.backend) for case in CASES]
    print(markdown(results))
    if args.json is not None:
        write_atomic(args.json, json.dumps([r.row() for r in results], indent=2) + "\n",
                     what="--json")
    return 1 if any(r.problems() for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
