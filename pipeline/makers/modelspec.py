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

__all__ = ["ARCH", "DS4_ARCH", "DS4_FLASH", "DS4_SHAPES", "DS4_SMALL", "PRESETS", "Ds4Shape",
           "ModelSpec", "spec_for", "tensor_nbytes"]

ARCH = "deepseek2"  # the default architecture (DeepSeek's tensor names and keys)
DS4_ARCH = "deepseek4"  # ds4's DeepSeek V4 Flash files (``pipeline.makers.ds4layout``)


@dataclass(frozen=True)
class Ds4Shape:
    """The non-routed shape of a DeepSeek V4 file: attention, compressor, indexer,
    hyper-connections and vocabulary (ds4's constants, ``DS4_N_*`` in its ds4.c).

    The routed experts' shape stays the spec's (``hidden``, ``expert_ffn``); this is what
    ``pipeline.makers.ds4layout`` needs to write every other tensor ds4 loads.
    """

    vocab: int = 129280
    heads: int = 64
    head_dim: int = 512
    rope_dim: int = 64
    q_lora: int = 1024
    o_lora: int = 1024
    o_groups: int = 8
    index_heads: int = 64
    index_head_dim: int = 128
    index_top_k: int = 512
    hc: int = 4
    sliding_window: int = 128

    def __post_init__(self) -> None:
        if self.heads % self.o_groups:
            raise UsageError(f"heads ({self.heads}) must divide into o_groups ({self.o_groups})")
        if not 0 < self.rope_dim <= self.head_dim or self.rope_dim % 2:
            raise UsageError(f"rope_dim must be even and in 1..head_dim, got {self.rope_dim}")
        # Q8_0 rows (32 values a block): q_b's, o_a's and o_b's inputs
        for name in ("q_lora", "head_dim", "o_lora"):
            if getattr(self, name) % 32:
                raise UsageError(f"{name} must be a multiple of 32 (Q8_0 blocks)")


DS4_FLASH = Ds4Shape()
"""DeepSeek V4 Flash as ds4 runs it (ds4 refuses any other shape)."""

DS4_SMALL = Ds4Shape(vocab=1024, heads=4, head_dim=128, q_lora=128, o_lora=128, o_groups=2,
                     index_heads=4, index_head_dim=64, index_top_k=64)
"""The same tensors at a small size: what a scaled-down ds4 preset writes, so a test model
stays small (the full shape adds ~1.6 GB of vocabulary and ~180 MB a layer)."""


@dataclass(frozen=True)
class ModelSpec:
    """Shape, types and seed of one generated model.

    Layers ``0..leading_dense-1`` are dense; the first ``hash_routed`` MoE layers have no
    router (``ffn_gate_inp``) because ds4 routes them from the token id. ``arch`` names the
    metadata keys (``general.architecture``); ``shared_experts`` is 1 for DeepSeek's shared
    expert per MoE layer, 0 for models without one (Qwen3 MoE, Mixtral). ``ds4`` (with
    ``arch`` ``deepseek4``) is the non-routed shape of a file in ds4's layout: every tensor
    and metadata key ds4 loads, hash-routed layers with their ``tid2eid`` table.
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
    ds4: Ds4Shape | None = None

    def __post_init__(self) -> None:
        if (self.ds4 is not None) != (self.arch == DS4_ARCH):
            raise UsageError(f"a ds4 shape goes with arch {DS4_ARCH!r}, got {self.arch!r}")
        if self.ds4 is not None and (self.leading_dense or self.shared_experts != 1
                                     or self.vocab != self.ds4.vocab):
            raise UsageError("DeepSeek V4 has no dense layers, one shared expert and its "
                             "shape's vocabulary")
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
    # ds4's files: every tensor and key ds4 loads (names, types, shapes), the experts in
    # the quantizations it ships (q2: IQ2_XXS gate/up, Q2_K down; q4: Q4_K)
    "ds4-flash-q2": ModelSpec("ds4-flash-q2", 43, 0, 3, 256, 6, 4096, 2048,
                              QType.IQ2_XXS, QType.Q2_K, vocab=DS4_FLASH.vocab, arch=DS4_ARCH,
                              ds4=DS4_FLASH),
    "ds4-flash-q4": ModelSpec("ds4-flash-q4", 43, 0, 3, 256, 6, 4096, 2048,
                              QType.Q4_K, QType.Q4_K, vocab=DS4_FLASH.vocab, arch=DS4_ARCH,
                              ds4=DS4_FLASH),
    # F16 experts (48 MiB each): the only type real compute (SwiGLU) runs on, so the only
    # ds4-shaped model whose hidden state, and so live routing, changes layer by layer (ds4
    # itself runs only quantized experts).
    "ds4-flash-f16": ModelSpec("ds4-flash-f16", 43, 0, 3, 256, 6, 4096, 2048,
                               QType.F16, QType.F16, vocab=DS4_FLASH.vocab, arch=DS4_ARCH,
                               ds4=DS4_FLASH),
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


DS4_SHAPES = {"flash": DS4_FLASH, "small": DS4_SMALL}


def spec_for(preset: str, layers: int | None = None, experts: int | None = None,
             seed: int = 0, *, fused_gate_up: bool = False,
             ds4_shape: str | None = None) -> ModelSpec:
    """The spec of ``preset``, scaled down to ``layers``/``experts``; per-expert sizes stay.

    A ds4 preset keeps DeepSeek V4 Flash's non-routed shape (``DS4_FLASH``) unscaled and
    takes ``DS4_SMALL`` when scaled down, unless ``ds4_shape`` (``flash`` or ``small``)
    says which.

    Raises:
        UsageError: unknown preset, a count that leaves no MoE layer or no expert, or a
            ``ds4_shape`` for a preset that is not ds4's.
    """
    if preset not in PRESETS:
        raise UsageError(f"unknown preset {preset!r} (choose from {', '.join(PRESETS)})")
    base = PRESETS[preset]
    n_layers = base.n_layers if layers is None else layers
    n_experts = base.n_experts if experts is None else experts
    if n_layers < 1 or n_experts < 1:
        raise UsageError(f"layers and experts must be >= 1, got {n_layers} and {n_experts}")
    leading = min(base.leading_dense, n_layers - 1)
    ds4 = _ds4_shape(base, ds4_shape, (n_layers, n_experts) != (base.n_layers, base.n_experts))
    return dataclasses.replace(
        base, n_layers=n_layers, leading_dense=leading, n_experts=n_experts,
        hash_routed=min(base.hash_routed, n_layers - leading), top_k=min(base.top_k, n_experts),
        seed=seed, fused_gate_up=fused_gate_up, ds4=ds4,
        vocab=base.vocab if ds4 is None else ds4.vocab)


def _ds4_shape(base: ModelSpec, name: str | None, scaled: bool) -> Ds4Shape | None:
    """The non-routed shape a ds4 preset gets: ``name``'s, else the small one if scaled."""
    if base.ds4 is None:
        if name is not None:
            raise UsageError(f"--ds4-shape is for the ds4 presets, not {base.preset!r}")
        return None
    if name is None:
        return DS4_SMALL if scaled else base.ds4
    if name not in DS4_SHAPES:
        raise UsageError(f"unknown ds4 shape {name!r} (choose from {', '.join(DS4_SHAPES)})")
    return DS4_SHAPES[name]


def tensor_nbytes(qtype: QType, n_elements: int) -> int:
    """Bytes of ``n_elements`` values stored as ``qtype`` (whole quantization blocks)."""
    block, type_size = GGML_QUANT_SIZES[qtype]
    return n_elements // block * type_size
