"""GGUF expert bytes to the compute dtype, on the device that holds them.

A GGUF model's experts stay quantized in the file, on the wire and in the device cache; each
use turns the arrived experts of a layer into the compute dtype here, one call per ggml type
(the caller concatenates the experts of one type, or passes a stacked view)::

    dequantize(blocks, ggml_type, dtype, *, out=None) -> torch.Tensor

- ``blocks``: uint8 (or int8) bytes on any device, CPU or CUDA, of shape ``(..., nbytes)``
  with ``nbytes`` a whole number of the type's blocks: one row, one expert's matrix as
  ``(rows, row_bytes)``, or experts stacked ``(experts, rows, row_bytes)``; a view is
  fine (it is read, never written).
- ``ggml_type``: the tensor's ggml type id (``gguf.GGMLQuantizationType``): the quantized
  types Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ1_S, IQ1_M,
  IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ4_NL, IQ4_XS, MXFP4 and NVFP4, and F32, F16,
  BF16 passed through. :func:`supported` says which; anything else (TQ1_0, TQ2_0...) is refused
  by :func:`require` and :func:`dequantize` with a ``UsageError`` naming the type.
- ``dtype``: torch.bfloat16, torch.float16 or torch.float32.
- Returns ``(..., nbytes // block_bytes * block_elems)`` of ``dtype`` on ``blocks``'s
  device, or ``out`` filled: a contiguous tensor of exactly that shape and dtype on that
  device, which the caller may reuse as scratch from call to call (nothing else is kept).
  Work is done in chunks of at most ``CHUNK_VALUES`` values, so the float32 temporaries
  stay bounded whatever the batch. Ops run on torch's current stream, like the model's:
  no synchronization here.
- Refused, each in one line: a type not :func:`supported` (``UsageError``; a loader that
  knows the file and tensor calls :func:`require` first and says which), a dtype not in
  ``DTYPES``, a last dimension that is not whole blocks, an ``out`` that does not fit
  (``UsageError``), ``blocks`` that are not a uint8/int8 tensor (``UsageTypeError``).

Exactness, the contract: the result is bitwise equal (so ``torch.equal``) to
``torch.from_numpy(gguf.quants.dequantize(raw, ggml_type)).to(dtype)``, gguf-py's float32
reference rounded once to ``dtype``: every routine (``_gguf_blocks``) computes in float32,
product for product as gguf-py does, and rounds once, on the store of its last product into
the output. ``tests/transformers/test_gguf_dequant.py`` holds it on random valid blocks of
every type and dtype (and ``test_gguf_dequant_gpu.py`` on CUDA).

Why not transformers' ``integrations/gguf/dequant.py`` (torch ops, any device): it is not
in the transformers the GPU machine has for most types (5.16 and earlier: absent; 5.17:
Q8_0 and Q4_K..Q6_K only; 5.18 to 5.25: 12 of the 15 types, never Q5_0, Q5_1 or MXFP4),
asked for bf16 it computes in bf16 (``d.to(bf16) * q``: two roundings, not gguf-py's
values), and at float32, where it is equal, it does more work: it returns float32 that
must then be cast (one more pass over the values) and builds the IQ types' values with two
gathers and two products where a signed grid needs one of each (``python -m
bench.gguf_dequant`` times both, and checks they make the same bits). So no transformers
version is required, and one code path runs everywhere.
"""

from __future__ import annotations

from typing import Any

import gguf
import torch  # type: ignore[import-not-found, unused-ignore]

from moestream.pipeline.foundation.errors import UsageError, UsageTypeError
from moestream.transformers._gguf_blocks import ROUTINES

__all__ = ["CHUNK_VALUES", "DTYPES", "block_shape", "dequantize", "require", "supported"]

Q = gguf.GGMLQuantizationType

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
"""The compute dtypes :func:`dequantize` writes."""

CHUNK_VALUES = 1 << 24
"""The most values one routine call makes (64 MiB of each float32 temporary)."""

_PLAIN = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}
"""The float types: their bytes are the values, read as this torch dtype."""


def supported(ggml_type: int) -> bool:
    """Whether :func:`dequantize` takes tensors of this ggml type id."""
    return ggml_type in ROUTINES or ggml_type in _PLAIN


def require(ggml_type: int) -> None:
    """Refuse a ggml type :func:`dequantize` does not take, in one line naming it.

    Raises:
        UsageError: the type is not :func:`supported`.
    """
    if not supported(ggml_type):
        names = ", ".join(_name(t) for t in sorted({*ROUTINES, *_PLAIN}))
        raise UsageError(f"GGUF tensor type {_name(ggml_type)} cannot be dequantized by "
                         f"moestream (supported: {names})")


def block_shape(ggml_type: int) -> tuple[int, int]:
    """``(values, bytes)`` of one block of this type (one value for the float types)."""
    require(ggml_type)
    elems, nbytes = gguf.GGML_QUANT_SIZES[Q(ggml_type)]
    return int(elems), int(nbytes)


def dequantize(blocks: torch.Tensor, ggml_type: int, dtype: torch.dtype, *,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """GGUF bytes of one or many experts to values of ``dtype``, on their device.

    Args:
        blocks: ``(..., nbytes)`` uint8 or int8, ``nbytes`` a whole number of blocks.
        ggml_type: the bytes' ggml type id.
        dtype: bfloat16, float16 or float32.
        out: optional, contiguous ``(..., values)`` of ``dtype`` on ``blocks``'s device:
            written and returned instead of a new tensor.

    Returns:
        ``(..., nbytes // block_bytes * block_elems)`` of ``dtype``, bitwise gguf-py's
        float32 dequantization rounded once to ``dtype``.

    Raises:
        UsageError: an unsupported type or dtype, a partial block, or an ``out`` that does
            not fit; ``UsageTypeError`` when ``blocks`` is not a uint8/int8 tensor.
    """
    elems, nbytes = block_shape(ggml_type)
    shape = _result_shape(blocks, nbytes, elems, dtype)
    target = _target(out, shape, dtype, blocks.device)
    raw = blocks.view(torch.uint8)
    if ggml_type in _PLAIN:
        return _cast(raw, _PLAIN[Q(ggml_type)], target)
    flat_blocks = raw.reshape(-1, nbytes)
    flat_out = target.view(-1, elems)
    routine = ROUTINES[ggml_type]
    step = max(1, CHUNK_VALUES // elems)
    for start in range(0, flat_blocks.shape[0], step):
        routine(flat_blocks[start : start + step], flat_out[start : start + step])
    return target


def _result_shape(blocks: Any, nbytes: int, elems: int, dtype: Any) -> tuple[int, ...]:
    """The values' shape for ``blocks``, after checking the arguments."""
    if not isinstance(blocks, torch.Tensor) or blocks.dtype not in (torch.uint8, torch.int8):
        kind = blocks.dtype if isinstance(blocks, torch.Tensor) else type(blocks).__name__
        raise UsageTypeError(f"GGUF blocks must be a uint8 tensor, not {kind}")
    if dtype not in DTYPES:
        raise UsageError(f"GGUF blocks dequantize to bfloat16, float16 or float32, not {dtype}")
    if blocks.dim() == 0 or blocks.shape[-1] % nbytes:
        last = blocks.shape[-1] if blocks.dim() else "a scalar"
        raise UsageError(f"GGUF blocks of {nbytes} bytes: a row of {last} bytes is not a "
                         "whole number of blocks")
    return (*blocks.shape[:-1], blocks.shape[-1] // nbytes * elems)


def _target(out: Any, shape: tuple[int, ...], dtype: Any, device: Any) -> torch.Tensor:
    """``out`` checked against the result, or a new tensor for it."""
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != shape or out.dtype != dtype \
            or out.device != device or not out.is_contiguous():
        got = (f"{tuple(out.shape)} {out.dtype} on {out.device}"
               f"{'' if out.is_contiguous() else ', not contiguous'}"
               if isinstance(out, torch.Tensor) else type(out).__name__)
        raise UsageError(f"out must be a contiguous {shape} {dtype} tensor on {device}, "
                         f"not {got}")
    return out


def _cast(raw: torch.Tensor, stored: Any, target: torch.Tensor) -> torch.Tensor:
    """F32/F16/BF16 bytes read as their type and rounded once into ``target``."""
    size = torch.empty((), dtype=stored).element_size()
    if raw.storage_offset() % size or not raw.is_contiguous():
        raw = raw.clone()  # a typed view needs aligned, contiguous bytes
    return target.copy_(raw.view(stored))


def _name(ggml_type: int) -> str:
    try:
        return f"{Q(ggml_type).name} ({int(ggml_type)})"
    except ValueError:
        return f"ggml type {ggml_type!r}"
