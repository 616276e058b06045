"""``python -m bench.held_cost``: where a held-whole token's host time goes, beside the
resident model's, unprofiled.

A transformers model whose budget holds every expert decodes with no lease and no host read
of the routing, yet stays below the resident model on a GPU (0.74-0.79x on an H100), and
both are bound by the host's launches. A profiler slows every Python call about tenfold and
so inflates the side with more calls: this bench times, with a clock read at each entry
and exit (~1 us a call), only the calls that differ between the two runs, in one process,
the resident model first (the first model a process loads runs slower) and the two
alternated ``--rounds`` times:

- ``experts_us``: each token's experts calls (the experts module's ``forward``, both
  models: transformers' ``batched_mm``/``grouped_mm`` in the resident one, moestream's
  whole-layer path in the held one);
- ``begin_us``, ``end_us``: moestream's forward pre-hook and hook (its token's start event,
  and its end: the routing's copy to the host, the session told of the hits, the token's
  log line), ``end_us`` split into ``take_us``, ``account_us`` and ``session_us``
  (``SyncSession.end_token``); ``end_other_us`` is the rest of ``end_us``: its events
  and, on a GPU decoding under ``defer``, the wait for the token before's device work
  (``ExpertStream.flush``), which the resident run waits in transformers' own loop;
- ``rest_us``: the token's wall time less those: transformers' own layers and its decode
  loop, the same code in both runs.

If the held run's ``rest_us`` equals the resident one's, the gap is the calls named;
if it is larger, something slows transformers' own code in the held run.

    python -m bench.held_cost -m CHECKPOINT --device cuda --out held_cost.json
    python -m bench.held_cost --make /tmp/m --shape cpu --layers 8 --device cpu
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.transformers import _fill_cache, _generate, add_spread_argument, make_checkpoint

__all__ = ["main"]

_TIMED = {"begin": ("_experts", "ExpertStream", "begin_step"),
          "end": ("_experts", "ExpertStream", "end_step"),
          "take": ("_routing", "WholeLayers", "take"),
          "account": ("_routing", "WholeLayers", "account"),
          "session": ("_sync", "SyncSession", "end_token")}
"""Each timed part of moestream's token: module (under ``moestream.transformers``, or
``moestream`` for ``_sync``), class and method."""

_CALL_PARTS = {"whole": ("_routing", "WholeLayers", "forward"),
               "gather": ("_routing", "WholeLayers", "_gather")}
"""With ``--split-calls``, a held experts call's parts too: the whole-layer path's
``forward`` (``whole_us``; the rest of ``experts_us`` is the calls' way to it, through
transformers' registry and ``ExpertStream.forward``) and its gather launch (``gather_us``)."""


class Clock:
    """Seconds spent inside wrapped callables, by name, since the last ``take``."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = {}

    def wrap(self, name: str, f: Callable[..., Any]) -> Callable[..., Any]:
        perf = time.perf_counter

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = perf()
            try:
                return f(*args, **kwargs)
            finally:
                spent = self.spent
                spent[name] = spent.get(name, 0.0) + perf() - t0

        return timed

    def take(self) -> dict[str, float]:
        spent, self.spent = self.spent, {}
        return spent


@contextmanager
def _patched(clock: Clock, experts_classes: set[type],
             timed: dict[str, tuple[str, str, str]]) -> Iterator[None]:
    """Every ``timed`` method wrapped by ``clock`` meanwhile (the experts classes'
    ``forward`` as ``experts``), then restored."""
    import importlib

    targets: list[tuple[Any, str, str]] = [(cls, "forward", "experts") for cls in experts_classes]
    for name, (module, cls_name, method) in timed.items():
        where = "moestream._sync" if module == "_sync" else f"moestream.transformers.{module}"
        targets.append((getattr(importlib.import_module(where), cls_name), method, name))
    originals = [(owner, attr, owner.__dict__[attr]) for owner, attr, _ in targets]
    try:
        for owner, attr, name in targets:
            setattr(owner, attr, clock.wrap(name, owner.__dict__[attr]))
        yield
    finally:
        for owner, attr, original in originals:
            setattr(owner, attr, original)


def _experts_classes(model: Any) -> set[type]:
    """The classes of the modules moestream serves (their ``moestream_layer`` is set): the
    resident model of the same checkpoint has the same ones."""
    return {type(m) for m in model.modules() if hasattr(m, "moestream_layer")}


def _run(model: Any, prompt: Any, args: argparse.Namespace, device: Any,
         clock: Clock, timed: dict[str, tuple[str, str, str]]) -> dict[str, float]:
    """One timed generate: its tok/s and each part's microseconds a token."""
    clock.take()
    _, seconds = _generate(model, prompt, args.tokens, device)
    spent = clock.take()
    per_token = {f"{name}_us": spent.get(name, 0.0) / args.tokens * 1e6
                 for name in ("experts", *timed)}
    own = per_token["experts_us"] + per_token["begin_us"] + per_token["end_us"]
    parts = per_token["take_us"] + per_token["account_us"] + per_token["session_us"]
    return {"tok_s": args.tokens / seconds, **per_token,
            "end_other_us": per_token["end_us"] - parts,
            "rest_us": seconds / args.tokens * 1e6 - own}


def _medians(runs: list[dict[str, float]]) -> dict[str, Any]:
    return {key: round(statistics.median(r[key] for r in runs), 2) for key in runs[0]} | {
        "each_tok_s": [round(r["tok_s"], 2) for r in runs]}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.held_cost",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", type=Path, help="checkpoint directory")
    p.add_argument("--make", type=Path, help="write a random-init checkpoint here first "
                   "(unless one is there) and use it")
    p.add_argument("--shape", choices=["tiny", "cpu", "qwen3-30b-a3b"], default="cpu")
    p.add_argument("--layers", type=int, default=2, help="layers of --make's model")
    add_spread_argument(p)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if torch sees one)")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3, help="resident and held alternated")
    p.add_argument("--split-calls", action="store_true",
                   help="time the held experts calls' whole-layer path and gather launch too "
                   "(two more wrapped calls a layer, ~1 us each)")
    p.add_argument("--held-tokens", type=_counts,
                   default=[], metavar="N[,N...]",
                   help="the held run again with a decode holding N tokens before it ends "
                   "them together (the model's held_tokens, 8 as shipped; 0: each at the "
                   "next one's end), an arm of each N (held_N) in every round")
    p.add_argument("--other-graphs", action="store_true",
                   help="the held run again with its decode steps' experts calls replayed as "
                   "CUDA graphs where shipped without (held_graphs_on), or the reverse "
                   "(held_graphs_off), in every round")
    p.add_argument("--out", type=Path)
    return p


def _counts(text: str) -> list[int]:
    """``--held-tokens``' values: counts, comma-separated."""
    counts = [int(n) for n in text.split(",")]
    if min(counts) < 0:
        raise argparse.ArgumentTypeError(f"counts of tokens, not {text!r}")
    return counts


@contextmanager
def _held_tokens(stream: Any, n: int | None, graphs: bool | None = None) -> Iterator[None]:
    """The model's decode holding ``n`` tokens before it ends them meanwhile, its decode
    steps replayed as CUDA graphs or not (None: as shipped)."""
    shipped, shipped_graphs = stream.held_tokens, stream.graphs.on
    stream.held_tokens = shipped if n is None else n
    stream.graphs.on = shipped_graphs if graphs is None else graphs
    try:
        yield
    finally:
        stream.held_tokens, stream.graphs.on = shipped, shipped_graphs


def _ratios(runs: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    """Each arm's medians and, for the held arms, the median of its rounds' tok/s over the
    resident run's in the same round."""
    out: dict[str, Any] = {name: _medians(r) for name, r in runs.items()}
    for name, arm in runs.items():
        if name != "resident":
            out[name]["x_resident"] = round(statistics.median(
                h["tok_s"] / r["tok_s"] for r, h in zip(runs["resident"], arm, strict=True)), 3)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    if (args.model is None) == (args.make is None):
        p.error("give one of -m/--model and --make")
    import torch
    import transformers

    from moestream.transformers import from_pretrained

    device: Any = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model_dir = args.model or args.make
    if args.make is not None and not (args.make / "config.json").is_file():
        make_checkpoint(args.make, args.shape, args.layers, device.type, args.spread)
    prompt = torch.tensor([[1, 2, 3, 4]])
    resident: Any = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, experts_implementation="grouped_mm").to(device)
    reference, _ = _generate(resident, prompt, args.tokens, device)  # the first: slow
    held: Any = from_pretrained(model_dir, device=device)
    try:
        _fill_cache(held.moestream)
        if _generate(held, prompt, args.tokens, device)[0] != reference:
            raise SystemExit("held model's tokens differ from the resident model's")
        clock = Clock()
        arms: dict[str, tuple[int | None, bool | None]] = {"held": (None, None)} | {
            f"held_{n}": (n, None) for n in args.held_tokens}
        if args.other_graphs:
            other = not held.moestream.graphs.on
            arms[f"held_graphs_{'on' if other else 'off'}"] = (None, other)
        runs: dict[str, list[dict[str, float]]] = {a: [] for a in ("resident", *arms)}
        whole0, tokens0 = held.moestream.whole_tokens, held.moestream.tokens
        timed = _TIMED | (_CALL_PARTS if args.split_calls else {})
        with _patched(clock, _experts_classes(held), timed):
            for _ in range(args.rounds):
                runs["resident"].append(_run(resident, prompt, args, device, clock, timed))
                for arm, (n, graphs) in arms.items():
                    with _held_tokens(held.moestream, n, graphs):
                        runs[arm].append(_run(held, prompt, args, device, clock, timed))
        result = _ratios(runs)
        result["x_resident"] = result["held"]["x_resident"]
        result["whole_tokens"] = [held.moestream.whole_tokens - whole0,
                                  held.moestream.tokens - tokens0]
        result["setup"] = {"model": str(model_dir), "device": str(device),
                           "tokens": args.tokens, "rounds": args.rounds,
                           "split_calls": args.split_calls, "held_tokens": args.held_tokens,
                           "other_graphs": args.other_graphs,
                           "graph_replays": held.moestream.graphs.replays,
                           "torch": torch.__version__, "transformers": transformers.__version__}
    finally:
        held.moestream.close()
    text = json.dumps(result, indent=1)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
