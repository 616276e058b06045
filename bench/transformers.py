"""``python -m bench.transformers``: a transformers MoE model resident, offloaded, streamed.

One process, one checkpoint, greedy generation of ``--tokens`` tokens from one prompt,
in these runs (``--runs`` picks some):

- ``resident``: every weight on the device, ``experts_implementation="grouped_mm"``
  (transformers' default);
- ``eager``: the same with ``experts_implementation="eager"``;
- ``accelerate``: accelerate's offload, ``device_map="auto"`` with ``max_memory`` of
  ``--total`` on the device (needs accelerate and a GPU);
- ``warm``: moestream at the same ``--total`` in all (dense weights + expert cache), or with
  a cache of ``--cache-share`` of the experts' bytes, the checkpoint's pages resident in the
  page cache first (as accelerate's experts sit in RAM);
- ``cold``: the same from storage (page cache dropped, no warm-up generate), against the
  time its missed bytes take at the disk's rate, measured in the run after it
  (``x_disk_floor``: O_DIRECT reads of the checkpoint's first GiB on 8 threads);
- ``predict``: ``warm`` with ``prefetch="predict"`` (each MoE layer hints the experts the
  next layer's router picks for its input), with the guesses' counts;
- ``in_place``: ``warm`` with ``in_place=True`` (once the cache is full, each decode step
  reads the experts it lacks in place from the registered page-cache mapping, no host read
  of the routing: resident mode);
- ``all``: moestream with a budget that holds every expert, every expert fetched once and
  a warm-up generate before timing;
- ``held``: the same budget as a user loads it, nothing fetched beforehand: the model is
  held whole once the routing and the fill (a lease's group of experts a token, unasked)
  have loaded every expert;
- ``alternate``: the resident model and ``all``'s moestream model loaded together, their
  timed generates alternated ``--repeat`` times: each round's ratio, their median
  (``x_resident``), so that a drift of the host's speed during the process (tens of percent
  on the GPU machine) falls on both sides alike.

The reference holds: the process first loads the resident model and generates the timed
tokens untimed (the first model a process loads runs slower, whatever its implementation);
those tokens are the reference every run is checked against. Each run then generates
``--warmup`` tokens (but ``cold``) and ``--repeat`` timed generates: in one load where the
run's state does not change between generates, in a fresh load each where it does (a budget
below every expert: the previous generate would have warmed the cache). Prints one JSON
object: the machine, its load, the versions, and per run the median tokens/s, every run's
figure and the spread, whether every run's tokens equal the reference, device memory, and
for moestream runs the hit rate and the token time split summed over the timed tokens (what
bounds the run). ``--make DIR`` first writes a random-init checkpoint with
``save_pretrained`` (``--shape``: ``tiny``, ``cpu``, the host backend's bench shape, or
``qwen3-30b-a3b``: Qwen3-30B-A3B's per-layer shape, ``--layers`` layers).

    python -m bench.transformers --make /tmp/tiny --shape tiny --tokens 8
    python -m bench.transformers -m /data/qwen3-8l --total 3GiB --out bench/results/x.json
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.kit import merged_rounds
from bench.record import report_main
from moestream.pipeline.foundation.config import Budget, parse_size
from moestream.pipeline.foundation.errors import UsageError
from moestream.pipeline.foundation.safetensors_table import is_routed

__all__ = ["main"]

RUNS = ("resident", "eager", "accelerate", "warm", "cold", "predict", "in_place", "all", "held",
        "alternate")
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                 num_experts=8, num_experts_per_tok=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=96),
    "cpu": dict(hidden_size=512, intermediate_size=1536, moe_intermediate_size=256,
                num_experts=64, num_experts_per_tok=8, num_attention_heads=8,
                num_key_value_heads=2, head_dim=64, vocab_size=8192),
    "qwen3-30b-a3b": dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                          num_experts=128, num_experts_per_tok=8, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, vocab_size=151936),
}


SPREAD_EMBEDDINGS = 200.0
"""``--spread``'s factor on the token embeddings (std 0.02 -> 4)."""


def make_checkpoint(where: Path, shape: str, layers: int, device: str,
                    spread: bool = False) -> None:
    """A random-init Qwen3-MoE checkpoint of ``shape`` written by ``save_pretrained``.

    A random model's residual stream loses the token in its deeper layers (each layer adds
    a part every token shares), so their routers pick the same few experts whatever the
    token: at Qwen3-30B-A3B's width, over 128 random tokens, 111 distinct experts in layer
    0 but 58, 47 and 35 in layers 1-3, the 22 commonest taking 92-96% of the picks; a cache
    of 17% of the experts then hits 95% and no run is bound by its misses. ``spread``
    scales the token embeddings by :data:`SPREAD_EMBEDDINGS`, which keeps the token in
    the stream: 127-128 distinct experts in each of 8 layers, the 22 commonest 26-30% of
    the picks, as a trained router's balanced load spreads them."""
    import torch
    import transformers

    config = transformers.AutoConfig.for_model("qwen3_moe", num_hidden_layers=layers,
                                               **SHAPES[shape])
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    if spread:
        with torch.no_grad():
            model.get_input_embeddings().weight.mul_(SPREAD_EMBEDDINGS)
    model.save_pretrained(where)


def add_spread_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--spread", action="store_true", help="make the model with its token "
                   "embeddings scaled, so that its deeper layers' routing depends on the "
                   "token (a random model's otherwise picks the same few experts: nearly "
                   "every fetch hits and no run is bound by its misses)")


def _shards(path: Path) -> list[Path]:
    return sorted(path.glob("*.safetensors"))


def checkpoint_bytes(path: Path) -> tuple[int, int]:
    """The checkpoint's bytes outside the routed experts (what moestream puts on the
    device besides its cache) and the routed experts' bytes."""
    from safetensors import safe_open

    dense = experts = 0
    for shard in _shards(path):
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (a safe_open is not iterable)
                tensor = f.get_slice(name)
                n = 1
                for d in tensor.get_shape():
                    n *= d
                n *= {"BF16": 2, "F16": 2, "F32": 4}.get(tensor.get_dtype(), 4)
                if is_routed(name):
                    experts += n
                else:
                    dense += n
    return dense, experts


def _peak_reset(device: Any) -> None:
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device: Any) -> int:
    import torch

    return int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else 0


def _generate(model: Any, prompt: Any, tokens: int, device: Any,
              sample: int | None = None) -> tuple[list[int], float]:
    """``tokens`` new tokens: greedy, or sampled from the whole distribution under the seed
    ``sample`` (the same seed, the same logits: the same tokens)."""
    import torch

    ids = prompt.to(device)
    choice: dict[str, Any] = {"do_sample": False}
    if sample is not None:
        torch.manual_seed(sample)
        choice = {"do_sample": True, "top_k": 0, "top_p": 1.0, "temperature": 1.0}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                             min_new_tokens=tokens, **choice)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out[0, ids.shape[1]:].tolist(), time.perf_counter() - started


def _timed(model: Any, prompt: Any, args: argparse.Namespace, device: Any, *, warm_up: bool,
           repeat: int) -> list[tuple[list[int], float]]:
    """``repeat`` timed generates of ``args.tokens`` after ``args.warmup`` untimed tokens
    (when ``warm_up``): each one's tokens and seconds."""
    if warm_up and args.warmup:
        _generate(model, prompt, args.warmup, device, args.sample)
    return [_generate(model, prompt, args.tokens, device, args.sample) for _ in range(repeat)]


def summary(timings: Sequence[tuple[list[int], float]], reference: str | None) -> dict[str, Any]:
    """A run's timed generates: the median tokens/s, each one's, the spread (max - min over
    the median), and whether every generate gave the reference tokens."""
    rates = [len(tokens) / seconds for tokens, seconds in timings]
    median = statistics.median(rates)
    texts = {",".join(map(str, tokens)) for tokens, _ in timings}
    out: dict[str, Any] = {
        "tokens": texts.pop() if len(texts) == 1 else "differ between runs",
        "tokens_per_s": round(median, 3),
        "tokens_per_s_runs": [round(r, 3) for r in rates],
        "spread": round((max(rates) - min(rates)) / median, 4),
        "seconds": [round(seconds, 4) for _, seconds in timings],
    }
    if reference is not None:  # a caller without one checks the tokens itself
        out["same_tokens"] = not texts and out["tokens"] == reference
    return out


def reference_tokens(args: argparse.Namespace, prompt: Any, device: Any) -> str:
    """The process's warm-up: the resident model loaded and the timed tokens generated
    untimed (the first model a process loads runs slower); its tokens are the reference."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        args.model, experts_implementation="grouped_mm").to(device)
    if args.warmup:
        _generate(model, prompt, args.warmup, device, args.sample)
    tokens, _ = _generate(model, prompt, args.tokens, device, args.sample)
    del model
    return ",".join(map(str, tokens))


def run_resident(args: argparse.Namespace, prompt: Any, device: Any, implementation: str,
                 reference: str) -> dict[str, Any]:
    import transformers

    _peak_reset(device)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        args.model, experts_implementation=implementation).to(device)
    result = summary(_timed(model, prompt, args, device, warm_up=True, repeat=args.repeat),
                     reference)
    result["device_peak_bytes"] = _peak(device)
    del model
    return result


def run_accelerate(args: argparse.Namespace, prompt: Any, device: Any,
                   reference: str) -> dict[str, Any]:
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
    result = summary(_timed(model, prompt, args, device, warm_up=True, repeat=args.repeat),
                     reference)
    result["device_peak_bytes"] = _peak(device)
    del model
    return result


def run_moestream(args: argparse.Namespace, prompt: Any, device: Any, reference: str | None,
                  *, budget: Budget | None, cold: bool, log: Path | None = None,
                  prefetch: str = "none", in_place: bool = False, prefill: bool = True
                  ) -> dict[str, Any]:
    """moestream's run: one load timed ``--repeat`` times holding every expert (``budget``
    None; every expert fetched first unless not ``prefill``), else a fresh load a timed
    generate (the previous one would have warmed the cache)."""
    loads, per_load = (1, args.repeat) if budget is None else (args.repeat, 1)
    timings: list[tuple[list[int], float]] = []
    parts: dict[str, float] = {}
    hits = misses = file_bytes = storage_bytes = prefetched = tokens = whole = replays = 0
    last: Any = None
    graphs = False
    for _ in range(loads):
        done, last = _moestream_load(args, prompt, device, budget=budget, cold=cold,
                                     repeat=per_load, parts=parts, log=log, prefetch=prefetch,
                                     in_place=in_place, prefill=prefill)
        timings += done["timings"]
        hits, misses = hits + done["hits"], misses + done["misses"]
        file_bytes += done["file_bytes"]
        storage_bytes += done["storage_bytes"]
        prefetched += done["prefetched"]
        tokens, whole = tokens + done["tokens"], whole + done["whole_tokens"]
        replays, graphs = replays + done["graph_replays"], done["graphs"]
    result = summary(timings, reference)
    result.update({
        "budget_bytes": last.budget_bytes,
        "cache_peak_bytes": last.peak_device_bytes,
        "device_peak_bytes": _peak(device),
        "hit_rate": round(hits / (hits + misses), 4) if hits + misses else 0.0,
        "misses": misses,
        "file_bytes": file_bytes,
        "storage_bytes": storage_bytes,
        "prefetch": prefetch,
        "prefetched": prefetched,
        # the timed tokens the GPU's whole-layer path served alone (no lease): a held
        # model's run slower than its kind says whether it left that path
        "whole_share": round(whole / tokens, 3) if tokens else None,
        "graphs": graphs,
        "graph_replays": replays,
        "mode": last.mode,
        "time_ms": {k: round(v, 3) for k, v in parts.items()},
        "bound": max(parts, key=parts.__getitem__) if parts else None,
    })
    return result


def run_alternate(args: argparse.Namespace, prompt: Any, device: Any, reference: str
                  ) -> dict[str, Any]:
    """The resident model and moestream's holding every expert, both loaded and warmed,
    their timed generates alternated ``--repeat`` times; the per-round ratios' median is
    the run's ``x_resident``."""
    import transformers

    from moestream.transformers import from_pretrained

    resident = transformers.AutoModelForCausalLM.from_pretrained(
        args.model, experts_implementation="grouped_mm").to(device)
    with from_pretrained(args.model, device=device, mode=args.mode,
                         tuning=tuning_of(args)) as model:
        _graphs_as_asked(model.moestream, args)
        _fill_cache(model.moestream)
        for warm in (resident, model):
            _generate(warm, prompt, max(args.warmup, 1), device, args.sample)
        rounds = [(_generate(resident, prompt, args.tokens, device, args.sample),
                   _generate(model, prompt, args.tokens, device, args.sample))
                  for _ in range(args.repeat)]
    del resident
    theirs = summary([r for r, _ in rounds], reference)
    result = summary([m for _, m in rounds], reference)
    ratios = [theirs_s / ours_s for (_, theirs_s), (_, ours_s) in rounds]
    result.update({"resident_tokens_per_s": theirs["tokens_per_s"],
                   "resident_tokens_per_s_runs": theirs["tokens_per_s_runs"],
                   "x_resident_rounds": [round(r, 3) for r in ratios],
                   "x_resident": round(statistics.median(ratios), 3)})
    result["same_tokens"] = bool(result.get("same_tokens") and theirs.get("same_tokens"))
    return result


def _graphs_as_asked(stream: Any, args: argparse.Namespace) -> None:
    """``--graphs``: the session's decode steps replayed as CUDA graphs, or not."""
    if args.graphs is not None:
        stream.graphs.on = args.graphs == "on"


def _moestream_load(args: argparse.Namespace, prompt: Any, device: Any, *,
                    budget: Budget | None, cold: bool, repeat: int,
                    parts: dict[str, float], log: Path | None = None,
                    prefetch: str = "none", in_place: bool = False, prefill: bool = True
                    ) -> tuple[dict[str, Any], Any]:
    """One moestream model loaded, warmed (unless ``cold``) and timed ``repeat`` times; its
    token time split added into ``parts``. Returns the timings and counts, and the
    session's last counters."""
    from bench.kit import drop_caches, make_resident
    from moestream.transformers import from_pretrained

    for shard in _shards(args.model):
        if cold:
            drop_caches(shard)
        else:
            make_resident(shard)
    _peak_reset(device)
    model = from_pretrained(args.model, budget=budget, device=device, mode=args.mode, log=log,
                            prefetch=prefetch, in_place=in_place, tuning=tuning_of(args))
    stream = model.moestream
    _graphs_as_asked(stream, args)
    try:
        if budget is None and prefill:  # every expert on the device before timing
            _fill_cache(stream)

        def add(stats: Any) -> None:
            for part, ms in stats.time.items():
                parts[part] = parts.get(part, 0.0) + ms

        if not cold and args.warmup:
            _generate(model, prompt, args.warmup, device, args.sample)
        before = stream.session.counters()
        tokens, whole = stream.tokens, stream.whole_tokens
        stream.on_token = add
        timings = _timed(model, prompt, args, device, warm_up=False, repeat=repeat)
        after = stream.session.counters()
        tokens, whole = stream.tokens - tokens, stream.whole_tokens - whole
    finally:
        stream.close()
    del model
    return {"timings": timings, "tokens": tokens, "whole_tokens": whole,
            "hits": after.hits - before.hits,
            "misses": after.misses - before.misses,
            "file_bytes": after.file_bytes - before.file_bytes,
            "storage_bytes": after.storage_bytes - before.storage_bytes,
            "prefetched": after.prefetched - before.prefetched,
            "graphs": stream.graphs.on, "graph_replays": stream.graphs.replays}, after


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


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """The device, moestream's I/O mode and the report's file: every transformers bench's."""
    p.add_argument("--device", help="cpu or cuda (default: cuda if torch sees one)")
    p.add_argument("--mode", default="auto", choices=["auto", "direct", "resident"])
    add_gather_argument(p)
    p.add_argument("--out", type=Path, help="also write the JSON here")


def add_graphs_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--graphs", choices=["on", "off"], help="moestream's held-whole decode "
                   "steps replayed as CUDA graphs or not (default: as shipped, on a GPU)")


def add_warmup_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--warmup", type=int, help="tokens of the untimed generate before a run's "
                   "timed ones (default: as many as --tokens; a shorter one left the first "
                   "timed generate of a run at a fraction of the next ones' speed on a GPU)")


def warmed(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with ``--warmup`` defaulted to ``--tokens``."""
    if args.warmup is None:
        args.warmup = args.tokens
    return args


def add_gather_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-gather", action="store_true", help="resident misses always on the "
                   "copy engines (Tuning(gather=False)), never the gather kernel on the SMs "
                   "that small expert matrices (under 2 MiB: FP8 at Qwen3-30B-A3B's shape) "
                   "take by default")


def tuning_of(args: argparse.Namespace) -> Any:
    """The benches' ``tuning=`` for moestream (None: the defaults)."""
    import moestream

    return moestream.Tuning(gather=False) if args.no_gather else None


def add_sample_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sample", type=int, metavar="SEED", help="sample the tokens under this "
                   "seed instead of greedy: a random model's greedy output soon repeats one "
                   "token, so each layer routes to the same few experts and nearly every "
                   "fetch hits; sampled tokens spread the routing and the misses show")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.transformers",
                                description=__doc__.splitlines()[0])
    p.add_argument("-m", "--model", type=Path, help="checkpoint directory")
    p.add_argument("--make", type=Path, help="write a random-init checkpoint here first "
                   "(unless one is there) and use it")
    p.add_argument("--shape", default="tiny", choices=list(SHAPES))
    p.add_argument("--layers", type=int, default=2, help="layers of --make's model (2)")
    p.add_argument("--tokens", type=int, default=16, help="tokens timed (16)")
    add_warmup_argument(p)
    p.add_argument("--repeat", type=int, default=3, help="timed generates a run (3): their "
                   "median, each and the spread are reported")
    p.add_argument("--cache-share", type=float, help="the warm and cold runs' cache: this "
                   "share of the experts' bytes (0.25, say), instead of --total less the "
                   "dense weights")
    p.add_argument("--prompt-ids", default="1,2,3,4", help="prompt token ids (1,2,3,4)")
    add_sample_argument(p)
    add_spread_argument(p)
    p.add_argument("--total", default="3GiB", help="device memory of the offloaded runs: "
                   "accelerate's max_memory, moestream's dense weights + cache (3GiB)")
    p.add_argument("--runs", default=",".join(RUNS), help=f"some of {','.join(RUNS)}")
    p.add_argument("--rounds", type=int, default=1, help="the runs measured in turns this "
                   "many times, each x_resident taken within a round, their median reported "
                   "(a machine whose speed drifts over a process drifts under every run alike)")
    add_graphs_argument(p)
    add_run_arguments(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = warmed(build_parser().parse_args(argv))
    return report_main("bench.transformers", lambda: _bench(args), args.out,
                       lambda report: bool(report["identical_tokens"]))


def _bench(args: argparse.Namespace) -> dict[str, Any]:
    from moestream.transformers import is_available

    is_available(raise_error=True)
    import torch

    runs = [r for r in args.runs.split(",") if r]
    unknown = sorted(set(runs) - set(RUNS))
    if unknown:
        raise UsageError(f"--runs: unknown {', '.join(unknown)} (runs: {', '.join(RUNS)})")
    if args.repeat < 1 or args.rounds < 1:
        raise UsageError(f"--repeat and --rounds must be >= 1, got {args.repeat} and "
                         f"{args.rounds}")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.make is not None:
        if not (args.make / "config.json").is_file():
            make_checkpoint(args.make, args.shape, args.layers, str(device), args.spread)
        args.model = args.make
    if args.model is None:
        raise UsageError("give -m CHECKPOINT or --make DIR")
    if not (args.model / "config.json").is_file():
        raise UsageError(f"{args.model}: not a checkpoint directory (no config.json)")
    args.total_bytes = parse_size(args.total)
    dense, experts = checkpoint_bytes(args.model)
    cache = _cache_bytes(args, dense, experts)
    fits = Budget(nbytes=cache)
    prompt = torch.tensor([[int(t) for t in args.prompt_ids.split(",")]])
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    reference = reference_tokens(args, prompt, device)
    plan: dict[str, Callable[[], dict[str, Any]]] = {
        "resident": lambda: run_resident(args, prompt, device, "grouped_mm", reference),
        "eager": lambda: run_resident(args, prompt, device, "eager", reference),
        "accelerate": lambda: run_accelerate(args, prompt, device, reference),
        "warm": lambda: run_moestream(args, prompt, device, reference, budget=fits, cold=False),
        "cold": lambda: run_moestream(args, prompt, device, reference, budget=fits, cold=True),
        "predict": lambda: run_moestream(args, prompt, device, reference, budget=fits,
                                         cold=False, prefetch="predict"),
        "in_place": lambda: (run_moestream(args, prompt, device, reference, budget=fits,
                                           cold=False, in_place=True)
                             if device.type == "cuda" else
                             {"skipped": "a GPU path: the host backend has no tables"}),
        "all": lambda: run_moestream(args, prompt, device, reference, budget=None, cold=False),
        "held": lambda: run_moestream(args, prompt, device, reference, budget=None, cold=False,
                                      prefill=False),
        "alternate": lambda: run_alternate(args, prompt, device, reference),
    }
    results = _measured(plan, runs, args.rounds, args.model)
    return {
        "command": "python -m bench.transformers " + " ".join(sys.argv[1:]),
        "model": str(args.model), "device": str(device), "dense_bytes": dense,
        "expert_bytes": experts, "total_bytes": args.total_bytes, "cache_budget_bytes": cache,
        "tokens": args.tokens, "repeat": args.repeat, "reference_tokens": reference,
        "load_before": load,
        "load_after": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        **_versions(),
        "identical_tokens": all(r.get("same_tokens", True) for r in results.values()),
        "runs": results,
    }


def disk_floor(model: Path, cold: dict[str, Any]) -> dict[str, Any]:
    """The cold run against its storage floor: the disk's rate measured now (O_DIRECT, 8
    threads of 8 MiB reads over the first GiB of the checkpoint's first shard, its pages
    dropped first), the time the run's missed bytes take at that rate, and the run's timed
    seconds over it (the issue's figure: within 1.2x)."""
    from bench.kit import drop_caches
    from bench.references import raw_read_gbps
    from moestream.pipeline.foundation.files import model_files

    files = model_files(_shards(model)[0])
    drop_caches(files)
    gbps = raw_read_gbps(files, [(0, min(1 << 30, files[0].end - files[0].base))], threads=8,
                         chunk_bytes=8 << 20, direct=True)
    floor_s = cold["file_bytes"] / (gbps * 1e9)
    return {"disk_gbps": round(gbps, 3), "disk_floor_s": round(floor_s, 3),
            "x_disk_floor": round(sum(cold["seconds"]) / floor_s, 3) if floor_s else None}


def _cache_bytes(args: argparse.Namespace, dense: int, experts: int) -> int:
    """The warm and cold runs' cache budget: ``--cache-share`` of the experts' bytes, or
    ``--total`` less the dense weights."""
    if args.cache_share is not None:
        if not 0 < args.cache_share <= 1:
            raise UsageError(f"--cache-share must be in (0, 1], got {args.cache_share}")
        return int(experts * args.cache_share)
    cache = int(args.total_bytes) - dense
    if cache <= 0:
        raise UsageError(f"--total {args.total} does not hold the dense weights "
                         f"({dense} bytes)")
    return cache


def _measured(plan: dict[str, Callable[[], dict[str, Any]]], runs: list[str], rounds: int,
              model: Path) -> dict[str, dict[str, Any]]:
    """The runs measured in turns ``rounds`` times, compared within each round (the cold
    run against the disk's rate too); several rounds merged (``kit.merged_rounds``)."""
    each = []
    for _ in range(rounds):
        results = {name: plan[name]() for name in runs}
        _compare(results)
        if "seconds" in results.get("cold", {}):
            results["cold"].update(disk_floor(model, results["cold"]))
        each.append(results)
    return each[0] if rounds == 1 else merged_rounds(each, ("tokens_per_s", "x_resident"))


def _compare(results: dict[str, dict[str, Any]]) -> None:
    """Each run's median speed against the resident run's (``x_resident``), and the
    moestream runs' against accelerate's offload (``x_accelerate``), added in place."""
    resident = results.get("resident", {}).get("tokens_per_s")
    for name, result in results.items():
        if resident and "tokens_per_s" in result and name != "alternate":  # its own rounds'
            result["x_resident"] = round(result["tokens_per_s"] / resident, 3)
    offload = results.get("accelerate", {}).get("tokens_per_s")
    for name in ("warm", "cold"):
        if offload and "tokens_per_s" in results.get(name, {}):
            results[name]["x_accelerate"] = round(results[name]["tokens_per_s"] / offload, 2)


if __name__ == "__main__":
    sys.exit(main())
