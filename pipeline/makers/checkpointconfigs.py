"""The ``config.json`` of each checkpoint layout (``moestream.pipeline.makers.checkpointlayouts``).

Kept apart from the tensors: a config is what transformers reads to build the model, key
for key as the real checkpoints ship it, while the layouts say which bytes go where; the
attention shapes below are the two sides' one meeting point.
"""

from __future__ import annotations

from moestream.pipeline.makers.modelspec import ModelSpec

__all__ = [
    "OSS_HEADS", "OSS_HEAD_DIM", "OSS_KV_HEADS", "QWEN_HEADS", "QWEN_HEAD_DIM", "QWEN_KV_HEADS",
    "V4_BLOCK", "V4_HC", "V4_HEADS", "V4_HEAD_DIM", "V4_O_GROUPS", "V4_O_LORA", "V4_Q_LORA",
    "deepseek_v4_config", "gpt_oss_config", "qwen3_config",
]

# attention reduced to a few heads (query heads, key/value heads, head size): what the
# checkpoints are for is their experts
QWEN_HEADS, QWEN_KV_HEADS, QWEN_HEAD_DIM = 4, 2, 128
OSS_HEADS, OSS_KV_HEADS, OSS_HEAD_DIM = 4, 2, 64
V4_HEADS, V4_HEAD_DIM, V4_Q_LORA, V4_O_GROUPS, V4_O_LORA, V4_HC = 4, 128, 128, 2, 128, 4
V4_BLOCK = (128, 128)


def qwen3_config(spec: ModelSpec, torch_dtype: str) -> dict[str, object]:
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": spec.hidden,
        "intermediate_size": spec.dense_ffn,
        "moe_intermediate_size": spec.expert_ffn,
        "num_experts": spec.n_experts,
        "num_experts_per_tok": spec.top_k,
        "num_hidden_layers": spec.n_layers,
        "vocab_size": spec.vocab,
        "num_attention_heads": QWEN_HEADS,
        "num_key_value_heads": QWEN_KV_HEADS,
        "head_dim": QWEN_HEAD_DIM,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "attention_bias": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "tie_word_embeddings": False,
        "torch_dtype": torch_dtype,
        "dtype": torch_dtype,
    }

def gpt_oss_config(spec: ModelSpec, torch_dtype: str) -> dict[str, object]:
    return {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "hidden_size": spec.hidden,
        "intermediate_size": spec.expert_ffn,
        "num_local_experts": spec.n_experts,
        "num_experts_per_tok": spec.top_k,
        "experts_per_token": spec.top_k,
        "num_hidden_layers": spec.n_layers,
        "vocab_size": spec.vocab,
        "num_attention_heads": OSS_HEADS,
        "num_key_value_heads": OSS_KV_HEADS,
        "head_dim": OSS_HEAD_DIM,
        "hidden_act": "silu",
        "attention_bias": True,
        "sliding_window": 128,
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention"
                        for i in range(spec.n_layers)],
        "max_position_embeddings": 131072,
        "initial_context_length": 4096,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                            "beta_slow": 1.0, "truncate": False,
                            "original_max_position_embeddings": 4096,
                            "rope_theta": 150000.0},
        "swiglu_limit": 7.0,
        "router_aux_loss_coef": 0.9,
        "output_router_logits": False,
        "tie_word_embeddings": False,
        "use_cache": True,
        "torch_dtype": torch_dtype,
        "dtype": torch_dtype,
        "quantization_config": {
            "quant_method": "mxfp4",
            "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                       "model.embed_tokens", "lm_head"],
        },
    }

def deepseek_v4_config(spec: ModelSpec, torch_dtype: str) -> dict[str, object]:
    hashed = min(spec.hash_routed, spec.n_layers)
    return {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "hidden_size": spec.hidden,
        "moe_intermediate_size": spec.expert_ffn,
        "n_routed_experts": spec.n_experts,
        "n_shared_experts": 1,
        "num_experts_per_tok": spec.top_k,
        "num_hidden_layers": spec.n_layers,
        "num_nextn_predict_layers": 0,
        "vocab_size": spec.vocab,
        "num_attention_heads": V4_HEADS,
        "num_key_value_heads": 1,
        "head_dim": V4_HEAD_DIM,
        "q_lora_rank": V4_Q_LORA,
        "o_groups": V4_O_GROUPS,
        "o_lora_rank": V4_O_LORA,
        "partial_rotary_factor": 0.5,
        "layer_types": ["sliding_attention"] * spec.n_layers,
        "mlp_layer_types": ["hash_moe"] * hashed + ["moe"] * (spec.n_layers - hashed),
        "sliding_window": 128,
        "hc_mult": V4_HC,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "scoring_func": "sqrtsoftplus",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "swiglu_limit": 10.0,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "tie_word_embeddings": False,
        "torch_dtype": torch_dtype,
        "dtype": torch_dtype,
        "expert_dtype": "fp4",
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                "weight_block_size": list(V4_BLOCK)},
    }
