"""``python -m bench.quantized``: an FP8 checkpoint streamed, against its BF16 original.

One process, two checkpoints of one shape: a random-init BF16 Qwen3-MoE
(``bench.transformers.make_checkpoint``) and its FP8 block quantization (every ``*_proj``
weight F8_E4M3 with an F32 ``weight_scale_inv`` per 128 x 128 block, as DeepSeek-V3 and
Qwen3-FP8 ship theirs; quantized here on the device). Runs, greedy, ``--tokens`` tokens:

- ``reference``: transformers' own ``from_pretrained(fp8, quantization_config=
  FineGrainedFP8Config(dequantize=True))``, resident: the tokens every FP8 run must equal;
- ``fp8``: moestream on the FP8 checkpoint, dense weights + expert cache within ``--total``
  (the checkpoint's pages warm in the page cache);
- ``bf16``: moestream on the BF16 checkpoint at the same expert-cache bytes;
- ``fp8_all``: moestream on the FP8 checkpoint holding every expert;
- ``dequant``: one layer's top-k experts dequantized on the device (one batch a matrix
  kind: the CUDA kernel the experts call uses, and torch's ops) against the upload of
  their FP8 bytes from pinned memory, CUDA events, medians.

Prints one JSON object (``--out`` writes it too): tok/s, hit rates, same tokens, and the
ratios the FP8 path is held to (``fp8`` over ``bf16``; dequantization over upload).

    python -m bench.quantized --make /tmp/q8 --shape qwen3-30b-a3b --layers 8 --total 3GiB
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from pathlib import Path
from typing import Any

from bench.transformers import (
    SHAPES,
    _timed,
    _versions,
    dense_bytes,
    make_checkpoint,
    run_moestream,
)
from moestream.pipeline.foundation.config import Budget, parse_size

__all__ = ["main", "quantize_fp8_blocks"]

BLOCK = (128, 128)
E4M3_MAX = 448.0


def quantize_fp8_blocks(weight: Any, block: tuple[int, int] = BLOCK) -> tuple[Any, Any]:
    """``weight`` (rows, cols) as E4M3 and its float32 scales, one per block (edge blocks
    partial): a block's scale is its largest magnitude over 448, the format's rule."""
    import torch

    rows, cols = weight.shape
    bm, bn = block
    sr, sc = -(-rows // bm), -(-cols // bn)
    padded = torch.zeros((sr * bm, sc * bn), dtype=torch.float32, device=weight.device)
    padded[:rows, :cols] = weight
    grid = padded.view(sr, bm, sc, bn)
    scales = grid.abs().amax(dim=(1, 3)).clamp(min=1e-12) / E4M3_MAX
    q = (grid / scales[:, None, :, None]).to(torch.float8_e4m3fn).view(sr * bm, sc * bn)
    return q[:rows, :cols].contiguous(), scales


def make_fp8(source: Path, target: Path, device: str) -> None:
    """``source``'s checkpoint with every ``*_proj`` weight FP8 (made in a temporary folder
    beside ``target``, renamed when whole)."""
    import torch
    from safetensors.torch import load_file, save_file

    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for file in source.iterdir():
        if file.suffix != ".safetensors":
            if file.is_file():
                shutil.copyfile(file, staging / file.name)
            continue
        out: dict[str, Any] = {}
        for name, tensor in load_file(file, device=device).items():
            if name.endswith("_proj.weight") and tensor.dim() == 2:
                q, scales = quantize_fp8_blocks(tensor)
                out[name], out[name[:-len("weight")] + "weight_scale_inv"] = q.cpu(), scales.cpu()
            else:
                out[name] = tensor.cpu()
        save_file(out, staging / file.name, metadata={"format": "pt"})
        del out
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    index = staging / "model.safetensors.index.json"
    if index.is_file():
        doc = json.loads(index.read_text())
        for name, shard in list(doc["weight_map"].items()):
            if name.endswith("_proj.weight"):
                doc["weight_map"][name[:-len("weight")] + "weight_scale_inv"] = shard
        index.write_text(json.dumps(doc))
    config = json.loads((staging / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                     "weight_block_size": list(BLOCK),
                                     "activation_scheme": "dynamic"}
    (staging / "config.json").write_text(json.dumps(config))
    staging.rename(target)


def run_reference(args: argparse.Namespace, prompt: Any, device: Any) -> dict[str, Any]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        args.fp8, quantization_config=transformers.FineGrainedFP8Config(dequantize=True),
        experts_implementation="grouped_mm", device_map=str(device))
    result = _timed(model, prompt, args, device, warm_up=True)
    del model
    return result


def run_dequant(args: argparse.Namespace, device: Any) -> dict[str, Any]:
    """One layer's top-k experts: dequantization (one batch per matrix kind) against the
    upload of their FP8 bytes from pinned memory."""
    import torch

    from moestream.transformers._dequant import fp8_blocks
    from moestream.transformers._dequant_cuda import fp8_experts_cuda

    if device.type != "cuda":
        return {"skipped": "timed with CUDA events on a GPU"}
    shape = SHAPES[args.shape]
    k, hidden, ffn = (shape["num_experts_per_tok"], shape["hidden_size"],
                      shape["moe_intermediate_size"])
    gen = torch.Generator(device=device).manual_seed(0)
    raw = [torch.randint(0, 120, (k, rows, cols), dtype=torch.uint8, device=device,
                         generator=gen) for rows, cols in ((ffn, hidden),) * 2 + ((hidden, ffn),)]
    scales = [torch.rand((k, -(-r.shape[1] // 128), -(-r.shape[2] // 128)), device=device)
              for r in raw]
    pinned = [r.cpu().pin_memory() for r in raw]
    target = [torch.empty_like(r) for r in raw]

    def timed(work: Any) -> float:
        times = []
        for _ in range(20):
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start.record()
            work()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return float(statistics.median(times[5:]))

    outs = [torch.empty(r.shape, dtype=torch.bfloat16, device=device) for r in raw]
    experts = list(range(k))

    def kernel() -> None:  # as the experts call runs it: from each matrix's address
        for r, s, o in zip(raw, scales, outs, strict=True):
            fp8_experts_cuda([r[e].data_ptr() for e in experts], experts, s, o, BLOCK)

    dequant_ms = timed(kernel)
    torch_ms = timed(lambda: [fp8_blocks(r, s, BLOCK, torch.bfloat16)
                              for r, s in zip(raw, scales, strict=True)])
    upload_ms = timed(lambda: [t.copy_(p, non_blocking=True)
                               for t, p in zip(target, pinned, strict=True)])
    nbytes = sum(r.numel() for r in raw)
    return {"experts": k, "fp8_bytes": nbytes, "dequant_ms": round(dequant_ms, 4),
            "dequant_torch_ops_ms": round(torch_ms, 4),
            "upload_ms": round(upload_ms, 4),
            "upload_gb_s": round(nbytes / upload_ms / 1e6, 1),
            "dequant_over_upload": round(dequant_ms / upload_ms, 3)}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.quantized",
                                description=__doc__.splitlines()[0])
    p.add_argument("--make", type=Path, required=True, help="folder of the two checkpoints "
                   "(bf16/ and fp8/ inside; made unless there)")
    p.add_argument("--shape", default="tiny", choices=list(SHAPES))
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--prompt-ids", default="1,2,3,4")
    p.add_argument("--total", default="3GiB", help="device memory of the streamed runs: "
                   "dense weights + expert cache (3GiB)")
    p.add_argument("--runs", default="reference,fp8,bf16,fp8_all,dequant")
    p.add_argument("--device", help="cpu or cuda (default: cuda if torch sees one)")
    p.add_argument("--mode", default="auto", choices=["auto", "direct", "resident"])
    p.add_argument("--out", type=Path)
    return p


def main(argv: list[str] | None = None) -> int:
    import torch

    args = build_parser().parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    bf16, args.fp8 = args.make / "bf16", args.make / "fp8"
    if not (bf16 / "config.json").is_file():
        make_checkpoint(bf16, args.shape, args.layers, str(device))
    if not (args.fp8 / "config.json").is_file():
        make_fp8(bf16, args.fp8, str(device))
    dense = dense_bytes(bf16)  # on the device both are BF16: FP8 dense weights dequantized
    budget = Budget(nbytes=parse_size(args.total) - dense)
    prompt = torch.tensor([[int(t) for t in args.prompt_ids.split(",")]])
    runs = [r for r in args.runs.split(",") if r]
    results: dict[str, dict[str, Any]] = {}
    for name in runs:  # a run named twice is measured twice (the later one kept as name)
        if name in results:
            results[f"{name}_first"] = results.pop(name)
        if name == "reference":
            results[name] = run_reference(args, prompt, device)
        elif name == "dequant":
            results[name] = run_dequant(args, device)
        else:
            args.model = bf16 if name == "bf16" else args.fp8
            results[name] = run_moestream(args, prompt, device,
                                          budget=None if name == "fp8_all" else budget,
                                          cold=False)
    reference = results.get("reference", {}).get("tokens")
    for name in ("fp8", "fp8_all"):
        if reference is not None and "tokens" in results.get(name, {}):
            results[name]["same_tokens"] = results[name]["tokens"] == reference
    ratios = {}
    if "tokens_per_s" in results.get("fp8", {}) and "tokens_per_s" in results.get("bf16", {}):
        ratios["fp8_over_bf16"] = round(results["fp8"]["tokens_per_s"]
                                        / results["bf16"]["tokens_per_s"], 3)
    if "tokens_per_s" in results.get("reference", {}):
        for name in ("fp8", "fp8_all"):
            if "tokens_per_s" in results.get(name, {}):
                ratios[f"{name}_over_resident"] = round(
                    results[name]["tokens_per_s"] / results["reference"]["tokens_per_s"], 3)
    report = {"command": "python -m bench.quantized " + " ".join(sys.argv[1:]),
              "device": str(device), "dense_bytes": dense, "cache_budget_bytes": budget.nbytes,
              **_versions(), "ratios": ratios, "runs": results}
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0 if all(r.get("same_tokens", True) for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
