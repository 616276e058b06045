"""``python -m bench.experts_profile``: where the host time of a transformers model's token
goes when moestream holds every expert (the all-cached run of ``bench.transformers``), or
at a ``--budget``.

That run is bound by the host, not the device: the resident model's launches run ahead of the
GPU, moestream's per-layer and per-token Python adds to them. This loads the checkpoint as
``bench.transformers``' ``all`` run does (every expert fetched once before timing), times
``--tokens`` greedy tokens plain, then again under ``cProfile``, and prints the functions
with the most time of their own and the most time under them; ``--resident`` does the same
for transformers' resident model first, in the same process. Profiling slows Python about
twice: read the shares, not the times. ``--timeline`` adds one more generate under the torch
profiler, reduced to the device's busy times a token (``bench.timeline``): whether the
uploads overlap the kernels; ``--prefetch predict`` loads as ``from_pretrained``'s does.

    python -m bench.experts_profile -m qwen3-30b-a3b-8l --device cuda --out profile.txt
    python -m bench.experts_profile -m spread-8l --budget 1.5GiB --fresh   # the miss path
    python -m bench.experts_profile -m spread-8l --budget 1.5GiB --fresh --timeline \
        --prefetch predict --out predict.txt        # and predict.trace.json.gz
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import itertools
import pstats
import sys
import threading
import time
import traceback
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from bench.timeline import profiled_timeline
from bench.transformers import _fill_cache, _generate, add_gather_argument, tuning_of

__all__ = ["main"]


def _profiled(model: Any, prompt: Any, tokens: int, device: Any, top: int) -> str:
    profile = cProfile.Profile()
    profile.enable()
    _generate(model, prompt, tokens, device)
    profile.disable()
    text = io.StringIO()
    for order in ("tottime", "cumulative"):
        stats = pstats.Stats(profile, stream=text)
        stats.sort_stats(order).print_stats(top)
    return text.getvalue()


def _other_threads(model: Any, prompt: Any, tokens: int, device: Any, top: int) -> str:
    """What the process's other threads run while ``tokens`` are generated: their stacks
    sampled every half millisecond, the commonest first. A thread that holds the GIL often
    slows every torch call of the model's thread: cProfile, which sees one thread, shows
    only that slowing."""
    seen: collections.Counter[str] = collections.Counter()
    me, done = threading.get_ident(), threading.Event()

    def sample() -> None:
        sampler = threading.get_ident()
        while not done.is_set():
            for ident, frame in sys._current_frames().items():
                if ident in (me, sampler):
                    continue
                stack = traceback.extract_stack(frame, limit=4)
                seen[" <- ".join(f"{Path(f.filename).name}:{f.name}:{f.lineno}"
                                 for f in reversed(stack))] += 1
            time.sleep(0.0005)

    thread = threading.Thread(target=sample, name="stack-sampler")
    thread.start()
    try:
        _generate(model, prompt, tokens, device)
    finally:
        done.set()
        thread.join()
    return "".join(f"{n:6d}  {stack}\n" for stack, n in seen.most_common(top))


def _prompts(fresh: bool) -> Iterator[Any]:
    """Each generate's prompt: ``[1, 2, 3, 4]`` every time, or (``fresh``) one of its own,
    so that a model whose routing follows the token (``--spread``) misses at a budget as a
    new text would, rather than finding the experts the last generate left."""
    import torch

    for i in itertools.count():
        yield torch.tensor([[1 + 4 * i, 2 + 4 * i, 3 + 4 * i, 4 + 4 * i]] if fresh
                           else [[1, 2, 3, 4]])


def _measured(name: str, model: Any, device: Any, args: argparse.Namespace) -> str:
    """Warm, time ``args.tokens`` tokens plain twice (the second quoted), then profiled;
    with ``--threads``, the other threads' stacks sampled over another run."""
    prompts = _prompts(args.fresh)
    _generate(model, next(prompts), 4, device)  # warm
    _generate(model, next(prompts), args.tokens, device)
    tokens, seconds = _generate(model, next(prompts), args.tokens, device)
    threads = ""
    if args.threads:
        threads = "-- other threads' stacks (samples)\n" + _other_threads(
            model, next(prompts), args.tokens, device, args.top)
    began = time.perf_counter()
    report = _profiled(model, next(prompts), args.tokens, device, args.top)
    profiled = time.perf_counter() - began
    timeline = ""
    if args.timeline:
        prompt = next(prompts)
        keep = args.out.with_suffix(".trace.json.gz") if args.out is not None else None
        began = time.perf_counter()
        found = profiled_timeline(lambda: _generate(model, prompt, args.tokens, device),
                                  args.tokens, keep)
        wall = 1000 * (time.perf_counter() - began) / args.tokens
        timeline = (f"-- timeline (ms a token; {wall:.2f} wall under the profiler): "
                    + ", ".join(f"{k} {v:.2f}" for k, v in found.items()) + "\n")
    return (f"== {name} ({args.model}): {len(tokens) / seconds:.1f} tok/s plain, "
            f"{args.tokens / profiled:.1f} tok/s profiled, device {device}\n{timeline}"
            f"{threads}{report}")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.experts_profile",
                                description=__doc__.splitlines()[0])
    p.add_argument("-m", "--model", type=Path, required=True, help="checkpoint directory")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--top", type=int, default=40, help="functions printed per order (40)")
    p.add_argument("--budget", help="the cache budget (from_pretrained's budget=, e.g. 1.5GiB); "
                   "default: every expert, each fetched once before timing")
    p.add_argument("--resident", action="store_true", help="profile transformers' resident "
                   "model (grouped_mm) first, in the same process: the reference's host time")
    p.add_argument("--threads", action="store_true", help="also sample the other threads' "
                   "stacks over a run (what may hold the GIL while the model computes)")
    p.add_argument("--mode", choices=["auto", "direct", "resident"], default="auto",
                   help="moestream's I/O mode (auto)")
    add_gather_argument(p)
    p.add_argument("--prefetch", choices=["none", "predict"], default="none",
                   help="from_pretrained's prefetch= (none)")
    p.add_argument("--timeline", action="store_true", help="one more generate under the torch "
                   "profiler, summarized as the device's busy times a token (bench.timeline); "
                   "with --out, its trace kept beside it (.trace.json.gz)")
    p.add_argument("--fresh", action="store_true", help="a prompt of its own for each generate "
                   "(default: the same one): with --budget on a --spread model, the timed "
                   "and profiled tokens miss as a new text's would")
    p.add_argument("--out", type=Path, help="also write the report here")
    args = p.parse_args(argv)
    import torch
    import transformers

    from moestream.transformers import from_pretrained

    device = torch.device(args.device)
    text = ""
    if args.resident:
        resident: Any = transformers.AutoModelForCausalLM.from_pretrained(
            args.model, experts_implementation="grouped_mm")
        resident.to(device)
        text += _measured("resident", resident, device, args)
        del resident
    with from_pretrained(args.model, device=device, budget=args.budget,
                         mode=args.mode, tuning=tuning_of(args),
                         prefetch=args.prefetch) as model:
        if args.budget is None:
            _fill_cache(model.moestream)
        text += _measured("moestream", model, device, args)
    sys.stdout.write(text)
    if args.out is not None:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
