"""``from_pretrained``'s arguments: transformers' loading words, the device, the dtype.

transformers' own loading words are taken where they mean something here and refused, in
one line naming what replaces them, where moestream does the thing otherwise (the dense
weights on one device, the experts' device memory bounded by the budget, a local path).
"""

from __future__ import annotations

import os
import re
from typing import Any, NamedTuple

import torch  # type: ignore[import-not-found, unused-ignore]

from moestream.pipeline.foundation.errors import ModelFileError, UsageError, UsageTypeError

__all__ = ["LoadingWords", "build_with", "device_of", "dtype_of", "first_line", "loading_words",
           "not_a_dtype", "wanted_dtype"]


_ARGUMENTS = ("path", "budget", "mode", "device", "dtype", "compute", "policy", "verify", "log",
              "tuning", "progress", "torch_dtype", "attn_implementation", "device_map",
              "max_memory", "revision", "cache_dir", "local_files_only", "low_cpu_mem_usage",
              "trust_remote_code", "gguf_file", "prefetch", "in_place")
"""What ``from_pretrained`` takes, as an unknown keyword's refusal lists it."""


class LoadingWords(NamedTuple):
    """What transformers' loading words said, once checked."""

    device: Any
    dtype: Any
    attention: str | None
    max_memory: Any
    """transformers' ``max_memory`` (device to size), or None."""
    revision: str | None
    """A hub id's revision (a branch, tag or commit), or None."""
    cache_dir: str | None
    """The hub cache to look a hub id up in (None: huggingface_hub's default)."""
    gguf_file: str | None = None
    """transformers' ``gguf_file``: the GGUF file in the directory (or hub snapshot) given."""


def loading_words(words: dict[str, Any], device: Any, dtype: Any) -> LoadingWords:
    """``device``, ``dtype``, the attention implementation and the hub and memory words,
    after transformers' loading words in ``words`` (see ``from_pretrained``); the rest
    refused in one line each."""
    words = dict(words)
    torch_dtype = words.pop("torch_dtype", None)
    if torch_dtype is not None:
        if dtype is not None and dtype != torch_dtype and (
                dtype_of(dtype) is None or dtype_of(dtype) != dtype_of(torch_dtype)):
            raise UsageError(f"dtype {str(dtype)[:40]!r} and torch_dtype "
                             f"{str(torch_dtype)[:40]!r}: give dtype alone (torch_dtype is "
                             "its old name)")
        dtype = torch_dtype
    if "device_map" in words:
        device = _device_map(words.pop("device_map"), device)
    max_memory = words.pop("max_memory", None)
    revision, cache_dir = words.pop("revision", None), words.pop("cache_dir", None)
    gguf_file = words.pop("gguf_file", None)
    for name, value in (("revision", revision), ("cache_dir", cache_dir),
                        ("gguf_file", gguf_file)):
        if value is not None and not isinstance(value, (str, os.PathLike)):
            raise UsageTypeError(f"{name} must be text, not {type(value).__name__}")
    if words.pop("local_files_only", None) not in (None, True, False):
        raise UsageTypeError("local_files_only must be True or False")
    trust = words.pop("trust_remote_code", None)
    if trust not in (None, False):
        raise UsageError("trust_remote_code: moestream never runs a checkpoint's code; it "
                         "serves the model types transformers itself ships")
    if words.pop("low_cpu_mem_usage", None) not in (None, True, False):
        raise UsageTypeError("low_cpu_mem_usage must be True or False")
    attention = words.pop("attn_implementation", None)
    if attention is not None:
        _check_attention(attention)
    if words:
        names = ", ".join(sorted(words))
        raise UsageTypeError(f"from_pretrained got an unexpected argument"
                             f"{'s' if len(words) > 1 else ''} {names}; it takes "
                             f"{', '.join(_ARGUMENTS)}")
    return LoadingWords(device, dtype, attention, max_memory,
                        None if revision is None else str(revision),
                        None if cache_dir is None else os.fspath(cache_dir),
                        None if gguf_file is None else os.fspath(gguf_file))


def _device_map(device_map: Any, device: Any) -> Any:
    """The one device ``device_map`` names (``"auto"``: ``device``'s default); a map that
    splits the model is refused."""
    chosen = device_map
    if isinstance(device_map, dict) and set(device_map) == {""}:
        chosen = device_map[""]
    elif isinstance(device_map, dict) or device_map in ("balanced", "balanced_low_0",
                                                        "sequential"):
        raise UsageError(f"device_map {str(device_map)[:60]}: moestream does not split the "
                         "model over devices; the dense weights go to one device (device= or "
                         "device_map=\"cuda:0\") and the routed experts stream under budget=")
    elif device_map == "auto" or device_map is None:
        chosen = None
    if device is not None and chosen is not None and str(device) != str(chosen):
        raise UsageError(f"device {str(device)!r} and device_map {str(device_map)[:60]}: give "
                         "one of them")
    return device if chosen is None else chosen


def _check_attention(attention: Any) -> None:
    """Refuse an attention implementation transformers does not know, or a hub kernel
    (moestream downloads nothing)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    known = ["eager", *ALL_ATTENTION_FUNCTIONS.valid_keys()]
    if not isinstance(attention, str):
        raise UsageTypeError(f"attn_implementation must be a name ({', '.join(known)}), not "
                             f"{type(attention).__name__}")
    if attention not in known:
        raise UsageError(f"attn_implementation {attention[:60]!r}: one of {', '.join(known)} "
                         "(a hub kernel is not downloaded)")


def build_with(attention: str | None, build: Any) -> Any:
    """``build()``; a failure the attention implementation causes (its package missing,
    the model lacking it) is the caller's, a ``UsageError`` naming it."""
    try:
        return build()
    except (ImportError, ModelFileError) as exc:
        cause = exc if isinstance(exc, ImportError) else exc.__cause__
        if (attention is None or not isinstance(cause, (ImportError, ValueError))
                or not re.search("attn|attention", str(cause), re.IGNORECASE)):
            raise
        raise UsageError(f"attn_implementation {attention!r}: {first_line(cause)}") from exc


def device_of(device: Any) -> Any:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        chosen = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise UsageError(f"device {device!r}: {exc}") from exc
    if chosen.type not in ("cpu", "cuda"):
        raise UsageError(f"device {device!r}: moestream computes on cpu or cuda")
    if chosen.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"device {device!r}: torch sees no CUDA device")
    return chosen


def dtype_of(value: Any) -> Any:
    """A torch floating dtype from ``value`` (a torch dtype or its name), None for None or
    ``"auto"`` (the checkpoint's); None also for anything else, which the caller refuses."""
    chosen = getattr(torch, value, None) if isinstance(value, str) else value
    return chosen if isinstance(chosen, torch.dtype) and chosen.is_floating_point else None


def wanted_dtype(dtype: Any) -> Any:
    """The model's dtype as ``from_pretrained`` was given it (None: the checkpoint's).

    Raises:
        UsageError: not a torch floating-point dtype, its name, None or ``"auto"``.
    """
    wanted = dtype_of(dtype)
    if wanted is None and dtype not in (None, "auto"):
        raise UsageError(f"dtype {not_a_dtype(dtype)}")
    return wanted


def not_a_dtype(value: Any) -> str:
    return (f"{str(value)[:40]!r} is not a torch floating-point dtype (bfloat16, float16, "
            "float32 or \"auto\")")


def first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]
