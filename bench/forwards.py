"""``python -m bench.forwards``: prefill, verification and speculative decoding forwards of a
MoE model whose routed experts moestream streams, against the same model resident.

One process, the resident model (``grouped_mm``) first: its greedy tokens are every check's
reference. ``prefill``: one forward over ``--prompt-tokens`` ids, resident and streamed in
turns, each streamed one after a fresh load and decode warm-up. ``verify``: with the prompt's
KV cache, K-token and 1-token forwards in turns. ``speculative``: plain greedy ``generate``
against prompt lookup and a draft model, through moestream (docs/TRANSFORMERS.md, Measuring).

    python -m bench.forwards --make /tmp/fw --shape cpu --layers 8 --cache-share 0.25
"""

from __future__ import annotations

import argparse
import inspect
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import transformers as bt
from bench.record import provenance, report_main
from moestream.pipeline.foundation.config import Budget, parse_size
from moestream.pipeline.foundation.errors import UsageError

__all__ = ["main"]

CHECKED_POSITIONS = 16  # the prefill's logits kept (generate keeps 1) and compared
PATTERN, REPEATS = 32, 4  # speculative decoding's prompt: 32 random ids 4 times
TARGETS = {"prefill_x_resident": 1.5, "verify_k_x_one": 1.6}  # the figures


@dataclass(frozen=True)
class Inputs:
    """The ids every run is given (the same for each, so their tokens compare): ``prompt``
    the prefill's and the verification cache's; ``fresh`` ``(repeat + 1, 1 + K)`` ids fed
    after it, a row a pair of forwards (its first id, then the K others), row 0 untimed;
    ``repeating`` speculative decoding's prompt."""

    prompt: Any
    fresh: Any
    repeating: Any


def _inputs(args: argparse.Namespace, vocab: int) -> Inputs:
    import torch

    g = torch.Generator().manual_seed(0)
    pattern = torch.randint(0, vocab, (1, PATTERN), generator=g)
    return Inputs(prompt=torch.randint(0, vocab, (1, args.prompt_tokens), generator=g),
                  fresh=torch.randint(0, vocab, (args.repeat + 1, 1 + args.verify_tokens),
                                      generator=g),
                  repeating=pattern.repeat(1, REPEATS))


def _timed(device: Any, call: Callable[[], Any]) -> tuple[Any, float]:
    """``call()``'s answer and seconds, the device synchronized before and after."""
    import torch

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda _device: None)
    sync(device)
    started = time.perf_counter()
    with torch.no_grad():
        out = call()
    sync(device)
    return out, time.perf_counter() - started


def _forward(model: Any, ids: Any, device: Any, cache: Any = None,
             keep: int = CHECKED_POSITIONS) -> tuple[Any, float]:
    """One timed forward of ``ids`` (after ``cache``'s tokens): the greedy tokens of its
    last ``keep`` positions, and its seconds."""
    ids = ids.to(device)
    # transformers 5.2x renamed past_key_values (warned on) to cache; older ones lack it
    word = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out, seconds = _timed(device, lambda: model(input_ids=ids, use_cache=cache is not None,
                                                logits_to_keep=keep, **{word: cache}))
    return out.logits[0].argmax(-1).cpu(), seconds


def _generate(model: Any, ids: Any, tokens: int, device: Any,
              **extra: Any) -> tuple[list[int], float]:
    """A timed greedy ``generate`` of exactly ``tokens`` new tokens: they and its seconds."""
    import torch

    ids = ids.to(device)
    out, seconds = _timed(device, lambda: model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
        min_new_tokens=tokens, do_sample=False, **extra))
    return out[0, ids.shape[1]:].tolist(), seconds


def _figures(seconds: Sequence[float]) -> dict[str, Any]:
    """Timed runs' median seconds, each, and the spread (max - min over the median)."""
    median = statistics.median(seconds)
    return {"seconds": round(median, 5), "seconds_runs": [round(s, 5) for s in seconds],
            "spread": round((max(seconds) - min(seconds)) / median, 4)}


def _delta(before: Any, after: Any) -> dict[str, Any]:
    return {k: round(getattr(after, k) - getattr(before, k), 3)
            for k in ("hits", "misses", "file_bytes", "storage_bytes", "stall_ms")}


def _summed(deltas: Sequence[dict[str, Any]]) -> dict[str, Any]:
    return {k: round(sum(d[k] for d in deltas), 3) for k in deltas[0]} if deltas else {}


@contextmanager
def _streamed(args: argparse.Namespace, device: Any, warm: Any) -> Iterator[Any]:
    """A moestream model at the run's budget, its checkpoint's pages resident, after a
    decode warm-up of ``--warmup`` tokens from ``warm``; closed on leaving."""
    from bench.kit import make_resident
    from moestream.transformers import from_pretrained

    for shard in bt._shards(args.model):
        make_resident(shard)
    model = from_pretrained(args.model, budget=Budget(nbytes=args.cache_bytes), device=device,
                            mode=args.mode, tuning=bt.tuning_of(args))
    try:
        if args.warmup:
            _generate(model, warm, args.warmup, device)
        yield model
    finally:
        model.moestream.close()


def _prefill(args: argparse.Namespace, data: Inputs, resident: Any) -> dict[str, Any]:
    """The prefill in turns (a drifting, shared host moves both alike): the resident model's,
    then a fresh moestream load's after its decode warm-up; wall and process CPU seconds
    (all threads: moestream's loads run beside the compute on a host) of each."""
    runs: dict[str, list[tuple[float, float]]] = {"resident": [], "moestream": []}
    deltas: list[dict[str, Any]] = []
    split: dict[str, float] = {}
    same = True
    for _ in range(args.repeat):
        reference, timing = _prefill_once(resident, data.prompt, args.device)
        runs["resident"].append(timing)
        with _streamed(args, args.device, data.repeating) as model:
            stream = model.moestream
            seen: list[Any] = []
            stream.on_token = seen.append
            before = stream.session.counters()
            tokens, timing = _prefill_once(model, data.prompt, args.device)
            after = stream.session.counters()
            group, mode = stream.group_experts, after.mode
        runs["moestream"].append(timing)
        deltas.append(_delta(before, after))
        same = same and bool(tokens.equal(reference))
        for part, ms in seen[-1].time.items():
            split[part] = split.get(part, 0.0) + ms / args.repeat
    unions = [len(layer) for layer in seen[-1].experts if layer]
    out: dict[str, Any] = {name: {**_figures([w for w, _ in r]), "cpu_seconds": round(
        statistics.median(c for _, c in r), 5)} for name, r in runs.items()}
    out["moestream"].update({
        "same_tokens": same, "mode": mode, "group_experts": group,
        "union_experts_per_layer": unions,
        "groups_per_layer": [math.ceil(u / group) for u in unions], "per_run": deltas,
        "time_ms": {k: round(v, 3) for k, v in split.items()}})
    out["x_resident_paired"] = [round(m[0] / r[0], 3) for r, m in zip(
        runs["resident"], runs["moestream"], strict=True)]
    return out


def _prefill_once(model: Any, ids: Any, device: Any) -> tuple[Any, tuple[float, float]]:
    cpu = time.process_time()
    tokens, seconds = _forward(model, ids, device)
    return tokens, (seconds, time.process_time() - cpu)


def _verify_pairs(model: Any, data: Inputs, device: Any) -> dict[str, Any]:
    """With the prompt's KV cache, a 1-token then a K-token forward over each row of fresh
    ids, the cache cropped back after each (row 0 untimed): their seconds, tokens and, for a
    streamed model, counts."""
    import torch
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    _forward(model, data.prompt, device, cache, keep=1)
    stream = getattr(model, "moestream", None)
    seconds: dict[str, list[float]] = {"one": [], "k": []}
    counts: dict[str, list[dict[str, Any]]] = {"one": [], "k": []}
    tokens: dict[str, list[Any]] = {"one": [], "k": []}
    for i, row in enumerate(data.fresh):
        for kind, ids in (("one", row[:1]), ("k", row[1:])):
            before = stream.session.counters() if stream is not None else None
            got, took = _forward(model, ids[None], device, cache, keep=ids.numel())
            cache.crop(-ids.numel())
            if i == 0:
                continue
            seconds[kind].append(took)
            tokens[kind].append(got)
            if stream is not None:
                counts[kind].append(_delta(before, stream.session.counters()))
    out: dict[str, Any] = {kind: {**_figures(seconds[kind]), **_summed(counts[kind])}
                           for kind in seconds}
    out["k_x_one"] = round(out["k"]["seconds"] / out["one"]["seconds"], 3)
    out["tokens"] = torch.cat([torch.cat(tokens["one"]), torch.cat(tokens["k"])])
    return out


def _speculative(args: argparse.Namespace, data: Inputs, draft: Any,
                 reference: list[int]) -> dict[str, Any]:
    """Plain, prompt-lookup and assisted greedy generates through moestream, a fresh load
    (warmed by the same kind of generate) each timed one."""
    ways: dict[str, dict[str, Any]] = {
        "plain": {}, "prompt_lookup": {"prompt_lookup_num_tokens": args.verify_tokens},
        "assistant": {"assistant_model": draft}}
    out: dict[str, Any] = {}
    for name, extra in ways.items():
        timings: list[tuple[list[int], float]] = []
        runs: list[dict[str, Any]] = []
        for _ in range(args.repeat):
            with _streamed(args, args.device, data.repeating) as model:
                if args.warmup:
                    _generate(model, data.repeating, args.warmup, args.device, **extra)
                fed: list[int] = []  # the ids each target forward is fed
                handle = model.register_forward_pre_hook(lambda _m, a, kw, fed=fed: fed.append(
                    kw.get("input_ids", a[0] if a else None).shape[1]), with_kwargs=True)
                tokens, seconds = _generate(model, data.repeating, args.tokens, args.device,
                                            **extra)
                handle.remove()
            timings.append((tokens, seconds))
            runs.append(_acceptance(fed, data.repeating.shape[1], tokens))
        out[name] = {**runs[-1], **bt.summary(timings, ",".join(map(str, reference)))}
    for name in ("prompt_lookup", "assistant"):
        out[name]["x_plain"] = round(out[name]["tokens_per_s"] / out["plain"]["tokens_per_s"], 3)
    return out


def _acceptance(lengths: Sequence[int], prompt: int, tokens: list[int]) -> dict[str, Any]:
    """A generate's target forwards, the drafts they checked and those accepted: the first
    forward takes the prompt and its drafts, each later one the last token and its drafts;
    each yields its accepted drafts and one token of its own."""
    forwards = len(lengths)
    drafted = sum(lengths) - prompt - (forwards - 1)
    accepted = len(tokens) - forwards
    return {"forwards": forwards, "tokens_per_forward": round(len(tokens) / forwards, 3),
            "drafted": drafted, "accepted": accepted,
            "acceptance": round(accepted / drafted, 4) if drafted else None}


def _draft(args: argparse.Namespace) -> Any:
    """The assistant: the checkpoint's first ``--draft-layers`` layers, resident, drafting K
    tokens a round (constant schedule, no confidence stop): each target forward checks K."""
    import transformers

    draft = transformers.AutoModelForCausalLM.from_pretrained(
        args.model, num_hidden_layers=args.draft_layers,
        experts_implementation="grouped_mm").to(args.device)
    draft.generation_config.num_assistant_tokens = args.verify_tokens
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.assistant_confidence_threshold = 0.0
    return draft


def _page_cache_rate(args: argparse.Namespace) -> dict[str, Any]:
    """Buffered reads of the checkpoint's shards (resident: ``_streamed`` read them in) into
    one buffer, up to 2 GiB: the page cache's rate on this machine."""
    view, total, limit = memoryview(bytearray(16 << 20)), 0, 2 << 30
    started = time.perf_counter()
    for shard in bt._shards(args.model):
        with open(shard, "rb", buffering=0) as f:
            while total < limit and (n := f.readinto(view)):
                total += n
    seconds = time.perf_counter() - started
    return {"bytes": total, "seconds": round(seconds, 4),
            "bytes_per_s": round(total / seconds) if seconds else None}


def _bench(args: argparse.Namespace) -> dict[str, Any]:
    from moestream.transformers import is_available

    is_available(raise_error=True)
    import torch
    import transformers

    _checkpoint(args, torch)
    dense, experts = bt.checkpoint_bytes(args.model)
    args.cache_bytes = bt._cache_bytes(args, dense, experts)
    data = _inputs(args, transformers.AutoConfig.from_pretrained(args.model).vocab_size)
    load = os.getloadavg()[0]
    resident = transformers.AutoModelForCausalLM.from_pretrained(
        args.model, experts_implementation="grouped_mm").to(args.device)
    _generate(resident, data.repeating, max(args.warmup, 1), args.device)  # warm-ups, untimed
    _forward(resident, data.prompt, args.device)
    verify_resident = _verify_pairs(resident, data, args.device)
    plain, _ = _generate(resident, data.repeating, args.tokens, args.device)
    prefill = _prefill(args, data, resident)
    del resident
    bt._peak_reset(args.device)  # the resident weights freed (a GPU's memory too) before more loads
    rate = _page_cache_rate(args)
    with _streamed(args, args.device, data.repeating) as model:
        verify = _verify_pairs(model, data, args.device)
    verify["same_tokens"] = bool(verify.pop("tokens").equal(verify_resident.pop("tokens")))
    speculative = _speculative(args, data, _draft(args), plain)
    return {
        **provenance("bench.forwards", args.argv, device=str(args.device)),
        "versions": bt._versions(),
        "model": str(args.model), "dense_bytes": dense, "expert_bytes": experts,
        "cache_budget_bytes": args.cache_bytes, "prompt_tokens": args.prompt_tokens,
        "verify_tokens": args.verify_tokens, "tokens": args.tokens, "repeat": args.repeat,
        "torch_threads": torch.get_num_threads(), "load_before": load,
        "load_after": os.getloadavg()[0], "targets": TARGETS, "page_cache": rate,
        "prefill": _prefill_report(prefill, rate),
        "verify": {"resident": verify_resident, "moestream": verify},
        "speculative": speculative,
        "identical_tokens": prefill["moestream"]["same_tokens"] and verify["same_tokens"]
        and all(r["same_tokens"] for r in speculative.values()),
    }


def _prefill_report(out: dict[str, Any], rate: dict[str, Any]) -> dict[str, Any]:
    """The prefill's figures with their ratios (of the medians, wall and CPU), and the
    streamed run's missed bytes with the time they take at the page cache's rate."""
    resident, streamed = out["resident"], out["moestream"]
    missed = statistics.median(d["file_bytes"] for d in streamed["per_run"])
    out.update({"x_resident": round(streamed["seconds"] / resident["seconds"], 3),
                "x_resident_cpu": round(streamed["cpu_seconds"] / resident["cpu_seconds"], 3),
                "missed_bytes": missed})
    if rate["bytes_per_s"]:
        out["missed_seconds_at_page_cache_rate"] = round(missed / rate["bytes_per_s"], 5)
    return out


def _checkpoint(args: argparse.Namespace, torch: Any) -> None:
    """The device, the checkpoint (made first for ``--make``) and the defaults they set."""
    if args.repeat < 1 or args.verify_tokens < 2 or args.tokens < 1:
        raise UsageError("--repeat and --tokens must be >= 1, --verify-tokens >= 2")
    args.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.prompt_tokens is None:
        args.prompt_tokens = 2048 if args.device.type == "cuda" else 512
    if args.make is not None:
        if not (args.make / "config.json").is_file():
            bt.make_checkpoint(args.make, args.shape, args.layers, str(args.device))
        args.model = args.make
    if args.model is None or not (args.model / "config.json").is_file():
        raise UsageError("give -m CHECKPOINT (a directory with config.json) or --make DIR")
    args.total_bytes = parse_size(args.total)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.forwards",
                                description=__doc__.splitlines()[0])
    p.add_argument("-m", "--model", type=Path, help="checkpoint directory")
    p.add_argument("--make", type=Path, help="write a random checkpoint here (unless one is)")
    p.add_argument("--shape", default="tiny", choices=list(bt.SHAPES))
    p.add_argument("--prompt-tokens", type=int, help="the prefill's ids (cuda 2048, cpu 512)")
    for flag, default, text in (
            ("--layers", 2, "layers of --make's model"), ("--tokens", 32, "a generate's tokens"),
            ("--verify-tokens", 4, "K: a verification forward's ids, prompt lookup's and the "
             "draft's tokens a round"), ("--warmup", 4, "decode warm-up tokens"),
            ("--repeat", 3, "timed runs a figure"), ("--draft-layers", 1, "the draft's layers")):
        p.add_argument(flag, type=int, default=default, help=f"{text} ({default})")
    p.add_argument("--cache-share", type=float, help="cache: this share of the experts' bytes")
    p.add_argument("--total", default="3GiB", help="moestream's dense weights + cache (3GiB)")
    bt.add_run_arguments(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = argv

    def held(report: dict[str, Any]) -> bool:
        _summary(report)
        return bool(report["identical_tokens"])

    return report_main("bench.forwards", lambda: _bench(args), args.out, held)


def _summary(report: dict[str, Any]) -> None:
    """The headline figures, a line each, on stderr (the JSON holds the rest)."""
    pre, ver = report["prefill"], report["verify"]
    spec = ", ".join(f"{name} {r['tokens_per_s']} (acceptance {r['acceptance']})"
                     for name, r in report["speculative"].items())
    print(f"bench.forwards: prefill {pre['moestream']['seconds']} s = {pre['x_resident']} x "
          f"resident (target {TARGETS['prefill_x_resident']}); K-token forward = "
          f"{ver['moestream']['k_x_one']} x 1-token (target {TARGETS['verify_k_x_one']}); "
          f"tok/s {spec}; identical tokens {report['identical_tokens']}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
