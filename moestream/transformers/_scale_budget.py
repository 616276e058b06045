"""The quantized experts' scales inside the experts' budget.

The integration keeps every quantized layer's expert scales on the device (``load_scales``:
one read a layer, one tensor a matrix kind, indexed by expert), beside the expert cache.
They are the experts' bytes as much as the cached matrices are: 1/16384 of an FP8 expert at
128 x 128 blocks, but 1/16 of an FP4 or MXFP4 one (E8M0 bytes, a scale per 32 values):
DeepSeek-V4-Flash's are ~8.6 GB over its 43 layers. So a budget given in bytes is what
the device holds for the experts, scales included: the cache gets what the scales leave,
and a budget they leave too little of is refused naming them. A budget of N experts keeps
N experts in the cache (their scales are held for every expert, on top); no budget holds
every expert and every scale. The summary names the scales' bytes.

Why the scales are held whole rather than streamed with each expert: a miss then reads and
uploads the expert's matrices only (no extra ranges a miss, no small uploads), and a batch's
dequantization indexes one tensor a kind. The cost is the scales of experts not cached; at
a budget that holds a fraction ``f`` of the experts, streaming them would leave the cache
``S * (1 - f)`` more bytes (``S``: every scale's bytes).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import moestream
from moestream.pipeline.foundation.config import Budget, parse_budget
from moestream.pipeline.foundation.errors import UsageError
from moestream.pipeline.foundation.experts import ExpertTable
from moestream.pipeline.foundation.sizes import size_text
from moestream.pipeline.foundation.table import open_table
from moestream.transformers._mtp import mtp_layers

__all__ = ["budget_less_scales", "held_bytes", "layer_scale_bytes", "scale_bytes"]

_HELD_SIZE = {"fp8": 4, "fp4": 1, "mxfp4": 1}
"""Bytes a scale takes on the device, by format: FP8 block scales as float32 (whatever the
file's type), the FP4 formats' E8M0 as their bytes."""


def scale_bytes(table: ExpertTable) -> int:
    """The device bytes ``load_scales`` holds for ``table``'s expert scales: every quantized
    layer the model computes (its MTP layers are not), each scale at its held size."""
    return sum(layer_scale_bytes(table).values())


def layer_scale_bytes(table: ExpertTable) -> dict[int, int]:
    """:func:`scale_bytes` per quantized layer the model computes."""
    shapes = {t.name: t.shape for t in table.non_routed}
    skipped = mtp_layers(table.config, table.layers)
    out: dict[int, int] = {}
    for index, layer in table.layers.items():
        quant = layer.quant
        if quant is None or index in skipped:
            continue
        total = 0
        for name in quant.names:
            elements = 1
            for n in shapes[name]:
                elements *= n
            total += elements * _HELD_SIZE[quant.method]
        out[index] = total
    return out


def held_bytes(scales: Mapping[int, Any]) -> int:
    """The device bytes the loaded scales take (``ExpertStream.scales``: per layer its
    ``LayerScales``; other per-layer entries hold none)."""
    total = 0
    for layer in scales.values():
        for kind in ("gate", "up", "down"):
            tensor = getattr(layer, kind, None)
            if tensor is not None and hasattr(tensor, "nbytes"):
                total += int(tensor.nbytes)
    return total


def budget_less_scales(path: Path, budget: Any, tuning: moestream.Tuning | None,
                       max_memory: Any = None) -> Any:
    """``budget`` for the session's cache: a size less the scales the device will hold
    (unchanged for a quantized-free checkpoint, a count of experts, no budget, or a budget
    from ``max_memory``, whose dense weights counted the scales already).

    Raises:
        UsageError: the scales leave the cache less than ``Tuning.layers_in_flight``
            layers' top-k experts.
    """
    given = _bytes_of(budget)
    if given is None or max_memory is not None:
        return budget
    layers_in_flight = (tuning or moestream.Tuning()).layers_in_flight
    table = open_table(path)
    scales = scale_bytes(table)
    if scales == 0:
        return budget
    largest = max(layer.expert_bytes for layer in table.layers.values())
    least = layers_in_flight * table.top_k * largest
    if given - scales < least:
        raise UsageError(f"budget {size_text(given)}: the experts' scales take "
                         f"{size_text(scales)} of it on the device (held for every expert) "
                         f"and the cache needs at least {size_text(least)} (top-{table.top_k} "
                         f"for each of {layers_in_flight} layers in flight): give at least "
                         f"{size_text(scales + least)}")
    return Budget(nbytes=given - scales)


def _bytes_of(budget: Any) -> int | None:
    """A budget's bytes, where it is a size (a ``Budget`` or its text); else None."""
    if isinstance(budget, Budget):
        return budget.nbytes
    if isinstance(budget, str):
        try:
            return parse_budget(budget).nbytes
        except UsageError:
            return None  # unreadable: the session's own check says why
    return None

