"""A GGUF layer's routed experts dequantized per use, into the module's own layout.

The experts of a GGUF file stream as their blocks (the cache holds, and the budget counts,
the quantized bytes); each use turns the experts of one arrival batch into the compute
dtype on the device: on a GPU by ``_dequant_cuda.gguf_layer_cuda`` (one CuPy kernel launch
a type, reading the cache in place), elsewhere (and for a float type among them) by
:meth:`GgufExperts.fill`, ``_gguf_dequant.dequantize``'s torch ops. Both give gguf-py's
float32 rounded once to the dtype, bit for bit: what transformers' own GGUF loading gives,
since it dequantizes with gguf-py and casts (an architecture transformers loads through its
conversion ops dequantizes by its own routines in the model's dtype: outside float32 those
serve, :attr:`GgufExperts.in_dtype`). A layer's gate and up share one ggml type (the
table checks it) and are dequantized together straight into the stacked ``gate_up`` (gate
rows first, as transformers stacks ``ffn_gate_exps`` and ``ffn_up_exps``); down apart where
its type differs. Types may differ from layer to layer and between gate/up and down; float
types (F16, BF16, F32) among them are cast by the torch path.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch  # type: ignore[import-not-found, unused-ignore]
from gguf import GGMLQuantizationType

import moestream
from moestream.pipeline.foundation.errors import ModelFileError
from moestream.transformers._gguf_dequant import dequantize, supported
from moestream.transformers._layout import TORCH_DTYPES

__all__ = ["GgufExperts", "gguf_experts"]


@dataclass(frozen=True, slots=True)
class GgufExperts:
    """One GGUF layer's expert types, and their dequantization into the module's layout
    (``gate_up`` ``(n, 2F, D)``, ``down`` ``(n, D, F)``; GGUF's experts are never
    transposed).

    Attributes:
        gate_up_type: the ggml type of gate and up.
        down_type: the ggml type of down.
    """

    gate_up_type: int
    down_type: int
    method: str = "gguf"
    transposed: bool = False
    in_dtype: bool = False
    """The reference dequantizes in the compute dtype (transformers' conversion-ops path:
    its own routines, whose arithmetic in bf16 or fp16 rounds along the way), not gguf-py's
    float32 rounded once: into any dtype but float32 (where the two agree), transformers'
    routine serves, not moestream's."""

    def own(self, dtype: Any) -> bool:
        """Whether moestream's dequantization (``_gguf_dequant``, the CUDA kernels) gives
        the reference's values in ``dtype``."""
        return not self.in_dtype or dtype == torch.float32

    def fill(self, experts: list[int], raws: tuple[Any, Any, Any], gate_up: Any,
             down: Any) -> None:
        """The stacked blocks of gate, up and down (``raws``: ``(n, rows, row_bytes)``
        each) dequantized into ``gate_up`` and ``down``: one call per matrix kind."""
        stacked = torch.cat((_bytes(raws[0]), _bytes(raws[1])), dim=1)
        self._into(stacked, self.gate_up_type, gate_up)
        self._into(_bytes(raws[2]), self.down_type, down)

    def expert(self, expert: int, raws: tuple[Any, Any, Any], dtype: Any
               ) -> tuple[Any, Any, Any]:
        """One expert's gate ``(F, D)``, up ``(F, D)`` and down ``(D, F)`` in ``dtype``, from
        its blocks (``raws``: ``(rows, row_bytes)`` each)."""
        gate, up, down = raws
        routine = dequantize if self.own(dtype) else _theirs
        return (routine(_bytes(gate), self.gate_up_type, dtype),
                routine(_bytes(up), self.gate_up_type, dtype),
                routine(_bytes(down), self.down_type, dtype))

    def _into(self, blocks: Any, kind: int, out: Any) -> None:
        if self.own(out.dtype):
            dequantize(blocks, kind, out.dtype, out=out)
        else:
            out.copy_(_theirs(blocks, kind, out.dtype))


def _theirs_read(*kinds: int) -> bool:
    """Whether transformers' conversion-ops routines dequantize every one of ``kinds``."""
    from transformers.integrations.gguf.dequant import GGML_BLOCK

    return all(int(kind) in GGML_BLOCK or GGMLQuantizationType(kind).name in TORCH_DTYPES
               for kind in kinds)


def _theirs(blocks: Any, kind: int, dtype: Any) -> Any:
    """``blocks`` ``(..., rows, row_bytes)`` as transformers' conversion-ops path
    dequantizes them into ``dtype`` (its ``Dequantize`` op's routine), ``(..., rows,
    values)``; a float type cast once, as its ``Cast`` does."""
    float_type = TORCH_DTYPES.get(GGMLQuantizationType(kind).name)
    if float_type is not None:
        return blocks.contiguous().view(float_type).to(dtype)
    from transformers.integrations.gguf.dequant import dequantize as transformers_dequantize

    values = transformers_dequantize(blocks.contiguous().reshape(-1), kind, dtype)
    return values.reshape(*blocks.shape[:-1], -1)


def _bytes(matrix: Any) -> Any:
    """A matrix of the cache as its bytes, ``(..., rows, row_bytes)`` (an F16 or F32 matrix
    comes typed)."""
    return matrix if matrix.dtype == torch.uint8 else matrix.view(torch.uint8)


def gguf_experts(session: moestream.SyncSession, layers: list[int], *,
                 in_dtype: bool = False) -> dict[int, GgufExperts]:
    """Each quantized MoE layer's :class:`GgufExperts`, once every expert type is one
    moestream dequantizes (``in_dtype``: as :attr:`GgufExperts.in_dtype`). A layer of float
    experts only (F16, BF16, F32) is left out: the experts call casts those from the cache
    as it does a checkpoint's (on a GPU by copies out of the cache, no stacking), the same
    values (a float type's values cast once).

    Raises:
        ModelFileError: a layer's experts in a type the dequantizer lacks (named).
    """
    out = {}
    path: Path = session.model.path
    for layer in layers:
        info = session.model.layers[layer]
        for kind in (info.gate_up_type, info.down_type):
            if not supported(int(kind)):
                names = ", ".join(t.name for t in GGMLQuantizationType if supported(int(t)))
                raise ModelFileError(path, f"layer {layer}: experts in {kind.name}, a GGUF "
                                     f"type moestream does not dequantize (it does {names})")
        if {info.gate_up_type.name, info.down_type.name} - set(TORCH_DTYPES):
            # a type transformers' routines lack (MXFP4, say): transformers loads no such
            # file at all, and gguf-py's values are the reference, as on the legacy path
            kinds = int(info.gate_up_type), int(info.down_type)
            out[layer] = GgufExperts(*kinds, in_dtype=in_dtype and _theirs_read(*kinds))
    return out
