"""The experts' budget from transformers' words: ``max_memory``, and a budget of nothing.

transformers bounds a model's memory per device with ``max_memory``; here the dense weights
sit on one device whole and only the routed experts stream, so ``max_memory`` for that
device is the dense weights plus the experts' cache: the budget is what ``max_memory``
leaves once the dense weights are counted. Both that and the refusal of a zero or negative
budget need the model's sizes (its dense tensors, its top-k and expert bytes) before the
session opens with the budget, so they read the checkpoint's headers once more
(``open_table``): sizes only, never a byte the model computes with.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch  # type: ignore[import-not-found, unused-ignore]

import moestream
from moestream.pipeline.foundation.config import Budget, parse_budget, parse_size
from moestream.pipeline.foundation.errors import UsageError, UsageTypeError
from moestream.pipeline.foundation.experts import ExpertTable
from moestream.pipeline.foundation.sizes import size_text
from moestream.pipeline.foundation.table import open_table
from moestream.transformers._mtp import mtp_layers
from moestream.transformers._scale_budget import scale_bytes

__all__ = ["budget_for", "dense_bytes", "warn_if_clamped"]

_FLOATS = {"F16", "BF16", "F32", "F64", "F8_E4M3", "F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ"}
"""Dense tensor types the loader casts to the model's dtype (FP8 weights dequantized)."""


def budget_for(path: Path, budget: Any, max_memory: Any, device: Any, dtype: Any,
               tuning: moestream.Tuning | None) -> Any:
    """The budget to open the session with: ``budget`` as given, or what ``max_memory``
    leaves the experts on ``device``.

    Raises:
        UsageError: both given; ``max_memory`` names no size for ``device`` or leaves the
            experts less than they need; a budget of no experts (the refusal names the
            model's least).
    """
    if max_memory is not None and budget is not None:
        raise UsageError("give budget or max_memory, not both (max_memory for the device, "
                         "less the dense weights, is the experts' budget)")
    # a tuning of another type is refused by the session's open, in its own words
    in_flight = (tuning if isinstance(tuning, moestream.Tuning)
                 else moestream.Tuning()).layers_in_flight
    if max_memory is not None:
        return _from_max_memory(path, max_memory, device, dtype, in_flight)
    if _nothing(budget):
        table = open_table(path)
        least = in_flight * table.top_k
        shown = str(budget) if isinstance(budget, Budget) else repr(budget)
        raise UsageError(f"budget {shown[:40]}: this model needs at least "
                         f"{_experts(least)} (its top-{table.top_k} for "
                         f"{_in_flight(in_flight)}): give budget={least} or more, or "
                         "a size (\"20GiB\")")
    return budget


def _nothing(budget: Any) -> bool:
    """A budget of no experts or bytes (zero or negative), which no model can take."""
    if isinstance(budget, Budget):
        return (budget.experts if budget.experts is not None else budget.nbytes or 0) < 1
    if isinstance(budget, int) and not isinstance(budget, bool):
        return budget < 1
    if isinstance(budget, str):
        if budget.strip().startswith("-"):
            return True
        try:
            parsed = parse_budget(budget)
        except UsageError:
            return False  # unreadable: the session's own check says why
        return (parsed.experts if parsed.experts is not None else parsed.nbytes or 0) < 1
    return False


def _from_max_memory(path: Path, max_memory: Any, device: Any, dtype: Any,
                     in_flight: int) -> Budget:
    limit = _device_limit(max_memory, device)
    table = open_table(path)
    dense = dense_bytes(table, dtype)
    least = in_flight * table.top_k * max(layer.expert_bytes for layer in table.layers.values())
    if limit - dense < least:
        raise UsageError(f"max_memory {size_text(limit)} for {device}: the dense weights take "
                         f"{size_text(dense)} and the experts at least {size_text(least)} "
                         f"(top-{table.top_k} for {_in_flight(in_flight)}): "
                         f"give at least {size_text(dense + least)}")
    return Budget(nbytes=limit - dense)


def _device_limit(max_memory: Any, device: Any) -> int:
    """The bytes ``max_memory`` gives ``device`` (keys as transformers': a GPU's index or
    ``"cuda:N"``, ``"cpu"``); entries for other devices are not used."""
    if not isinstance(max_memory, dict):
        raise UsageTypeError(f"max_memory must be a dict of device to size, as transformers "
                             f"takes it ({{0: \"20GiB\"}}), not {type(max_memory).__name__}")
    keys = ([device.index or 0, str(device.index or 0), f"cuda:{device.index or 0}"]
            if device.type == "cuda" else ["cpu"])
    if device.type == "cuda" and device.index in (None, 0):
        keys.append("cuda")
    for key in keys:
        if key in max_memory:
            value = max_memory[key]
            break
    else:
        raise UsageError(f"max_memory names no size for {device}, where the model computes "
                         f"(give {{{keys[0]!r}: \"20GiB\"}}; its keys: "
                         f"{', '.join(map(repr, list(max_memory)[:8]))})")
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    if isinstance(value, str):
        return parse_size(value.strip())
    raise UsageError(f"max_memory[{key!r}]: {str(value)[:40]!r} is not a size (bytes as an "
                     "int, or text with its unit: \"20GiB\")")


def dense_bytes(table: ExpertTable, dtype: Any) -> int:
    """The device bytes of the checkpoint's tensors other than the routed experts, as the
    model will hold them: floating (and FP8, dequantized) ones in ``dtype`` (None: the
    checkpoint's, as ``config.json`` names it), others as stored. A GGUF file's are all
    dequantized at load, in float32 unless ``dtype`` (transformers' dtype for a GGUF). The
    experts' scales count at their held size; a dense FP8 weight's scale, folded into it at
    load, not at all."""
    gguf = table.format == "gguf"
    if dtype is None and gguf:
        dtype = torch.float32
    elif dtype is None:
        stored = table.config.get("dtype") or table.config.get("torch_dtype")
        dtype = getattr(torch, str(stored), None) if stored not in (None, "auto") else None
    size = torch.tensor([], dtype=dtype).element_size() if isinstance(dtype, torch.dtype) else None
    names = {tensor.name: tensor.type_name for tensor in table.non_routed}
    experts_scales = {name for layer in table.layers.values() if layer.quant is not None
                      for name in layer.quant.names}
    total = scale_bytes(table)  # the experts' scales, at the size the device holds them
    for tensor in table.non_routed:
        if tensor.name in experts_scales or _folded_scale(tensor.name, names):
            continue
        elements = 1
        for n in tensor.shape:
            elements *= n
        floating = gguf or tensor.type_name in _FLOATS
        total += elements * size if size is not None and floating else tensor.nbytes
    return total


def _folded_scale(name: str, types: dict[str, str]) -> bool:
    """Whether ``name`` is a dense FP8 weight's scale, folded into the weight at load and
    never held (a ``weight_scale_inv`` beside its weight, or DeepSeek-V4's ``.scale`` of an
    F8_E4M3 ``.weight``)."""
    if name.endswith("_scale_inv"):
        return name.removesuffix("_scale_inv") in types
    return name.endswith(".scale") and types.get(
        name.removesuffix(".scale") + ".weight") == "F8_E4M3"


def warn_if_clamped(session: moestream.SyncSession, budget: Any) -> None:
    """Warn (``UserWarning``, shown whether or not the application configured logging) when
    the session holds less than ``budget`` asked: the device had less free memory, so the
    cache was cut to it and more experts will miss than the budget promised."""
    info = session.model
    expert_bytes = max(layer.expert_bytes for layer in info.layers.values())
    if budget is None:  # the model's experts: a checkpoint's MTP layers are never fetched
        skipped = mtp_layers(info.config, info.layers)
        wanted = sum(layer.n_experts * layer.expert_bytes
                     for index, layer in info.layers.items() if index not in skipped)
        asked = f"every expert ({size_text(wanted)})"
    else:
        given = budget if isinstance(budget, Budget) else parse_budget(str(budget))
        if given.nbytes is not None:
            wanted, asked = given.nbytes, f"budget {size_text(given.nbytes)}"
        else:
            wanted = (given.experts or 0) * expert_bytes
            asked = f"budget {given} ({size_text(wanted)})"
    held = session.counters().budget_bytes
    if held < wanted:
        warnings.warn(f"{asked} is more than the device's free memory: the experts' cache "
                      f"holds {size_text(held)} (room for {_experts(held // expert_bytes)})",
                      UserWarning, stacklevel=3)


def _experts(n: int) -> str:
    return f"{n} expert{'' if n == 1 else 's'}"


def _in_flight(n: int) -> str:
    return "the one layer in flight" if n == 1 else f"each of the {n} layers in flight"
