"""What the proxy engine's compute can be on a model: ``real`` needs F16 experts.

``pipeline.run`` decodes with ``real`` (SwiGLU on F16 experts), ``digest`` or ``fixed``
compute (``pipeline.proxy.decode``). The session checks the choice before the log header names
it (``digest`` compute turns verification on), so the check lives below both, beside
``ComputeSpec``.
"""

from __future__ import annotations

import structlog
from gguf import GGMLQuantizationType

from moestream.pipeline.foundation.config import ComputeSpec
from moestream.pipeline.foundation.errors import ExpertLayoutError
from moestream.pipeline.foundation.table import ExpertTable

__all__ = ["resolve_compute"]

_log = structlog.get_logger("moestream.decode")


def _all_f16(table: ExpertTable) -> bool:
    """Whether ``real`` compute can run: every MoE layer's experts are F16 (True), or none
    are (False: the run falls back to ``digest``, logged once).

    Raises:
        ExpertLayoutError: some layers are F16 and others are not (every layer is checked
            here, before decoding, not when a token first reaches the other type).
    """
    f16 = GGMLQuantizationType.F16
    types = {n: (layer.gate_up_type, layer.down_type) for n, layer in table.layers.items()}
    other = {n: t for n, t in types.items() if t != (f16, f16)}
    if not other:
        return True
    n, (gate_up, down) = next(iter(other.items()))
    quant = table.layers[n].quant
    kinds = f"{quant.method} blocks" if quant is not None else f"{gate_up.name}/{down.name}"
    if len(other) < len(types):
        f16_layer = next(m for m in types if m not in other)
        raise ExpertLayoutError(
            table.path, f"real compute needs F16 experts in every MoE layer: layer {f16_layer} "
            f"is F16, layer {n} is {kinds}; use --compute digest or fixed")
    _log.warning("compute_fallback", requested="real", using="digest",
                 reason=f"experts are {kinds}; real SwiGLU needs F16")
    return False


def resolve_compute(compute: ComputeSpec, table: ExpertTable) -> ComputeSpec:
    """The compute a run on ``table`` does: ``real`` becomes ``digest`` on a model without
    F16 experts (logged once).

    Raises:
        ExpertLayoutError: some MoE layers are F16 and others are not.
    """
    if compute.kind == "real" and any(layer.transposed or not layer.gated
                                      for layer in table.layers.values()):
        _log.warning("compute_fallback", requested="real", using="digest",
                     reason="transposed (gpt-oss) or gate-less (Nemotron-H) experts: not the "
                            "SwiGLU layout real compute runs")
        return ComputeSpec("digest")
    if compute.kind == "real" and not _all_f16(table):
        return ComputeSpec("digest")
    return compute
