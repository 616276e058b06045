"""``python -m bench.gguf_dequant``: GGUF expert dequantization per type, against the upload
of the same quantized bytes.

For each ggml type and each expert shape (``--shapes``: presets of
``pipeline/makers/modelspec.py``; Qwen3-30B-A3B's 2048 x 768 and DeepSeek-V4-Flash's 4096 x
2048 by default), random valid blocks of one expert's three matrices (gate and up
``ffn x hidden``, down ``hidden x ffn``) are made on the device, then timed:

- ``one_expert_ms``: ``_gguf_dequant.dequantize`` of the three matrices of one expert, one
  call each, into reused scratch (``out=``), in ``--dtype``; ``out_gb_s`` is its output
  bytes over that time;
- ``batch_expert_ms``: a layer's ``top_k`` experts of the shape dequantized one call per
  matrix kind (as the experts call batches its arrivals), per expert;
- ``upload_ms``: the expert's quantized bytes copied host to device from pinned memory
  (on the CPU: a memcpy of those bytes), measured in the same run; ``over_upload`` is
  ``one_expert_ms / upload_ms`` (the issue holds dequantization to <= 10% of a miss);
- ``kernel_expert_ms``: on a GPU, the same batch through the experts call's CUDA kernels
  (``_dequant_cuda.gguf_layer_cuda``: one launch, two where down's type differs, straight into
  the module's stacked layout), per expert; ``kernel_same_values``: the torch routines' bits;
- ``transformers_expert_ms``: where the installed transformers has a torch routine for the
  type (``integrations/gguf/dequant.py``, 5.17 and later), the same expert through it at
  float32 and cast into the same scratch (its bf16 is not gguf-py's values); ``same_values``
  says whether it made the same bits.

Each shape also gets a row with its preset's own types (``IQ2_XXS+Q2_K`` for ds4's file).
Times are medians: CUDA events on a GPU, ``perf_counter`` on the CPU. Prints a table; with
``--out``, the JSON report too.

    python -m bench.gguf_dequant --device cuda --out bench/results/gguf_dequant_h200.json
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from bench.kit import median_ms
from bench.transformers import _versions
from moestream.pipeline.foundation.ggml_blocks import put_scales, scale_count
from moestream.pipeline.makers.modelspec import PRESETS
from moestream.transformers import _dequant_cuda as dc
from moestream.transformers import _gguf_dequant as gd
from moestream.transformers._gguf_blocks import ROUTINES
from moestream.transformers._gguf_experts import GgufExperts

__all__ = ["build_parser", "main", "random_blocks"]

Q = gguf.GGMLQuantizationType
DEFAULT_SHAPES = "qwen3-30b-a3b,ds4-flash-q2"
DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}
Types = tuple[int, int, int]
"""A row's ggml types: gate, up, down."""


def random_blocks(ggml_type: int, rows: int, cols: int, device: Any,
                  gen: torch.Generator) -> torch.Tensor:
    """``(rows, row_bytes)`` valid random blocks: random bytes, scales of a trained
    model's size (float16 around 1e-3; MXFP4's E8M0 near 2 ** -7)."""
    elems, nbytes = gguf.GGML_QUANT_SIZES[Q(ggml_type)]
    raw = torch.randint(0, 256, (rows * cols // elems, nbytes), dtype=torch.uint8,
                        generator=gen)
    count = raw.shape[0]
    if ggml_type not in (Q.F16, Q.BF16, Q.F32):
        scales = (torch.rand(count, scale_count(ggml_type), generator=gen) * 2e-3).half()
        put_scales(raw.numpy(), ggml_type, scales.view(torch.int16).numpy().view(np.uint16))
    if ggml_type == Q.MXFP4:
        raw[:, 0] = torch.randint(116, 124, (count,), dtype=torch.uint8, generator=gen)
    if ggml_type in (Q.F16, Q.BF16, Q.F32):
        kind = {Q.F16: torch.float16, Q.BF16: torch.bfloat16, Q.F32: torch.float32}
        raw = (torch.randn(rows, cols, generator=gen) * 0.02).to(kind[Q(ggml_type)])
        return raw.view(torch.uint8).to(device)
    return raw.reshape(rows, -1).to(device)


def _timer(device: Any, repeats: int) -> Callable[[Callable[[], Any]], float]:
    """A median-of-``repeats`` timer in milliseconds (after two unmeasured calls)."""
    return functools.partial(median_ms, device=device, repeats=repeats, skip=2)


def _transformers_routine() -> Any:
    """transformers' torch GGUF dequantizer, or None where it has none."""
    try:
        from transformers.integrations.gguf import dequant
    except ImportError:
        return None
    return dequant


def _theirs(types: Types, mats: list[Any], outs: list[Any],
            timed: Callable[[Callable[[], Any]], float]) -> dict[str, Any]:
    """The expert through transformers' routines at float32, cast into scratch like ours."""
    module = _transformers_routine()
    if module is None or any(t not in getattr(module, "GGML_BLOCK", {}) for t in types):
        return {}
    ours = [o.clone() for o in outs]
    theirs = [torch.empty_like(o) for o in outs]

    def run() -> None:
        for m, t, o in zip(mats, types, theirs, strict=True):
            o.copy_(module.dequantize(m.reshape(-1), t, torch.float32).view(o.shape))

    ms = timed(run)
    same = all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    return {"transformers_expert_ms": round(ms, 4), "same_values": same}


def _matrices(shape: str) -> tuple[int, list[tuple[int, int]]]:
    spec = PRESETS[shape]
    ffn, hidden = spec.expert_ffn, spec.hidden
    return spec.top_k, [(ffn, hidden), (ffn, hidden), (hidden, ffn)]


def measure(types: Types, shape: str, args: argparse.Namespace,
            device: Any) -> dict[str, Any]:
    """One row: the three matrices of ``shape`` with ``types`` (gate, up, down)."""
    top_k, dims = _matrices(shape)
    gen = torch.Generator().manual_seed(0)
    dtype = DTYPES[args.dtype]
    batch = top_k if args.batch is None else args.batch
    timed = _timer(device, args.repeats)
    mats = [random_blocks(t, r, c, device, gen) for t, (r, c) in zip(types, dims, strict=True)]
    outs = [torch.empty(r, c, dtype=dtype, device=device) for r, c in dims]
    one = timed(lambda: [gd.dequantize(m, t, dtype, out=o)
                         for m, t, o in zip(mats, types, outs, strict=True)])
    host = [m.cpu().pin_memory() if device.type == "cuda" else m.clone() for m in mats]
    upload = timed(lambda: [m.copy_(h, non_blocking=True)
                            for m, h in zip(mats, host, strict=True)])
    qbytes = sum(m.numel() for m in mats)
    obytes = sum(o.numel() for o in outs) * outs[0].element_size()
    row: dict[str, Any] = {
        "type": "+".join(dict.fromkeys(Q(t).name for t in types)), "shape": shape,
        "expert_quant_bytes": qbytes, "expert_out_bytes": obytes,
        "one_expert_ms": round(one, 4), "out_gb_s": round(obytes / one / 1e6, 1),
        "upload_ms": round(upload, 4), "upload_gb_s": round(qbytes / upload / 1e6, 1),
        "over_upload": round(one / upload, 3)}
    row.update(_theirs(types, mats, outs, timed))
    if batch > 1:
        row.update(_batched(types, dims, batch, mats, dtype, timed))
    return row


def _batched(types: Types, dims: list[tuple[int, int]], batch: int,
             mats: list[Any], dtype: Any, timed: Callable[[Callable[[], Any]], float],
             ) -> dict[str, Any]:
    """A layer's ``batch`` experts, one call per matrix kind, per expert."""
    stacks = [m.unsqueeze(0).expand(batch, *m.shape).contiguous() for m in mats]
    outs = [torch.empty(batch, r, c, dtype=dtype, device=mats[0].device) for r, c in dims]
    ms = timed(lambda: [gd.dequantize(s, t, dtype, out=o)
                        for s, t, o in zip(stacks, types, outs, strict=True)])
    obytes = sum(o.numel() for o in outs) * outs[0].element_size()
    row = {"batch": batch, "batch_expert_ms": round(ms / batch, 4),
           "batch_out_gb_s": round(obytes / ms / 1e6, 1)}
    if mats[0].device.type == "cuda" and {types[0], types[2]} <= dc.GGUF_TYPES:
        row.update(_kernel(types, dims, stacks, dtype, timed))
    return row


def _kernel(types: Types, dims: list[tuple[int, int]], stacks: list[Any], dtype: Any,
            timed: Callable[[Callable[[], Any]], float]) -> dict[str, Any]:
    """The same batch through the experts call's CUDA kernels (``gguf_layer_cuda``: one
    launch, two for two types, into the module's stacked layout), per expert, and whether
    it made the torch routines' bits."""
    batch, (ffn, hidden) = stacks[0].shape[0], dims[0]
    gate_up = torch.empty((batch, 2 * ffn, hidden), dtype=dtype, device=stacks[0].device)
    down = torch.empty((batch, hidden, ffn), dtype=dtype, device=stacks[0].device)
    addresses = [[int(s[i].data_ptr()) for i in range(batch)] for s in stacks]
    layer = GgufExperts(types[0], types[2])
    ms = timed(lambda: dc.gguf_layer_cuda(layer, addresses, gate_up, down))
    want = [gd.dequantize(s, t, dtype) for s, t in zip(stacks, types, strict=True)]
    same = (torch.equal(gate_up, torch.cat(want[:2], dim=1)) and torch.equal(down, want[2]))
    return {"kernel_expert_ms": round(ms / batch, 4), "kernel_same_values": same}


def _rows(args: argparse.Namespace) -> list[tuple[Types, str]]:
    ids = {t.name: int(t) for t in Q}
    names = args.types.split(",") if args.types else \
        [Q(t).name for t in sorted(ROUTINES)] + ["BF16"]
    for name in names:
        if name not in ids or not gd.supported(ids[name]):
            raise SystemExit(f"python -m bench.gguf_dequant: unknown or unsupported type {name}")
    rows: list[tuple[Types, str]] = []
    for shape in args.shapes.split(","):
        if shape not in PRESETS:
            raise SystemExit(f"python -m bench.gguf_dequant: no preset {shape} "
                             f"(one of {', '.join(PRESETS)})")
        rows += [((ids[n],) * 3, shape) for n in names]
        spec = PRESETS[shape]
        own = (int(spec.gate_up_type), int(spec.gate_up_type), int(spec.down_type))
        if len(set(own)) > 1 and all(gd.supported(t) for t in own):
            rows.append((own, shape))
    return rows


def _print_table(rows: list[dict[str, Any]], out: Any) -> None:
    head = ("type", "shape", "one_expert_ms", "out_gb_s", "upload_ms", "over_upload",
            "batch_expert_ms", "batch_out_gb_s", "kernel_expert_ms", "kernel_same_values",
            "transformers_expert_ms", "same_values")
    print("  ".join(f"{h:>15}" for h in head), file=out)
    for row in rows:
        print("  ".join(f"{row.get(h, '-')!s:>15}" for h in head), file=out)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.gguf_dequant",
                                description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--shapes", default=DEFAULT_SHAPES,
                   help=f"modelspec presets, comma-separated ({DEFAULT_SHAPES})")
    p.add_argument("--types", help="ggml type names, comma-separated (default: every "
                   "quantized type moestream dequantizes, and BF16)")
    p.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    p.add_argument("--batch", type=int, help="experts batched a call (default: the "
                   "shape's top-k; 1 skips the batched timing)")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", type=Path, help="write the JSON report here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("python -m bench.gguf_dequant: torch sees no CUDA device")
    rows = [measure(types, shape, args, device) for types, shape in _rows(args)]
    _print_table(rows, sys.stdout)
    report = {"command": "python -m bench.gguf_dequant " + " ".join(sys.argv[1:]),
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "dtype": args.dtype, "repeats": args.repeats, **_versions(), "rows": rows}
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
