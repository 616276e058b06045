"""A checkpoint's ``config.json``: read, and checked against the tensors.

Each of the integers ``config.json`` may hold (the expert count ``num_experts``/
``num_local_experts``/``n_routed_experts``, the hidden size ``moe_latent_size`` or
``hidden_size``, the expert FFN ``moe_intermediate_size`` or, in Mixtral's configs,
``intermediate_size``, the top-k under any name transformers gives it
(``num_experts_per_tok``, ``moe_topk``, ``moe_k``, ``num_experts_per_token``, ``moe_top_k``,
``top_k_experts``),
``num_hidden_layers`` and ``num_nextn_predict_layers``) must be an integer where present
(``null`` counts as absent, as transformers writes an unset value; a per-layer list of top-k
as absent too), and must agree: the expert count, hidden size and FFN with every MoE layer,
the top-k within 1..experts, ``num_hidden_layers`` with the layers the tensors name (or,
with DeepSeek's multi-token-prediction layers in the checkpoint, that plus
``num_nextn_predict_layers``).

A multimodal checkpoint (Llama 4's Scout and Maverick, ``Llama4ForConditionalGeneration``)
nests its language model's config as ``text_config``: the integers are read there, where
transformers' ``get_text_config()`` finds them and the MoE layers read them, never at the
top level (which has none of them, and would leave the top-k at its default of 8).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from moestream.pipeline.foundation.errors import ExpertLayoutError, ModelFileError
from moestream.pipeline.foundation.experts import MoeLayer
from moestream.pipeline.foundation.safetensors_header import read_json, short

__all__ = ["CONFIG_LIMIT_BYTES", "EXPERT_KEYS", "TOP_K_KEYS", "check_layer_sizes",
           "config_ints", "layer_count", "layer_sizes", "read_config", "text_config", "top_k"]

CONFIG_LIMIT_BYTES = 16 << 20
"""The largest ``config.json`` (or index) read."""
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
TOP_K_KEYS = ("num_experts_per_tok", "moe_topk", "moe_k", "num_experts_per_token",
              "moe_top_k", "top_k_experts")
"""The top-k's names in config.json: transformers' own and those its config classes map to
it (Hunyuan and LongCat-Flash, ERNIE-4.5, Kimi-Linear and Bailing, Step), and Gemma 4's."""
_INT_KEYS = (*EXPERT_KEYS, "moe_latent_size", "hidden_size", "moe_intermediate_size",
             "intermediate_size", "num_hidden_layers", "num_nextn_predict_layers", *TOP_K_KEYS)
Size = tuple[str, int, int]
"""What config.json says of every MoE layer: (in words, the value, its place in
``(n_experts, hidden, ffn)``)."""


def read_config(directory: Path, *, required: bool) -> dict[str, Any]:
    """The checkpoint's ``config.json`` as an object; ``{}`` when it has none and need not
    (a lone ``.safetensors`` file)."""
    config = directory / "config.json"
    if not config.exists():
        if required:
            raise ModelFileError(directory, "is a directory with no config.json (not a checkpoint)")
        return {}
    return read_json(config, CONFIG_LIMIT_BYTES)


def text_config(config: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """Where ``config.json`` keeps the language model's settings, and the prefix that names
    that place in a refusal: its ``text_config`` object where it nests one (a multimodal
    checkpoint), else the file's top level."""
    nested = config.get("text_config")
    if isinstance(nested, dict):
        return nested, "text_config."
    return config, ""


def config_ints(path: Path, config: dict[str, Any]) -> dict[str, int]:
    """The integers the table reads from ``config.json`` (its :func:`text_config`), by key
    (see the module docstring), read before any shard, so that a bad config costs no header;
    a value of another type (a bool, a float, a string...) is refused, never ignored."""
    out: dict[str, int] = {}
    config, prefix = text_config(config)
    for key in _INT_KEYS:
        value = config.get(key)
        if value is None:
            continue
        if value.__class__ is int:
            out[key] = value
        elif not (key in TOP_K_KEYS and isinstance(value, list)):  # per layer (Hunyuan)
            kind = {bool: "a boolean", float: "a float", str: "a string", list: "a list",
                    dict: "an object"}.get(type(value), type(value).__name__)
            shown = json.dumps(value)  # as the file has it: true, "2", 16.0
            if len(shown) > 40:
                shown = f"{shown[:40]}... ({len(shown)} characters)"
            raise ExpertLayoutError(path, f"config.json's {prefix}{key} is {kind} ({shown}), "
                                          f"not an integer")
    return out


def layer_sizes(config: dict[str, Any], ints: dict[str, int]) -> list[Size]:
    """What ``config.json`` says every MoE layer's expert count, hidden size and expert FFN
    are (those it names)."""
    hidden = ints.get("moe_latent_size", ints.get("hidden_size"))  # Nemotron's latent MoE
    ffn = ints.get("moe_intermediate_size")
    if ffn is None and "num_local_experts" in text_config(config)[0]:  # Mixtral's, Llama 4's
        ffn = ints.get("intermediate_size")
    want = [(f"experts {short(ints[k], 20)} ({k})", ints[k], 0)
            for k in EXPERT_KEYS if k in ints]
    want += [(f"hidden_size {short(hidden, 20)}", hidden, 1)] if hidden is not None else []
    want += [(f"expert FFN {short(ffn, 20)}", ffn, 2)] if ffn is not None else []
    return want


def check_layer_sizes(path: Path, moe: MoeLayer, want: list[Size]) -> None:
    """Refuse a layer whose tensors disagree with what ``config.json`` says (``want``)."""
    have = (moe.n_experts, moe.shape[0], moe.shape[1])
    for said, value, at in want:
        if value != have[at]:
            raise ExpertLayoutError(path, f"config.json says {said}, but layer "
                                          f"{moe.index}'s tensors have {have[at]}")


def top_k(path: Path, ints: dict[str, int], count: int) -> int:
    """config.json's top-k, under whichever of its names it has; ``min(8, count)`` when it
    has none (or a per-layer list)."""
    named = {k: ints[k] for k in TOP_K_KEYS if k in ints}
    if len(set(named.values())) > 1:
        said = ", ".join(f"{k} {short(v, 20)}" for k, v in named.items())
        raise ExpertLayoutError(path, f"config.json names two top-k: {said}")
    if not named:
        return min(8, count)
    key, top_k = next(iter(named.items()))
    if not 0 < top_k <= count:
        raise ExpertLayoutError(path, f"config.json's {key} {short(top_k, 20)} is outside "
                                      f"1..{count}")
    return top_k


def layer_count(path: Path, ints: dict[str, int], n_blocks: int) -> int:
    """The model's layer count: those the tensors name, which ``num_hidden_layers`` must
    equal (dense layers have tensors too), or exceed by DeepSeek's
    ``num_nextn_predict_layers`` when the checkpoint holds those."""
    n_layers = ints.get("num_hidden_layers")
    if n_layers is None:
        return n_blocks
    extra = ints.get("num_nextn_predict_layers", 0)
    if n_blocks not in (n_layers, n_layers + extra):
        plus = f" (and {short(extra, 20)} multi-token prediction)" if extra else ""
        raise ExpertLayoutError(path, f"config.json says {short(n_layers, 20)} layers{plus}, "
                                      f"but the tensors name layers 0..{n_blocks - 1}")
    return n_blocks
