"""``python -m bench.archs``: which transformers MoE architectures moestream serves exactly.

For each model type (``--kinds``; default: every one of ``KINDS`` the installed
transformers knows), in a process of its own so that a crash or a hang stops only that one:
a tiny random-init bf16 checkpoint written by transformers' ``save_pretrained`` (sizes from
``SIZES``, ``_rules`` and ``FIXES``), then for each compute (``grouped``, ``eager``)
``moestream.transformers.from_pretrained(path, device="cpu", compute=...)`` against the same
checkpoint loaded whole by transformers with ``experts_implementation`` ``grouped_mm`` or
``eager``: logits ``torch.equal`` on two prompts and 6 greedy tokens identical. Each compute
ends as

- ``PASS``: both equal;
- ``MISMATCH``: logits or tokens differ (the logits' largest absolute difference);
- ``REFUSED``: moestream refused the checkpoint (its one-line ``MoestreamError``);
- ``CRASH``: anything else raised (type, message, innermost moestream frame), or the
  worker process died or ran past ``--timeout``;
- ``SKIPPED``: the tiny model could not be built, transformers has no causal-LM class for
  it, or transformers' own model failed (why).

A kind's outcome is its worst compute's. A model type AutoModelForCausalLM does not map is
built by its own ``<Name>ForCausalLM`` class where transformers has one (Mistral-4), as the
loader does through the saved ``config.architectures``. Weights that start at zero and
would hide a path (``ZERO_INIT``: gpt-oss's expert biases, AfMoE's router) are drawn from
normal(0, 0.02) before saving. Checkpoints (and the digest manifests moestream keeps for
them) live in a temporary directory removed at the end. Prints a line per kind and the
summary; ``--out`` also writes the JSON (machine, commit, command, versions; per kind the
overrides, outcome, per-compute status and seconds; counts by outcome). Exit status 0 when
every kind is PASS or SKIPPED.

    python -m bench.archs --kinds qwen3_moe,mixtral
    python -m bench.archs --device cuda        # the GPU path (CuPy backend), same checks
    python -m bench.archs --out bench/results/archs-vm-COMMIT/archs.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from bench.kit import run_command
from bench.record import provenance, write_result
from moestream.pipeline.foundation.errors import UsageError
from moestream.pipeline.foundation.outputs import check_output

__all__ = ["FIXES", "KINDS", "SIZES", "ZERO_INIT", "main", "one", "overrides"]

PROG = "bench.archs"
REPO = Path(__file__).resolve().parent.parent

KINDS = (
    "afmoe", "axk1", "axk2", "bailing_hybrid", "beam", "cohere2_moe", "deepseek_v2",
    "deepseek_v3", "deepseek_v32", "deepseek_v4", "dots1", "ergo", "ernie4_5_moe",
    "exaone_moe", "flex_olmo", "flint", "glm4_moe", "glm4_moe_lite", "glm_moe_dsa", "gpt_oss",
    "granitemoe", "granitemoe_swa", "granitemoehybrid", "granitemoeshared", "hunyuan_v1_moe",
    "hy_v3", "hy_v4", "jamba", "kimi_linear", "kolibri1", "laguna", "lara_mini", "lfm2_moe",
    "longcat_flash", "mellum", "mimo_v2_flash", "minicpm5_moe", "minimax", "minimax_m2",
    "mistral4", "mixtral", "nemotron_h", "olmoe", "phimoe", "qwen2_moe", "qwen3_5_moe",
    "qwen3_moe", "qwen3_next", "solar_open", "step3p7",
)
"""The MoE model types swept by default (those the installed transformers knows)."""

OUTCOMES = ("PASS", "MISMATCH", "REFUSED", "CRASH", "SKIPPED")
_WORST_FIRST = ("CRASH", "MISMATCH", "REFUSED", "SKIPPED", "PASS")
COMPUTES = {"grouped": "grouped_mm", "eager": "eager"}
"""moestream's compute and the ``experts_implementation`` of transformers' it must equal."""
PROMPTS = [[3, 17, 42, 5, 9, 11], [7, 8, 9, 10, 11, 12]]
NEW_TOKENS = 6
LAYERS = 4
MODEL_TYPES = {"qwen3_5_moe": "qwen3_5_moe_text"}
"""Kinds whose causal LM is built from another config (Qwen3.5-MoE's is vision-language)."""

SIZES: dict[str, Any] = {
    # width, experts and attention: every name a config may use for them
    "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
    "ffn_hidden_size": 96, "expert_ffn_hidden_size": 32, "shared_expert_intermediate_size": 48,
    "num_experts": 8, "num_local_experts": 8, "n_routed_experts": 8, "moe_num_experts": 8,
    "num_experts_per_tok": 2, "num_experts_per_token": 2, "moe_k": 2, "moe_topk": 2,
    "num_hidden_layers": LAYERS, "num_layers": LAYERS,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 96,
    "max_position_embeddings": 128, "model_max_length": 128,
    # multi-head latent attention (DeepSeek, GLM-4-MoE-Lite, Kimi, LongCat, Mistral-4)
    "kv_lora_rank": 16, "q_lora_rank": 24, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    # a dense first layer, then MoE layers to the last
    "first_k_dense_replace": 1, "num_dense_layers": 1, "moe_layer_start_index": 1,
    "moe_layer_end_index": LAYERS - 1,
    # linear attention and Mamba layers (Qwen3-Next, Kimi-Linear, Jamba)
    "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_num_key_heads": 2,
    "linear_num_value_heads": 4, "linear_head_dim": 16, "linear_num_heads": 4,
    "mamba_dt_rank": 8, "mamba_d_state": 4, "use_mamba_kernels": False,
    # sparse-attention indexers and grouped output projections (DeepSeek-V3.2, V4)
    "index_topk": 16, "index_head_dim": 16, "index_n_heads": 2, "o_lora_rank": 16,
    "o_groups": 2,
}
"""The tiny sizes, each applied where the kind's default config has that attribute: a tiny
model of every kind is built from these names, whichever of them its config uses."""

_SMALL_EXPERTS = {"intermediate_size": 32}  # experts sized by intermediate_size
FIXES: dict[str, dict[str, Any]] = {
    # attention sized by head_dim, one KV head, compressed layers that fit 4 layers, and a
    # swiglu_limit small enough that the experts' clamped SwiGLU binds (as the tests)
    "deepseek_v4": {"head_dim": 16, "num_key_value_heads": 1, "sliding_window": 8,
                    "swiglu_limit": 0.001,
                    "compress_rates": {"compressed_sparse_attention": 4,
                                       "heavily_compressed_attention": 8}},
    "bailing_hybrid": {"layer_types": ["linear_attention", "full_attention"] * (LAYERS // 2),
                       "num_expert_group": 2, "topk_group": 1},
    "dots1": {"n_shared_experts": 1},
    "ernie4_5_moe": {"moe_num_shared_experts": 1},
    "flex_olmo": _SMALL_EXPERTS,
    "gpt_oss": {**_SMALL_EXPERTS, "swiglu_limit": 0.001},  # a clamp that binds
    "granitemoe": _SMALL_EXPERTS,
    "granitemoehybrid": {"layer_types": ["linear_attention", "attention"] * (LAYERS // 2)},
    "granitemoeshared": {**_SMALL_EXPERTS, "shared_intermediate_size": 48},
    "jamba": {**_SMALL_EXPERTS, "attn_layer_period": 2, "attn_layer_offset": 1,
              "expert_layer_period": 2, "expert_layer_offset": 1},
    # its first layers are all linear attention: mix in full attention
    "kimi_linear": {"num_expert_group": 1, "topk_group": 1,
                    "layer_types": ["linear_attention", "full_attention"] * (LAYERS // 2)},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"] * (LAYERS // 2)},
    # zero (identity) experts beside the routed ones; head_dim is the rope part of q and k
    "longcat_flash": {"zero_expert_num": 2, "head_dim": 8},
    "minimax": _SMALL_EXPERTS,
    "minimax_m2": _SMALL_EXPERTS,
    "mixtral": _SMALL_EXPERTS,
    # Mamba, MoE and attention layers; a small shared expert and Mamba heads
    "nemotron_h": {"moe_shared_expert_intermediate_size": 48, "mamba_num_heads": 4,
                   "mamba_head_dim": 16, "ssm_state_size": 8, "n_groups": 1,
                   "layers_block_type": ["mamba", "moe", "attention", "moe"]},
    "olmoe": _SMALL_EXPERTS,
    "phimoe": _SMALL_EXPERTS,
}
"""Per-kind overrides on top of ``SIZES`` and ``_rules``: what a kind needs besides them."""

ZERO_INIT = re.compile(r"\.experts\.\w+_bias$|\.router\.gate\.weight$")
"""Parameters drawn from normal(0, 0.02) where they start at zero: experts' biases (gpt-oss;
the bias path would go unchecked) and a router's weight (AfMoE; every token would tie onto
the same two experts)."""


def _rules(defaults: dict[str, Any]) -> dict[str, Any]:
    """Overrides that follow from a default config: per-layer lists cut to ``LAYERS``, MLA's
    heads, expert groups, and token ids the tiny vocabulary must hold."""
    out: dict[str, Any] = {}
    layers = defaults.get("num_hidden_layers") or defaults.get("num_layers")
    for key, value in defaults.items():
        if isinstance(value, list) and len(value) == layers and key != "architectures":
            out[key] = value[:LAYERS]
            if key == "mlp_layer_types" and set(value) == {"dense", "sparse"}:
                out[key] = ["dense"] + ["sparse"] * (LAYERS - 1)
    if "kv_lora_rank" in defaults:  # MLA: heads shaped by the ranks, head_dim derived
        out["num_key_value_heads"] = 4
    n_group = defaults.get("n_group")
    if isinstance(n_group, int) and n_group > 1:
        out.update(n_group=2, topk_group=1)
    vocab = SIZES["vocab_size"]
    for key, small in (("pad_token_id", 0), ("bos_token_id", 1), ("eos_token_id", 2)):
        value = defaults.get(key)
        ids = value if isinstance(value, list) else [value]
        if any(isinstance(i, int) and i >= vocab for i in ids):
            out[key] = small
    return out


def overrides(kind: str, defaults: dict[str, Any]) -> dict[str, Any]:
    """The tiny config's overrides of ``kind``, whose default config is ``defaults``."""
    out = {k: v for k, v in SIZES.items() if k in defaults}
    if "kv_lora_rank" in defaults:
        out.pop("head_dim", None)
    return {**out, **_rules(defaults), **FIXES.get(kind, {})}


# -- the worker: one kind, in its own process -------------------------------------------------

def _error(exc: BaseException) -> str:
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first[:300]}"


def _moestream_frame(exc: BaseException) -> str | None:
    """The innermost traceback frame in moestream's own code (moestream/, pipeline/)."""
    found = None
    for frame in traceback.extract_tb(exc.__traceback__):
        path = Path(frame.filename)
        if path.is_relative_to(REPO / "moestream") or path.is_relative_to(REPO / "pipeline"):
            found = f"{path.relative_to(REPO)}:{frame.lineno} ({frame.name})"
    return found


def _causal_lm(config: Any) -> Any:
    """The class that builds ``config``'s causal LM: AutoModelForCausalLM, else the model's
    own ``<Name>ForCausalLM`` where transformers has one (Mistral-4), else None."""
    import transformers

    if type(config) in transformers.AutoModelForCausalLM._model_mapping:
        return transformers.AutoModelForCausalLM
    own = getattr(transformers, type(config).__name__.removesuffix("Config") + "ForCausalLM",
                  None)
    return own if own is not None and own.config_class is type(config) else None


def _save(kind: str, where: Path) -> dict[str, Any]:
    """Write ``kind``'s tiny checkpoint to ``where``: its overrides and class, or why not
    (``skipped``)."""
    import torch
    import transformers

    model_type = MODEL_TYPES.get(kind, kind)
    try:
        used = overrides(kind, transformers.AutoConfig.for_model(model_type).to_dict())
        config = transformers.AutoConfig.for_model(model_type, **used)
    except Exception as exc:  # recorded as the kind's outcome, not swallowed
        return {"skipped": f"tiny config: {_error(exc)}"}
    lm = _causal_lm(config)
    if lm is None:
        return {"overrides": used, "skipped": f"transformers {transformers.__version__} has "
                f"no causal-LM class for {type(config).__name__}"}
    torch.manual_seed(0)
    # a model's own class builds by _from_config, the auto class by from_config
    build = lm._from_config if hasattr(lm, "_from_config") else lm.from_config
    try:
        model = build(config, dtype=torch.bfloat16)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if ZERO_INIT.search(name) and not param.any():
                    param.normal_(0.0, 0.02)
        model.save_pretrained(where)
    except Exception as exc:  # recorded as the kind's outcome, not swallowed
        return {"overrides": used, "skipped": f"tiny model: {_error(exc)}"}
    return {"overrides": used, "model_class": type(model).__name__}


def _generate(model: Any) -> Any:
    import torch

    ids = torch.tensor(PROMPTS, device=model.device)
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                          min_new_tokens=NEW_TOKENS, do_sample=False)


def _compare(path: Path, lm: Any, compute: str, device: str) -> dict[str, Any]:
    """One compute's status on ``device``: moestream's model against transformers' own."""
    import torch

    import moestream
    from moestream.transformers import from_pretrained

    ids = torch.tensor(PROMPTS, device=device)
    try:
        whole = lm.from_pretrained(path, experts_implementation=COMPUTES[compute]).to(device)
        with torch.no_grad():
            expected = whole(ids).logits
        expected_tokens = _generate(whole)
        del whole
    except Exception as exc:  # transformers' own failure: nothing to compare with
        return {"status": "SKIPPED", "reason": f"transformers' own model: {_error(exc)}"}
    model = None
    try:
        model = from_pretrained(path, device=device, compute=compute)  # type: ignore[arg-type]
        with torch.no_grad():
            got = model(ids).logits
        tokens = _generate(model)
        misses = model.moestream.session.counters().misses
    except moestream.MoestreamError as exc:
        return {"status": "REFUSED", "error": f"{type(exc).__name__}: {exc}"}
    except Exception as exc:  # a crash is this command's finding
        return {"status": "CRASH", "error": _error(exc), "frame": _moestream_frame(exc)}
    finally:
        if model is not None:
            model.moestream.close()
    logits_equal = bool(torch.equal(expected, got))
    tokens_equal = bool(torch.equal(expected_tokens, tokens))
    result: dict[str, Any] = {
        "status": "PASS" if logits_equal and tokens_equal else "MISMATCH",
        "expert_misses": misses,
    }
    if result["status"] == "MISMATCH":
        diff = (expected.float() - got.float()).abs().max() if expected.shape == got.shape \
            else math.inf
        result.update(logits_equal=logits_equal, tokens_equal=tokens_equal,
                      max_abs_diff=float(diff))
    return result


def one(kind: str, where: Path, device: str = "cpu") -> dict[str, Any]:
    """``kind``'s checkpoint written under ``where``, and each compute's status on
    ``device``."""
    import transformers

    result: dict[str, Any] = {"kind": kind, **_save(kind, where / kind)}
    if "skipped" in result:
        result.update(outcome="SKIPPED", reason=result.pop("skipped"), computes={})
        return result
    config = transformers.AutoConfig.from_pretrained(where / kind)
    lm = _causal_lm(config)
    result["computes"] = {c: _compare(where / kind, lm, c, device) for c in COMPUTES}
    statuses = {r["status"] for r in result["computes"].values()}
    result["outcome"] = next(s for s in _WORST_FIRST if s in statuses)
    return result


# -- the sweep: one worker process per kind ---------------------------------------------------

def _run_one(kind: str, root: Path, timeout_s: float, device: str) -> dict[str, Any]:
    """``python -m bench.archs --one KIND`` in a process of its own, its JSON line read; a
    worker that dies or runs past ``timeout_s`` is a CRASH."""
    # the digest manifests moestream keeps per checkpoint go with the checkpoints
    env = {**os.environ, "XDG_CACHE_HOME": str(root / "cache"),
           "TRANSFORMERS_VERBOSITY": "error"}
    command = [sys.executable, "-m", "bench.archs", "--one", kind, "--dir", str(root),
               "--device", device]
    try:
        done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"kind": kind, "outcome": "CRASH", "reason": f"timed out after {timeout_s:g} s"}
    if done.returncode == 0:
        try:  # its last line (a library may have printed before it)
            result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
            return result
        except (IndexError, ValueError):
            return {"kind": kind, "outcome": "CRASH", "reason": "worker printed no result"}
    last = (done.stderr.strip().splitlines() or ["no output"])[-1]
    return {"kind": kind, "outcome": "CRASH",
            "reason": f"worker exited with {done.returncode}: {last[:300]}"}


def _detail(result: dict[str, Any]) -> str:
    """What a line says after a kind's outcome: why, where it is not PASS."""
    if result.get("reason"):
        return str(result["reason"])
    parts = []
    for compute, status in result.get("computes", {}).items():
        if status["status"] == "MISMATCH":
            parts.append(f"{compute}: MISMATCH max abs diff {status['max_abs_diff']:g}, "
                         f"tokens {'equal' if status['tokens_equal'] else 'differ'}")
        elif status["status"] != "PASS":
            why = status.get("error") or status.get("reason")
            where = f" at {status['frame']}" if status.get("frame") else ""
            parts.append(f"{compute}: {status['status']} {why}{where}")
    return "; ".join(parts)


def _kinds(text: str | None) -> list[str]:
    import transformers

    if text is None:
        return [k for k in KINDS if k in transformers.CONFIG_MAPPING]
    kinds = list(dict.fromkeys(k.strip() for k in text.split(",") if k.strip()))
    if not kinds:
        raise UsageError("--kinds: no model type given")
    unknown = [k for k in kinds if k not in KINDS and k not in transformers.CONFIG_MAPPING]
    if unknown:
        raise UsageError(f"--kinds: unknown {', '.join(unknown)} (neither in bench.archs.KINDS "
                         f"nor a model type of transformers {transformers.__version__})")
    return kinds


def _timeout(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise UsageError(f"--timeout takes a positive number of seconds, not {text!r}")
    return value


def _sweep(args: argparse.Namespace, argv: Sequence[str]) -> int:
    import torch
    import transformers

    from moestream.transformers import is_available

    is_available(raise_error=True)
    timeout_s = _timeout(args.timeout)
    kinds = _kinds(args.kinds)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: torch sees no CUDA device")
    if args.out is not None:  # before the sweep, not after
        check_output(args.out, what="--out", make_parents=True)
    result: dict[str, Any] = {
        **provenance(PROG, argv, backend="cupy" if args.device == "cuda" else "host",
                     device=args.device),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "timeout_s": timeout_s, "summary": {}, "kinds": {},
    }
    with tempfile.TemporaryDirectory(prefix="bench-archs-") as root:
        for kind in kinds:
            started = time.perf_counter()
            if kind in transformers.CONFIG_MAPPING:
                one_result = _run_one(kind, Path(root), timeout_s, args.device)
            else:
                one_result = {"kind": kind, "outcome": "SKIPPED", "reason": f"transformers "
                              f"{transformers.__version__} has no {kind}"}
            one_result.pop("kind", None)
            one_result["seconds"] = round(time.perf_counter() - started, 1)
            result["kinds"][kind] = one_result
            print(f"{kind:<18} {one_result['outcome']:<8} {one_result['seconds']:6.1f}s  "
                  f"{_detail(one_result)}".rstrip(), flush=True)
    counts = Counter(r["outcome"] for r in result["kinds"].values())
    result["summary"] = {o: counts[o] for o in OUTCOMES if counts[o]}
    print("summary: " + ", ".join(f"{n} {o}" for o, n in result["summary"].items())
          + f" ({len(kinds)} kinds)")
    if args.out is not None:
        write_result(args.out, result)
        print(f"written: {args.out}")
    return 0 if set(counts) <= {"PASS", "SKIPPED"} else 1


def _bench(args: argparse.Namespace, argv: Sequence[str]) -> int:
    if args.one is None:
        return _sweep(args, argv)
    with ExitStack() as stack:
        where = args.dir or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        print(json.dumps(one(args.one, where, args.device), default=str))
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m {PROG}", description=__doc__.splitlines()[0])
    p.add_argument("--kinds", help="model types, comma-separated (default: every one of "
                   "KINDS this transformers knows)")
    p.add_argument("--out", type=Path, help="also write the result JSON here")
    p.add_argument("--timeout", default="300", help="seconds a kind may take (300)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where both models compute: cpu (moestream's host backend) or cuda "
                   "(its CuPy backend, torch's stream waiting on the uploads)")
    p.add_argument("--one", metavar="KIND", help="the worker: check one model type, print "
                   "its result as one JSON line")
    p.add_argument("--dir", type=Path, help="where --one writes its checkpoint (default: a "
                   "temporary directory)")
    p.add_argument("--debug", action="store_true", help="debug events and tracebacks")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point; returns the exit code (2 for bad input)."""
    return run_command(PROG, _parser(), _bench, argv)


if __name__ == "__main__":
    sys.exit(main())
