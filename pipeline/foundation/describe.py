"""A model's experts as people read them: their format and bytes each.

Here, beside the expert table's types, because both the library (the session names the
experts in its summary and the log's ``run_end``) and a client that has only the public
``LayerInfo`` (``--engine transformers``' summary) describe them, and must say the same.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from moestream.pipeline.foundation.sizes import size_text

__all__ = ["describe_experts"]


def describe_experts(layers: Iterable[Any]) -> str:
    """The experts as a miss reads them: format and bytes each, from MoE layer descriptions
    (``MoeLayer`` or ``LayerInfo``: ``gate_up_type``, ``down_type``, ``expert_bytes``,
    ``quant``), e.g. ``fp8 blocks 128x128, 4.50 MiB an expert as stored``."""
    layers = list(layers)
    if not layers:
        return ""
    first = layers[0]
    if first.quant is not None and first.quant.method == "fp8":
        bm, bn = first.quant.block
        kind = f"fp8 blocks {bm}x{bn}"
    elif first.quant is not None:  # E2M1 pairs, a power-of-two scale per 32 values
        kind = f"{first.quant.method} (E2M1, an E8M0 scale per 32)"
    else:
        kinds = {first.gate_up_type.name, first.down_type.name}
        kind = "/".join(sorted(kinds))
    sizes = sorted({layer.expert_bytes for layer in layers})
    each = size_text(sizes[0])
    if len(sizes) > 1:
        each += f" to {size_text(sizes[-1])}"
    return f"experts {kind}, {each} an expert as stored"
