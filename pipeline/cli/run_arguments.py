"""``python -m pipeline.run``'s command line: its parser, the ``RunConfig`` it gives the
proxy engine, the streaming options both engines take, and each engine's refusal of the
other's options (given to the wrong engine they would be dropped without a word).

Kept apart from the run itself (``moestream.pipeline.cli.run``): the options are a long,
flat list that changes with every setting, while the run's order of opening, decoding and
closing does not.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from moestream.pipeline.foundation.compute import DEQUANTIZED
from moestream.pipeline.foundation.config import (
    GATHER_BLOCKS,
    parse_budget,
    parse_compute,
    parse_devices,
    parse_size,
)
from moestream.pipeline.foundation.errors import UsageError
from moestream.pipeline.proxy.config import RunConfig, parse_limits

__all__ = ["build_parser", "config_from_args", "refuse_for_the_proxy",
           "refuse_for_transformers", "streaming_options"]

_TRANSFORMERS_FLAGS = {"prompt": "--prompt", "prompt_ids": "--prompt-ids", "chat": "--chat",
                      "experts": "--experts", "in_place": "--in-place"}
"""The options of ``--engine transformers`` alone, by attribute."""
_PROXY_FLAGS = {"compute": "--compute", "devices": "--devices", "router": "--router",
                "lookahead": "--lookahead", "seed": "--seed", "trace": "--trace",
                "record_trace": "--record-trace", "routing": "--routing",
                "log_level": "--log-level", "limits": "--limits"}
"""The proxy engine's options that ``--engine transformers`` has no use for (its routing is
the model's, its compute transformers', its device one), by attribute. The streaming options
(``streaming_options``) serve both engines."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pipeline.run",
        description="Decode a MoE model while streaming its routed experts into a device cache.",
    )
    p.add_argument("-m", "--model", type=Path, help="GGUF model (default: the embedded tiny model)")
    p.add_argument("--engine", default="proxy", choices=["proxy", "transformers"],
                   help="proxy: moestream's proxy engine; transformers: generate with the "
                   "checkpoint directory's real model (moestream.transformers) (proxy)")
    p.add_argument("-n", "--tokens", type=int, default=32, help="tokens to decode (32)")
    p.add_argument("--cache-budget", help="device cache: N experts or a size (11GB, 20GiB); "
                   "default holds every expert")
    p.add_argument("--mode", default="auto", choices=["auto", "direct", "resident"],
                   help="I/O mode; auto lets the controller choose from live RAM (auto)")
    p.add_argument("--policy", default="lru", choices=["lru", "freq"],
                   help="eviction: lru, or freq (route hotness with decay) (lru)")
    p.add_argument("--compute", default="real",
                   help="real (SwiGLU on F16 experts, or GGUF quantized ones dequantized: "
                   f"{', '.join(q.name for q in sorted(DEQUANTIZED))}), digest, "
                   "or fixed:MS per layer (real)")
    p.add_argument("--backend", default="auto", choices=["auto", "host", "cupy"])
    p.add_argument("--devices", help="devices to shard the experts over, e.g. 0,1 (default: "
                   "every visible GPU; with --backend host, indices emulate devices)")
    _add_streaming_options(p)
    p.add_argument("--seed", type=int, default=0, help="routing seed (0)")
    p.add_argument("--trace", type=Path, help="replay this routing trace (.npz or .jsonl)")
    p.add_argument("--record-trace", type=Path, help="write the routing used here")
    p.add_argument("--routing", default="ds4-flash", help="synthetic routing preset (ds4-flash)")
    p.add_argument("--log", type=Path, help="JSON-lines log, one event per token")
    p.add_argument("--log-level", default="info", choices=["info", "debug"])
    p.add_argument("--ram-limit", help="cap the RAM the controller believes it has (e.g. 8GiB)")
    p.add_argument("--sample-ms", type=float, default=250.0, help="controller period (250)")
    p.add_argument("--margin", help="controller safety margin (default max(2GiB, 5%% of RAM))")
    p.add_argument("--limits", metavar="SPEC",
                   help="bandwidths the run is told, for the analysis's device limit: "
                   "read=RATE,copy=RATE (e.g. read=1.8GB/s,copy=55GB/s); logged in run_start")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--debug", action="store_true", help="show tracebacks and debug events")
    p.add_argument("--inject", default="", metavar="SPEC",
                   help="fault injection, a test facility: kind[=value]@N[+],... e.g. "
                   "read_eio@3,device_oom@10 (kinds: see pipeline/foundation/faults.py)")
    _add_transformers_options(p)
    return p


def _add_streaming_options(p: argparse.ArgumentParser) -> None:
    """How experts are read, staged, uploaded and gathered, which are loaded ahead
    (--router, --prefetch, --lookahead) and whether they are verified."""
    p.add_argument("--queue-depth", type=int, default=8, help="reads in flight (8)")
    p.add_argument("--chunk", default="4MiB", help="largest read request (4MiB)")
    p.add_argument("--staging-slots", type=int, default=16, help="pinned staging slots (16)")
    p.add_argument("--streams", type=int, default=2, help="upload streams (2)")
    p.add_argument("--router", default="trace", choices=["trace", "live"],
                   help="trace: replay --trace or synthetic routing; live: the model's router")
    p.add_argument("--prefetch", default="none", choices=["none", "predict", "oracle"],
                   help="predict: load the next layer's guessed experts during this one; "
                   "oracle: read the routing ahead (upper bound)")
    p.add_argument("--lookahead", type=int, default=1, help="layers prefetched ahead (1)")
    p.add_argument("--no-verify", action="store_true", help="skip install-time verification")
    p.add_argument("--no-gather", action="store_true",
                   help="resident misses on the copy engines (a layer's copies as one batched "
                        "copy), not one gather kernel per layer (leaves the SMs to compute)")
    p.add_argument("--gather-blocks", type=int, default=GATHER_BLOCKS,
                   help="the gather kernel's blocks per copy, at most: its SM budget "
                        f"({GATHER_BLOCKS})")


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """The proxy engine's run config (``--engine transformers`` reads ``args`` itself).

    Raises:
        UsageError: an option of ``--engine transformers`` given, or a value that does
            not parse.
    """
    refuse_for_the_proxy(args)
    return RunConfig(
        model=args.model,
        tokens=args.tokens,
        budget=parse_budget(args.cache_budget) if args.cache_budget else None,
        mode=args.mode,
        policy=args.policy,
        compute=parse_compute(args.compute),
        backend=args.backend,
        devices=parse_devices(args.devices) if args.devices else None,
        verify=not args.no_verify,
        prefetch=args.prefetch,
        lookahead=args.lookahead,
        seed=args.seed,
        trace=args.trace,
        record_trace=args.record_trace,
        router=args.router,
        routing_preset=args.routing,
        log=args.log,
        log_level=args.log_level,
        json=args.json,
        debug=args.debug,
        limits=parse_limits(args.limits) if args.limits else None,
        **streaming_options(args),
    )


def streaming_options(args: argparse.Namespace) -> dict[str, Any]:
    """How experts are read, staged, uploaded and watched, as both engines take them: the
    fields of those names of ``StreamConfig`` (the proxy's ``RunConfig``) and of
    ``moestream.Tuning`` (``--engine transformers``)."""
    return dict(
        queue_depth=args.queue_depth, chunk_bytes=parse_size(args.chunk),
        staging_slots=args.staging_slots, upload_streams=args.streams,
        gather=not args.no_gather, gather_blocks=args.gather_blocks,
        ram_limit=parse_size(args.ram_limit) if args.ram_limit else None,
        sample_ms=args.sample_ms,
        margin_bytes=parse_size(args.margin) if args.margin else None,
        faults=args.inject)


def _add_transformers_options(parser: argparse.ArgumentParser) -> None:
    """The options of ``--engine transformers`` alone."""
    group = parser.add_argument_group("--engine transformers")
    group.add_argument("--prompt", help="prompt text (needs the checkpoint's tokenizer)")
    group.add_argument("--prompt-ids", help="prompt as token ids, e.g. 1,2,3")
    group.add_argument("--chat", action="store_true",
                       help="--prompt as a user message in the tokenizer's chat template, "
                       "generation stopped at the model's end of turn (at most --tokens)")
    group.add_argument("--experts", default="grouped", choices=["grouped", "eager"],
                       help="expert arithmetic: grouped (as transformers' grouped_mm) or "
                       "eager (logits equal to experts_implementation=eager) (grouped)")
    group.add_argument("--in-place", action="store_true",
                       help="on a GPU below the model's experts, once the cache is full: each "
                       "decode step reads the experts the cache lacks in place from the "
                       "registered page-cache mapping, no host read of the routing (resident "
                       "mode)")


def refuse_for_the_proxy(args: argparse.Namespace) -> None:
    """The transformers engine's options given to the proxy engine, which reads none of
    them: refused in one line, not ignored (a prompt would be dropped without a word).

    Raises:
        UsageError: one of them is away from its default.
    """
    _refuse(args, _TRANSFORMERS_FLAGS, " given without --engine transformers (the proxy "
            "engine, the default, decodes synthetic or traced routing: no prompt)")


def refuse_for_transformers(args: argparse.Namespace) -> None:
    """The proxy engine's own options given to ``--engine transformers``: refused in one
    line, not ignored.

    Raises:
        UsageError: one of them is away from its default.
    """
    _refuse(args, _PROXY_FLAGS, ": options of the proxy engine, not of --engine transformers "
            "(its routing is the model's, its compute transformers', on one device: "
            "CUDA_VISIBLE_DEVICES picks it)")


def _refuse(args: argparse.Namespace, flags: dict[str, str], why: str) -> None:
    """One line, the ``flags`` whose values in ``args`` are not the parser's defaults then
    ``why``, if any."""
    parser = build_parser()
    given = [flag for name, flag in flags.items()
             if getattr(args, name, None) != parser.get_default(name)]
    if given:
        raise UsageError(f"{', '.join(given)}{why}")
