"""``python -m tools.make_trace``: write a synthetic routing trace, or check its calibration.

The generator lives in the product (``proxy.synthetic``: ``pipeline.run`` routes with it
when no trace is given); this command writes its traces to files and, with ``--check``,
prints the calibration table (``moestream.pipeline.proxy.calibrate``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from moestream.pipeline.cli.common import UsageParser, closable_stdout, print_error, printable
from moestream.pipeline.cli.interrupts import stoppable
from moestream.pipeline.foundation.errors import MoestreamError, UsageError
from moestream.pipeline.foundation.outputs import check_output
from moestream.pipeline.foundation.trace import save_trace
from moestream.pipeline.proxy.calibrate import calibration_table
from moestream.pipeline.proxy.synthetic import PRESETS, synthetic_trace

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = UsageParser(
        prog="python -m tools.make_trace",
        description="Write a synthetic routing trace (.npz, or .jsonl by suffix); "
        "--check prints the preset's calibration against published measurements.",
    )
    parser.add_argument("out", nargs="?", help="trace file to write (.npz or .jsonl)")
    parser.add_argument("--preset", default="ds4-flash", choices=sorted(PRESETS))
    parser.add_argument("--tokens", type=int, help="tokens to generate (needed with OUT)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int, help="MoE layers (default: the preset's)")
    parser.add_argument("--experts", type=int, help="experts per layer (default: the preset's)")
    parser.add_argument("--top-k", type=int, help="experts per token (default: the preset's)")
    parser.add_argument(
        "--check",
        action="store_true",
        help="print LRU hit rates vs the published figures (at the preset's own shape)",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    return parser


def _print_table(preset: str, seed: int) -> None:
    rows = calibration_table(preset, seed=seed)
    print(f"preset {preset} (seed {seed}): {PRESETS[preset].description}")
    if not rows:
        print("  no published figures for this preset")
        return
    print(f"  {'figure':<60} {'published':>11} {'measured':>9} {'delta':>7}")
    for row in rows:
        point = row.point
        published = (
            f"{point.low:.3f}" if point.low == point.high else f"{point.low:.2f}-{point.high:.2f}"
        )
        print(f"  {point.label:<60} {published:>11} {row.measured:>9.3f} {row.delta:>+7.3f}")


@stoppable("make_trace")  # SIGTERM, SIGHUP as SIGINT: a partial trace goes
def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status (2 for bad options)."""
    args: argparse.Namespace | None = None
    try:
        args = _parser().parse_args(argv)
        if args.out is None and not args.check:
            raise UsageError("give OUT (a trace file to write), --check, or both")
        if args.out is not None:
            if args.tokens is None:
                raise UsageError("--tokens is required when writing a trace")
            check_output(args.out, what="OUT")  # before generating: a FIFO or device refused
            trace = synthetic_trace(
                args.preset,
                args.tokens,
                seed=args.seed,
                n_layers=args.layers,
                n_experts=args.experts,
                top_k=args.top_k,
            )
            save_trace(trace, args.out)  # a failed write is an OutputError naming the file
            with closable_stdout():
                print(
                    f"wrote {printable(args.out)}: {trace.n_tokens} tokens x "
                    f"{trace.n_layers} layers x top-{trace.top_k} of {trace.n_experts} "
                    f"experts (preset {trace.preset}, seed {args.seed})"
                )
        if args.check:
            with closable_stdout():
                _print_table(args.preset, args.seed)
    except MoestreamError as exc:
        if args is not None and args.debug:
            raise
        print_error("make_trace: ", exc)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
