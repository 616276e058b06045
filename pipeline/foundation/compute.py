"""What the proxy engine's compute can be on a model: ``real`` needs F16 experts or GGUF
quantized experts of a type it dequantizes (``DEQUANTIZED``).

``pipeline.run`` decodes with ``real`` (SwiGLU on the experts' values: F16 as stored, the
quantized types dequantized to float32 per use, ``moestream.gpu.dequant``), ``digest`` or
``fixed`` compute (``pipeline.proxy.decode``). The session checks the choice before the log
header names it (``digest`` compute turns verification on), so the check lives below both,
beside ``ComputeSpec``; the set of types is here for the same reason, and
``moestream.gpu.dequant`` has a kernel for each.
"""

from __future__ import annotations

import structlog
from gguf import GGMLQuantizationType

from moestream.pipeline.foundation.config import ComputeSpec
from moestream.pipeline.foundation.errors import ExpertLayoutError
from moestream.pipeline.foundation.table import ExpertTable, MoeLayer

__all__ = ["DEQUANTIZED", "resolve_compute"]

_log = structlog.get_logger("moestream.decode")

_Q = GGMLQuantizationType
DEQUANTIZED = frozenset({_Q.Q4_0, _Q.Q4_1, _Q.Q5_0, _Q.Q5_1, _Q.Q8_0, _Q.Q2_K, _Q.Q3_K,
                         _Q.Q4_K, _Q.Q5_K, _Q.Q6_K, _Q.IQ1_S, _Q.IQ1_M, _Q.IQ2_XXS,
                         _Q.IQ2_XS, _Q.IQ2_S, _Q.IQ3_XXS, _Q.IQ3_S, _Q.IQ4_NL, _Q.IQ4_XS,
                         _Q.MXFP4, _Q.NVFP4})
"""The GGUF quantized types ``real`` compute dequantizes (bitwise ``gguf.quants.dequantize``)
before its SwiGLU: ds4's experts (IQ2_XXS, Q2_K), the k-quants and legacy quants, the IQ
types of the common low-bit files (IQ1 to IQ4), MXFP4 (gpt-oss's GGUF) and NVFP4."""
_COMPUTED = DEQUANTIZED | {_Q.F16}


def _kinds(layer: MoeLayer) -> str:
    if layer.quant is not None:
        return f"{layer.quant.method} blocks"
    return f"{layer.gate_up_type.name}/{layer.down_type.name}"


def _computable(table: ExpertTable) -> bool:
    """Whether ``real`` compute can run: every MoE layer's experts are F16 or of a type in
    ``DEQUANTIZED`` (True), or none are (False: the run falls back to ``digest``, logged
    once with the types).

    Raises:
        ExpertLayoutError: some layers can be computed and others cannot (every layer is
            checked here, before decoding, not when a token first reaches the other type).
    """
    other = {n: layer for n, layer in table.layers.items()
             if layer.quant is not None
             or not {layer.gate_up_type, layer.down_type} <= _COMPUTED}
    if not other:
        return True
    n, layer = next(iter(other.items()))
    if len(other) < len(table.layers):
        ok = next(m for m in table.layers if m not in other)
        raise ExpertLayoutError(
            table.path, f"real compute cannot run layer {n}'s {_kinds(layer)} experts "
            f"(layer {ok} is {_kinds(table.layers[ok])}; it dequantizes "
            f"{', '.join(sorted(q.name for q in DEQUANTIZED))}); use --compute digest or fixed")
    _log.warning("compute_fallback", requested="real", using="digest",
                 reason=f"experts are {_kinds(layer)}; real SwiGLU needs F16 or "
                        f"{', '.join(sorted(q.name for q in DEQUANTIZED))}")
    return False


def resolve_compute(compute: ComputeSpec, table: ExpertTable) -> ComputeSpec:
    """The compute a run on ``table`` does: ``real`` becomes ``digest`` on a model none of
    whose experts it can compute (logged once).

    Raises:
        ExpertLayoutError: some MoE layers can be computed and others cannot.
    """
    if compute.kind == "real" and any(layer.transposed or not layer.gated or layer.interleaved
                                      for layer in table.layers.values()):
        _log.warning("compute_fallback", requested="real", using="digest",
                     reason="transposed (gpt-oss), gate-less (Nemotron-H) or interleaved "
                            "(Inkling2) experts: not the SwiGLU layout real compute runs")
        return ComputeSpec("digest")
    if compute.kind == "real" and not _computable(table):
        return ComputeSpec("digest")
    return compute
