"""Quantized experts dequantized on a CUDA device by kernels of our own (CuPy), bitwise what
torch's ops give: one launch a batch of arrived experts, all three matrix kinds.

torch's path stacks the experts' bytes (a copy, through one DLPack import a matrix: host
time), then gathers, multiplies and casts (several kernels and float32 temporaries a
matrix kind). These kernels read each expert's bytes where the cache holds them and write
the compute dtype straight into the grouped product's stacked weights, in the module's
layout (gpt-oss's transposed one included). What they compute is in ``_dequant_source``:
FP8 by its arithmetic (an exact decode, one float32 product, the output type's rounding),
the FP4 formats by a table of the torch path's own values for every code and scale byte.

A batch's table of addresses, expert ids and kind parameters goes to the device through
pinned memory (``_kernel_tables``: a ring, or a captured launch's kept slot), a copy queued
on torch's stream. Launched on torch's current stream: ordered with the model's kernels.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch  # type: ignore[import-not-found, unused-ignore]

from moestream.transformers._dequant import (
    e2m1_pairs,
    fp4_blocks,
    mxfp4_blocks,
    mxfp4_exponents,
)
from moestream.transformers._dequant_source import (
    FP4_PARAMS,
    FP8_PARAMS,
    GGUF_GROUP,
    GGUF_KERNELS,
    GGUF_PARAMS,
    SOURCE,
    gguf_source,
)
from moestream.transformers._gguf_experts import GgufExperts
from moestream.transformers._kernel_tables import table_on_device
from moestream.transformers._launch import current_stream, on_stream
from moestream.transformers._quantized import LayerScales

__all__ = [
    "CUDA_DTYPES",
    "GGUF_TYPES",
    "Kind",
    "available",
    "fp4_experts_cuda",
    "fp8_experts_cuda",
    "fp8_kinds_cuda",
    "gguf_kinds_cuda",
    "gguf_layer_cuda",
    "kernels_serve",
    "layer_experts_cuda",
    "layer_slots_cuda",
    "lookup_table",
]

_FP8_KERNELS = {torch.bfloat16: "fp8_experts_bf16", torch.float16: "fp8_experts_f16",
                torch.float32: "fp8_experts_f32"}
CUDA_DTYPES = frozenset(_FP8_KERNELS)
"""The output types the kernels write."""
_SUFFIXES = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}
GGUF_TYPES = frozenset(GGUF_KERNELS)
"""The ggml types (ids) the GGUF kernels dequantize."""
_THREADS = 256
_MAX_BLOCKS = 4096
_FP4_BLOCKS = 1024
"""Blocks of an FP4 kernel a kind: each block first copies the 8-16 KB value table into
its shared memory, so fewer blocks, each taking more chunks, copy it fewer times."""
_PART = 1000
"""Experts one launch takes (its table within a table slot, ``_kernel_tables.SLOT``)."""
_NO_SLOTS = np.uint64(0)
"""The slots and layer table of a launch whose batch table names its experts."""


@dataclass(frozen=True, slots=True)
class Kind:
    """One matrix kind of a batch (gate, up or down).

    Attributes:
        addresses: each expert's matrix on the device (``Matrix.ptr``).
        scales: the layer's scales of this kind, indexed by expert: FP8 float32
            ``(experts, rows / bm, cols / bn)``; FP4 the E8M0 bytes ``(experts, rows,
            cols / 32)``, rows and experts at any stride.
        out: ``(n, rows, cols)`` (FP4 transposed: ``(n, cols, rows)``), the last axis
            contiguous.
    """

    addresses: Sequence[int]
    scales: Any
    out: Any


@functools.cache
def available() -> bool:
    """Whether CuPy is here to compile and launch the kernels (with a CUDA device)."""
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


@functools.cache
def _module(device: int, gguf: bool) -> Any:
    """The FP8/FP4 kernels, or (``gguf``) the GGUF ones: built apart, so that a model of
    one kind never waits for the other's compile."""
    import cupy

    with cupy.cuda.Device(device):
        return cupy.RawModule(code=gguf_source() if gguf else SOURCE, options=("-std=c++14",))


@functools.cache
def _function(name: str, device: int) -> Any:
    import cupy

    with cupy.cuda.Device(device):
        return _module(device, name.startswith("gguf_")).get_function(name)


def _launch(name: str, out: Any, table: Sequence[int], kinds: int, chunks: int,
            *tail: Any) -> None:
    """One kernel over ``kinds`` kinds of ``chunks`` chunks at most, its table ``table``."""

    stream = current_stream(out.device)
    device = stream.device_index
    address = table_on_device(table, stream)
    most = _FP4_BLOCKS if name.startswith("fp4_") else _MAX_BLOCKS
    grid = (max(1, min(-(-chunks // _THREADS), most)), kinds)
    on_stream(_function(name, device), device, stream.cuda_stream, grid, (_THREADS,),
              (np.uint64(address), np.int32(kinds), *tail))


def _aligned(*values: int) -> bool:
    return all(v % 16 == 0 for v in values)


def _fp8_params(kinds: Sequence[Kind], n: int, bn: int) -> tuple[list[int], int]:
    """The FP8 kernel's parameters of each kind (16 bytes a thread where a row's columns,
    a scale's block and the output allow), and the most chunks a kind has.

    Raises:
        ValueError: an output or scales the kernel cannot address.
    """
    out = kinds[0].out
    params: list[int] = []
    chunks = 0
    for kind in kinds:
        o = kind.out
        _, rows, cols = o.shape
        if o.stride(2) != 1 or o.stride(1) != cols or o.dtype != out.dtype:
            raise ValueError("the kernel writes rows of contiguous columns, one type a batch")
        scales = kind.scales
        if scales.dtype != torch.float32 or not scales.is_contiguous():
            raise ValueError("FP8 scales are contiguous float32 on the device")
        _, sr, sc = scales.shape
        vec = cols % 16 == 0 and bn % 16 == 0 and _aligned(o.data_ptr(),
                                                           o.stride(0) * o.element_size())
        params += [o.data_ptr(), o.stride(0), rows, cols, scales.data_ptr(), sr, sc, int(vec)]
        chunks = max(chunks, n * rows * (cols // 16 if vec else cols))
    assert len(params) == FP8_PARAMS * len(kinds)
    return params, chunks


def _fp4_params(kinds: Sequence[Kind], n: int, transposed: bool) -> tuple[list[int], int]:
    """The FP4 kernel's parameters of each kind, and the most chunks a kind has.

    Raises:
        ValueError: an output or scales the kernel cannot address.
    """
    out = kinds[0].out
    params: list[int] = []
    chunks = 0
    for kind in kinds:
        o, scales = kind.out, kind.scales
        _, rows, groups = scales.shape
        want = (groups * 32, rows) if transposed else (rows, groups * 32)
        if (tuple(o.shape[1:]) != want or o.stride(2) != 1 or o.dtype != out.dtype
                or scales.dtype != torch.uint8 or scales.stride(2) != 1):
            raise ValueError("FP4 outputs of the scales' shape with contiguous last axes, one "
                             "type a batch; scales their E8M0 bytes")
        size = o.element_size()
        vec = not transposed and _aligned(o.data_ptr(), o.stride(0) * size, o.stride(1) * size)
        params += [o.data_ptr(), o.stride(0), o.stride(1), int(transposed), rows, groups,
                   scales.data_ptr(), scales.stride(0), scales.stride(1), int(vec)]
        chunks = max(chunks, n * rows * groups)
    assert len(params) == FP4_PARAMS * len(kinds)
    return params, chunks


def _batches(kinds: Sequence[Kind], experts: Sequence[int],
             params: Callable[[Sequence[Kind], int], tuple[list[int], int]], name: str,
             *tail: Any) -> None:
    """One launch of kernel ``name`` a part of ``_PART`` experts (a table within a ring
    slot): its table ``params``' parameters of the part's kinds, then each kind's addresses
    and the experts' ids; no slots (the table names the experts), then ``tail``."""
    for at in range(0, len(experts), _PART):
        part = [Kind(k.addresses[at:at + _PART], k.scales, k.out[at:at + _PART])
                for k in kinds]
        ids = experts[at:at + _PART]
        values, chunks = params(part, len(ids))
        if chunks:
            addresses = [int(a) for kind in part for a in kind.addresses]
            _launch(name, part[0].out, values + addresses + [int(e) for e in ids], len(part),
                    chunks, np.int32(len(ids)), _NO_SLOTS, _NO_SLOTS, *tail)


def fp8_kinds_cuda(kinds: Sequence[Kind], experts: Sequence[int], block: tuple[int, int]
                   ) -> None:
    """Dequantize FP8 matrices of each kind into its ``out``, one launch (a part of
    ``_PART`` experts).

    Raises:
        ValueError: an output or scales the kernel cannot address.
    """
    bm, bn = block
    _batches(kinds, experts, lambda part, n: _fp8_params(part, n, bn),
             _FP8_KERNELS[kinds[0].out.dtype], np.int32(bm), np.int32(bn))


def fp8_experts_cuda(addresses: Sequence[int], experts: Sequence[int], scales: Any,
                     out: Any, block: tuple[int, int]) -> None:
    """Dequantize ``len(addresses)`` FP8 matrices of one kind into ``out``.

    Args:
        addresses: each matrix's device address (``Matrix.ptr``), ``(rows, cols)`` bytes.
        experts: each matrix's expert, its row of ``scales``.
        scales: float32 ``(experts, ceil(rows / bm), ceil(cols / bn))`` on the device.
        out: ``(n, rows, cols)`` of a ``CUDA_DTYPES`` type, rows contiguous (a slice of
            the stacked gate_up is fine: any stride between matrices).
        block: ``(bm, bn)``.
    """
    fp8_kinds_cuda([Kind(addresses, scales, out)], experts, block)


@functools.cache
def lookup_table(method: str, dtype: Any, device: Any) -> Any:
    """``(256 * 16,)`` of ``dtype``: the torch path's value of each E2M1 code under each E8M0
    scale byte (``method``: ``fp4`` or ``mxfp4``), scale-major. Both paths' values are
    elementwise functions of (code, scale), so a lookup is bitwise the torch path. Kept for
    the process (a few 16 KB tables): a captured graph's kernels read it by address."""
    pairs = e2m1_pairs(device)
    codes = torch.arange(16, dtype=torch.uint8, device=device)
    group = torch.zeros(16, dtype=torch.uint8, device=device)  # one group: 32 values
    group[:8] = codes[0::2] | (codes[1::2] << 4)
    packed = group.expand(256, 16).contiguous()
    scales = torch.arange(256, dtype=torch.int32, device=device).to(torch.uint8)[:, None]
    if method == "mxfp4":
        values = mxfp4_blocks(packed, mxfp4_exponents(scales), dtype, pairs)
    elif method == "fp4":
        values = fp4_blocks(packed, scales.view(torch.float8_e8m0fnu), dtype, pairs)
    else:
        raise ValueError(f"no lookup table for {method!r}")
    return values[:, :16].contiguous().reshape(-1)


def fp4_experts_cuda(kinds: Sequence[Kind], experts: Sequence[int], method: str,
                     transposed: bool) -> None:
    """Dequantize FP4 (``fp4``) or MXFP4 (``mxfp4``) matrices of each kind into its
    ``out`` (``transposed``: each matrix's transpose, as gpt-oss keeps its experts), one
    launch (a part of ``_PART`` experts).

    Raises:
        ValueError: an output or scales the kernel cannot address.
    """
    out = kinds[0].out
    lut = lookup_table(method, out.dtype, out.device)
    _batches(kinds, experts, lambda part, n: _fp4_params(part, n, transposed),
             f"fp4_experts_{out.element_size()}", np.uint64(lut.data_ptr()))


def gguf_kinds_cuda(ggml_type: int, kinds: Sequence[Kind], slots: Any = None,
                    table: int = 0) -> None:
    """Dequantize GGUF matrices of one ``ggml_type`` (one of ``GGUF_TYPES``) of each kind
    into its ``out``, one launch (a part of ``_PART`` experts): a matrix's blocks in order
    are its values in order, so a kind's ``out`` is ``(n, values)`` at any stride between
    experts (``scales`` unused: a block holds its own). With ``slots`` (int64 on the
    device), slot ``j`` is expert ``slots[j]`` of ``table`` (a layer's ``(experts, 3)``
    addresses, from the column of the first kind), the kinds' addresses unused.

    Raises:
        ValueError: an output the kernel cannot address.
    """
    n = len(kinds[0].addresses) if slots is None else int(slots.shape[0])
    if slots is None and n > _PART:
        for at in range(0, n, _PART):
            gguf_kinds_cuda(ggml_type, [Kind(k.addresses[at:at + _PART], None,
                                             k.out[at:at + _PART]) for k in kinds])
        return
    out = kinds[0].out
    params: list[int] = []
    chunks = 0
    for kind in kinds:
        o = kind.out
        values = o.shape[-1]
        if (o.dim() != 2 or o.stride(1) != 1 or o.dtype != out.dtype
                or out.dtype not in _SUFFIXES or values % GGUF_GROUP
                or (slots is None and len(kind.addresses) != n)):
            raise ValueError(f"GGUF outputs are (experts, values) of whole groups of "
                             f"{GGUF_GROUP} contiguous values, one of the kernels' types "
                             "a batch")
        size = o.element_size()
        vec = _aligned(o.data_ptr(), o.stride(0) * size)
        params += [o.data_ptr(), o.stride(0), values, int(vec)]
        chunks = max(chunks, n * values // GGUF_GROUP)
    if n == 0 or chunks == 0:
        return
    addresses = [int(a) for kind in kinds for a in kind.addresses]
    assert len(params) == GGUF_PARAMS * len(kinds)
    _launch(f"{GGUF_KERNELS[ggml_type]}_{_SUFFIXES[out.dtype]}", out, params + addresses,
            len(kinds), chunks, np.int32(n),
            _NO_SLOTS if slots is None else np.uint64(slots.data_ptr()), np.uint64(table))


def gguf_layer_cuda(types: GgufExperts, addresses: Sequence[Sequence[int]], gate_up: Any,
                    down: Any, slots: Any = None, table: int = 0) -> None:
    """A batch of one GGUF layer's experts (``addresses``: per kind, gate, up and down, each
    expert's blocks; or, with ``slots``, each slot's expert's row of ``table``, as
    :func:`layer_slots_cuda`) dequantized into the stacked ``gate_up`` (gate rows first)
    and ``down``: one launch, or two where down's type is not gate and up's."""
    n = gate_up.shape[0]
    flat = gate_up.view(n, -1)
    half = flat.shape[1] // 2
    gate, up = Kind(addresses[0], None, flat[:, :half]), Kind(addresses[1], None, flat[:, half:])
    rest = Kind(addresses[2], None, down.view(n, -1))
    if types.down_type == types.gate_up_type:
        gguf_kinds_cuda(types.gate_up_type, [gate, up, rest], slots, table)
    else:
        gguf_kinds_cuda(types.gate_up_type, [gate, up], slots, table)
        # down alone: its column of the layer's table, the third (8 bytes an address)
        gguf_kinds_cuda(types.down_type, [rest], slots, table + 2 * 8 if table else 0)


def layer_experts_cuda(scales: LayerScales, addresses: Sequence[Sequence[int]],
                       experts: Sequence[int], gate_up: Any, down: Any) -> None:
    """A batch of one layer's quantized experts (``addresses``: per kind, gate, up and down,
    each expert's matrix) dequantized into the stacked ``gate_up`` and ``down`` in the
    module's layout, one launch."""
    targets = scales.targets(gate_up, down)
    kinds = [Kind(a, stack, t) for a, stack, t in
             zip(addresses, (scales.gate, scales.up, scales.down), targets, strict=True)]
    if scales.method == "fp8" and not scales.transposed:
        fp8_kinds_cuda(kinds, experts, scales.block)
    else:
        fp4_experts_cuda(kinds, experts, scales.method, scales.transposed)


def layer_slots_cuda(scales: LayerScales | GgufExperts, table: int, slots: Any, gate_up: Any,
                     down: Any) -> None:
    """A call's experts, named on the device, dequantized into the stacked ``gate_up`` and
    ``down`` in the module's layout, one launch (a GGUF layer of two types: two): slot
    ``j`` gets expert ``slots[j]`` (int64 on the device; -1: an empty slot, left
    unwritten), its matrices found in ``table``, a layer's ``(experts, 3)`` int64 device
    addresses of each expert's gate, up and down (the cache's, or a mapping's the device
    reads in place). No host read: the kernel's parameters go from pinned memory on
    torch's stream."""
    n = int(slots.shape[0])
    if isinstance(scales, GgufExperts):
        gguf_layer_cuda(scales, ((), (), ()), gate_up, down, slots, table)
        return
    targets = scales.targets(gate_up, down)
    kinds = [Kind((), stack, t) for stack, t in
             zip((scales.gate, scales.up, scales.down), targets, strict=True)]
    out = gate_up
    tail: tuple[Any, ...]
    if scales.method == "fp8" and not scales.transposed:
        bm, bn = scales.block
        params, chunks = _fp8_params(kinds, n, bn)
        name, tail = _FP8_KERNELS[out.dtype], (np.int32(bm), np.int32(bn))
    else:
        params, chunks = _fp4_params(kinds, n, scales.transposed)
        lut = lookup_table(scales.method, out.dtype, out.device)
        name, tail = f"fp4_experts_{out.element_size()}", (np.uint64(lut.data_ptr()),)
    if n and chunks:
        _launch(name, out, params, len(kinds), chunks, np.int32(n),
                np.uint64(slots.data_ptr()), np.uint64(table), *tail)


def kernels_serve(scales: object, dtype: Any) -> bool:
    """Whether the kernels here dequantize a layer of ``scales`` (a layer's
    ``ExpertWeights`` entry) into ``dtype``, a batch or a call's slots: FP8 in the
    module's own layout, FP4, MXFP4, or GGUF types they have, into a type they write. The
    caller asks whether a GPU and CuPy are here (:func:`available`)."""
    if dtype not in CUDA_DTYPES:
        return False
    if isinstance(scales, GgufExperts):
        return scales.own(dtype) and {scales.gate_up_type, scales.down_type} <= GGUF_TYPES
    return isinstance(scales, LayerScales) and (scales.method != "fp8" or not scales.transposed)
