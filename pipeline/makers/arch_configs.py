"""Tiny configs of the MoE model types (``python -m bench.archs`` sweeps them, the swap
tests build a few): which model types, and the sizes that make each a small random model
of 4 layers, hidden 64, 8 experts, top-2.

``SIZES`` names every attribute a config may use for a size; ``_rules`` follows from a
kind's default config (per-layer lists, MLA's heads, expert groups, token ids);
``FIXES`` is what a kind needs besides them.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["FIXES", "KINDS", "LAYERS", "MODEL_TYPES", "SIZES", "ZERO_INIT", "overrides"]

KINDS = (
    "afmoe", "aria", "axk1", "axk2", "bailing_hybrid", "beam", "cohere2_moe", "dbrx",
    "deepseek_ocr2", "deepseek_v2", "deepseek_v3", "deepseek_v32", "deepseek_v4",
    "diffusion_gemma", "doge", "dots1", "dots3_note", "ergo", "ernie4_5_moe", "ernie4_5_vl_moe",
    "exaone_moe", "flex_olmo", "flint", "gemma4", "glm4_moe", "glm4_moe_lite", "glm4v_moe",
    "glm5_next", "glm_moe_dsa", "gpt_oss", "granitemoe", "granitemoe_swa", "granitemoehybrid",
    "granitemoeshared", "hunyuan_v1_moe", "hy_v3", "hy_v4", "hy_v4_vl", "inkling", "inkling2",
    "inkling2_loop", "jamba", "jetmoe", "kimi_linear", "kolibri1", "kolibri1_1", "laguna",
    "lara_mini", "lfm2_moe", "llama4", "longcat_flash", "mellum", "mimo_v2_flash",
    "minicpm5_moe", "minimax", "minimax_m2", "minimax_m3_vl", "mistral4", "mistral_large4",
    "mixtral", "muse_spark", "nemotron_h", "nllb-moe", "olmoe", "openai_privacy_filter",
    "phimoe", "qwen2_moe", "qwen3_5_moe", "qwen3_moe", "qwen3_next", "qwen3_omni_moe",
    "qwen3_vl_moe", "qwen4_exp", "solar_open", "step3p7", "switch_transformers",
    "unlimited_ocr", "zaya",
)
"""The MoE model types swept by default (those the installed transformers knows): every
type of transformers 5.25 whose modeling routes tokens to experts, those without a causal
LM (vision-language, encoder-decoder, classifiers) included, so that each says why."""

LAYERS = 4
MODEL_TYPES = {
    "aria": "aria_text", "deepseek_ocr2": "deepseek_ocr2_text",
    "diffusion_gemma": "diffusion_gemma_text", "dots3_note": "dots3_note_text",
    "ernie4_5_vl_moe": "ernie4_5_vl_moe_text", "gemma4": "gemma4_text",
    "glm4v_moe": "glm4v_moe_text", "glm5_next": "glm5_next_text", "hy_v4_vl": "hy_v4_vl_text",
    "inkling": "inkling_text", "inkling2": "inkling2_text",
    "inkling2_loop": "inkling2_loop_text", "llama4": "llama4_text",
    "minimax_m3_vl": "minimax_m3_vl_text", "mistral_large4": "mistral_large4_text",
    "muse_spark": "muse_spark_text", "qwen3_5_moe": "qwen3_5_moe_text",
    "qwen3_omni_moe": "qwen3_omni_moe_text", "qwen3_vl_moe": "qwen3_vl_moe_text",
    "qwen4_exp": "qwen4_exp_text", "unlimited_ocr": "unlimited_ocr_text",
}
"""Kinds whose language model is built from another config: a multimodal model's text part
(Qwen3.5-MoE, Llama 4, Gemma 4, Aria...)."""

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
    "doge": {"is_moe": True},  # its routed experts are off by default
    "dots1": {"n_shared_experts": 1},
    "ernie4_5_moe": {"moe_num_shared_experts": 1},
    # the text and the vision experts' FFN sizes
    "ernie4_5_vl_moe": {"moe_num_shared_experts": 1, "moe_intermediate_size": [32, 32]},
    "flex_olmo": _SMALL_EXPERTS,
    "gemma4": {"enable_moe_block": True, "top_k_experts": 2},  # the MoE block beside the MLP
    # DSA attention takes no rope dimension
    "glm5_next": {"qk_rope_head_dim": 0},
    "gpt_oss": {**_SMALL_EXPERTS, "swiglu_limit": 0.001},  # a clamp that binds
    "granitemoe": _SMALL_EXPERTS,
    "granitemoehybrid": {"layer_types": ["linear_attention", "attention"] * (LAYERS // 2)},
    "granitemoeshared": {**_SMALL_EXPERTS, "shared_intermediate_size": 48},
    "hy_v4_vl": {"rope_parameters": {"rope_type": "default", "mrope_section": [2, 1, 1]}},
    "inkling2": {"unpadded_vocab_size": 96},
    "inkling2_loop": {"unpadded_vocab_size": 96},
    "jamba": {**_SMALL_EXPERTS, "attn_layer_period": 2, "attn_layer_offset": 1,
              "expert_layer_period": 2, "expert_layer_offset": 1},
    # its first layers are all linear attention: mix in full attention
    "kimi_linear": {"num_expert_group": 1, "topk_group": 1,
                    "layer_types": ["linear_attention", "full_attention"] * (LAYERS // 2)},
    # an indexed-attention last layer whose index heads fit one key head's query heads
    "kolibri1_1": {"index_num_heads": 2, "index_layers": [LAYERS - 1],
                   "layer_types": ["sliding_attention"] * (LAYERS - 1) + ["indexed_attention"]},
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
    # its indexed-attention layers need the token indexer's sizes (unset by default)
    "qwen4_exp": {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16,
                  "indexer_budget": 16, "indexer_compress_ratio": 4},
    "zaya": {"num_experts_per_tok": 1},  # the only top-k it takes
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
