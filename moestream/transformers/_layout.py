"""How transformers' experts modules keep and use their weights, and the cache's matrices
as torch tensors: what the experts implementation computes with."""

from __future__ import annotations

from typing import Any

import torch  # type: ignore[import-not-found, unused-ignore]
from transformers.integrations import moe as hf_moe  # type: ignore[import-not-found, unused-ignore]

__all__ = ["TORCH_DTYPES", "biases", "first_projection", "grouped_linear", "raw", "view"]

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
