"""How a generated checkpoint's tensors get their bytes: seeded values, rounded or quantized.

Why: ``pipeline.makers.checkpointgen`` writes a checkpoint shard by shard with only that shard's
tensors in memory, from a plan ``pipeline.makers.checkpointlayouts`` makes per architecture. The
plan is a list of ``Unit``s: tensors written together (a weight and its scales never land in
different shards) and the jobs that fill them, run on a thread pool (numpy releases the GIL).

Values are deterministic: uniform float32 of standard deviation 0.02 (norms are ones) from a
fresh generator per seed key, so one matrix's values depend only on (seed, layer, expert,
matrix) and every layout of one spec (per-expert or fused, plain or quantized) starts from
the same weights. A plain tensor holds them rounded to its dtype (BF16: round to nearest
even of the float32's upper half); a quantized one quantizes those rounded values
(``moestream.pipeline.makers.quantgen``): an FP8 checkpoint is the BF16 one of its seed, quantized.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import numpy as np
import numpy.typing as npt

from moestream.pipeline.makers.quantgen import pow2_e8m0, quantize_fp8_blocks, quantize_mx_e2m1

__all__ = ["OTHER", "Fill", "FillRows", "Fp8Matrix", "HashRoutes", "Job", "MxRows", "Out",
           "Piece", "Unit", "rounded", "to_bf16", "values"]

Fill = Literal["random", "ones", "zeros"]
Buffers = Mapping[str, npt.NDArray[Any]]
OTHER = 0xFFFF_FFFF  # seed-key namespace of non-expert tensors (layer ids stay below it)
_SCALE = np.float32(0.02 * 3**0.5 / 32768)  # int16 -> uniform values of std 0.02

_STORAGE = {"bfloat16": "<u2", "float16": "<f2", "float32": "<f4", "int64": "<i8",
            "float8_e4m3fn": "u1", "float8_e8m0fnu": "u1", "uint8": "u1", "int8": "u1"}
"""``TensorSpec`` dtype -> the numpy dtype its bytes are built in (1-byte codes as uint8)."""


@dataclass(frozen=True, slots=True)
class Piece:
    """Rows ``[row, row + rows)`` of a tensor (as ``[rows, last axis]``), from one seed key."""

    key: tuple[int, ...]
    row: int
    rows: int
    fill: Fill = "random"


@dataclass(frozen=True, slots=True)
class Out:
    """One tensor as written: its name, shape and ``TensorSpec`` dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def storage(self) -> str:
        return _STORAGE[self.dtype]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * np.dtype(self.storage).itemsize


class Job(Protocol):
    """Fills its part of a unit's buffers; returns the bytes it wrote."""

    def __call__(self, buffers: Buffers) -> int: ...


@dataclass(frozen=True, slots=True)
class Unit:
    """Tensors written together, in one shard, and the jobs that fill every byte of them."""

    outs: tuple[Out, ...]
    jobs: tuple[Job, ...]

    @property
    def nbytes(self) -> int:
        return sum(out.nbytes for out in self.outs)


def values(piece: Piece, width: int) -> npt.NDArray[np.float32]:
    """The float32 values of ``piece`` (flat): a fresh generator per seed key.

    Uniform on [-a, a] with a standard deviation of 0.02, from 16 random bits each: a tenth
    of the time of numpy's normal sampler (SFC64 ``random_raw`` is ~4 GB/s a core).
    """
    n = piece.rows * width
    if piece.fill != "random":
        return np.full(n, 1.0 if piece.fill == "ones" else 0.0, dtype=np.float32)
    bits = np.random.SFC64(np.random.SeedSequence(list(piece.key))).random_raw(-(-n // 4))
    out = bits.view("<i2")[:n].astype(np.float32)
    out *= _SCALE
    return out


def to_bf16(values: npt.NDArray[np.float32],
            out: npt.NDArray[np.uint16] | None = None) -> npt.NDArray[np.uint16]:
    """BF16 bit patterns of finite float32 ``values``: the upper half, rounded to nearest
    even. ``values`` is used as scratch; ``out`` (same length) receives them if given."""
    bits = values.view(np.uint32)
    carry = bits >> np.uint32(16)
    carry &= np.uint32(1)
    carry += np.uint32(0x7FFF)
    bits += carry
    bits >>= np.uint32(16)
    if out is None:
        return bits.astype("<u2")
    out[:] = bits
    return out


def rounded(source: npt.NDArray[np.float32], dtype: str) -> npt.NDArray[np.float32]:
    """``source`` as a ``dtype`` tensor would hold it, back in float32 (``source`` is
    scratch): what a quantized tensor quantizes, so it matches the plain checkpoint's."""
    if dtype == "bfloat16":  # to_bf16's rounding, in place, the low half cleared
        bits = source.view(np.uint32)
        carry = bits >> np.uint32(16)
        carry &= np.uint32(1)
        carry += np.uint32(0x7FFF)
        bits += carry
        bits &= np.uint32(0xFFFF0000)
        return source
    if dtype == "float16":
        return source.astype(np.float16).astype(np.float32)
    return source


def _matrix(pieces: tuple[Piece, ...], width: int, dtype: str) -> npt.NDArray[np.float32]:
    """The rounded values of consecutive ``pieces`` as one ``[rows, width]`` matrix."""
    parts = [values(piece, width) for piece in pieces]
    flat = parts[0] if len(parts) == 1 else np.concatenate(parts)
    return rounded(flat, dtype).reshape(-1, width)


@dataclass(frozen=True, slots=True)
class FillRows:
    """``piece``'s rows of the float tensor ``name``, rounded to its dtype."""

    name: str
    piece: Piece
    dtype: str

    def __call__(self, buffers: Buffers) -> int:
        buffer = buffers[self.name]
        width = buffer.shape[-1] if buffer.ndim else 1
        source = values(self.piece, width)
        rows = buffer.reshape(-1, width)[self.piece.row: self.piece.row + self.piece.rows]
        flat = rows.reshape(-1)
        if self.dtype == "bfloat16":
            to_bf16(source, flat.view(np.uint16))
        else:
            flat[:] = source  # numpy's cast to float16 rounds to nearest even
        return int(flat.nbytes)


@dataclass(frozen=True, slots=True)
class Fp8Matrix:
    """The FP8 E4M3 matrix ``weight`` (whole, from ``pieces``) and its block scales ``scale``:
    float32 scales, or with ``pow2`` E8M0 bytes of power-of-two ones."""

    weight: str
    scale: str
    pieces: tuple[Piece, ...]
    source_dtype: str
    block: tuple[int, int]
    pow2: bool = False

    def __call__(self, buffers: Buffers) -> int:
        codes_out, scales_out = buffers[self.weight], buffers[self.scale]
        matrix = _matrix(self.pieces, codes_out.shape[-1], self.source_dtype)
        codes, scales = quantize_fp8_blocks(matrix, self.block, pow2=self.pow2)
        codes_out[...] = codes
        if self.pow2:
            scales_out[...] = pow2_e8m0(scales)
        else:
            scales_out[...] = scales
        return int(codes_out.nbytes + scales_out.nbytes)


@dataclass(frozen=True, slots=True)
class MxRows:
    """One matrix (from ``piece``) as MX E2M1 into ``blocks`` (packed, ``[..., rows, cols /
    2]`` or gpt-oss's ``[..., rows, cols / 32, 16]``) and ``scales`` (``[..., rows, cols /
    32]``): at index ``expert`` of a fused tensor when given, every ``step``-th row from
    ``first`` (gpt-oss interleaves gate and up rows)."""

    blocks: str
    scales: str
    piece: Piece
    width: int
    source_dtype: str
    expert: int | None = None
    first: int = 0
    step: int = 1

    def __call__(self, buffers: Buffers) -> int:
        blocks, scales = buffers[self.blocks], buffers[self.scales]
        if self.expert is not None:
            blocks, scales = blocks[self.expert], scales[self.expert]
        blocks = blocks.reshape(scales.shape[0], -1)[self.first::self.step]
        scales = scales[self.first::self.step]
        packed, exponents = quantize_mx_e2m1(_matrix((self.piece,), self.width,
                                                     self.source_dtype))
        blocks[...] = packed
        scales[...] = exponents
        return int(packed.nbytes + exponents.nbytes)


@dataclass(frozen=True, slots=True)
class HashRoutes:
    """DeepSeek-V4's ``tid2eid`` ``[vocab, top_k]`` int64: each token's ``top_k`` distinct
    experts, a seeded permutation's first ``top_k``."""

    name: str
    key: tuple[int, ...]
    n_experts: int

    def __call__(self, buffers: Buffers) -> int:
        out = buffers[self.name]
        rng = np.random.Generator(np.random.SFC64(np.random.SeedSequence(list(self.key))))
        ranks = rng.random((out.shape[0], self.n_experts), dtype=np.float32)
        out[...] = np.argsort(ranks, axis=1, kind="stable")[:, :out.shape[1]]
        return int(out.nbytes)
