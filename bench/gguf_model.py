"""``python -m bench.gguf_model``: a Q4_K GGUF model against its BF16 checkpoint, streamed.

Greedy tokens/s through ``moestream.transformers.from_pretrained`` of a Qwen3-MoE GGUF file
whose routed experts are Q4_K (4.5 bits a value) against the BF16 ``save_pretrained``
checkpoint of the same shape, both in bfloat16 at the same device budget (``--total``: the
dense weights plus the expert cache; or a cache of ``--cache-share`` of the BF16 experts'
bytes). The same cache holds 16 / 4.5 = 3.6x the GGUF's experts, whose misses read 0.28x
the bytes; the GGUF's experts are dequantized on the compute device at each use.

``--make DIR`` writes (or reuses) ``bench.transformers``' random-init checkpoint of
``--shape`` and ``--layers`` and ``DIR/model-q4_k.gguf`` from it, laid out as llama.cpp's
converter does (gguf's names and metadata, 1-D tensors and routers F32, other dense
tensors F16, experts stacked as ``blk.N.ffn_{gate,up,down}_exps``), a tensor at a time.
gguf-py cannot quantize Q4_K, so the experts are random valid blocks (small finite float16
scales): their values are not the checkpoint's and the tokens differ; a speed figure only.
Where the expert widths are no whole 256-value block (``tiny``) they are Q4_0 (4.5 bits).

The process first loads the BF16 model resident and generates the timed tokens (the first
model loaded runs slower; its tokens are the BF16 runs' reference, its speed the resident
reference), then one untimed round (a load and a generate of each), then ``--repeat``
rounds alternating the two: a fresh load each (a generate warms the cache), ``--warmup``
untimed tokens, ``--tokens`` timed, with the session's counts and time split over them.

    python -m bench.gguf_model --make /tmp/gm --shape cpu --layers 8 --total 122MiB
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.record import report_main
from bench.transformers import (
    SHAPES,
    _cache_bytes,
    _generate,
    _peak,
    _peak_reset,
    _shards,
    _versions,
    add_run_arguments,
    add_sample_argument,
    add_spread_argument,
    checkpoint_bytes,
    make_checkpoint,
    reference_tokens,
    run_resident,
    summary,
    tuning_of,
)
from moestream.pipeline.foundation.config import Budget, parse_size
from moestream.pipeline.foundation.errors import UsageError
from moestream.pipeline.foundation.safetensors_table import is_routed

__all__ = ["main", "write_gguf"]

GGUF_NAME = "model-q4_k.gguf"
_SCALES: dict[str, tuple[tuple[int, ...], float, float]] = {
    "Q4_K": ((0, 2), 2.0**-14, 2.0**-13),  # d and dmin; a value is d*sc*q - dmin*m
    "Q4_0": ((0,), 2.0**-9, 2.0**-8),  # d; a value is d*(q - 8)
}
"""Each expert type's float16 scale fields (byte offsets in a block) and the range of their
random values: normal halves whose values come near a random-init model's (std 0.02)."""


def expert_type(config: dict[str, Any]) -> str:
    """Q4_K where both expert widths are whole 256-value blocks, else Q4_0 (4.5 bits too)."""
    widths = (config["hidden_size"], config["moe_intermediate_size"])
    return "Q4_K" if all(w % 256 == 0 for w in widths) else "Q4_0"


def random_blocks(kind: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """``(rows, row bytes)`` valid random blocks of ``kind``: random bytes, small scales."""
    import gguf

    elems, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    n = rows * cols // elems
    blocks = rng.integers(0, 256, (n, nbytes), dtype=np.uint8)
    offsets, low, high = _SCALES[kind]
    for at in offsets:
        halves = rng.uniform(low, high, n).astype(np.float16).view(np.uint8)
        blocks[:, at:at + 2] = halves.reshape(n, 2)
    return blocks.reshape(rows, cols // elems * nbytes)


def _experts(config: dict[str, Any]) -> int:
    """The routed experts a layer (transformers 5 saves Qwen3-MoE's as num_local_experts)."""
    return int(config.get("num_experts") or config["num_local_experts"])


def _metadata(writer: Any, config: dict[str, Any]) -> None:
    """The hyperparameters and GPT-2 byte-level tokenizer convert_hf_to_gguf writes for a
    Qwen3-MoE checkpoint (the vocabulary's size stated: the token list is 256 bytes and
    an end-of-text token, the embedding's rows are the checkpoint's)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    writer.add_name("moestream-bench")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_expert_count(_experts(config))
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_vocab_size(config["vocab_size"])
    byte_tokens = bytes_to_unicode().values()  # type: ignore[no-untyped-call]
    tokens = [*byte_tokens, "<|endoftext|>"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - 1) + [3])
    writer.add_token_merges([])
    if len(tokens) <= config["vocab_size"]:  # the tiny shape's 96 rows hold no such id
        writer.add_eos_token_id(len(tokens) - 1)


@dataclass(frozen=True)
class _Dense:
    """One dense tensor to write: its GGUF name, file type, and where the checkpoint has it."""

    gguf_name: str
    kind: str
    shard: Path
    name: str
    shape: tuple[int, ...]

    @property
    def dtype(self) -> Any:
        return np.dtype(np.float32 if self.kind == "F32" else np.float16)


def _dense_plan(checkpoint: Path, layers: int) -> list[_Dense]:
    """The checkpoint's dense tensors by gguf's name map: 1-D tensors and the routers F32,
    as llama.cpp keeps them, the rest F16.

    Raises:
        UsageError: a tensor gguf's name map does not know.
    """
    import gguf
    from safetensors import safe_open

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3MOE, layers)
    plan = []
    for shard in _shards(checkpoint):
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (a safe_open is not iterable)
                if is_routed(name):
                    continue
                shape = tuple(f.get_slice(name).get_shape())
                base, _, suffix = name.rpartition(".")
                mapped = names.get_name(base)
                if mapped is None:
                    raise UsageError(f"{checkpoint}: gguf maps no name for {name}")
                gguf_name = f"{mapped}.{suffix}"
                kind = "F32" if len(shape) == 1 or ".ffn_gate_inp." in gguf_name else "F16"
                plan.append(_Dense(gguf_name, kind, shard, name, shape))
    return plan


def _expert_shapes(config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """Each projection's experts as values: (rows, columns) of one expert."""
    hidden, ffn = config["hidden_size"], config["moe_intermediate_size"]
    return {"gate": (ffn, hidden), "up": (ffn, hidden), "down": (hidden, ffn)}


def _plan_tensors(writer: Any, config: dict[str, Any], dense: Sequence[_Dense],
                  kind: str) -> None:
    """Every tensor's name, shape and type in the writer, in the order they are written."""
    import gguf

    for d in dense:
        writer.add_tensor_info(d.gguf_name, d.shape, d.dtype,
                               int(np.prod(d.shape)) * d.dtype.itemsize)
    raw = gguf.GGMLQuantizationType[kind]
    elems, nbytes = gguf.GGML_QUANT_SIZES[raw]
    experts = _experts(config)
    for layer in range(config["num_hidden_layers"]):
        for proj, (rows, cols) in _expert_shapes(config).items():
            shape = (experts, rows, cols // elems * nbytes)
            writer.add_tensor_info(f"blk.{layer}.ffn_{proj}_exps.weight", shape,
                                   np.dtype(np.uint8), int(np.prod(shape)), raw_dtype=raw)


def write_gguf(checkpoint: Path, path: Path, seed: int = 0) -> dict[str, Any]:
    """Write ``path`` from ``checkpoint`` tensor by tensor (the dense ones converted, the
    routed experts random blocks), atomically. Returns its expert type and byte counts.

    Raises:
        UsageError: the checkpoint has a tensor gguf's name map does not know.
    """
    import gguf
    import torch
    from safetensors import safe_open

    config = json.loads((checkpoint / "config.json").read_text())
    kind = expert_type(config)
    dense = _dense_plan(checkpoint, config["num_hidden_layers"])
    part = path.with_name(path.name + ".part")
    writer = gguf.GGUFWriter(part, "qwen3moe")
    try:
        _metadata(writer, config)
        _plan_tensors(writer, config, dense, kind)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for d in dense:
            with safe_open(str(d.shard), framework="pt") as f:
                value = f.get_tensor(d.name).to(torch.float32).numpy()
            writer.write_tensor_data(value.astype(d.dtype))
        rng = np.random.default_rng(seed)
        expert_bytes = 0
        for _ in range(config["num_hidden_layers"]):
            for rows, cols in _expert_shapes(config).values():
                blocks = random_blocks(kind, _experts(config) * rows, cols, rng)
                writer.write_tensor_data(blocks)
                expert_bytes += blocks.nbytes
    finally:
        writer.close()
    os.replace(part, path)
    return {"expert_type": kind, "gguf_expert_bytes": expert_bytes,
            "gguf_file_bytes": path.stat().st_size}


def _load_and_time(path: Path, args: argparse.Namespace, prompt: Any, device: Any,
                   cache: int) -> dict[str, Any]:
    """One fresh load of ``path`` at a cache of ``cache`` bytes in bfloat16, its pages
    resident first, ``--warmup`` untimed tokens, ``--tokens`` timed: the tokens, seconds
    and the session's counts over the timed tokens."""
    import torch

    from bench.kit import make_resident
    from moestream.transformers import from_pretrained

    for file in [path] if path.is_file() else _shards(path):
        make_resident(file)
    _peak_reset(device)
    model = from_pretrained(path, budget=Budget(nbytes=cache), device=device,
                            dtype=torch.bfloat16, mode=args.mode, tuning=tuning_of(args),
                            in_place=args.in_place)
    stream = model.moestream
    try:
        if args.warmup:
            _generate(model, prompt, args.warmup, device, args.sample)
        parts: dict[str, float] = {}  # the timed tokens' wall time by what it went to
        stream.on_token = lambda stats: parts.update(
            {part: parts.get(part, 0.0) + ms for part, ms in stats.time.items()})
        before = stream.session.counters()
        tokens, seconds = _generate(model, prompt, args.tokens, device, args.sample)
        after = stream.session.counters()
    finally:
        stream.close()
    del model
    return {"tokens": tokens, "seconds": seconds, "hits": after.hits - before.hits,
            "misses": after.misses - before.misses,
            "file_bytes": after.file_bytes - before.file_bytes,
            "storage_bytes": after.storage_bytes - before.storage_bytes,
            "budget_bytes": after.budget_bytes, "device_peak_bytes": _peak(device),
            "time_ms": parts}


def _rounds(paths: dict[str, Path], args: argparse.Namespace, prompt: Any, device: Any,
            cache: int) -> dict[str, list[dict[str, Any]]]:
    """One untimed round, then ``--repeat`` rounds alternating the models (so a drift in
    the machine's speed falls on both): each model's timed loads."""
    for path in paths.values():
        _load_and_time(path, args, prompt, device, cache)
    done: dict[str, list[dict[str, Any]]] = {name: [] for name in paths}
    for _ in range(args.repeat):
        for name, path in paths.items():
            done[name].append(_load_and_time(path, args, prompt, device, cache))
    return done


def _run_summary(loads: Sequence[dict[str, Any]], reference: str | None) -> dict[str, Any]:
    """A model's timed loads: ``summary``'s speed figures, each load's counts, and the
    time split summed over them (what bounds the run)."""
    out = summary([(d["tokens"], d["seconds"]) for d in loads], reference)
    hits, misses = sum(d["hits"] for d in loads), sum(d["misses"] for d in loads)
    out.update({
        "hit_rate": round(hits / (hits + misses), 4) if hits + misses else 0.0,
        "hit_rate_runs": [round(d["hits"] / max(1, d["hits"] + d["misses"]), 4)
                          for d in loads],
        "misses_runs": [d["misses"] for d in loads],
        "file_bytes_runs": [d["file_bytes"] for d in loads],
        "storage_bytes_runs": [d["storage_bytes"] for d in loads],
        "misses_median": statistics.median(d["misses"] for d in loads),
        "file_bytes_median": statistics.median(d["file_bytes"] for d in loads),
        "budget_bytes": loads[-1]["budget_bytes"],
        "device_peak_bytes": max(d["device_peak_bytes"] for d in loads),
        "time_ms": {part: round(sum(d["time_ms"].get(part, 0.0) for d in loads), 1)
                    for part in loads[0]["time_ms"]},
    })
    out["bound"] = max(out["time_ms"], key=out["time_ms"].__getitem__, default=None)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.gguf_model",
                                description=__doc__.splitlines()[0])
    p.add_argument("--make", type=Path, required=True, help="the directory of the BF16 "
                   f"checkpoint and {GGUF_NAME} (written unless there)")
    p.add_argument("--shape", default="tiny", choices=list(SHAPES))
    p.add_argument("--layers", type=int, default=2, help="layers of the model (2)")
    p.add_argument("--tokens", type=int, default=16, help="tokens timed (16)")
    p.add_argument("--warmup", type=int, default=4, help="tokens generated first (4)")
    p.add_argument("--repeat", type=int, default=3, help="timed loads a model (3)")
    p.add_argument("--total", default="3GiB", help="device memory: the dense weights "
                   "(bfloat16) + the expert cache (3GiB)")
    p.add_argument("--cache-share", type=float, help="a cache of this share of the BF16 "
                   "experts' bytes instead (0.25, say)")
    p.add_argument("--prompt-ids", default="1,2,3,4", help="prompt token ids (1,2,3,4)")
    p.add_argument("--in-place", action="store_true", help="both models with in_place=True "
                   "(on a GPU, once the cache is full, the experts it lacks read in place "
                   "from the page cache by the dequantization or gather kernel)")
    add_sample_argument(p)
    add_spread_argument(p)
    add_run_arguments(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return report_main("bench.gguf_model", lambda: _bench(args), args.out,
                       lambda report: bool(report["runs"]["bf16"]["same_tokens"]))


def _prepare(args: argparse.Namespace, device: Any) -> dict[str, Any]:
    """The checkpoint and the GGUF file in ``--make`` (each made unless there)."""
    if args.repeat < 1:
        raise UsageError(f"--repeat must be >= 1, got {args.repeat}")
    if not (args.make / "config.json").is_file():
        make_checkpoint(args.make, args.shape, args.layers, str(device), args.spread)
    gguf_path = args.make / GGUF_NAME
    if gguf_path.is_file():
        import gguf

        reader = gguf.GGUFReader(gguf_path)
        kinds = {t.tensor_type.name for t in reader.tensors if "_exps." in t.name}
        made = {"expert_type": ",".join(sorted(kinds)), "gguf_file_bytes":
                gguf_path.stat().st_size, "gguf_expert_bytes":
                sum(int(t.n_bytes) for t in reader.tensors if "_exps." in t.name)}
    else:
        made = write_gguf(args.make, gguf_path)
    return {"gguf": str(gguf_path), **made}


def _bench(args: argparse.Namespace) -> dict[str, Any]:
    from moestream.transformers import is_available

    is_available(raise_error=True)
    import torch

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    made = _prepare(args, device)
    args.model, args.total_bytes = args.make, parse_size(args.total)
    dense, experts = checkpoint_bytes(args.make)
    cache = _cache_bytes(args, dense, experts)
    prompt = torch.tensor([[int(t) for t in args.prompt_ids.split(",")]])
    load = os.getloadavg()[0]
    reference = reference_tokens(args, prompt, device)
    resident = run_resident(args, prompt, device, "grouped_mm", reference)
    loads = _rounds({"gguf": Path(made["gguf"]), "bf16": args.make}, args, prompt, device,
                    cache)
    runs = {"resident": resident, "bf16": _run_summary(loads["bf16"], reference),
            "gguf": _run_summary(loads["gguf"], None)}
    return {
        "command": "python -m bench.gguf_model " + " ".join(sys.argv[1:]),
        "checkpoint": str(args.make), **made, "device": str(device), "dtype": "bfloat16",
        "in_place": args.in_place,
        "shape": args.shape, "layers": json.loads((args.make / "config.json").read_text())
        ["num_hidden_layers"], "dense_bytes": dense, "bf16_expert_bytes": experts,
        "total_bytes": args.total_bytes, "cache_budget_bytes": cache,
        "cache_share_bf16": round(cache / experts, 4),
        "cache_share_gguf": round(cache / made["gguf_expert_bytes"], 4),
        "tokens": args.tokens, "warmup": args.warmup, "repeat": args.repeat,
        "reference_tokens": reference, "load_before": load, "load_after": os.getloadavg()[0],
        **_versions(),
        "gguf_over_bf16": round(runs["gguf"]["tokens_per_s"] / runs["bf16"]["tokens_per_s"], 3),
        "note": "the GGUF's experts are random Q4_K blocks, not the checkpoint's values: its "
                "tokens differ from the BF16 model's; a speed figure only",
        "runs": runs,
    }


if __name__ == "__main__":
    sys.exit(main())
