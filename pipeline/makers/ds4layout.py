"""ds4's DeepSeek V4 Flash layout: every tensor and metadata key ds4 loads, for a spec.

Why: the ds4 presets must be files the code that reads ds4's real GGUF reads unchanged
(the expert table, the transformers mapping in ``moestream.transformers._gguf_ds4``), so
they carry the real names, types, shapes and keys, not a DeepSeek-2-shaped stand-in.

Source: ds4 (github.com/antirez/ds4, read at commit 8d576642c39b9a2d782a80159ba84ef5a81c0b81),
``ds4.c``: ``config_validate_model`` (the ``deepseek4.*`` keys and the types it reads them
as), ``weights_bind`` and ``weights_validate_layout`` (tensor names, ggml types, shapes),
``ds4_layer_compress_ratio`` (layers 0-1 sliding, then ratio 4 on even layers, 128 on odd
ones). Shapes here are numpy order (outermost first), ds4's ``ne`` reversed. What ds4 does
not read (a tokenizer, ``general.name``, llama.cpp's extra keys) is not written: a generated
file carries no tokenizer.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from gguf import GGMLQuantizationType as QType
from gguf import GGUFValueType, GGUFWriter

from moestream.pipeline.makers.modelspec import DS4_ARCH, Ds4Shape, ModelSpec

__all__ = ["Ds4Tensor", "compress_ratio", "ds4_metadata", "ds4_tensors"]

# ds4.c's fixed scalars (DS4_* defines); a scaled-down file keeps them.
_CONTEXT = 1048576
_ROPE_BASE = 10000.0
_COMPRESS_ROPE_BASE = 160000.0
_ROPE_FACTOR = 16.0
_ROPE_ORIGINAL_CONTEXT = 65536
_YARN_BETA_FAST = 32.0
_YARN_BETA_SLOW = 1.0
_EXPERT_WEIGHTS_SCALE = 1.5
_RMS_EPS = 1e-6
_HC_EPS = 1e-6
_HC_SINKHORN_ITERATIONS = 20
_SWIGLU_CLAMP = 10.0
_INDEXED_RATIO = 4  # compressed layers with a lightning indexer
_HEAVY_RATIO = 128


@dataclass(frozen=True)
class Ds4Tensor:
    """One tensor of the file: name, numpy-order shape, ggml type and how to fill it.

    ``fill`` is ``bits`` (random valid bytes of ``qtype``), ``ones`` (F32 norms),
    ``normal`` (small F32 values), ``expert_ids`` (I32 ``tid2eid``: each row ``top_k``
    distinct expert ids) or ``experts`` (routed experts of ``layer``: ``matrices`` names
    which of gate 0, up 1, down 2 the tensor holds, per expert in that order).
    """

    name: str
    shape: tuple[int, ...]
    qtype: QType
    fill: str = "bits"
    layer: int = -1
    matrices: tuple[int, ...] = ()


def compress_ratio(layer: int) -> int:
    """ds4's attention compression of ``layer``: 0 (sliding window only), 4 or 128."""
    if layer < 2:
        return 0
    return _INDEXED_RATIO if layer % 2 == 0 else _HEAVY_RATIO


def ds4_tensors(spec: ModelSpec) -> Iterator[Ds4Tensor]:
    """Every tensor of ``spec`` in ds4's layout, in file order."""
    shape = _shape(spec)
    yield Ds4Tensor("token_embd.weight", (spec.vocab, spec.hidden), QType.F16)
    for layer in range(spec.n_layers):
        yield from _attention(spec, shape, layer)
        yield from _ffn(spec, shape, layer)
    h, hc = spec.hidden, shape.hc
    yield Ds4Tensor("output_hc_base.weight", (hc,), QType.F32, "normal")
    yield Ds4Tensor("output_hc_fn.weight", (hc, hc * h), QType.F16)
    yield Ds4Tensor("output_hc_scale.weight", (1,), QType.F32, "normal")
    yield Ds4Tensor("output_norm.weight", (h,), QType.F32, "ones")
    yield Ds4Tensor("output.weight", (spec.vocab, h), QType.Q8_0)


def _shape(spec: ModelSpec) -> Ds4Shape:
    if spec.ds4 is None or spec.arch != DS4_ARCH:
        raise ValueError(f"{spec.preset} is not a ds4 spec")
    return spec.ds4


def _hyper_connection(prefix: str, shape: Ds4Shape, hidden: int) -> Iterator[Ds4Tensor]:
    mixes = (2 + shape.hc) * shape.hc  # pre and post weights, then the hc x hc combination
    yield Ds4Tensor(prefix + "fn.weight", (mixes, shape.hc * hidden), QType.F16)
    yield Ds4Tensor(prefix + "scale.weight", (3,), QType.F32, "normal")
    yield Ds4Tensor(prefix + "base.weight", (mixes,), QType.F32, "normal")


def _attention(spec: ModelSpec, s: Ds4Shape, layer: int) -> Iterator[Ds4Tensor]:
    p, h = f"blk.{layer}.", spec.hidden
    yield from _hyper_connection(p + "hc_attn_", s, h)
    yield Ds4Tensor(p + "attn_norm.weight", (h,), QType.F32, "ones")
    yield Ds4Tensor(p + "attn_q_a.weight", (s.q_lora, h), QType.Q8_0)
    yield Ds4Tensor(p + "attn_q_a_norm.weight", (s.q_lora,), QType.F32, "ones")
    yield Ds4Tensor(p + "attn_q_b.weight", (s.heads * s.head_dim, s.q_lora), QType.Q8_0)
    yield Ds4Tensor(p + "attn_kv.weight", (s.head_dim, h), QType.Q8_0)
    yield Ds4Tensor(p + "attn_kv_a_norm.weight", (s.head_dim,), QType.F32, "ones")
    yield Ds4Tensor(p + "attn_sinks.weight", (s.heads,), QType.F32, "normal")
    low = s.o_groups * s.o_lora
    yield Ds4Tensor(p + "attn_output_a.weight", (low, s.head_dim * s.heads // s.o_groups),
                    QType.Q8_0)
    yield Ds4Tensor(p + "attn_output_b.weight", (h, low), QType.Q8_0)
    ratio = compress_ratio(layer)
    if ratio:
        width = (2 if ratio == _INDEXED_RATIO else 1) * s.head_dim
        yield from _compressor(p + "attn_compressor_", ratio, width, s.head_dim, h)
    if ratio == _INDEXED_RATIO:
        yield Ds4Tensor(p + "indexer.attn_q_b.weight", (s.index_heads * s.index_head_dim,
                                                        s.q_lora), QType.F16)
        yield Ds4Tensor(p + "indexer.proj.weight", (s.index_heads, h), QType.F16)
        yield from _compressor(p + "indexer_compressor_", ratio, 2 * s.index_head_dim,
                               s.index_head_dim, h)


def _compressor(prefix: str, ratio: int, width: int, norm: int,
                hidden: int) -> Iterator[Ds4Tensor]:
    yield Ds4Tensor(prefix + "ape.weight", (ratio, width), QType.F16)
    yield Ds4Tensor(prefix + "kv.weight", (width, hidden), QType.F16)
    yield Ds4Tensor(prefix + "gate.weight", (width, hidden), QType.F16)
    yield Ds4Tensor(prefix + "norm.weight", (norm,), QType.F32, "ones")


def _ffn(spec: ModelSpec, s: Ds4Shape, layer: int) -> Iterator[Ds4Tensor]:
    p, h, f, n = f"blk.{layer}.", spec.hidden, spec.expert_ffn, spec.n_experts
    hashed = layer < spec.hash_routed
    yield from _hyper_connection(p + "hc_ffn_", s, h)
    yield Ds4Tensor(p + "ffn_norm.weight", (h,), QType.F32, "ones")
    yield Ds4Tensor(p + "ffn_gate_inp.weight", (n, h), QType.F16)
    if not hashed:  # the selection bias: DeepSeek's checkpoint has none on hash layers
        yield Ds4Tensor(p + "exp_probs_b.bias", (n,), QType.F32, "normal")
    gu = spec.gate_up_type
    if spec.fused_gate_up:  # llama.cpp's newer form; ds4's own files keep them apart
        yield Ds4Tensor(p + "ffn_gate_up_exps.weight", (n, 2 * f, h), gu, "experts", layer,
                        (0, 1))
    else:
        yield Ds4Tensor(p + "ffn_gate_exps.weight", (n, f, h), gu, "experts", layer, (0,))
        yield Ds4Tensor(p + "ffn_up_exps.weight", (n, f, h), gu, "experts", layer, (1,))
    yield Ds4Tensor(p + "ffn_down_exps.weight", (n, h, f), spec.down_type, "experts", layer,
                    (2,))
    yield Ds4Tensor(p + "ffn_gate_shexp.weight", (f, h), QType.Q8_0)
    yield Ds4Tensor(p + "ffn_up_shexp.weight", (f, h), QType.Q8_0)
    yield Ds4Tensor(p + "ffn_down_shexp.weight", (h, f), QType.Q8_0)
    if hashed:
        yield Ds4Tensor(p + "ffn_gate_tid2eid.weight", (spec.vocab, spec.top_k), QType.I32,
                        "expert_ids")


def ds4_metadata(writer: GGUFWriter, spec: ModelSpec) -> None:
    """ds4's ``deepseek4.*`` keys, each in a type ds4 reads it as (``required_u32``: UINT32;
    ``required_f32``: FLOAT32; arrays of UINT32 and FLOAT32)."""
    s, a = _shape(spec), DS4_ARCH + "."
    counts = {
        "block_count": spec.n_layers, "context_length": _CONTEXT,
        "embedding_length": spec.hidden, "vocab_size": spec.vocab,
        "attention.head_count": s.heads, "attention.head_count_kv": 1,
        "attention.key_length": s.head_dim, "attention.value_length": s.head_dim,
        "rope.dimension_count": s.rope_dim, "attention.q_lora_rank": s.q_lora,
        "attention.output_lora_rank": s.o_lora, "attention.output_group_count": s.o_groups,
        "expert_count": spec.n_experts, "expert_used_count": spec.top_k,
        "expert_feed_forward_length": spec.expert_ffn, "expert_shared_count": 1,
        "hash_layer_count": spec.hash_routed, "attention.sliding_window": s.sliding_window,
        "attention.indexer.head_count": s.index_heads,
        "attention.indexer.key_length": s.index_head_dim,
        "attention.indexer.top_k": s.index_top_k, "hyper_connection.count": s.hc,
        "hyper_connection.sinkhorn_iterations": _HC_SINKHORN_ITERATIONS,
        "rope.scaling.original_context_length": _ROPE_ORIGINAL_CONTEXT,
    }
    for key, value in counts.items():
        writer.add_uint32(a + key, value)
    scalars = {
        "rope.freq_base": _ROPE_BASE, "rope.scaling.factor": _ROPE_FACTOR,
        "rope.scaling.yarn_beta_fast": _YARN_BETA_FAST,
        "rope.scaling.yarn_beta_slow": _YARN_BETA_SLOW,
        "attention.compress_rope_freq_base": _COMPRESS_ROPE_BASE,
        "expert_weights_scale": _EXPERT_WEIGHTS_SCALE,
        "attention.layer_norm_rms_epsilon": _RMS_EPS, "hyper_connection.epsilon": _HC_EPS,
    }
    for key, scalar in scalars.items():
        writer.add_float32(a + key, scalar)
    writer.add_bool(a + "expert_weights_norm", True)
    writer.add_key_value(a + "attention.compress_ratios",
                         [compress_ratio(i) for i in range(spec.n_layers)],
                         GGUFValueType.ARRAY, sub_type=GGUFValueType.UINT32)
    writer.add_key_value(a + "swiglu_clamp_exp", [_SWIGLU_CLAMP] * spec.n_layers,
                         GGUFValueType.ARRAY, sub_type=GGUFValueType.FLOAT32)
