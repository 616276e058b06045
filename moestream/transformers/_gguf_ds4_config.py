"""ds4's ``deepseek4.*`` GGUF metadata as transformers' ``DeepseekV4Config``.

For a file whose ``general.architecture`` is ``deepseek4`` (transformers maps no model from
it), the GGUF loader takes ``ds4_config`` in place of transformers' GGUF config;
``config_kwargs`` gives its arguments and ``metadata_values`` the file's keys as Python values.
The tensors' names and values are ``_gguf_ds4``'s.

The metadata keys, their types and the fixed choices (sqrt-softplus scores, YaRN on the
compressed layers only and without its magnitude factor, layers 0-1 sliding then ratio 4
and 128 alternating) are ds4's: ``ds4.c`` ``config_validate_model``, ``weights_bind``,
``layer_router_probs_one``, ``rope_tail_layer_inplace`` (github.com/antirez/ds4 at commit
8d576642c39b9a2d782a80159ba84ef5a81c0b81); the config fields are transformers 5.25's
``configuration_deepseek_v4.py``.

Refused, each in one line: a key ds4 requires missing; a shape transformers' model cannot
hold (more than one KV head, value and key widths that differ, more or fewer than one
shared expert, expert groups, per-layer SwiGLU clamps that differ, a compression ratio
other than 0, 4 or 128). Not read: ``deepseek4.nextn_predict_layers`` and
``expert_gating_func`` (ds4 reads neither; its scores are sqrt-softplus whatever a key says)
and the tokenizer (transformers builds none for ``deepseek4``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader

from moestream.pipeline.foundation.errors import ExpertLayoutError, ModelFileError

__all__ = ["ARCHITECTURE", "config_kwargs", "ds4_config", "metadata_values"]

ARCHITECTURE = "deepseek4"
_A = ARCHITECTURE + "."
_RATIO_TYPES = {0: "sliding_attention", 4: "compressed_sparse_attention",
                128: "heavily_compressed_attention"}
"""A layer's compression ratio (ds4's ``attention.compress_ratios``) -> its attention kind."""


def metadata_values(reader: GGUFReader) -> dict[str, Any]:
    """Every metadata key of ``reader`` with its Python value (gguf's ``contents``)."""
    return {name: field.contents() for name, field in reader.fields.items()}


def _decimal(value: Any) -> float:
    """A FLOAT32 key's value as the decimal a converter wrote from ``config.json`` (the
    shortest one that rounds to the same float32: ``1e-06``, not ``9.99999997e-07``)."""
    return float(str(np.float32(value)))


def _required(path: Path, metadata: Mapping[str, Any], key: str) -> Any:
    if _A + key not in metadata:
        raise ExpertLayoutError(path, f"ds4 GGUF without the metadata key {_A}{key}")
    return metadata[_A + key]


def _one_of(path: Path, key: str, values: Iterable[Any]) -> Any:
    """The value every entry of a per-layer array has (transformers takes one)."""
    distinct = set(values)
    if len(distinct) != 1:
        raise ExpertLayoutError(path, f"{_A}{key} differs between layers ({sorted(distinct)}); "
                                      f"transformers' DeepSeek-V4 takes one value")
    return distinct.pop()


def _check_shape(path: Path, metadata: Mapping[str, Any]) -> None:
    """Refuse the shapes transformers' DeepSeek-V4 cannot hold."""
    need = {"attention.head_count_kv": 1, "expert_shared_count": 1}
    for key, value in need.items():
        if _required(path, metadata, key) != value:
            raise ExpertLayoutError(path, f"{_A}{key} is {metadata[_A + key]}; transformers' "
                                          f"DeepSeek-V4 has exactly {value}")
    if _required(path, metadata, "attention.value_length") != _required(
            path, metadata, "attention.key_length"):
        raise ExpertLayoutError(path, "value and key widths differ; transformers' DeepSeek-V4 "
                                      "has one head_dim")
    for key in ("expert_group_count", "expert_group_used_count"):
        if metadata.get(_A + key, 0):
            raise ExpertLayoutError(path, f"{_A}{key} is {metadata[_A + key]}: grouped expert "
                                          f"routing, which DeepSeek-V4 does not have")


def config_kwargs(path: Path, metadata: Mapping[str, Any]) -> dict[str, Any]:
    """``DeepseekV4Config`` arguments from ds4's ``deepseek4.*`` metadata.

    Raises:
        ExpertLayoutError: not a ds4 file, a key ds4 requires missing, or a shape
            transformers' DeepSeek-V4 cannot hold (the message says which).
    """
    if metadata.get("general.architecture") != ARCHITECTURE:
        raise ExpertLayoutError(path, f"general.architecture is "
                                      f"{metadata.get('general.architecture')!r}, not "
                                      f"{ARCHITECTURE!r}")
    _check_shape(path, metadata)

    def get(key: str) -> Any:
        return _required(path, metadata, key)

    head_dim = int(get("attention.key_length"))
    kwargs: dict[str, Any] = {
        "vocab_size": int(get("vocab_size")),
        "hidden_size": int(get("embedding_length")),
        "num_attention_heads": int(get("attention.head_count")),
        "num_key_value_heads": 1,
        "head_dim": head_dim,
        "partial_rotary_factor": int(get("rope.dimension_count")) / head_dim,
        "q_lora_rank": int(get("attention.q_lora_rank")),
        "o_lora_rank": int(get("attention.output_lora_rank")),
        "o_groups": int(get("attention.output_group_count")),
        "n_routed_experts": int(get("expert_count")),
        "num_experts_per_tok": int(get("expert_used_count")),
        "n_shared_experts": 1,
        "moe_intermediate_size": int(get("expert_feed_forward_length")),
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
        "sliding_window": int(get("attention.sliding_window")),
        "index_n_heads": int(get("attention.indexer.head_count")),
        "index_head_dim": int(get("attention.indexer.key_length")),
        "index_topk": int(get("attention.indexer.top_k")),
        "hc_mult": int(get("hyper_connection.count")),
        "hc_sinkhorn_iters": int(get("hyper_connection.sinkhorn_iterations")),
        "hc_eps": _decimal(get("hyper_connection.epsilon")),
        "rms_norm_eps": _decimal(get("attention.layer_norm_rms_epsilon")),
        "scoring_func": "sqrtsoftplus",  # ds4.c layer_router_probs_one; no key says it
        "routed_scaling_factor": _decimal(get("expert_weights_scale")),
        "norm_topk_prob": bool(get("expert_weights_norm")),
        "num_nextn_predict_layers": 0,
        "tie_word_embeddings": False,
        "rope_parameters": _rope(path, metadata, head_dim),
        **_per_layer(path, metadata),
    }
    if _A + "context_length" in metadata:
        kwargs["max_position_embeddings"] = int(metadata[_A + "context_length"])
    for key in ("bos_token_id", "eos_token_id"):
        if f"tokenizer.ggml.{key}" in metadata:
            kwargs[key] = int(metadata[f"tokenizer.ggml.{key}"])
    return kwargs


def _per_layer(path: Path, metadata: Mapping[str, Any]) -> dict[str, Any]:
    """The layer count and what ds4 says per layer: attention kind (its compression
    ratio), hash or top-k routing, the SwiGLU clamp (one value in transformers)."""
    n_layers = int(_required(path, metadata, "block_count"))
    ratios = [int(r) for r in _required(path, metadata, "attention.compress_ratios")]
    ratios = ratios[:n_layers]
    if len(ratios) != n_layers or not set(ratios) <= set(_RATIO_TYPES):
        raise ExpertLayoutError(path, f"{_A}attention.compress_ratios {ratios[:8]} is not one "
                                      f"of 0, 4, 128 for each of {n_layers} layers")
    clamps = _required(path, metadata, "swiglu_clamp_exp")[:n_layers]
    clamp = _decimal(_one_of(path, "swiglu_clamp_exp", clamps))
    if clamp <= 0:
        raise ExpertLayoutError(path, f"{_A}swiglu_clamp_exp {clamp}: no clamp, which "
                                      f"transformers' DeepSeek-V4 always applies")
    n_hash = min(int(_required(path, metadata, "hash_layer_count")), n_layers)
    return {"num_hidden_layers": n_layers,
            "layer_types": [_RATIO_TYPES[r] for r in ratios],
            "mlp_layer_types": ["hash_moe"] * n_hash + ["moe"] * (n_layers - n_hash),
            "swiglu_limit": clamp}


def _rope(path: Path, metadata: Mapping[str, Any], head_dim: int) -> dict[str, Any]:
    """Plain RoPE on sliding layers, YaRN without magnitude scaling on compressed ones (as
    ds4's ``rope_tail_layer_inplace`` and transformers' config both do)."""

    def get(key: str) -> Any:
        return _required(path, metadata, key)

    rotary = int(get("rope.dimension_count")) / head_dim
    main = {"rope_type": "default", "rope_theta": _decimal(get("rope.freq_base")),
            "partial_rotary_factor": rotary}
    compress: dict[str, Any] = {"rope_type": "default",
                                "rope_theta": _decimal(get("attention.compress_rope_freq_base")),
                                "partial_rotary_factor": rotary}
    factor = _decimal(get("rope.scaling.factor"))
    if factor > 1:  # ds4: ext_factor 1 on compressed layers only when the factor exceeds 1
        compress.update(rope_type="yarn", factor=factor, attention_factor=1.0,
                        original_max_position_embeddings=int(
                            get("rope.scaling.original_context_length")),
                        beta_fast=_decimal(get("rope.scaling.yarn_beta_fast")),
                        beta_slow=_decimal(get("rope.scaling.yarn_beta_slow")))
    return {"main": main, "compress": compress}


def ds4_config(path: Path, reader: GGUFReader) -> Any:
    """transformers' ``DeepseekV4Config`` of the ds4 file ``reader`` reads.

    Raises:
        ExpertLayoutError: as :func:`config_kwargs`.
        ModelFileError: a transformers without DeepSeek-V4, or one that refuses the values.
    """
    import transformers  # type: ignore[import-not-found, unused-ignore]

    config_class = getattr(transformers, "DeepseekV4Config", None)
    if config_class is None:
        raise ModelFileError(path, f"transformers {transformers.__version__} has no "
                                   f"DeepSeek-V4 (DeepseekV4Config) to build ds4's model with")
    kwargs = config_kwargs(path, metadata_values(reader))
    try:
        return config_class(**kwargs)
    except (ValueError, TypeError) as exc:
        raise ModelFileError(path, f"DeepseekV4Config refuses the file's metadata: "
                                   f"{str(exc).splitlines()[0][:200]}") from exc
