"""``python -m tools.make_model OUT --preset ...``: write a GGUF model with known expert bytes.

The generator is in the product (``pipeline.modelgen``: ``pipeline.run`` makes its default
model with it); this command writes a preset, scaled by ``--layers``/``--experts``, to OUT.
With ``--format safetensors`` OUT is a Hugging Face checkpoint directory instead
(``pipeline.checkpointgen``).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import structlog

from pipeline.checkpointgen import DTYPES, CheckpointOptions, write_checkpoint
from pipeline.foundation.cli import UsageParser, closable_stdout, print_error, printable
from pipeline.foundation.config import parse_size
from pipeline.foundation.errors import MoestreamError, UsageError
from pipeline.foundation.interrupts import stoppable
from pipeline.foundation.outputs import check_output
from pipeline.modelgen import PRESETS, spec_for, write_model

__all__ = ["main"]

_DESCRIPTION = ("Write a GGUF model (or, with --format safetensors, a Hugging Face "
                "checkpoint) shaped like a public MoE model (DeepSeek V4 Flash, "
                "Qwen3-30B-A3B, Mixtral-8x7B) with known expert bytes.")


@stoppable("moestream-make-model")  # SIGTERM, SIGHUP as SIGINT: the temp file goes
def main(argv: Sequence[str] | None = None) -> int:
    """Command line: ``python -m tools.make_model OUT --preset ...``; returns the exit code."""
    parser = UsageParser(prog="moestream-make-model", description=_DESCRIPTION)
    parser.add_argument("out", type=Path, metavar="OUT",
                        help="GGUF file to write (a checkpoint directory with --format "
                        "safetensors)")
    parser.add_argument("--format", default="gguf", choices=("gguf", "safetensors"),
                        help="a GGUF file (default) or a Hugging Face checkpoint directory")
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    parser.add_argument("--layers", type=int, help="scale down to N layers")
    parser.add_argument("--experts", type=int, help="scale down to N experts per layer")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fused-gate-up", action="store_true",
                        help="one ffn_gate_up_exps tensor instead of gate and up")
    parser.add_argument("--no-digests", action="store_true",
                        help="no moestream metadata (digests, preset, seed), as real files "
                        "come: runs verify against a digest manifest")
    parser.add_argument("--fused-experts", action="store_true",
                        help="safetensors: gate_up_proj [E, 2F, D] and down_proj [E, D, F] "
                        "per layer instead of three tensors per expert")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="safetensors: tensor dtype "
                        "(default bf16)")
    parser.add_argument("--shard-size", metavar="SIZE", help="safetensors: largest shard "
                        "(default 2GiB; 5GB is 5 x 10^9 bytes)")
    parser.add_argument("--force", action="store_true", help="replace OUT if it exists")
    parser.add_argument("--debug", action="store_true", help="tracebacks on errors")
    debug = "--debug" in (sys.argv[1:] if argv is None else argv)
    if not structlog.is_configured():
        # stdout carries only the summary line; log events go to stderr.
        structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    try:
        args = parser.parse_args(argv)
        if args.format == "safetensors":
            return _checkpoint(args)
        for option in ("fused_experts", "dtype", "shard_size"):
            if getattr(args, option) not in (None, False):
                raise UsageError(f"--{option.replace('_', '-')} is for --format safetensors")
        check_output(args.out, what="OUT")  # a directory, device or FIFO: refused, --force or not
        if args.out.exists() and not args.force:
            raise UsageError(f"{args.out} exists (use --force to replace it)")
        spec = spec_for(args.preset, args.layers, args.experts, args.seed,
                        fused_gate_up=args.fused_gate_up)
        started = time.perf_counter()
        write_model(spec, args.out, progress=sys.stderr.isatty(),
                    record_digests=not args.no_digests)
    except MoestreamError as exc:
        if debug:
            raise
        print_error("moestream-make-model: error: ", exc)
        return exc.exit_code
    except KeyboardInterrupt:
        print("moestream-make-model: interrupted", file=sys.stderr)
        return 130
    seconds = time.perf_counter() - started
    size = args.out.stat().st_size
    with closable_stdout():
        print(f"{printable(str(args.out))}: {spec.preset}, {spec.n_layers} layers x "
              f"{spec.n_experts} experts, {size / 2**30:.3f} GiB in {seconds:.1f} s "
              f"({size / 1e6 / seconds:.0f} MB/s)")
    return 0


def _checkpoint(args: argparse.Namespace) -> int:
    """``--format safetensors``: write the checkpoint directory and print its summary line."""
    if args.fused_gate_up:
        raise UsageError("--fused-gate-up is for GGUF; a checkpoint's is --fused-experts")
    options = CheckpointOptions(
        dtype=args.dtype or "bf16", fused_experts=args.fused_experts,
        shard_bytes=parse_size(args.shard_size) if args.shard_size else 2 << 30)
    spec = spec_for(args.preset, args.layers, args.experts, args.seed)
    written = write_checkpoint(spec, args.out, options, progress=sys.stderr.isatty(),
                               replace=args.force)
    size = written.tensor_bytes
    with closable_stdout():
        print(f"{printable(str(args.out))}: {spec.preset}, {spec.n_layers} layers x "
              f"{spec.n_experts} experts, {options.dtype}, {size / 2**30:.3f} GiB in "
              f"{len(written.shards)} shard{'s' if len(written.shards) > 1 else ''}, "
              f"{written.seconds:.1f} s ({size / 1e6 / max(written.seconds, 1e-9):.0f} MB/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
