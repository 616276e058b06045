"""DeepSeek V4 Flash as ds4 runs it: ds4's GGUF mapped onto transformers' DeepSeek-V4.

What it gives the GGUF loader, for a file whose ``general.architecture`` is ``deepseek4``
(transformers maps no model from it): ``ds4_config`` (the ``deepseek4.*`` metadata as a
``DeepseekV4Config``; ``config_kwargs`` its arguments), in place of transformers' GGUF
config, and ``ds4_dense_tensors`` (every non-routed tensor as the model holds it, under the
model's name), in place of transformers' tensor processor; ``Ds4Names`` says where each
tensor goes, routed experts included (``gate_up_proj`` stacks gate rows then up rows, as
the loader's GGUF experts fill it). Each refuses in one line what does not map.

How the names map, in two public steps and no guess:

1. ds4's GGUF name -> DeepSeek's checkpoint name, by ds4's own converter table
   (``gguf-tools/deepseek4-quantize.c``, ``top_map`` / ``layer_map``; github.com/antirez/ds4
   at commit 8d576642c39b9a2d782a80159ba84ef5a81c0b81). The converter copies each tensor
   with its shape reversed into ggml's ``ne`` order and nothing permuted
   (``check_reversed_shape``), so numpy's view of a GGUF tensor is DeepSeek's tensor as
   it was (dequantized); ``tid2eid`` is stored I32 where DeepSeek's is I64.
2. DeepSeek's name -> the model's, by transformers' own conversion mapping for
   ``deepseek_v4`` (the renamings, and the converter that stacks ``experts.*.w1`` and
   ``w3`` into ``gate_up_proj`` in that order, ``w2`` into ``down_proj``), asked through
   the model as its loading asks (``_renaming.renamer``).

The metadata keys, their types and the fixed choices (sqrt-softplus scores, YaRN on the
compressed layers only and without its magnitude factor, layers 0-1 sliding then ratio 4
and 128 alternating) are ds4's: ``ds4.c`` ``config_validate_model``, ``weights_bind``,
``layer_router_probs_one``, ``rope_tail_layer_inplace`` at the same commit; the config
fields are transformers 5.25's ``configuration_deepseek_v4.py``.

Refused, each in one line: a key ds4 requires missing; a shape transformers' model cannot
hold (more than one KV head, value and key widths that differ, more or fewer than one
shared expert, expert groups, per-layer SwiGLU clamps that differ, a compression ratio
other than 0, 4 or 128); multi-token-prediction blocks inside the main file (llama.cpp's
``blk.N.nextn.*``: ds4 ships them as a separate file, and transformers builds none); a
tensor ds4's layout does not have, or one it requires missing (the selection bias
``exp_probs_b``, optional to ds4, included: DeepSeek's checkpoint has it on every top-k
layer). DeepSeek's own ``mtp.*`` tensors are skipped, as transformers skips them. Not
read: ``deepseek4.nextn_predict_layers`` and ``expert_gating_func`` (ds4 reads neither; its
scores are sqrt-softplus whatever a key says) and the tokenizer (transformers builds none
for ``deepseek4``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch  # type: ignore[import-not-found, unused-ignore]
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize as gguf_dequantize

import moestream
from moestream.pipeline.foundation.errors import ExpertLayoutError, ModelFileError
from moestream.transformers._renaming import renamer

__all__ = ["ARCHITECTURE", "Ds4Names", "Target", "config_kwargs", "ds4_config",
           "ds4_dense_tensors", "metadata_values"]

ARCHITECTURE = "deepseek4"
_A = ARCHITECTURE + "."

# ds4's converter (deepseek4-quantize.c): GGUF name -> DeepSeek's checkpoint name.
_TOP = {
    "token_embd.weight": "embed.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "head.weight",
    "output_hc_base.weight": "hc_head_base",
    "output_hc_fn.weight": "hc_head_fn",
    "output_hc_scale.weight": "hc_head_scale",
}
_LAYER = {
    "hc_attn_base.weight": "hc_attn_base",
    "hc_attn_fn.weight": "hc_attn_fn",
    "hc_attn_scale.weight": "hc_attn_scale",
    "hc_ffn_base.weight": "hc_ffn_base",
    "hc_ffn_fn.weight": "hc_ffn_fn",
    "hc_ffn_scale.weight": "hc_ffn_scale",
    "attn_sinks.weight": "attn.attn_sink",
    "attn_q_a.weight": "attn.wq_a.weight",
    "attn_q_b.weight": "attn.wq_b.weight",
    "attn_q_a_norm.weight": "attn.q_norm.weight",
    "attn_kv.weight": "attn.wkv.weight",
    "attn_kv_a_norm.weight": "attn.kv_norm.weight",
    "attn_output_a.weight": "attn.wo_a.weight",
    "attn_output_b.weight": "attn.wo_b.weight",
    "attn_compressor_ape.weight": "attn.compressor.ape",
    "attn_compressor_kv.weight": "attn.compressor.wkv.weight",
    "attn_compressor_gate.weight": "attn.compressor.wgate.weight",
    "attn_compressor_norm.weight": "attn.compressor.norm.weight",
    "indexer.attn_q_b.weight": "attn.indexer.wq_b.weight",
    "indexer.proj.weight": "attn.indexer.weights_proj.weight",
    "indexer_compressor_ape.weight": "attn.indexer.compressor.ape",
    "indexer_compressor_kv.weight": "attn.indexer.compressor.wkv.weight",
    "indexer_compressor_gate.weight": "attn.indexer.compressor.wgate.weight",
    "indexer_compressor_norm.weight": "attn.indexer.compressor.norm.weight",
    "attn_norm.weight": "attn_norm.weight",
    "ffn_norm.weight": "ffn_norm.weight",
    "ffn_gate_shexp.weight": "ffn.shared_experts.w1.weight",
    "ffn_up_shexp.weight": "ffn.shared_experts.w3.weight",
    "ffn_down_shexp.weight": "ffn.shared_experts.w2.weight",
    "ffn_gate_inp.weight": "ffn.gate.weight",
    "exp_probs_b.bias": "ffn.gate.bias",
    "ffn_gate_tid2eid.weight": "ffn.gate.tid2eid",
}
# The routed experts, as DeepSeek names one expert's matrices (the converter reads
# ``layers.L.ffn.experts.E.{w1,w2,w3}``); moestream's fused form holds gate rows then up.
_EXPERT_PARTS = {"gate": ("w1",), "up": ("w3",), "down": ("w2",), "gate_up": ("w1", "w3")}
_EXPERTS = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down|gate_up)_exps\.weight$")
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")
_RATIO_TYPES = {0: "sliding_attention", 4: "compressed_sparse_attention",
                128: "heavily_compressed_attention"}
_ALWAYS = ("hc_attn_base.weight", "hc_attn_fn.weight", "hc_attn_scale.weight",
           "hc_ffn_base.weight", "hc_ffn_fn.weight", "hc_ffn_scale.weight", "attn_sinks.weight",
           "attn_q_a.weight", "attn_q_b.weight", "attn_q_a_norm.weight", "attn_kv.weight",
           "attn_kv_a_norm.weight", "attn_output_a.weight", "attn_output_b.weight",
           "attn_norm.weight", "ffn_norm.weight", "ffn_gate_shexp.weight",
           "ffn_up_shexp.weight", "ffn_down_shexp.weight", "ffn_gate_inp.weight")
_COMPRESSOR = tuple(f"attn_compressor_{n}.weight" for n in ("ape", "kv", "gate", "norm"))
_INDEXER = ("indexer.attn_q_b.weight", "indexer.proj.weight",
            *(f"indexer_compressor_{n}.weight" for n in ("ape", "kv", "gate", "norm")))


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


@dataclass(frozen=True)
class Target:
    """Where one GGUF tensor goes in the model.

    Attributes:
        name: the model's parameter or buffer (``model.layers.3.mlp.experts.gate_up_proj``).
        slot: for a routed-expert part, which of the parameter's stacked parts along its
            rows it is (``gate_up_proj``: gate 0, up 1; a fused GGUF tensor fills both from
            slot 0); 0 otherwise.
        experts: whether it is a routed-expert tensor (the loader streams these).
        integer: whether the model keeps it as int64 (``tid2eid``; the file has I32).
    """

    name: str
    slot: int = 0
    experts: bool = False
    integer: bool = False


class Ds4Names:
    """ds4's GGUF tensor names -> the model's, through DeepSeek's checkpoint names.

    Args:
        model: the ``DeepseekV4ForCausalLM`` being loaded (on the meta device is enough):
            transformers' renamings are asked through it.
        path: the file, for the messages.
    """

    def __init__(self, model: Any, path: Path) -> None:
        self._rename = renamer(model)
        self._path = path
        self._state = set(model.state_dict())
        self._config = model.config

    def target(self, name: str) -> Target | None:
        """Where GGUF tensor ``name`` goes; None for the MTP layers transformers skips.

        Raises:
            ExpertLayoutError: a name ds4's layout does not have, or one the model has no
                place for (a selection bias on a hash-routed layer).
        """
        if name.startswith("mtp."):
            return None  # transformers ignores DeepSeek's mtp.* (its unexpected-keys list)
        expert = _EXPERTS.match(name)
        if expert is not None:
            layer, part = int(expert.group(1)), expert.group(2)
            source = f"layers.{layer}.ffn.experts.0.{_EXPERT_PARTS[part][0]}.weight"
            target, converter = self._rename(source)
            slot = 0
            if converter is not None:
                slot = list(converter[0].source_patterns).index(converter[1])
            return self._known(name, Target(target, slot, experts=True))
        return self._known(name, Target(self._rename(_checkpoint_name(self._path, name))[0],
                                        integer=name.endswith("ffn_gate_tid2eid.weight")))

    def _known(self, name: str, target: Target) -> Target:
        if target.name not in self._state:
            raise ExpertLayoutError(self._path, f"{name} ({target.name}) has no place in "
                                                f"transformers' DeepSeek-V4 of this config")
        return target

    def check(self, names: Iterable[str], moe_layers: Iterable[int]) -> dict[str, Target]:
        """Every non-routed tensor of the file mapped, checked against ds4's per-layer
        layout, and every layer an MoE layer (``moe_layers``: those whose routed experts
        the file has, as the expert table found them).

        Raises:
            ExpertLayoutError: a tensor ds4 requires missing, or one it does not have.
        """
        names = list(names)
        present = set(names)
        lacking = sorted(set(range(self._config.num_hidden_layers)) - set(moe_layers))
        if lacking:
            raise ExpertLayoutError(self._path, f"ds4 GGUF without routed experts in layer "
                                                f"{lacking[0]} (every DeepSeek V4 layer has them)")
        missing = [n for n in _expected(self._config) if n not in present]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise ExpertLayoutError(self._path, f"ds4 GGUF without {missing[0]}{more}")
        return {n: t for n in names if (t := self.target(n)) is not None}


def _checkpoint_name(path: Path, name: str) -> str:
    """DeepSeek's checkpoint name of GGUF tensor ``name`` (ds4's converter table)."""
    if name in _TOP:
        return _TOP[name]
    if ".nextn." in name:
        raise ExpertLayoutError(path, f"{name}: a multi-token-prediction layer inside the "
                                      f"model file (llama.cpp's form; ds4 ships them as a "
                                      f"separate file, and transformers builds none)")
    block = _BLOCK.match(name)
    if block is None or block.group(2) not in _LAYER:
        raise ExpertLayoutError(path, f"tensor {name} is not in ds4's DeepSeek V4 layout")
    return f"layers.{block.group(1)}.{_LAYER[block.group(2)]}"


def _expected(config: Any) -> list[str]:
    """The non-routed tensors ds4 requires of a file of ``config`` (``weights_bind``)."""
    names = list(_TOP)
    for layer in range(config.num_hidden_layers):
        kind = config.layer_types[layer]
        hashed = config.mlp_layer_types[layer] == "hash_moe"
        parts = list(_ALWAYS)
        if kind != "sliding_attention":
            parts += _COMPRESSOR
        if kind == "compressed_sparse_attention":
            parts += _INDEXER
        parts.append("ffn_gate_tid2eid.weight" if hashed else "exp_probs_b.bias")
        names += [f"blk.{layer}.{part}" for part in parts]
    return names


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


def ds4_dense_tensors(model: Any, session: moestream.SyncSession) -> Iterator[
        tuple[str, str, Any]]:
    """Each non-routed tensor of a ds4 file as the model holds it: (file name, model name,
    CPU tensor), read through the session, float tensors dequantized by gguf-py to float32,
    ``tid2eid`` as int64; the layout checked first (:meth:`Ds4Names.check`).

    Raises:
        ExpertLayoutError: a tensor ds4's layout does not have, or one it requires missing.
        ModelFileError: a tensor gguf cannot dequantize.
    """
    path = session.model.path
    names = Ds4Names(model, path)
    dense = session.model.tensors
    targets = names.check(dense, session.model.moe_layers)
    for spec in dense.values():
        target = targets.get(spec.name)
        if target is None:
            continue  # the MTP layers transformers builds none of
        yield spec.name, target.name, _tensor(path, spec, session.read_tensor(spec.name),
                                              target.integer)


def _tensor(path: Path, spec: moestream.TensorSpec, data: bytearray, integer: bool) -> Any:
    """A tensor's bytes as the model's values: int64 ids, else gguf-py's float32."""
    raw = np.frombuffer(data, dtype=np.uint8)
    if integer:
        if spec.dtype != "I32":
            raise ExpertLayoutError(path, f"{spec.name} is {spec.dtype}, ds4 stores it I32")
        return torch.from_numpy(raw.view("<i4").astype(np.int64).reshape(spec.shape))
    try:
        kind = GGMLQuantizationType[spec.dtype]
        values = gguf_dequantize(raw.reshape(*spec.shape[:-1], -1), kind)
        return torch.from_numpy(np.asarray(values, dtype=np.float32).reshape(spec.shape))
    except (KeyError, ValueError, NotImplementedError) as exc:
        raise ModelFileError(path, f"{spec.name[:120]}: a {spec.dtype[:20]} tensor gguf cannot "
                                   f"dequantize ({str(exc)[:120]})") from exc
