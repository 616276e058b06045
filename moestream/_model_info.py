"""What a session says of its model: ``ModelInfo``, its layers and tensors, its router."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from gguf import GGMLQuantizationType

from moestream.pipeline.foundation.quantization import ExpertQuant
from moestream.pipeline.foundation.table import ExpertTable

__all__ = ["LayerInfo", "ModelInfo", "Router", "TensorSpec"]


@dataclass(frozen=True, slots=True)
class LayerInfo:
    """One MoE layer of the model."""

    layer: int
    n_experts: int
    hidden: int
    ffn: int
    gate_up_type: GGMLQuantizationType
    down_type: GGMLQuantizationType
    expert_bytes: int
    """Bytes of one expert's three matrices in the file."""
    transposed: bool = False
    """gpt-oss's layout: gate_up (hidden, 2 * ffn), gate and up interleaved by column, its
    row halves handed out as ``gate`` and ``up``; down (ffn, hidden) (see ``Matrix``)."""
    gated: bool = True
    """False for experts without a gate (Nemotron-H): the up projection (ffn, hidden) is
    handed out as its row halves in ``gate`` and ``up`` (see ``Matrix``)."""
    quant: ExpertQuant | None = None
    """Quantized experts (``fp8`` blocks, ``mxfp4``, ``fp4``): the matrices are their file
    bytes (``gate_up_type`` I8 as the carrier; ``quant.shapes`` their shapes where a byte
    holds two values), to be multiplied by their scales, non-routed tensors named here
    (``read_tensor``); None for float and GGUF experts."""
    interleaved: bool = False
    """Inkling2's layout: gate_up (2 * ffn, hidden) with gate and up rows alternating (gate
    rows 0, 2, 4...), handed out as stored: its first row half as ``gate``, its second as
    ``up``; an engine de-interleaves them."""


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """A tensor of the model that is not a routed expert (embeddings, attention, norms,
    routers, shared experts), as the file declares it; ``Session.read_tensor`` reads it.

    Attributes:
        name: its name in the file.
        dtype: the file's name of its type (safetensors ``BF16``, ``F8_E4M3``...; a GGUF
            type name such as ``Q4_K``).
        shape: elements along each axis, outermost first.
        nbytes: its bytes in the file.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """The model a session streams.

    Attributes:
        path: the model as opened (a GGUF file, a checkpoint directory or file).
        moe_layers: the model layer indices of the MoE layers, in decode order.
        layers: each MoE layer's description, by layer index.
        n_experts: routed experts per layer (the largest).
        top_k: experts the router picks per layer and token.
        hidden: the hidden size.
        hash_routed: how many of the first MoE layers route by token id (no router).
        tensors: every other tensor, by name (``Session.read_tensor`` reads one).
        config: a checkpoint's ``config.json`` as the session's one read of it parsed it
            (bounded in size and depth, no duplicate keys); empty for a GGUF file. Build a
            model from these values, not from a second read of the path.
        file_bytes: a GGUF file's size as the session identified it (for a split GGUF or a
            checkpoint, the end of its shards laid end to end); with
            ``Session.read_header`` it lays out a private copy of the header a GGUF reader
            can parse.
    """

    path: Path
    moe_layers: tuple[int, ...]
    layers: Mapping[int, LayerInfo]
    n_experts: int
    top_k: int
    hidden: int
    hash_routed: int
    tensors: Mapping[str, TensorSpec] = field(default_factory=dict)
    config: Mapping[str, Any] = field(default_factory=dict)
    file_bytes: int = 0

    @classmethod
    def of(cls, table: ExpertTable) -> ModelInfo:
        layers = {
            n: LayerInfo(n, m.n_experts, m.shape[0], m.shape[1], m.gate_up_type, m.down_type,
                         m.expert_bytes, m.transposed, m.gated, m.quant, m.interleaved)
            for n, m in table.layers.items()
        }
        tensors = {t.name: TensorSpec(t.name, t.type_name, t.shape, t.nbytes)
                   for t in table.non_routed}
        return cls(table.path, tuple(table.moe_layers), layers, table.n_experts, table.top_k,
                   table.hidden, table.hash_routed, tensors, copy.deepcopy(table.config),
                   table.file_bytes)


class Router(Protocol):
    """The model's own router (``ffn_gate_inp``), as ``pipeline.cli.run --router live`` applies
    it; ``Session.router`` makes one. An engine normally routes with its own kernels; this
    one serves examples and tests."""

    def embedding(self, token: int) -> Any:
        """The hidden state token ``token`` starts with (a float32 vector on the device)."""

    def route(self, token: int, i: int, hidden: Any) -> tuple[list[int], list[float]]:
        """Experts and weights of MoE layer *position* ``i`` (an index into
        ``ModelInfo.moe_layers``) for ``hidden``."""

    def predict(self, token: int, i: int, hidden: Any) -> list[int]:
        """A guess of ``route(token, i, ...)`` from an earlier hidden state."""

