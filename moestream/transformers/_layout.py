"""How transformers' experts modules keep and use their weights, and the cache's matrices
as torch tensors: what the experts implementation computes with."""

from __future__ import annotations

from typing import Any

import torch  # type: ignore[import-not-found, unused-ignore]
from transformers.integrations import moe as hf_moe  # type: ignore[import-not-found, unused-ignore]

__all__ = ["TORCH_DTYPES", "batched_mm", "biases", "first_projection", "grouped_linear", "raw",
           "view"]

TORCH_DTYPES: dict[str, Any] = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
}
"""The expert types torch computes, by GGUF type name."""


def view(matrix: Any, dtype: Any) -> Any:
    """A matrix of the cache as a torch tensor of its shape (no copy; BF16 included, which
    numpy has no type for), cast to ``dtype`` if it differs."""
    source = TORCH_DTYPES[matrix.ggml_type.name]
    # the matrix's own export: on a GPU it orders torch's stream after the upload (already
    # waited for) and nothing else; BF16 comes as its raw bytes (numpy has no bfloat16)
    tensor = torch.utils.dlpack.from_dlpack(matrix).view(source).view(matrix.shape)
    return tensor if source == dtype else tensor.to(dtype)


def raw(matrix: Any) -> Any:
    """A quantized matrix's bytes as a tensor of its rows (no copy): uint8 ``(rows,
    row_bytes)`` (a GGUF block type's rows are whole blocks), typed for F16 and F32."""
    return torch.utils.dlpack.from_dlpack(matrix).view(matrix.shape[0], -1)


def first_projection(module: Any) -> Any:
    """An experts module's first projection: ``gate_up_proj``, or ``up_proj`` for experts
    without a gate (Nemotron-H); None if it has neither."""
    return getattr(module, "gate_up_proj" if getattr(module, "has_gate", True) else "up_proj",
                   None)


def biases(module: Any) -> tuple[Any, Any]:
    """The experts' first-projection and down biases (gpt-oss), or (None, None)."""
    if not getattr(module, "has_bias", False):
        return None, None
    first = (module.gate_up_proj_bias if getattr(module, "has_gate", True)
             else module.up_proj_bias)
    return first, module.down_proj_bias


def grouped_linear(x: Any, weight: Any, offsets: Any, bias: Any, transposed: bool) -> Any:
    """transformers' grouped product; its bias and transposed arguments only when used
    (older transformers 5 releases take neither)."""
    if bias is None and not transposed:
        return hf_moe._grouped_linear(x, weight, offsets)
    return hf_moe._grouped_linear(x, weight, offsets, bias=bias, is_transposed=transposed)


BATCHED_MM = getattr(hf_moe, "batched_mm_experts_forward", None)
"""transformers' ``batched_mm`` arithmetic (None before it had one)."""


class _Gathered:
    """A stacked parameter's stand-in in :data:`BATCHED_MM`: indexed by the call's expert
    ids, it gives the weights already gathered in the pairs' order."""

    __slots__ = ("weights",)

    def __init__(self, weights: Any) -> None:
        self.weights = weights

    def __getitem__(self, expert_ids: Any) -> Any:
        return self.weights


class _PairsModule:
    """An experts module as :data:`BATCHED_MM` reads it, its stacked projections replaced
    by the call's gathered weights; everything else (gate, activation, biases, flags) the
    module's own."""

    def __init__(self, module: Any, first: Any, down: Any) -> None:
        self._module = module
        self.gate_up_proj = self.up_proj = _Gathered(first)
        self.down_proj = _Gathered(down)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def batched_mm(module: Any, first: Any, down: Any, hidden: Any, top_k_index: Any,
               top_k_weights: Any) -> Any:
    """transformers' own ``batched_mm_experts_forward`` over weights gathered per (token,
    slot) pair: ``first`` ``(pairs, ...)`` as the module's first projection a row, ``down``
    as its down projection, pair ``i`` the expert ``top_k_index.reshape(-1)[i]``. What
    ``generate`` computes a decode step with on a GPU where the model's experts use
    ``grouped_mm`` (its ``_optimize_model_for_decode``)."""
    assert BATCHED_MM is not None  # callers ask only where it exists
    return BATCHED_MM(_PairsModule(module, first, down), hidden, top_k_index, top_k_weights)
