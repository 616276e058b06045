"""Generate with a transformers MoE model whose routed experts moestream streams.

    python examples/transformers_generate.py CHECKPOINT_DIR --budget 3GiB --prompt "Hello"
    python examples/transformers_generate.py CHECKPOINT_DIR --prompt-ids 1,2,3 -n 16

The model is an ordinary transformers model (``generate`` as usual); its attention, norms,
embeddings, routers and shared experts are on the device, its routed experts are fetched
from the checkpoint by a moestream session under ``--budget``. ``--tiny DIR`` first writes
a tiny random Qwen3-MoE checkpoint there (no download) to try it on.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

import moestream
from moestream import transformers as mt


def write_tiny(where: Path) -> None:
    """A tiny random-init Qwen3-MoE checkpoint, written by transformers' save_pretrained."""
    import transformers

    config = transformers.AutoConfig.for_model(
        "qwen3_moe", hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_experts=8, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=96)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16) \
        .save_pretrained(where)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", type=Path)
    p.add_argument("--budget", help="device cache for the routed experts (default: all)")
    p.add_argument("--device", help="cpu or cuda (default: cuda if torch sees one)")
    p.add_argument("--prompt", help="text (needs the checkpoint's tokenizer)")
    p.add_argument("--prompt-ids", type=_ids, default="1,2,3", help="token ids (1,2,3)")
    p.add_argument("-n", "--tokens", type=_positive, default=16)
    p.add_argument("--tiny", action="store_true", help="write a tiny model at CHECKPOINT first")
    args = p.parse_args()
    if args.tiny:
        write_tiny(args.checkpoint)
    try:
        model = mt.from_pretrained(args.checkpoint, budget=args.budget, device=args.device)
    except moestream.MoestreamError as exc:
        return _failed(exc)
    try:
        # the model's own tokenizer, read as its session read the checkpoint
        tokenizer = None if args.prompt is None else mt.tokenizer(model)
        ids = args.prompt_ids if tokenizer is None else tokenizer(
            args.prompt, return_tensors="pt")["input_ids"]
        rows = model.get_input_embeddings().num_embeddings
        if not all(0 <= i < rows for i in ids[0].tolist()):
            raise moestream.UsageError(f"--prompt-ids: the model's token ids are 0..{rows - 1}")
        ids = ids.to(model.device)
        started = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=args.tokens, min_new_tokens=args.tokens)
        elapsed = time.perf_counter() - started
        counters = model.moestream.session.counters()
    except moestream.MoestreamError as exc:
        return _failed(exc)
    finally:
        model.moestream.close()
    new = out[0, ids.shape[1]:].tolist()
    print("tokens:", new)
    if tokenizer is not None:
        print("text:", tokenizer.decode(new))
    print(f"{len(new) / elapsed:.2f} tok/s; hit rate {counters.hit_rate:.3f}, "
          f"{counters.misses} misses, {counters.evictions} evictions, "
          f"peak {_mib(counters.peak_device_bytes)} of {_mib(counters.budget_bytes)}")
    return 0


def _ids(text: str) -> torch.Tensor:
    try:
        return torch.tensor([[int(t) for t in text.split(",")]])
    except ValueError:
        raise argparse.ArgumentTypeError(f"not comma-separated token ids: {text!r}") from None


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"not a positive count: {text!r}")
    return int(text)


def _failed(exc: moestream.MoestreamError) -> int:
    """moestream's errors are one line each, with the exit status they name."""
    print(f"error: {exc}", file=sys.stderr)
    return exc.exit_code


def _mib(nbytes: int) -> str:
    """MiB, or KiB below one (a tiny model's experts read 0.0 MiB)."""
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.1f} KiB"


if __name__ == "__main__":
    sys.exit(main())
