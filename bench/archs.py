"""``python -m bench.archs``: which transformers MoE architectures moestream serves exactly.

For each model type (``--kinds``; default: every one of ``KINDS`` the installed
transformers knows), in a process of its own so that a crash or a hang stops only that one:
a tiny random-init bf16 checkpoint written by transformers' ``save_pretrained`` (sizes from
``SIZES``, ``_rules`` and ``FIXES``), then for each compute (``grouped``, ``eager``)
``moestream.transformers.from_pretrained(path, device="cpu", compute=...)`` against the same
checkpoint loaded whole by transformers with ``experts_implementation`` ``grouped_mm`` or
``eager`` (a model that takes none, whose experts moestream swaps: as it is): logits
``torch.equal`` on two prompts and 6 greedy tokens identical. Each compute ends as

- ``PASS``: both equal;
- ``MISMATCH``: logits or tokens differ (the logits' largest absolute difference);
- ``REFUSED``: moestream refused the checkpoint (its one-line ``MoestreamError``);
- ``CRASH``: anything else raised (type, message, innermost moestream frame), or the
  worker process died or ran past ``--timeout``;
- ``SKIPPED``: the tiny model could not be built, transformers has no causal-LM class for
  it (a vision-language model's text part, an encoder-decoder, a classifier), or
  transformers' own model failed (why).

The kinds, sizes and per-kind fixes are ``pipeline.makers.arch_configs``'s.

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
from moestream.pipeline.makers.arch_configs import (
    FIXES,
    KINDS,
    MODEL_TYPES,
    SIZES,
    ZERO_INIT,
    overrides,
)

__all__ = ["FIXES", "KINDS", "MODEL_TYPES", "SIZES", "ZERO_INIT", "main", "one", "overrides"]

PROG = "bench.archs"
REPO = Path(__file__).resolve().parent.parent

OUTCOMES = ("PASS", "MISMATCH", "REFUSED", "CRASH", "SKIPPED")
_WORST_FIRST = ("CRASH", "MISMATCH", "REFUSED", "SKIPPED", "PASS")
COMPUTES = {"grouped": "grouped_mm", "eager": "eager"}
"""moestream's compute and the ``experts_implementation`` of transformers' it must equal."""
PROMPTS = [[3, 17, 42, 5, 9, 11], [7, 8, 9, 10, 11, 12]]
NEW_TOKENS = 6


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


def _reference(path: Path, lm: Any, compute: str) -> tuple[Any, bool]:
    """transformers' own model of ``path`` with the ``experts_implementation`` that
    ``compute`` must equal; for a model that computes its experts in a module of its own
    (Llama 4, JetMoE: moestream swaps that module), the model as it is, and True."""
    try:
        return lm.from_pretrained(path, experts_implementation=COMPUTES[compute]), False
    except ValueError as exc:
        if "does not support setting experts implementation" not in str(exc):
            raise
    return lm.from_pretrained(path), True


def _compare(path: Path, lm: Any, compute: str, device: str) -> dict[str, Any]:
    """One compute's status on ``device``: moestream's model against transformers' own."""
    import torch

    import moestream
    from moestream.transformers import from_pretrained

    ids = torch.tensor(PROMPTS, device=device)
    try:
        whole, own = _reference(path, lm, compute)
        whole = whole.to(device)
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
    if own:
        result["reference"] = "the model's own experts (it takes no experts_implementation)"
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
