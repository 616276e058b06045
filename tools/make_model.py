"""``python -m tools.make_model OUT --preset ...``: write a GGUF model with known expert bytes.

The generator is in the product (``pipeline.makers.modelgen``: ``pipeline.run`` makes its default
model with it); this command writes a preset, scaled by ``--layers``/``--experts``, to OUT.
With ``--format safetensors`` OUT is a Hugging Face checkpoint directory instead
(``makers.checkpointgen``), plain or, with ``--quant``, quantized as FP8 blocks (Qwen3-MoE),
MXFP4 (gpt-oss) or FP4 experts (DeepSeek-V4); ``--hidden``/``--expert-ffn``/``--top-k``
reshape the preset (gpt-oss-120b's layer: ``--preset qwen3-30b-a3b --hidden 2880
--expert-ffn 2880 --top-k 4``).
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import structlog
from gguf import GGMLQuantizationType as QType

from moestream.pipeline.cli.common import UsageParser, closable_stdout, print_error, printable
from moestream.pipeline.cli.interrupts import stoppable
from moestream.pipeline.foundation.config import parse_size
from moestream.pipeline.foundation.errors import MoestreamError, UsageError
from moestream.pipeline.foundation.outputs import check_output
from moestream.pipeline.makers.checkpointgen import (
    DTYPES,
    QUANTS,
    CheckpointOptions,
    write_checkpoint,
)
from moestream.pipeline.makers.modelgen import PRESETS, ModelSpec, spec_for, write_model
from moestream.pipeline.makers.modelspec import DS4_SHAPES

__all__ = ["main"]

_DESCRIPTION = ("Write a GGUF model (or, with --format safetensors, a Hugging Face "
                "checkpoint) shaped like a public MoE model (DeepSeek V4 Flash, "
                "Qwen3-30B-A3B, Mixtral-8x7B) with known expert bytes.")


@stoppable("moestream-make-model")  # SIGTERM, SIGHUP as SIGINT: the temp file goes
def main(argv: Sequence[str] | None = None) -> int:
    """Command line: ``python -m tools.make_model OUT --preset ...``; returns the exit code."""
    parser = _parser()
    debug = "--debug" in (sys.argv[1:] if argv is None else argv)
    if not structlog.is_configured():
        # stdout carries only the summary line; log events go to stderr.
        structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    try:
        args = parser.parse_args(argv)
        if args.format == "safetensors":
            return _checkpoint(args)
        for option in ("fused_experts", "dtype", "quant", "block", "hidden",
                       "expert_ffn", "top_k"):
            if getattr(args, option) not in (None, False):
                raise UsageError(f"--{option.replace('_', '-')} is for --format safetensors")
        check_output(args.out, what="OUT")  # a directory, device or FIFO: refused, --force or not
        made = [args.out] + (sorted(args.out.parent.glob(f"{glob.escape(args.out.stem)}-*-of-"
                                                        "*.gguf")) if args.shard_size else [])
        if any(path.exists() for path in made) and not args.force:
            raise UsageError(f"{next(p for p in made if p.exists())} exists (use --force to "
                             "replace it)")
        spec = spec_for(args.preset, args.layers, args.experts, args.seed,
                        fused_gate_up=args.fused_gate_up, ds4_shape=args.ds4_shape)
        started = time.perf_counter()
        written = write_model(spec, args.out, progress=sys.stderr.isatty(),
                              record_digests=not args.no_digests,
                              shard_bytes=parse_size(args.shard_size) if args.shard_size else 0)
    except MoestreamError as exc:
        if debug:
            raise
        print_error("moestream-make-model: error: ", exc)
        return exc.exit_code
    except KeyboardInterrupt:
        print("moestream-make-model: interrupted", file=sys.stderr)
        return 130
    seconds = time.perf_counter() - started
    shards = [written] if written == args.out else sorted(
        written.parent.glob(written.name.replace("-00001-of-", "-*-of-")))
    size = sum(shard.stat().st_size for shard in shards)
    split = f", {len(shards)} shards," if len(shards) > 1 else ""
    with closable_stdout():
        print(f"{printable(str(written))}: {spec.preset}, {spec.n_layers} layers x "
              f"{spec.n_experts} experts, {size / 2**30:.3f} GiB{split} in {seconds:.1f} s "
              f"({size / 1e6 / seconds:.0f} MB/s)")
    return 0


def _parser() -> UsageParser:
    """The command's arguments: OUT, the preset and its scaling, and the checkpoint's."""
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
    parser.add_argument("--ds4-shape", choices=sorted(DS4_SHAPES),
                        help="ds4 presets: the attention, hyper-connections and vocabulary at "
                        "DeepSeek V4 Flash's size (flash) or small (default: flash unscaled, "
                        "small with --layers/--experts)")
    parser.add_argument("--no-digests", action="store_true",
                        help="no moestream metadata (digests, preset, seed), as real files "
                        "come: runs verify against a digest manifest")
    parser.add_argument("--fused-experts", action="store_true",
                        help="safetensors: gate_up_proj [E, 2F, D] and down_proj [E, D, F] "
                        "per layer instead of three tensors per expert")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="safetensors: tensor dtype "
                        "(default bf16)")
    parser.add_argument("--shard-size", metavar="SIZE", help="the largest shard: a "
                        "checkpoint's (default 2GiB; 5GB is 5 x 10^9 bytes), or a GGUF split "
                        "as gguf-split writes it (OUT's stem -00001-of-0000N.gguf...; "
                        "default: one file)")
    parser.add_argument("--quant", choices=QUANTS, help="safetensors: fp8 (a Qwen3-MoE "
                        "checkpoint, every *_proj.weight F8_E4M3 with F32 weight_scale_inv "
                        "blocks), mxfp4 (gpt-oss: experts fused as E2M1 blocks with E8M0 "
                        "scales) or fp4 (DeepSeek-V4: experts E2M1 in I8 with E8M0 scales per "
                        "32, attention and shared experts FP8 with E8M0 128x128 scales); "
                        "norms, routers, embeddings and lm_head stay in --dtype")
    parser.add_argument("--block", metavar="ROWSxCOLS", help="--quant fp8: a scale block "
                        "(default 128x128; one number for a square)")
    for option, what in (("hidden", "hidden size"), ("expert-ffn", "expert FFN"),
                         ("top-k", "top-k")):
        parser.add_argument(f"--{option}", type=int, metavar="N",
                            help=f"safetensors: the preset's {what} replaced")
    parser.add_argument("--force", action="store_true", help="replace OUT if it exists")
    parser.add_argument("--debug", action="store_true", help="tracebacks on errors")
    return parser


def _checkpoint(args: argparse.Namespace) -> int:
    """``--format safetensors``: write the checkpoint directory and print its summary line."""
    if args.fused_gate_up:
        raise UsageError("--fused-gate-up is for GGUF; a checkpoint's is --fused-experts")
    if args.ds4_shape is not None:
        raise UsageError("--ds4-shape is for GGUF (ds4's layout)")
    if args.block is not None and args.quant != "fp8":
        raise UsageError("--block is for --quant fp8")
    options = CheckpointOptions(
        dtype=args.dtype or "bf16", fused_experts=args.fused_experts,
        shard_bytes=parse_size(args.shard_size) if args.shard_size else 2 << 30,
        quant=args.quant, block=_block(args.block) if args.block else (128, 128))
    spec = _reshaped(spec_for(args.preset, args.layers, args.experts, args.seed), args)
    written = write_checkpoint(spec, args.out, options, progress=sys.stderr.isatty(),
                               replace=args.force)
    size = written.tensor_bytes
    kind = f"{options.quant} ({options.dtype} dense)" if options.quant else options.dtype
    with closable_stdout():
        print(f"{printable(str(args.out))}: {spec.preset}, {spec.n_layers} layers x "
              f"{spec.n_experts} experts, {kind}, {written.expert_bytes / 2**20:.3f} MiB per "
              f"expert, {size / 2**30:.3f} GiB in {len(written.shards)} "
              f"shard{'s' if len(written.shards) > 1 else ''}, {written.seconds:.1f} s "
              f"({size / 1e6 / max(written.seconds, 1e-9):.0f} MB/s)")
    return 0


def _block(text: str) -> tuple[int, int]:
    """``--block``: ``128x128`` or ``128``."""
    parts = text.lower().split("x")
    try:
        sizes = [int(part) for part in parts]
    except ValueError:
        sizes = []
    if len(sizes) not in (1, 2) or min(sizes) < 1:
        raise UsageError(f"--block: expected ROWSxCOLS or one size >= 1, got {text!r}")
    return (sizes[0], sizes[-1])


def _reshaped(spec: ModelSpec, args: argparse.Namespace) -> ModelSpec:
    """``spec`` with ``--hidden``, ``--expert-ffn`` and ``--top-k`` applied."""
    changes = {field: getattr(args, option) for option, field in
               (("hidden", "hidden"), ("expert_ffn", "expert_ffn"), ("top_k", "top_k"))
               if getattr(args, option) is not None}
    for field, value in changes.items():
        if value < 1:
            raise UsageError(f"--{field.replace('_', '-')} must be >= 1, got {value}")
    if changes.get("top_k", 0) > spec.n_experts:
        raise UsageError(f"--top-k {changes['top_k']} is more than the {spec.n_experts} "
                         "experts")
    if not changes:
        return spec
    # The GGUF quant types' block sizes do not bind a checkpoint's shape (only MX's 32 does)
    return dataclasses.replace(spec, **changes, gate_up_type=QType.F16, down_type=QType.F16)


if __name__ == "__main__":
    sys.exit(main())
