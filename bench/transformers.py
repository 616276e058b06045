"""``python -m bench.transformers``: a transformers MoE model resident, offloaded, streamed.

One process, one checkpoint, greedy generation of ``--tokens`` tokens from one prompt,
in these runs (``--runs`` picks some):

- ``resident``: every weight on the device, ``experts_implementation="grouped_mm"``
  (transformers' default); its tokens are the reference every other run is checked against;
- ``eager``: the same with ``experts_implementation="eager"``;
- ``accelerate``: accelerate's offload, ``device_map="auto"`` with ``max_memory`` of
  ``--total`` on the device (needs accelerate and a GPU);
- ``warm``: moestream at the same ``--total`` in all (dense weights + expert cache), the
  checkpoint's pages resident in the page cache first (as accelerate's experts sit in RAM);
- ``cold``: the same from storage (page cache dropped, no warm-up generate);
- ``all``: moestream with a budget that holds every expert, every expert fetched once and
  a warm-up generate before timing.

``resident`` runs first (its tokens are the reference) and again last, as
``resident_last``: the first model a process loads runs slower, so ``x_resident`` compares
with the faster of the two.

Each run but ``cold`` generates ``--warmup`` tokens before the timed generate (the first
model a process loads runs slower, whatever its implementation). Prints one JSON object:
the machine, the versions, and per run tokens/s, whether its tokens equal the resident
run's, device memory, and for moestream runs the hit rate and the token time split summed
over the timed tokens (what bounds the run). ``--make DIR`` first writes a random-init
checkpoint with ``save_pretrained`` (``--shape tiny`` or ``qwen3-30b-a3b``: Qwen3-30B-A3B's
per-layer shape, ``--layers`` layers).

    python -m bench.transformers --make /tmp/tiny --shape tiny --tokens 8
    python -m bench.transformers -m /data/qwen3-8l --total 3GiB --out bench/results/x.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from moestream.pipeline.foundation.config import Budget, parse_size
from moestream.pipeline.foundation.errors import MoestreamError, UsageError
from moestream.pipeline.foundation.safetensors_table import is_routed

__all__ = ["main"]

RUNS = ("resident", "eager", "accelerate", "warm", "cold", "all")
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                 num_experts=8, num_experts_per_tok=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=96),
    "qwen3-30b-a3b": dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                          num_experts=128, num_experts_per_tok=8, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, vocab_size=151936),
}


def make_checkpoint(where: Path, shape: str, layers: int, device: str) -> None:
    """A random-init Qwen3-MoE checkpoint of ``shape`` written by ``save_pretrained``."""
    import torch
    import transformers

    config = transformers.AutoConfig.for_model("qwen3_moe", num_hidden_layers=layers,
                                               **SHAPES[shape])
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(where)


def _shards(path: Path) -> list[Path]:
    return sorted(path.glob("*.safetensors"))


def dense_bytes(path: Path) -> int:
    """The checkpoint's bytes outside the routed experts (what moestream puts on the
    device besides its cache)."""
    from safetensors import safe_open

    total = 0
    for shard in _shards(path):
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (a safe_open is not iterable)
                if not is_routed(name):
                    tensor = f.get_slice(name)
                    n = 1
                    for d in tensor.get_shape():
                        n *= d
                    total += n * {"BF16": 2, "F16": 2, "F32": 4}.get(tensor.get_dtype(), 4)
    return total


def _peak_reset(device: Any) -> None:
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device: Any) -> int:
    import torch

    return int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else 0


def _generate(model: Any, prompt: Any, tokens: int, device: Any) -> tuple[list[int], float]:
    import torch

    ids = prompt.to(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                             min_new_tokens=tokens, do_sample=False)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out[0, ids.shape[1]:].tolist(), time.perf_counter() - started


def _timed(model: Any, prompt: Any, args: argparse.Namespace, device: Any,
           warm_up: bool) -> dict[str, Any]:
    if warm_up and args.warmup:
        _generate(model, prompt, args.warmup, device)
    tokens, seconds = _generate(model, prompt, args.tokens, device)
    return {"tokens": ",".join(map(str, tokens)), "seconds": round(seconds, 4),
            "tokens_per_s": round(len(tokens) / seconds, 3)}


def run_resident(args: argparse.Namespace, prompt: Any, device: Any,
                 implementation: str) -> dict[str, Any]:
    import transformers

    _peak_reset(device)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        args.model, experts_implementation=implementation).to(device)
    result = _timed(model, prompt, args, device, warm_up=True)
    result["device_peak_bytes"] = _peak(device)
    del model
    return result


def run_accelerate(args: argparse.Namespace, prompt: Any, device: Any) -> dict[str, Any]:
    import importlib.util

    if importlib.util.find_spec("accelerate") is None:
        return {"skipped": "accelerate is not installed"}
    if device.type != "cuda":
        return {"skipped": "accelerate's offload is measured on a GPU"}
    import transformers

    _peak_reset(device)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        args.model, device_map="auto",
        max_memory={device.index or 0: args.total_bytes, "cpu": 1 << 40})
    result = _timed(model, prompt, args, device, warm_up=True)
    result["device_peak_bytes"] = _peak(device)
    del model
    return result


def run_moestream(args: argparse.Namespace, prompt: Any, device: Any, *,
                  budget: Budget | None, cold: bool, log: Path | None = None) -> dict[str, Any]:
    from bench.kit import drop_caches, make_resident
    from moestream.transformers import from_pretrained

    for shard in _shards(args.model):
        if cold:
            drop_caches(shard)
        else:
            make_resident(shard)
    _peak_reset(device)
    model = from_pretrained(args.model, budget=budget, device=device, mode=args.mode, log=log)
    stream = model.moestream
    parts: dict[str, float] = {}
    try:
        if budget is None:  # every expert on the device before timing
            _fill_cache(stream)
        if not cold and args.warmup:
            _generate(model, prompt, args.warmup, device)
        before = stream.session.counters()

        def add(stats: Any) -> None:
            for part, ms in stats.time.items():
                parts[part] = parts.get(part, 0.0) + ms

        stream.on_token = add
        result = _timed(model, prompt, args, device, warm_up=False)
        after = stream.session.counters()
    finally:
        stream.close()
    hits, misses = after.hits - before.hits, after.misses - before.misses
    result.update({
        "budget_bytes": after.budget_bytes,
        "cache_peak_bytes": after.peak_device_bytes,
        "device_peak_bytes": _peak(device),
        "hit_rate": round(hits / (hits + misses), 4) if hits + misses else 0.0,
        "misses": misses,
        "file_bytes": after.file_bytes - before.file_bytes,
        "storage_bytes": after.storage_bytes - before.storage_bytes,
        "mode": after.mode,
        "time_ms": {k: round(v, 3) for k, v in parts.items()},
        "bound": max(parts, key=parts.__getitem__) if parts else None,
    })
    del model
    return result


def _fill_cache(stream: Any) -> None:
    """Fetch every expert of every layer once (in groups the budget holds), so that the
    timed tokens of a budget holding every expert find them all cached."""
    info = stream.session.model
    for layer in info.moe_layers:
        experts = list(range(info.layers[layer].n_experts))
        for i in range(0, len(experts), stream.group_experts):
            with stream.session.fetch(layer, experts[i:i + stream.group_experts]) as lease:
                lease.gather()
    stream.session.end_token()


def _versions() -> dict[str, str]:
    import torch
    import transformers

    out = {"torch": torch.__version__, "transformers": transformers.__version__,
           "python": platform.python_version(), "machine": platform.node()}
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
    if os.environ.get("MOESTREAM_COMMIT"):  # a tree copied without its .git
        out["commit"] = os.environ["MOESTREAM_COMMIT"]
        return out
    try:
        out["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                       capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        out["commit"] = "unknown"
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.transformers",
                                description=__doc__.splitlines()[0])
    p.add_argument("-m", "--model", type=Path, help="checkpoint directory")
    p.add_argument("--make", type=Path, help="write a random-init checkpoint here first "
                   "(unless one is there) and use it")
    p.add_argument("--shape", default="tiny", choices=list(SHAPES))
    p.add_argument("--layers", type=int, default=2, help="layers of --make's model (2)")
    p.add_argument("--tokens", type=int, default=16, help="tokens timed (16)")
    p.add_argument("--warmup", type=int, default=4, help="tokens generated first (4)")
    p.add_argument("--prompt-ids", default="1,2,3,4", help="prompt token ids (1,2,3,4)")
    p.add_argument("--total", default="3GiB", help="device memory of the offloaded runs: "
                   "accelerate's max_memory, moestream's dense weights + cache (3GiB)")
    p.add_argument("--runs", default=",".join(RUNS), help=f"some of {','.join(RUNS)}")
    p.add_argument("--device", help="cpu or cuda (default: cuda if torch sees one)")
    p.add_argument("--mode", default="auto", choices=["auto", "direct", "resident"])
    p.add_argument("--out", type=Path, help="also write the JSON here")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        report = _bench(args)
    except MoestreamError as exc:
        print(f"bench.transformers: error: {exc}", file=sys.stderr)
        return exc.exit_code
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0 if report["identical_tokens"] else 1


def _bench(args: argparse.Namespace) -> dict[str, Any]:
    from moestream.transformers import is_available

    is_available(raise_error=True)
    import torch

    runs = [r for r in args.runs.split(",") if r]
    unknown = sorted(set(runs) - set(RUNS))
    if unknown:
        raise UsageError(f"--runs: unknown {', '.join(unknown)} (runs: {', '.join(RUNS)})")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.make is not None:
        if not (args.make / "config.json").is_file():
            make_checkpoint(args.make, args.shape, args.layers, str(device))
        args.model = args.make
    if args.model is None:
        raise UsageError("give -m CHECKPOINT or --make DIR")
    if not (args.model / "config.json").is_file():
        raise UsageError(f"{args.model}: not a checkpoint directory (no config.json)")
    args.total_bytes = parse_size(args.total)
    dense = dense_bytes(args.model)
    cache = args.total_bytes - dense
    fits = Budget(nbytes=cache)
    if cache <= 0:
        raise UsageError(f"--total {args.total} does not hold the dense weights "
                         f"({dense} bytes)")
    prompt = torch.tensor([[int(t) for t in args.prompt_ids.split(",")]])
    plan: dict[str, Callable[[], dict[str, Any]]] = {
        "resident": lambda: run_resident(args, prompt, device, "grouped_mm"),
        "eager": lambda: run_resident(args, prompt, device, "eager"),
        "accelerate": lambda: run_accelerate(args, prompt, device),
        "warm": lambda: run_moestream(args, prompt, device, budget=fits, cold=False),
        "cold": lambda: run_moestream(args, prompt, device, budget=fits, cold=True),
        "all": lambda: run_moestream(args, prompt, device, budget=None, cold=False),
    }
    results: dict[str, dict[str, Any]] = {}
    reference: str | None = None
    if "resident" in runs:  # first: the reference, and the process's warm-up; again last,
        # as the first model a process loads runs slower whatever its implementation
        runs = ["resident"] + [r for r in runs if r != "resident"] + ["resident_last"]
        plan["resident_last"] = plan["resident"]
    for name in runs:
        results[name] = plan[name]()
        tokens = results[name].get("tokens")
        if tokens is not None and reference is None:
            reference = tokens
        if tokens is not None:
            results[name]["same_tokens"] = tokens == reference
    _compare(results)
    return {
        "command": "python -m bench.transformers " + " ".join(sys.argv[1:]),
        "model": str(args.model), "device": str(device), "dense_bytes": dense,
        "total_bytes": args.total_bytes, "cache_budget_bytes": cache, "tokens": args.tokens,
        **_versions(),
        "identical_tokens": all(r.get("same_tokens", True) for r in results.values()),
        "runs": results,
    }


def _compare(results: dict[str, dict[str, Any]]) -> None:
    """Each run's speed against the faster resident run's (``x_resident``), and the
    moestream runs' against accelerate's offload (``x_accelerate``), added in place."""
    fastest = max((results[r].get("tokens_per_s", 0.0) for r in ("resident", "resident_last")
                   if r in results), default=None)
    for result in results.values():
        if fastest and "tokens_per_s" in result:
            result["x_resident"] = round(result["tokens_per_s"] / fastest, 3)
    offload = results.get("accelerate", {}).get("tokens_per_s")
    for name in ("warm", "cold"):
        if offload and "tokens_per_s" in results.get(name, {}):
            results[name]["x_accelerate"] = round(results[name]["tokens_per_s"] / offload, 2)


if __name__ == "__main__":
    sys.exit(main())
