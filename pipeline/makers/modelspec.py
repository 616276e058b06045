"""The shapes of the generated models: ``ModelSpec``, the presets, and their scaling.

Kept apart from the writer (``moestream.pipeline.makers.modelgen``): the GGUF writer, the
checkpoint layouts (``checkpointlayouts``) and the tests all take a spec, and what a preset
is (which public model it imitates, at what per-expert size) reads on its own.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QType

from moestream.pipeline.foundation.errors import UsageError

__all__ = ["ARCH", "PRESETS", "ModelSpec", "spec_for", "tensor_nbytes"]

ARCH = "deepseek2"  # the default architecture (DeepSeek's tensor names and keys)


@dataclass(frozen=True)
class ModelSpec:
    """Shape, types and seed of one generated model.

    Layers ``0..leading_dense-1`` are dense; the first ``hash_routed`` MoE layers have no
    router (``ffn_gate_inp``) because ds4 routes them from the token id. ``arch`` names the
    metadata keys (``general.architecture``); ``shared_experts`` is 1 for DeepSeek's shared
    expert per MoE layer, 0 for models without one (Qwen3 MoE, Mixtral).
    """

    preset: str
    n_layers: int
    leading_dense: int
    hash_routed: int
    n_experts: int
    top_k: int
    hidden: int
    expert_ffn: int
    gate_up_type: QType
    down_type: QType
    fused_gate_up: bool = False
    vocab: int = 1024
    seed: int = 0
    arch: str = ARCH
    shared_experts: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.leading_dense < self.n_layers:
            raise UsageError(f"need at least one MoE layer: {self.n_layers} layers, "
                             f"{self.leading_dense} dense")
        if not 0 <= self.hash_routed <= self.n_layers - self.leading_dense:
            raise UsageError(f"hash_routed={self.hash_routed} exceeds the MoE layer count")
        if self.n_experts < 1 or not 1 <= self.top_k <= self.n_experts:
            raise UsageError(f"need 1 <= top_k <= experts, got {self.top_k} of {self.n_experts}")
        if not 0 <= self.seed < 2**64:
            raise UsageError(f"seed must fit in uint64, got {self.seed}")
        for qtype in (self.gate_up_type, self.down_type):
            block = GGML_QUANT_SIZES[qtype][0]
            if self.hidden % block or self.expert_ffn % block:
                raise UsageError(f"hidden and expert_ffn must be multiples of {block} for "
                                 f"{qtype.name}")

    @property
    def moe_layers(self) -> range:
        """Indices of the MoE layers, ascending (the digest array's layer order)."""
        return range(self.leading_dense, self.n_layers)

    @property
    def dense_ffn(self) -> int:
        """FFN width of the leading dense layers (``deepseek2.feed_forward_length``)."""
        return 4 * self.expert_ffn

    @property
    def matrix_bytes(self) -> tuple[int, int, int]:
        """Bytes of one expert's (gate, up, down) matrix."""
        gate_up = tensor_nbytes(self.gate_up_type, self.expert_ffn * self.hidden)
        return gate_up, gate_up, tensor_nbytes(self.down_type, self.hidden * self.expert_ffn)

    @property
    def expert_bytes(self) -> int:
        """Bytes of one routed expert: gate + up + down."""
        return sum(self.matrix_bytes)


PRESETS: dict[str, ModelSpec] = {
    "tiny": ModelSpec("tiny", 6, 1, 1, 32, 4, 512, 256, QType.F16, QType.F16),
    "ds4-flash-q2": ModelSpec("ds4-flash-q2", 43, 0, 3, 256, 6, 4096, 2048,
                              QType.IQ2_XXS, QType.Q2_K),
    "ds4-flash-q4": ModelSpec("ds4-flash-q4", 43, 0, 3, 256, 6, 4096, 2048,
                              QType.Q4_K, QType.Q4_K),
    # F16 experts (48 MiB each): the only type real compute (SwiGLU) runs on, so the only
    # ds4-shaped model whose hidden state, and so live routing, changes layer by layer.
    "ds4-flash-f16": ModelSpec("ds4-flash-f16", 43, 0, 3, 256, 6, 4096, 2048,
                               QType.F16, QType.F16),
    # Small experts: 3 x 864 KiB Q4_K matrices = 2.53 MiB per expert, 15.2 GiB routed.
    "qwen3-30b-a3b": ModelSpec("qwen3-30b-a3b", 48, 0, 0, 128, 8, 2048, 768,
                               QType.Q4_K, QType.Q4_K, arch="qwen3moe", shared_experts=0),
    # Fine-grained experts (Qwen3-Next-80B-A3B's routed shape: 512 experts, top-10, one
    # shared): 3 x 576 KiB Q4_K matrices = 1.69 MiB per expert; ``--layers 20`` is 16.9 GiB.
    "qwen3-next-80b-a3b": ModelSpec("qwen3-next-80b-a3b", 48, 0, 0, 512, 10, 2048, 512,
                                    QType.Q4_K, QType.Q4_K, arch="qwen3moe"),
    # Mid-sized experts (DeepSeek-V2-Lite's layer plan: one dense layer, 26 MoE layers of 64
    # experts, top-6): FFN 1536 (1408 there, not a multiple of Q5_K's 256-value block), Q5_K:
    # 3 x 2.06 MiB = 6.19 MiB per expert, 10.1 GiB routed.
    "deepseek-v2-lite": ModelSpec("deepseek-v2-lite", 27, 1, 0, 64, 6, 2048, 1536,
                                  QType.Q5_K, QType.Q5_K),
    # Large experts: 3 x 31.5 MiB Q4_K matrices = 94.5 MiB per expert, 23.6 GiB routed.
    "mixtral-8x7b": ModelSpec("mixtral-8x7b", 32, 0, 0, 8, 2, 4096, 14336,
                              QType.Q4_K, QType.Q4_K, arch="llama", shared_experts=0),
}


def spec_for(preset: str, layers: int | None = None, experts: int | None = None,
             seed: int = 0, *, fused_gate_up: bool = False) -> ModelSpec:
    """The spec of ``preset``, scaled down to ``layers``/``experts``; per-expert sizes stay.

    Raises:
        UsageError: unknown preset, or a count that leaves no MoE layer or no expert.
    """
    if preset not in PRESETS:
        raise UsageError(f"unknown preset {preset!r} (choose from {', '.join(PRESETS)})")
    base = PRESETS[preset]
    n_layers = base.n_layers if layers is None else layers
    n_experts = base.n_experts if experts is None else experts
    if n_layers < 1 or n_experts < 1:
        raise UsageError(f"layers and experts must be >= 1, got {n_layers} and {n_experts}")
    leading = min(base.leading_dense, n_layers - 1)
    return dataclasses.replace(
        base, n_layers=n_layers, leading_dense=leading, n_experts=n_experts,
        hash_routed=min(base.hash_routed, n_layers - leading), top_k=min(base.top_k, n_experts),
        seed=seed, fused_gate_up=fused_gate_up)


def tensor_nbytes(qtype: QType, n_elements: int) -> int:
    """Bytes of ``n_elements`` values stored as ``qtype`` (whole quantization blocks)."""
    block, type_size = GGML_QUANT_SIZES[qtype]
    return n_elements // block * type_size
