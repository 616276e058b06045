"""``python -m bench.mapped_prototype``: an experiment, not a product path. How fast could
a transformers model decode at a budget below its experts if its misses needed no host
synchronization?

Today a layer with misses reads its routing on the host (a device synchronization a MoE
layer) to know what to load; the host then stops running ahead of the device, and the run
pays the host's Python per layer and the device's work per layer in turn. On a GPU that can
read registered host memory in place (resident mode: the page-cache mapping registered with
CUDA), the whole-layer path's gather kernel could read an uncached expert straight from the
mapping, by the same device table of addresses, with no host read of the routing at all.

This freezes the cache after a warm-up (what is cached stays, nothing is loaded or evicted),
builds each layer's table from the cached experts' device addresses and the others' mapped
host addresses (reaching into the session's streamer for the mapping: hence a prototype),
and times greedy generates through it against the same model's lease path and the resident
model, tokens checked. The session's counters do not see the mapped reads.

    python -m bench.mapped_prototype -m /tmp/q/bf16-qwen3-30b-a3b-8-spread --budget 1.55GiB
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from bench.experts_profile import _prompts
from bench.transformers import _generate, summary

__all__ = ["main"]


def _rows(stream: Any, layer: int) -> tuple[list[list[int]], tuple[int, int, int], int]:
    """A layer's table rows (gate, up, down addresses an expert: the cache's for cached
    experts, the registered mapping's for the others), the matrices' bytes, and how many
    are cached."""
    session = stream.session
    streamer = session._session._streaming.streamers[0]
    mapping = streamer.mapping
    if mapping is None:
        raise SystemExit("no registered mapping: run in resident mode with a warm page cache")
    n = session.model.layers[layer].n_experts
    cached = [e for e in range(n) if session.ready(layer, [e])]
    rows: dict[int, list[int]] = {}
    sizes: set[tuple[int, ...]] = set()
    if cached:
        with session.fetch(layer, cached) as lease:
            for h in lease.gather():
                rows[h.expert] = [m.ptr for m in h.matrices]
                sizes.add(tuple(m.nbytes for m in h.matrices))
    for e in range(n):
        if e in rows:
            continue
        ranges = streamer.layout((layer, e)).ranges
        if not all(mapping.is_registered(r.file_offset, r.nbytes) for r in ranges):
            raise SystemExit(f"layer {layer} expert {e}: not in registered windows")
        rows[e] = [mapping.address(r.file_offset) for r in ranges]
        sizes.add(tuple(r.nbytes for r in ranges))
    if len(sizes) != 1:
        raise SystemExit(f"layer {layer}: experts of different sizes {sizes}")
    gate, up, down = sizes.pop()
    return [rows[e] for e in range(n)], (gate, up, down), len(cached)


def _freeze(stream: Any, device: Any) -> dict[str, Any]:
    """Serve every experts call from per-layer tables of cached and mapped addresses."""
    import torch

    from moestream.transformers._routing import _Table

    session = stream.session
    streamer = session._session._streaming.streamers[0]
    session._thread.run(streamer.registered())
    tables, cached, aligned = {}, 0, True
    for layer in session.model.moe_layers:
        rows, sizes, held = _rows(stream, layer)
        cached += held
        aligned &= all(a % 16 == 0 for row in rows for a in row)
        tables[layer] = _Table(torch.tensor(rows, dtype=torch.int64).to(device), sizes)
    whole = stream._whole
    whole.forget()
    counts = {"pairs": 0, "mapped_pairs": 0}
    mapped = {layer: set(range(session.model.layers[layer].n_experts))
              - {e for e in range(session.model.layers[layer].n_experts)
                 if session.ready(layer, [e])} for layer in tables}

    def account(routing: Any) -> None:  # the session is not told: count here
        if not routing.layers:
            return
        routing.landed.synchronize()
        ids, at = routing.ids.tolist(), 0
        for layer, size in zip(routing.layers, routing.sizes, strict=True):
            chosen = set(ids[at:at + size])
            at += size
            counts["pairs"] += len(chosen)
            counts["mapped_pairs"] += len(chosen & mapped[layer])

    whole._holds_every_expert = lambda: True
    whole._make = lambda layer, n, dtype: tables[layer]
    whole.account = account
    return {"cached_experts": cached, "addresses_16_aligned": aligned, "counts": counts}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.mapped_prototype",
                                description=__doc__.splitlines()[0])
    p.add_argument("-m", "--model", type=Path, required=True)
    p.add_argument("--budget", default="1.55GiB")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    import torch
    import transformers

    from moestream.transformers import from_pretrained

    device = torch.device("cuda")
    fresh = _prompts(True)
    warm = [next(fresh) for _ in range(2)]  # fill the cache by the lease path
    timed = [next(fresh) for _ in range(args.repeat)]  # texts of their own: misses
    resident: Any = transformers.AutoModelForCausalLM.from_pretrained(
        args.model, experts_implementation="grouped_mm")
    resident.to(device)
    _generate(resident, warm[0], args.tokens, device)  # the process's warm-up
    runs = [_generate(resident, prompt, args.tokens, device) for prompt in timed]
    references = [",".join(map(str, tokens)) for tokens, _ in runs]
    report: dict[str, Any] = {"command": "python -m bench.mapped_prototype "
                              + " ".join(sys.argv[1:] if argv is None else argv),
                              "resident": summary(runs, None)}
    del resident

    def timed_runs(model: Any) -> dict[str, Any]:
        runs = [_generate(model, prompt, args.tokens, device) for prompt in timed]
        out = summary(runs, None)
        out["same_tokens"] = [",".join(map(str, t)) for t, _ in runs] == references
        return out

    with from_pretrained(args.model, device=device, budget=args.budget,
                         mode="resident") as model:
        for prompt in warm:
            _generate(model, prompt, args.tokens, device)
        report["lease_path"] = timed_runs(model)
        report["frozen"] = _freeze(model.moestream, device)
        _generate(model, warm[1], args.tokens, device)  # the new path's warm-up
        report["mapped"] = timed_runs(model)
    for name in ("lease_path", "mapped"):
        report[name]["x_resident"] = round(report[name]["tokens_per_s"]
                                           / report["resident"]["tokens_per_s"], 3)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
