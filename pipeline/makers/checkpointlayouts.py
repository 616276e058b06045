"""The tensors and ``config.json`` of each checkpoint ``tools.make_model`` writes.

Why: moestream's safetensors source and its transformers integration must be measured on
checkpoints laid out as the real ones ship, plain and quantized, at every preset's shape.
Each layout keeps a preset's hidden size, expert FFN, expert count, top-k and layer count
(its leading dense layers are not kept; attention is reduced to a few heads) and names them
as its architecture does:

- plain (``qwen3_moe``): every layer a MoE layer; embeddings, per layer two norms, attention
  (4 query heads, 2 key/value heads of 128, with q/k norms), the router ``mlp.gate.weight``
  ``[E, D]`` and the experts, per expert (``mlp.experts.E.{gate,up,down}_proj.weight``,
  gate/up ``[F, D]``, down ``[D, F]``) or fused (``mlp.experts.gate_up_proj`` ``[E, 2F, D]``,
  ``mlp.experts.down_proj`` ``[E, D, F]``); the final norm and ``lm_head``.
- ``fp8`` (Qwen3-FP8, DeepSeek-V3): the plain per-expert layout with every ``*_proj.weight``
  (attention and experts; not the router, norms, embeddings or ``lm_head``) F8_E4M3 and a
  float32 ``*_proj.weight_scale_inv`` per block (``quantization_config.weight_block_size``).
- ``mxfp4`` (``gpt_oss``): attention with biases and sinks (4 query heads, 2 key/value heads
  of 64), ``mlp.router.{weight,bias}``, and each layer's experts fused and transposed as
  gpt-oss ships them: ``mlp.experts.gate_up_proj_blocks`` ``[E, 2F, D/32, 16]`` uint8 (E2M1
  pairs) with ``gate_up_proj_scales`` ``[E, 2F, D/32]`` (E8M0), rows interleaved gate, up,
  gate, ... (so transformers' dequantization, transposed to ``[E, D, 2F]``, has gate and up
  interleaved by column); ``down_proj_blocks`` ``[E, D, F/32, 16]``, ``down_proj_scales``
  ``[E, D, F/32]``; float32 biases ``gate_up_proj_bias`` ``[E, 2F]``, ``down_proj_bias``
  ``[E, D]``. Everything else stays in the plain dtype.
- ``fp4`` (``deepseek_v4``, as DeepSeek-V4-Flash ships): names as DeepSeek's (``embed``,
  ``layers.L.attn.wq_a``, ``layers.L.ffn.experts.E.w1``, ``head``), routed experts E2M1 in
  I8 (``w1``/``w3`` ``[F, D/2]``, ``w2`` ``[D, F/2]``) with an F8_E8M0 ``.scale`` per 32
  values, the attention and shared-expert linears FP8 E4M3 with an F8_E8M0 ``.scale`` per
  128x128 block; norms, router, embeddings, head in the plain dtype, the hyper-connection
  tensors, attention sinks and router bias float32. Every layer is a sliding-window one (no
  compressor or indexer), one shared expert, the preset's hash-routed layers ``hash_moe``
  (their ``ffn.gate.tid2eid``).

An expert's values come from its (seed, layer, expert, matrix) key in every layout, so the
quantized experts are the plain checkpoint's experts of the same seed, quantized.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from moestream.pipeline.foundation.errors import UsageError
from moestream.pipeline.makers.checkpointconfigs import (
    OSS_HEAD_DIM,
    OSS_HEADS,
    OSS_KV_HEADS,
    QWEN_HEAD_DIM,
    QWEN_HEADS,
    QWEN_KV_HEADS,
    V4_BLOCK,
    V4_HC,
    V4_HEAD_DIM,
    V4_HEADS,
    V4_O_GROUPS,
    V4_O_LORA,
    V4_Q_LORA,
    deepseek_v4_config,
    gpt_oss_config,
    qwen3_config,
)
from moestream.pipeline.makers.checkpointtensors import (
    OTHER,
    Fill,
    FillRows,
    Fp8Matrix,
    HashRoutes,
    MxRows,
    Out,
    Piece,
    Unit,
)
from moestream.pipeline.makers.modelspec import ModelSpec
from moestream.pipeline.makers.quantgen import MX_BLOCK

__all__ = ["QUANTS", "Layout", "Quant", "layout"]

Quant = Literal["fp8", "mxfp4", "fp4"]
QUANTS: tuple[Quant, ...] = ("fp8", "mxfp4", "fp4")
_GATE, _UP, _DOWN = 0, 1, 2  # an expert matrix's seed-key index, in every layout


@dataclass(frozen=True, slots=True)
class Layout:
    """A checkpoint's plan: its units in write order, ``config.json`` and the bytes one
    routed expert takes as stored (weights and scales, not gpt-oss's biases)."""

    units: list[Unit]
    config: dict[str, object]
    expert_bytes: int


class _Plan:
    """Collects a layout's units; ``dtype`` (a ``TensorSpec`` name) is the plain tensors'."""

    def __init__(self, spec: ModelSpec, dtype: str) -> None:
        self.spec, self.dtype = spec, dtype
        self.units: list[Unit] = []

    def key(self, name: str) -> tuple[int, ...]:
        return (self.spec.seed, OTHER, zlib.crc32(name.encode()))

    def plain(self, name: str, shape: tuple[int, ...], fill: Fill = "random",
              dtype: str | None = None) -> None:
        """A whole tensor of one seed key (keyed by its name)."""
        rows = 1
        for n in shape[:-1]:
            rows *= n
        dtype = dtype or self.dtype
        self.units.append(Unit((Out(name, shape, dtype),),
                               (FillRows(name, Piece(self.key(name), 0, rows, fill), dtype),)))

    def experts(self, name: str, shape: tuple[int, ...], matrices: Sequence[int], layer: int,
                expert: int | None) -> None:
        """Plain expert rows: one expert's matrix, or (``expert`` None) a fused tensor of
        every expert, ``matrices`` stacked by rows within each."""
        rows = shape[-2] // len(matrices)
        first, count = (0, self.spec.n_experts) if expert is None else (expert, 1)
        jobs = tuple(FillRows(name, Piece((self.spec.seed, layer, e, m),
                                          (i * len(matrices) + j) * rows, rows), self.dtype)
                     for i, e in enumerate(range(first, first + count))
                     for j, m in enumerate(matrices))
        self.units.append(Unit((Out(name, shape, self.dtype),), jobs))

    def fp8(self, name: str, shape: tuple[int, int], key: tuple[int, ...] | None,
            block: tuple[int, int], *, ue8m0: bool = False) -> None:
        """``name`` (``*.weight``) FP8 E4M3 with its block scales: ``*.weight_scale_inv``
        float32, or with ``ue8m0`` DeepSeek-V4's ``*.scale`` E8M0."""
        scale = name.removesuffix(".weight") + (".scale" if ue8m0 else ".weight_scale_inv")
        grid = (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
        piece = Piece(key or self.key(name), 0, shape[0])
        self.units.append(Unit(
            (Out(name, shape, "float8_e4m3fn"),
             Out(scale, grid, "float8_e8m0fnu" if ue8m0 else "float32")),
            (Fp8Matrix(name, scale, (piece,), self.dtype, block, ue8m0),)))


def _check_mx(spec: ModelSpec, quant: str) -> None:
    for what, n in (("hidden size", spec.hidden), ("expert FFN", spec.expert_ffn)):
        if n % MX_BLOCK:
            raise UsageError(f"--quant {quant} needs a {what} divisible by {MX_BLOCK} "
                             f"(its scales cover {MX_BLOCK} values), got {n}")


def _fp8_bytes(rows: int, cols: int, block: tuple[int, int], scale_bytes: int) -> int:
    return rows * cols + -(-rows // block[0]) * -(-cols // block[1]) * scale_bytes


def _mx_bytes(rows: int, cols: int) -> int:
    return rows * cols // 2 + rows * cols // MX_BLOCK


def _decoder(plan: _Plan, attention: Callable[[str], None],
             mlp: Callable[[str, int], None]) -> list[Unit]:
    """The Hugging Face decoder both ``model.``-named layouts share (Qwen3-MoE, gpt-oss), in
    write order: the embeddings; per layer the input norm, ``attention``, the
    post-attention norm and ``mlp`` (given the layer's name prefix, and its index); the
    final norm and ``lm_head``."""
    spec = plan.spec
    d = spec.hidden
    plan.plain("model.embed_tokens.weight", (spec.vocab, d))
    for layer in range(spec.n_layers):
        p = f"model.layers.{layer}."
        plan.plain(p + "input_layernorm.weight", (d,), "ones")
        attention(p)
        plan.plain(p + "post_attention_layernorm.weight", (d,), "ones")
        mlp(p, layer)
    plan.plain("model.norm.weight", (d,), "ones")
    plan.plain("lm_head.weight", (spec.vocab, d))
    return plan.units


def _qwen3(spec: ModelSpec, dtype: str, fused: bool,
           block: tuple[int, int] | None) -> list[Unit]:
    """The plain layout, or with ``block`` the FP8 one."""
    d, f, n = spec.hidden, spec.expert_ffn, spec.n_experts
    plan = _Plan(spec, dtype)

    def linear(name: str, shape: tuple[int, int], key: tuple[int, ...] | None = None) -> None:
        if block is not None:
            plan.fp8(name, shape, key, block)
        elif key is None:
            plan.plain(name, shape)
        else:
            plan.experts(name, shape, (key[-1],), key[1], key[2])

    def attention(p: str) -> None:
        q, kv = QWEN_HEADS * QWEN_HEAD_DIM, QWEN_KV_HEADS * QWEN_HEAD_DIM
        for proj, shape in (("q", (q, d)), ("k", (kv, d)), ("v", (kv, d)), ("o", (d, q))):
            linear(f"{p}self_attn.{proj}_proj.weight", shape)
        plan.plain(p + "self_attn.q_norm.weight", (QWEN_HEAD_DIM,), "ones")
        plan.plain(p + "self_attn.k_norm.weight", (QWEN_HEAD_DIM,), "ones")

    def mlp(p: str, layer: int) -> None:
        plan.plain(p + "mlp.gate.weight", (n, d))
        if fused:
            plan.experts(p + "mlp.experts.gate_up_proj", (n, 2 * f, d), (_GATE, _UP), layer,
                         None)
            plan.experts(p + "mlp.experts.down_proj", (n, d, f), (_DOWN,), layer, None)
            return
        for e in range(n):
            q_ = f"{p}mlp.experts.{e}."
            for name, shape, m in (("gate", (f, d), _GATE), ("up", (f, d), _UP),
                                   ("down", (d, f), _DOWN)):
                linear(f"{q_}{name}_proj.weight", shape, (spec.seed, layer, e, m))

    return _decoder(plan, attention, mlp)


def _gpt_oss(spec: ModelSpec, dtype: str) -> list[Unit]:
    d, f, n = spec.hidden, spec.expert_ffn, spec.n_experts
    plan = _Plan(spec, dtype)
    q, kv = OSS_HEADS * OSS_HEAD_DIM, OSS_KV_HEADS * OSS_HEAD_DIM

    def attention(p: str) -> None:
        for proj, rows, cols in (("q", q, d), ("k", kv, d), ("v", kv, d), ("o", d, q)):
            plan.plain(f"{p}self_attn.{proj}_proj.weight", (rows, cols))
            plan.plain(f"{p}self_attn.{proj}_proj.bias", (rows,))
        plan.plain(p + "self_attn.sinks", (OSS_HEADS,))

    def mlp(p: str, layer: int) -> None:
        plan.plain(p + "mlp.router.weight", (n, d))
        plan.plain(p + "mlp.router.bias", (n,))
        x = p + "mlp.experts."
        for proj, rows, cols, matrices in (("gate_up_proj", 2 * f, d, (_GATE, _UP)),
                                           ("down_proj", d, f, (_DOWN,))):
            blocks, scales = f"{x}{proj}_blocks", f"{x}{proj}_scales"
            step = len(matrices)
            jobs = tuple(MxRows(blocks, scales, Piece((spec.seed, layer, e, m), 0, rows // step),
                                cols, dtype, e, j, step)
                         for e in range(n) for j, m in enumerate(matrices))
            plan.units.append(Unit(
                (Out(blocks, (n, rows, cols // MX_BLOCK, 16), "uint8"),
                 Out(scales, (n, rows, cols // MX_BLOCK), "uint8")), jobs))
            plan.plain(f"{x}{proj}_bias", (n, rows), dtype="float32")

    return _decoder(plan, attention, mlp)


def _deepseek_v4(spec: ModelSpec, dtype: str) -> list[Unit]:
    d, f, n = spec.hidden, spec.expert_ffn, spec.n_experts
    plan = _Plan(spec, dtype)
    hc, mixes = V4_HC * d, (2 + V4_HC) * V4_HC
    plan.plain("embed.weight", (spec.vocab, d))
    for layer in range(spec.n_layers):
        p = f"layers.{layer}."
        plan.plain(p + "attn_norm.weight", (d,), "ones")
        a = p + "attn."
        plan.plain(a + "attn_sink", (V4_HEADS,), "zeros", dtype="float32")
        heads, o_rank = V4_HEADS * V4_HEAD_DIM, V4_O_GROUPS * V4_O_LORA
        for name, shape in (("wq_a", (V4_Q_LORA, d)), ("wq_b", (heads, V4_Q_LORA)),
                            ("wkv", (V4_HEAD_DIM, d)),
                            ("wo_a", (o_rank, heads // V4_O_GROUPS)), ("wo_b", (d, o_rank))):
            plan.fp8(f"{a}{name}.weight", shape, None, V4_BLOCK, ue8m0=True)
        plan.plain(a + "q_norm.weight", (V4_Q_LORA,), "ones")
        plan.plain(a + "norm.weight", (V4_HEAD_DIM,), "ones")
        plan.plain(p + "ffn_norm.weight", (d,), "ones")
        g = p + "ffn.gate."
        plan.plain(g + "weight", (n, d))
        if layer < spec.hash_routed:
            plan.units.append(Unit((Out(g + "tid2eid", (spec.vocab, spec.top_k), "int64"),),
                                   (HashRoutes(g + "tid2eid", plan.key(g + "tid2eid"), n),)))
        else:
            plan.plain(g + "bias", (n,), "zeros", dtype="float32")
        for name, shape in (("w1", (f, d)), ("w2", (d, f)), ("w3", (f, d))):
            plan.fp8(f"{p}ffn.shared_experts.{name}.weight", shape, None, V4_BLOCK,
                     ue8m0=True)
        for e in range(n):
            x = f"{p}ffn.experts.{e}."
            for name, (rows, cols), m in (("w1", (f, d), _GATE), ("w2", (d, f), _DOWN),
                                          ("w3", (f, d), _UP)):
                weight, scale = f"{x}{name}.weight", f"{x}{name}.scale"
                plan.units.append(Unit(
                    (Out(weight, (rows, cols // 2), "int8"),
                     Out(scale, (rows, cols // MX_BLOCK), "float8_e8m0fnu")),
                    (MxRows(weight, scale, Piece((spec.seed, layer, e, m), 0, rows), cols,
                            dtype),)))
        for kind in ("attn", "ffn"):
            plan.plain(f"{p}hc_{kind}_fn", (mixes, hc), dtype="float32")
            plan.plain(f"{p}hc_{kind}_base", (mixes,), "zeros", dtype="float32")
            plan.plain(f"{p}hc_{kind}_scale", (3,), "ones", dtype="float32")
    plan.plain("norm.weight", (d,), "ones")
    plan.plain("head.weight", (spec.vocab, d))
    plan.plain("hc_head_fn", (V4_HC, hc), dtype="float32")
    plan.plain("hc_head_base", (V4_HC,), "zeros", dtype="float32")
    plan.plain("hc_head_scale", (1,), "ones", dtype="float32")
    return plan.units


def layout(spec: ModelSpec, dtype: str, *, fused: bool = False, quant: Quant | None = None,
           block: tuple[int, int] = (128, 128)) -> Layout:
    """The checkpoint of ``spec`` with plain tensors in ``dtype`` (a ``TensorSpec`` name:
    ``bfloat16``, ``float16``, ``float32``), experts fused or not (plain only) and
    quantized as ``quant`` (``fp8`` with ``block``-sized scale blocks).

    Raises:
        UsageError: ``mxfp4``/``fp4`` with a hidden size or expert FFN not divisible by 32.
    """
    d, f = spec.hidden, spec.expert_ffn
    if quant is None or quant == "fp8":
        units = _qwen3(spec, dtype, fused, block if quant == "fp8" else None)
        config = qwen3_config(spec, dtype)
        if quant == "fp8":
            config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                             "weight_block_size": list(block),
                                             "activation_scheme": "dynamic"}
            expert = 2 * _fp8_bytes(f, d, block, 4) + _fp8_bytes(d, f, block, 4)
        else:
            expert = 3 * f * d * {"bfloat16": 2, "float16": 2, "float32": 4}[dtype]
    elif quant == "mxfp4":
        _check_mx(spec, quant)
        units, config = _gpt_oss(spec, dtype), gpt_oss_config(spec, dtype)
        expert = 3 * _mx_bytes(f, d)
    else:
        _check_mx(spec, quant)
        units, config = _deepseek_v4(spec, dtype), deepseek_v4_config(spec, dtype)
        expert = 3 * _mx_bytes(f, d)
    config["moestream_preset"] = spec.preset
    config["moestream_seed"] = spec.seed
    return Layout(units, config, expert)
