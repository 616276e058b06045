"""``python -m bench.quantized``: a quantized checkpoint streamed, against transformers'
resident dequantized model; FP8 blocks, MXFP4 (gpt-oss) or FP4 (DeepSeek-V4).

One process, one format (``--format``), one shape (``--shape``):

- ``fp8`` (``tiny``, ``qwen3-30b-a3b``): a random-init BF16 Qwen3-MoE
  (``bench.transformers.make_checkpoint``) and its FP8 block quantization (every ``*_proj``
  weight F8_E4M3 with an F32 ``weight_scale_inv`` per 128 x 128 block, as DeepSeek-V3 and
  Qwen3-FP8 ship theirs; quantized here on the device);
- ``mxfp4`` (``tiny``, ``gpt-oss-120b``) and ``fp4`` (``tiny``, ``deepseek-v4-flash``): the
  project's checkpoint maker (``tools.make_model --quant``: gpt-oss's fused E2M1 blocks;
  DeepSeek-V4's I8 E2M1 experts and FP8 dense weights), experts at the model's layer shape
  (hidden, expert FFN, experts, top-k), the dense part small (vocabulary 1024, 4 heads).

Runs, greedy, ``--tokens`` tokens:

- ``reference``: transformers' ``from_pretrained(..., quantization_config=<format>(
  dequantize=True))``, resident: the tokens every streamed run must equal (skipped, with
  the reason, where it does not load or fit);
- ``<format>``: moestream on the quantized checkpoint, dense weights + expert cache + the
  experts' scales within ``--total`` (its pages warm in the page cache), with the hit rates
  the same routing would give in the same bytes BF16 experts and these experts with their
  scales streamed beside each one instead of held for all (a replay of the run's log
  through the cache's own index: ``hit_rate_replayed``, ``bf16_hit_rate_same_bytes``,
  ``scales_streamed_hit_rate_same_bytes``);
- ``bf16`` (``fp8`` only): moestream on the BF16 original at the same cache bytes;
- ``bf16_all`` (``fp8`` only): the BF16 original holding every expert;
- ``<format>_in_place``, ``bf16_in_place``: those two with ``in_place=True`` (once the
  cache is full, a decode step's experts are named on the device and the uncached ones
  read in place from the page cache by the dequantization or gather kernel; GPU only);
- ``<format>_all``: moestream holding every expert;
- ``dequant``: one layer's top-k experts dequantized on the device against the upload of
  their bytes (``bench.dequant``).

Prints one JSON object (``--out`` writes it too); exit 1 if a streamed run's tokens differ
from the reference's.

    python -m bench.quantized --make /tmp/q --format mxfp4 --shape gpt-oss-120b --layers 2
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from gguf import GGMLQuantizationType as QType

from bench.dequant import dequant_vs_upload
from bench.kit import merged_rounds
from bench.transformers import (
    SHAPES,
    _timed,
    _versions,
    add_graphs_argument,
    add_run_arguments,
    add_sample_argument,
    add_spread_argument,
    add_warmup_argument,
    make_checkpoint,
    run_moestream,
    summary,
    warmed,
)
from moestream.pipeline.foundation.config import Budget, parse_size
from moestream.pipeline.foundation.table import ExpertTable, open_table

__all__ = ["MADE_SHAPES", "main", "quantize_fp8_blocks"]

BLOCK = (128, 128)
E4M3_MAX = 448.0
FORMATS = ("fp8", "mxfp4", "fp4")
MADE_SHAPES: dict[str, dict[str, int]] = {
    "tiny": dict(hidden=64, expert_ffn=64, experts=8, top_k=2),
    "gpt-oss-120b": dict(hidden=2880, expert_ffn=2880, experts=128, top_k=4),
    "deepseek-v4-flash": dict(hidden=4096, expert_ffn=2048, experts=256, top_k=6),
}
"""The MXFP4 and FP4 checkpoints' expert shapes (the makers' ``qwen3-30b-a3b`` preset,
reshaped: its dense part stays small)."""
_FLOATS = {"BF16": 2, "F16": 2, "F32": 2, "F8_E4M3": 2}
"""Dense tensor types and their bytes on the device (the model's BF16; FP8 dequantized)."""


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
    _index_scales(staging)
    config = json.loads((staging / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                     "weight_block_size": list(BLOCK),
                                     "activation_scheme": "dynamic"}
    (staging / "config.json").write_text(json.dumps(config))
    staging.rename(target)


def _index_scales(staging: Path) -> None:
    """The shard index names each new scale in its weight's shard."""
    index = staging / "model.safetensors.index.json"
    if index.is_file():
        doc = json.loads(index.read_text())
        for name, shard in list(doc["weight_map"].items()):
            if name.endswith("_proj.weight"):
                doc["weight_map"][name[:-len("weight")] + "weight_scale_inv"] = shard
        index.write_text(json.dumps(doc))


def make_quantized(where: Path, fmt: str, shape: str, layers: int) -> None:
    """The ``mxfp4`` or ``fp4`` checkpoint of ``shape`` by the project's maker."""
    from moestream.pipeline.makers.checkpointgen import CheckpointOptions, write_checkpoint
    from moestream.pipeline.makers.modelspec import spec_for

    made = MADE_SHAPES[shape]
    spec = spec_for("qwen3-30b-a3b", layers, made["experts"], 0)
    spec = dataclasses.replace(spec, hidden=made["hidden"], expert_ffn=made["expert_ffn"],
                               top_k=made["top_k"], gate_up_type=QType.F16,
                               down_type=QType.F16)  # the preset's GGUF types bind no shape
    write_checkpoint(spec, where, CheckpointOptions(quant=fmt))  # type: ignore[arg-type]


def device_dense_bytes(table: ExpertTable) -> int:
    """The bytes the model holds on the device besides its experts and their scales: the
    dense tensors in BF16 (FP8 ones dequantized), the dense weights' scales consumed."""
    scales = {name for layer in table.layers.values() if layer.quant is not None
              for name in layer.quant.names}
    total = 0
    for tensor in table.non_routed:
        if tensor.name in scales or tensor.name.endswith(("_scale_inv", ".scale")):
            continue
        elements = 1
        for n in tensor.shape:
            elements *= n
        size = _FLOATS.get(tensor.type_name)
        total += elements * size if size is not None else tensor.nbytes
    return total


def run_reference(args: argparse.Namespace, prompt: Any, device: Any) -> dict[str, Any]:
    """transformers' resident model of the quantized checkpoint, dequantized at load."""
    import torch
    import transformers

    config = (transformers.Mxfp4Config(dequantize=True)  # type: ignore[attr-defined]
              if args.format == "mxfp4"
              else transformers.FineGrainedFP8Config(dequantize=True))
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            args.quantized, quantization_config=config, experts_implementation="grouped_mm",
            device_map=str(device))
        result = summary(_timed(model, prompt, args, device, warm_up=True,
                                repeat=args.repeat), None)
    except torch.cuda.OutOfMemoryError:
        return {"skipped": "does not fit the device"}
    except Exception as exc:  # transformers' own model failing is a finding, not a crash
        return {"skipped": f"transformers failed: {type(exc).__name__}: "
                           f"{str(exc).strip().splitlines()[0][:200] if str(exc) else ''}"}
    del model
    return result


def hit_rates_replayed(log: Path, table: ExpertTable, cache_bytes: int) -> dict[str, Any]:
    """The run's accesses replayed through the cache's own index, all in the run's bytes
    (its cache and the scales held): at the run's cache (its live count, checked), as BF16
    experts, and as the quantized experts with their scales streamed beside each one (the
    layout not taken: each cached expert carries its own, none are held for the others)."""
    from moestream.pipeline.runlog.read import read_log
    from moestream.tools.analyze.whatif_replay import AccessTrace, replay
    from moestream.transformers._scale_budget import layer_scale_bytes

    run = read_log(log)
    trace = AccessTrace.from_log(run)
    policy = run.header.policy if run.header is not None and run.header.policy else "lru"
    layers = [table.layers[n] for n in trace.moe_layers]
    scales = layer_scale_bytes(table)
    in_all = cache_bytes + sum(scales.values())
    bf16 = tuple(2 * 3 * layer.shape[0] * layer.shape[1] for layer in layers)
    streamed = tuple(layer.expert_bytes + scales.get(layer.index, 0) // layer.n_experts
                     for layer in layers)
    same = replay(trace, policy, cache_bytes)
    as_bf16 = replay(dataclasses.replace(trace, expert_bytes=bf16), policy, in_all)
    with_scales = replay(dataclasses.replace(trace, expert_bytes=streamed), policy, in_all)
    return {"hit_rate_replayed": round(same.hit_rate, 4),
            "bf16_hit_rate_same_bytes": round(as_bf16.hit_rate, 4),
            "scales_streamed_hit_rate_same_bytes": round(with_scales.hit_rate, 4),
            "bf16_expert_bytes": bf16[0], "scale_bytes_held": in_all - cache_bytes,
            "replayed_tokens": trace.tokens}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.quantized",
                                description=__doc__.splitlines()[0])
    p.add_argument("--make", type=Path, required=True, help="folder of the checkpoints "
                   "(made unless there)")
    p.add_argument("--format", default="fp8", choices=FORMATS)
    p.add_argument("--shape", default="tiny",
                   choices=sorted(set(SHAPES) | set(MADE_SHAPES)),
                   help="fp8: tiny, qwen3-30b-a3b; mxfp4: tiny, gpt-oss-120b; fp4: tiny, "
                   "deepseek-v4-flash")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--tokens", type=int, default=16)
    add_warmup_argument(p)
    p.add_argument("--repeat", type=int, default=3, help="timed generates a run (the median "
                   "is its tokens/s)")
    p.add_argument("--prompt-ids", default="1,2,3,4")
    add_sample_argument(p)
    add_spread_argument(p)
    p.add_argument("--total", default="3GiB", help="device memory of the streamed runs: "
                   "dense weights + expert cache + the experts' scales (3GiB)")
    p.add_argument("--runs", help="default: reference,<format>,<format>_in_place,bf16,"
                   "bf16_in_place (fp8),<format>_all,dequant")
    p.add_argument("--rounds", type=int, default=1,
                   help="measure the runs in turns this many times, each ratio taken within "
                   "a round and the median reported: a machine whose speed drifts over a "
                   "process (a third within a minute, seen on an H100) drifts under every "
                   "run alike")
    add_graphs_argument(p)
    add_run_arguments(p)
    return p


def _models(args: argparse.Namespace, device: Any) -> Path | None:
    """Make the checkpoints unless there; the quantized one in ``args.quantized``, the BF16
    original (``fp8`` only) returned."""
    if args.format == "fp8":
        made = f"{args.shape}-{args.layers}{'-spread' if args.spread else ''}"
        bf16 = args.make / f"bf16-{made}"
        args.quantized = args.make / f"fp8-{made}"
        if not (bf16 / "config.json").is_file():
            make_checkpoint(bf16, args.shape, args.layers, str(device), args.spread)
        if not (args.quantized / "config.json").is_file():
            make_fp8(bf16, args.quantized, str(device))
        return Path(bf16)
    args.quantized = args.make / f"{args.format}-{args.shape}-{args.layers}"
    if not (args.quantized / "config.json").is_file():
        args.make.mkdir(parents=True, exist_ok=True)
        make_quantized(args.quantized, args.format, args.shape, args.layers)
    return None


@dataclasses.dataclass(frozen=True)
class _Shared:
    """What every run of one command shares: the quantized checkpoint's table (opened once),
    the BF16 original (``fp8`` only), the streamed runs' budget and their logs' folder."""

    table: ExpertTable
    bf16: Path | None
    budget: Budget
    logs: Path


def _run(name: str, args: argparse.Namespace, prompt: Any, device: Any,
         shared: _Shared) -> dict[str, Any]:
    fmt, bf16, budget = args.format, shared.bf16, shared.budget
    if name == "reference":
        return run_reference(args, prompt, device)
    if name == "dequant":
        shape = _expert_shape(args)
        return dequant_vs_upload(fmt, shape["top_k"], shape["hidden"], shape["expert_ffn"],
                                 device)
    in_place = name.endswith("_in_place")
    if in_place and device.type != "cuda":
        return {"skipped": "a GPU path: the host backend has no tables"}
    if name in ("bf16", "bf16_in_place", "bf16_all"):
        if bf16 is None:
            return {"skipped": "a BF16 original is made for fp8 only (see the replay)"}
        args.model = bf16
        return run_moestream(args, prompt, device, None, cold=False, in_place=in_place,
                             budget=None if name == "bf16_all" else budget)
    if name not in (fmt, f"{fmt}_all", f"{fmt}_in_place"):
        return {"skipped": f"no run {name!r} for --format {fmt}"}
    args.model = args.quantized
    log = shared.logs / f"{name}.jsonl"
    result = run_moestream(args, prompt, device, None, budget=None if name.endswith("_all")
                           else budget, cold=False, log=log, in_place=in_place)
    if name == fmt:
        result.update(hit_rates_replayed(log, shared.table, result["budget_bytes"]))
    return result


def _expert_shape(args: argparse.Namespace) -> dict[str, int]:
    if args.format == "fp8":
        shape = SHAPES[args.shape]
        return {"hidden": shape["hidden_size"], "expert_ffn": shape["moe_intermediate_size"],
                "top_k": shape["num_experts_per_tok"]}
    return MADE_SHAPES[args.shape]


def _ratios(results: dict[str, dict[str, Any]], fmt: str, moe_layers: int
            ) -> dict[str, float]:
    def rate(name: str) -> float | None:
        value = results.get(name, {}).get("tokens_per_s")
        return float(value) if value is not None else None

    ratios: dict[str, float] = {}
    for suffix in ("", "_in_place", "_all"):
        ours, bf16 = rate(fmt + suffix), rate("bf16" + suffix)
        if ours is not None and bf16 is not None:
            ratios[f"{fmt}{suffix}_over_bf16{suffix}"] = round(ours / bf16, 3)
    resident = rate("reference")
    for name in (fmt, f"{fmt}_in_place", f"{fmt}_all"):
        value = rate(name)
        if value is not None and resident is not None:
            ratios[f"{name}_over_resident"] = round(value / resident, 3)
    dequant, every = results.get("dequant", {}), rate(f"{fmt}_all")
    if "dequant_device_ms" in dequant and every is not None:
        ratios["dequant_over_cached_token"] = round(
            dequant["dequant_device_ms"] * moe_layers / (1000.0 / every), 4)
    return ratios


def main(argv: list[str] | None = None) -> int:
    import torch

    args = warmed(build_parser().parse_args(argv))
    allowed = SHAPES if args.format == "fp8" else MADE_SHAPES
    if args.shape not in allowed:
        build_parser().error(f"--shape {args.shape} is not a {args.format} shape "
                             f"({', '.join(allowed)})")
    if args.spread and args.format != "fp8":
        build_parser().error("--spread: --format fp8 only (its BF16 original is the model "
                             "scaled; MXFP4 and FP4 checkpoints come from another maker)")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    bf16 = _models(args, device)
    table = open_table(args.quantized)
    dense = device_dense_bytes(table)
    budget = Budget(nbytes=parse_size(args.total) - dense)
    prompt = torch.tensor([[int(t) for t in args.prompt_ids.split(",")]])
    fmt = args.format
    originals = "bf16,bf16_in_place," if fmt == "fp8" else ""
    runs = [r for r in (args.runs or f"reference,{fmt},{fmt}_in_place,{originals}{fmt}_all,dequant"
                        ).split(",") if r]
    rounds: list[dict[str, dict[str, Any]]] = []
    with tempfile.TemporaryDirectory(prefix="bench-quantized-") as logs:
        shared = _Shared(table, bf16, budget, Path(logs))
        for _ in range(args.rounds):
            results: dict[str, dict[str, Any]] = {}
            for name in runs:  # a run named twice is measured twice (the later one kept)
                if name in results:
                    results[f"{name}_first"] = results.pop(name)
                results[name] = _run(name, args, prompt, device, shared)
            _check_tokens(results, fmt)
            rounds.append(results)
    moe_layers = len(table.layers)
    report = {"command": "python -m bench.quantized " + " ".join(sys.argv[1:] if argv is None
                                                                  else argv),
              "format": fmt, "shape": args.shape, "layers": args.layers,
              "device": str(device), "dense_bytes": dense, "experts_budget_bytes": budget.nbytes,
              **_versions(), **_rounds_report(rounds, fmt, moe_layers)}
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0 if all(r.get("same_tokens", True) for results in rounds
                    for r in results.values()) else 1


def _rounds_report(rounds: list[dict[str, dict[str, Any]]], fmt: str, moe_layers: int
                   ) -> dict[str, Any]:
    """The report's ``ratios`` and ``runs``: one round's as they are; of several rounds,
    each ratio's median over the rounds (a ratio taken within a round, its runs minutes
    apart, not across the process) with every round's in ``ratios_rounds``, and each run's
    rounds under ``runs`` (``kit.merged_rounds``), its ``tokens_per_s`` the median of theirs."""
    per_round = [_ratios(results, fmt, moe_layers) for results in rounds]
    if len(rounds) == 1:
        return {"ratios": per_round[0], "runs": rounds[0]}
    ratios = {key: round(statistics.median(r[key] for r in per_round if key in r), 3)
              for key in per_round[0]}
    return {"ratios": ratios, "ratios_rounds": per_round,
            "runs": merged_rounds(rounds, ("tokens_per_s",))}


def _check_tokens(results: dict[str, dict[str, Any]], fmt: str) -> None:
    reference = results.get("reference", {}).get("tokens")
    for name in (fmt, f"{fmt}_in_place", f"{fmt}_all"):
        if reference is not None and "tokens" in results.get(name, {}):
            results[name]["same_tokens"] = results[name]["tokens"] == reference


if __name__ == "__main__":
    sys.exit(main())
