"""A checkpoint's MoE layer, built from its routed expert tensors, per layout.

Two layouts hold routed experts: per expert, every matrix a tensor of its own (gate and up
``[F, D]``, down ``[D, F]``; with no gate, as in Nemotron-H, the up projection's row halves
stand as gate and up); or fused, ``gate_up_proj`` ``[E, 2F, D]`` and ``down_proj``
``[E, D, F]``, an expert one slice along the first axis (gpt-oss's transposed, ``[E, D, 2F]``
and ``[E, F, D]``, and in MXFP4 blocks). Each builder checks that the layer's tensors agree
with one another (shapes, dtypes, every expert present) and refuses them in one line
otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from gguf import GGMLQuantizationType

from moestream.pipeline.foundation.errors import ExpertLayoutError
from moestream.pipeline.foundation.experts import MoeLayer, TensorInfo
from moestream.pipeline.foundation.quantization import (
    CARRIER,
    ExpertQuant,
    QuantConfig,
    Spec,
    carried,
    element_shape,
    expert_layer_quant,
    mxfp4_layer_quant,
)
from moestream.pipeline.foundation.safetensors_header import short

__all__ = ["SAFETENSORS_TYPES", "Tensor", "expert_type", "fused_layer", "per_expert_layer"]

SAFETENSORS_TYPES = {
    "BF16": GGMLQuantizationType.BF16,
    "F16": GGMLQuantizationType.F16,
    "F32": GGMLQuantizationType.F32,
}
"""Expert dtypes the table accepts, as the GGUF types the rest of moestream speaks."""
_PARTS = ("gate", "up", "down")
Experts = dict[int, dict[str, "Tensor"]]
"""A per-expert layer's tensors: by expert, then by matrix (gate, up, down)."""


@dataclass(frozen=True, slots=True)
class Tensor:
    """One routed tensor, its offset already in the model's address space."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def expert_type(path: Path, index: int, t: Tensor,
                 quant: QuantConfig | None = None) -> GGMLQuantizationType:
    if carried(quant, t.dtype):
        return CARRIER
    kind = SAFETENSORS_TYPES.get(t.dtype)
    if kind is None:
        said = f" (quantization_config: {quant.experts} experts)" if quant is not None else ""
        raise ExpertLayoutError(path, f"layer {index}: {short(t.name, 120)} is {t.dtype}"
                                      f"{said}; experts must be {', '.join(SAFETENSORS_TYPES)}, "
                                      "or F8_E4M3 with quant_method fp8, I8 (FP4) with "
                                      "expert_dtype fp4, MXFP4 blocks with quant_method mxfp4")
    return kind


def per_expert_layer(path: Path, index: int, experts: Experts, router: TensorInfo | None,
                     quant: QuantConfig | None = None,
                     tensors: Mapping[str, Spec] | None = None) -> MoeLayer:
    """A layer whose every expert matrix is a tensor of its own; with no gate at all
    (Nemotron-H: up and down only), the up projection's two row halves stand as the
    expert's "gate" and "up" slices (``MoeLayer.gated`` false)."""
    n = _expert_count(path, index, experts)
    first = experts[0]
    gated = any("gate" in parts for parts in experts.values())
    parts = _PARTS if gated else ("up", "down")
    lacking = [e for e in range(n) if any(p not in experts[e] for p in parts)]
    if lacking:
        e = lacking[0]
        absent = next(p for p in parts if p not in experts[e])
        tail = (f" (experts {e}-{n - 1} all lack one: experts past the routed ones, as "
                "zero or identity experts are, are not streamed)"
                if len(lacking) > 1 and lacking == list(range(e, n)) else "")
        raise ExpertLayoutError(path, f"layer {index}: expert {e} has no {absent} matrix{tail}")
    lead = first[parts[0]]  # gate, or up when there is none
    if len(lead.shape) != 2:
        raise ExpertLayoutError(path, f"layer {index}: {short(lead.name, 120)} is "
                                      f"{len(lead.shape)}-D, expected [ffn, hidden]")
    ffn, hidden = element_shape(quant, lead.dtype, lead.shape)
    types = {p: expert_type(path, index, first[p], quant) for p in parts}
    if gated and types["gate"] != types["up"]:
        raise ExpertLayoutError(path, f"layer {index}: gate is {types['gate'].name} but up is "
                                      f"{types['up'].name}; they must share a type")
    _check_shapes(path, index, experts, parts, (hidden, ffn), quant)
    if gated:
        gate_bytes, up_bytes = lead.nbytes, first["up"].nbytes
        offsets = tuple((experts[e]["gate"].offset, experts[e]["up"].offset,
                         experts[e]["down"].offset) for e in range(n))
    else:
        gate_bytes = up_bytes = lead.nbytes // 2
        offsets = tuple((experts[e]["up"].offset, experts[e]["up"].offset + gate_bytes,
                         experts[e]["down"].offset) for e in range(n))
    scales = None
    if CARRIER in types.values():
        if not gated or len(set(types.values())) != 1:
            raise ExpertLayoutError(path, f"layer {index}: quantized experts are read with a "
                                          "gate and every matrix quantized")
        assert quant is not None and tensors is not None
        scales = _per_expert_quant(path, index, experts, quant, tensors)
    return MoeLayer(
        index=index, n_experts=n, gate_up_type=types[parts[0]], down_type=types["down"],
        gate_offset=offsets[0][0], up_offset=offsets[0][1], down_offset=offsets[0][2],
        gate_bytes=gate_bytes, up_bytes=up_bytes, down_bytes=first["down"].nbytes,
        gate_up_stride=gate_bytes, fused_gate_up=False, router=router, shape=(hidden, ffn),
        expert_offsets=offsets, gated=gated, quant=scales,
    )


def _expert_count(path: Path, index: int, experts: Experts) -> int:
    """How many experts the layer names, refused when one of 0..n-1 is missing."""
    n = max(experts) + 1
    if len(experts) != n:  # the first gap lies within len(experts): never walk a huge n
        missing = next(e for e in range(n) if e not in experts)
        raise ExpertLayoutError(path, f"layer {index}: expert {missing} is missing "
                                      f"(experts 0..{n - 1} are named)")
    return n


def _check_shapes(path: Path, index: int, experts: Experts, parts: tuple[str, ...],
                  shape: tuple[int, int], quant: QuantConfig | None) -> None:
    """Every expert's matrices are the first expert's dtype and ``shape`` (hidden, ffn) in
    elements, not empty; gate-less ones have an even FFN (their up goes in two halves)."""
    hidden, ffn = shape
    first = experts[0]
    want = {"gate": (ffn, hidden), "up": (ffn, hidden), "down": (hidden, ffn)}
    for e in range(len(experts)):
        for p in parts:
            t = experts[e][p]
            elements = element_shape(quant, t.dtype, t.shape)  # FP4: two values a byte
            if elements != want[p] or t.dtype != first[p].dtype:
                raise ExpertLayoutError(path, f"layer {index}: {short(t.name, 120)} is "
                                              f"{t.dtype} {short(list(elements))} (elements), "
                                              f"expected {first[p].dtype} {list(want[p])}")
    if ffn == 0 or hidden == 0:
        raise ExpertLayoutError(path, f"layer {index}: empty expert matrices {(hidden, ffn)}")
    if "gate" not in parts and ffn % 2:
        raise ExpertLayoutError(path, f"layer {index}: gate-less experts with an odd FFN size "
                                      f"{ffn} (their up projection goes in two halves)")


def _per_expert_quant(path: Path, index: int, experts: Experts, quant: QuantConfig,
                      tensors: Mapping[str, Spec]) -> ExpertQuant:
    """The scales of a layer whose every matrix is quantized (``expert_layer_quant``)."""
    def spec(t: Tensor) -> Spec:
        return (t.name, t.dtype, t.shape)

    return expert_layer_quant(path, index, quant, [
        (spec(experts[e]["gate"]), spec(experts[e]["up"]), spec(experts[e]["down"]))
        for e in range(len(experts))], tensors)


def fused_layer(path: Path, index: int, parts: dict[str, Tensor],
                 router: TensorInfo | None, quant: QuantConfig | None = None,
                 tensors: Mapping[str, Spec] | None = None) -> MoeLayer:
    """A layer of the fused form: ``gate_up_proj`` [E, 2F, D] and ``down_proj`` [E, D, F],
    or transposed (gpt-oss) [E, D, 2F] and [E, F, D]; the shapes tell which (both at once
    only when empty). gpt-oss's MXFP4 blocks are the transposed form, quantized. Inkling2's
    ``w13_weight`` is the first form with gate and up rows interleaved."""
    if "up_proj" in parts and "gate_up_proj" not in parts:
        return _gateless_fused_layer(path, index, parts, router)
    gate_up, down = parts.get("gate_up_proj"), parts.get("down_proj")
    if gate_up is None or down is None:
        missing = "gate_up_proj" if gate_up is None else "down_proj"
        raise ExpertLayoutError(path, f"layer {index}: fused experts lack {missing}")
    blocks = [t for t in (gate_up, down) if t.name.endswith("_blocks")]
    if blocks:
        if quant is None or quant.experts != "mxfp4" or tensors is None:
            raise ExpertLayoutError(path, f"layer {index}: {short(blocks[0].name, 120)} is "
                                          "MXFP4 blocks, but quantization_config is "
                                          f"{quant.method if quant else 'absent'}; moestream "
                                          "reads them with quant_method mxfp4")
        return mxfp4_layer(path, index, gate_up, down, router, tensors)
    if len(gate_up.shape) != 3 or len(down.shape) != 3:
        raise ExpertLayoutError(path, f"layer {index}: fused experts must be 3-D, got "
                                      f"{short(list(gate_up.shape))} and "
                                      f"{short(list(down.shape))}")
    n, rows, cols = gate_up.shape
    transposed = cols % 2 == 0 and down.shape == (n, cols // 2, rows) and rows % 2 == 0
    hidden, ffn = (rows, cols // 2) if transposed else (cols, rows // 2)
    if (not transposed and (rows % 2 or down.shape != (n, hidden, ffn))) or 0 in (n, ffn, hidden):
        raise ExpertLayoutError(path, f"layer {index}: gate_up_proj {list(gate_up.shape)} and "
                                      f"down_proj {list(down.shape)} are not [E, 2F, D] and "
                                      f"[E, D, F] (nor [E, D, 2F] and [E, F, D] with D even)")
    interleaved = gate_up.name.endswith("w13_weight")
    if interleaved and transposed:
        raise ExpertLayoutError(path, f"layer {index}: {short(gate_up.name, 120)} "
                                      f"{list(gate_up.shape)} is not [E, 2F, D] with down "
                                      "[E, D, F]")
    gate_up_type = expert_type(path, index, gate_up)
    down_type = expert_type(path, index, down)
    stride = gate_up.nbytes // n
    return MoeLayer(
        index=index, n_experts=n, gate_up_type=gate_up_type, down_type=down_type,
        gate_offset=gate_up.offset, up_offset=gate_up.offset + stride // 2,
        down_offset=down.offset, gate_bytes=stride // 2, up_bytes=stride // 2,
        down_bytes=down.nbytes // n, gate_up_stride=stride, fused_gate_up=True,
        router=router, shape=(hidden, ffn), transposed=transposed, interleaved=interleaved,
    )


def _gateless_fused_layer(path: Path, index: int, parts: dict[str, Tensor],
                          router: TensorInfo | None) -> MoeLayer:
    """A fused layer of experts without a gate, as Ergo stores them: ``up_proj`` [E, D, F]
    and ``down_proj`` [E, F, D], transposed (the shapes alone cannot tell [E, F, D] and
    [E, D, F] apart: a checkpoint of the other form meets config.json's hidden size, which
    refuses it); an expert's up goes in two row halves as the "gate" and "up" slices, as a
    per-expert gate-less layer's."""
    up, down = parts["up_proj"], parts.get("down_proj")
    if down is None:
        raise ExpertLayoutError(path, f"layer {index}: fused experts lack down_proj")
    if len(up.shape) != 3 or len(down.shape) != 3:
        raise ExpertLayoutError(path, f"layer {index}: fused experts must be 3-D, got "
                                      f"{short(list(up.shape))} and {short(list(down.shape))}")
    n, hidden, ffn = up.shape
    if down.shape != (n, ffn, hidden) or 0 in (n, hidden, ffn) or hidden % 2:
        raise ExpertLayoutError(path, f"layer {index}: up_proj {list(up.shape)} and down_proj "
                                      f"{list(down.shape)} are not [E, D, F] and [E, F, D] "
                                      "with D even")
    stride = up.nbytes // n
    return MoeLayer(
        index=index, n_experts=n, gate_up_type=expert_type(path, index, up),
        down_type=expert_type(path, index, down), gate_offset=up.offset,
        up_offset=up.offset + stride // 2, down_offset=down.offset, gate_bytes=stride // 2,
        up_bytes=stride // 2, down_bytes=down.nbytes // n, gate_up_stride=stride,
        fused_gate_up=True, router=router, shape=(hidden, ffn), transposed=True, gated=False,
    )


def mxfp4_layer(path: Path, index: int, gate_up: Tensor, down: Tensor,
                 router: TensorInfo | None, tensors: Mapping[str, Spec]) -> MoeLayer:
    """gpt-oss's MXFP4 experts: an expert is its slice of each blocks tensor, its gate and
    up the two row halves of its gate_up blocks (``ExpertQuant.shapes``)."""
    n, hidden, ffn, scales = mxfp4_layer_quant(path, index, (gate_up.name, gate_up.dtype,
                                                        gate_up.shape),
                                          (down.name, down.dtype, down.shape), tensors)
    stride = gate_up.nbytes // n
    return MoeLayer(
        index=index, n_experts=n, gate_up_type=CARRIER, down_type=CARRIER,
        gate_offset=gate_up.offset, up_offset=gate_up.offset + stride // 2,
        down_offset=down.offset, gate_bytes=stride // 2, up_bytes=stride // 2,
        down_bytes=down.nbytes // n, gate_up_stride=stride, fused_gate_up=True,
        router=router, shape=(hidden, ffn), transposed=True, quant=scales,
    )
