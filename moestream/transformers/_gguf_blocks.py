"""GGUF quantized blocks to values with torch ops, bitwise what gguf-py computes.

Each routine takes ``(n, block_bytes)`` uint8 blocks on any device and writes ``(n,
block_elems)`` values into ``out`` there, of any float dtype. They are transcriptions of
gguf-py's numpy ``dequantize_blocks`` (``gguf/quants.py``, the reference
``gguf.quants.dequantize``), kept operation for operation where a float is rounded: the same
products in the same order (``d * sc`` before ``* q``, ``dl * q - ml``), every intermediate
in float32, the last product stored straight into ``out`` (torch computes an op in its
inputs' float32 and rounds once on the store: one pass fewer than a cast afterwards). So the
results are bitwise gguf-py's rounded once, on the CPU and on CUDA (eager torch fuses no
multiply-add). Only the integer unpacking differs in form: bit fields are read from the
bytes, or from words copied out of the block (its fields are not aligned for a view in
place), quants stay integers until the product that converts them (exactly, in its own
pass), and an IQ point's values and signs are one row of a signed grid.
The IQ grids, sign patterns and IQ4 levels come from gguf-py itself.
"""

from __future__ import annotations

from collections.abc import Callable

import gguf
import numpy as np
import torch  # type: ignore[import-not-found, unused-ignore]

__all__ = ["ROUTINES", "Routine"]

Routine = Callable[[torch.Tensor, torch.Tensor], None]
"""``(n, block_bytes)`` uint8 blocks -> written into ``out``, ``(n, block_elems)`` of any
float dtype on the blocks' device: computed in float32, rounded once on the last store."""

Q = gguf.GGMLQuantizationType

_TABLES: dict[tuple[str, torch.device], torch.Tensor] = {}
_SHIFTS: dict[tuple[object, ...], torch.Tensor] = {}


def _table(name: str, device: torch.device) -> torch.Tensor:
    """A lookup table on ``device``, made once a device: a signed grid, levels (float32) or
    ksigns' nibbles (int64)."""
    key = (name, device)
    if key not in _TABLES:
        _TABLES[key] = torch.from_numpy(_host_table(name)).to(device)
    return _TABLES[key]


def _host_table(name: str) -> np.ndarray:
    ksigns = np.frombuffer(gguf.quants.IQ2_XXS.ksigns, dtype=np.uint8)
    if name == "ksigns_halves":  # a sign byte's low nibble, its high nibble
        return np.stack([ksigns & 15, ksigns >> 4], axis=1).astype(np.int64)
    if name in ("IQ2_XXS", "IQ2_XS", "IQ3_XXS"):
        return _signed_grid(name, ksigns)
    if name in ("IQ2_S", "IQ3_S", "IQ1_S"):  # unsigned rows (IQ1_S: -1, 0, 1)
        kind = getattr(gguf.quants, name)
        kind.init_grid()
        grid: np.ndarray = kind.grid.reshape(kind.grid_shape).astype(np.float32)
        return grid
    if name == "iq4":
        return np.array(gguf.quants.IQ4_NL.kvalues, dtype=np.float32)
    if name == "ue4m3":  # NVFP4's scale of each byte, gguf-py's own decoding
        scales: np.ndarray = gguf.quants.NVFP4.ue4m3_to_fp32(np.arange(256, dtype=np.uint8))
        return scales.astype(np.float32)
    # MXFP4's E2M1 values doubled (its scale is read as half the power of two)
    return np.array(gguf.quants.MXFP4.kvalues, dtype=np.float32)


def _signed_grid(name: str, ksigns: np.ndarray) -> np.ndarray:
    """gguf-py's grid of ``name`` times every sign pattern its points take, row ``point <<
    7 | sign index`` (IQ3_XXS's 4-value points: ``point << 4 | nibble`` of a sign byte).

    ``db * (grid * sign)`` is bitwise gguf-py's ``(db * grid) * sign``: a sign only flips
    the sign bit, and rounding to nearest is symmetric. One gather instead of two.
    """
    kind = getattr(gguf.quants, name)
    kind.init_grid()
    grid = kind.grid.reshape(kind.grid_shape).astype(np.float32)
    width = grid.shape[1]
    patterns = ksigns if width == 8 else np.arange(16, dtype=np.uint8)
    bits = (patterns.reshape(-1, 1) >> np.arange(width, dtype=np.uint8)) & 1
    signs = np.where(bits == 0, np.float32(1), np.float32(-1))
    signed: np.ndarray = (grid[:, None, :] * signs[None, :, :]).reshape(-1, width)
    return signed


def _f16(blocks: torch.Tensor, start: int, count: int = 1) -> torch.Tensor:
    """The ``count`` float16 from byte ``start`` of each block, as ``(n, count)`` float32."""
    return _words(blocks[:, start : start + 2 * count], torch.float16).float()


def _nibbles(data: torch.Tensor, rows: int) -> torch.Tensor:
    """``(n, rows * w)`` bytes -> ``(n, rows, 2, w)``: each row's low nibbles, then its high."""
    halves = data.reshape(data.shape[0], rows, 1, -1) >> _shifts(data, (0, 4), 4)
    return halves & 15


def _crumbs(data: torch.Tensor, rows: int) -> torch.Tensor:
    """``(n, rows * w)`` bytes -> ``(n, rows, 4, w)``: each row's 2-bit fields by position."""
    return (data.reshape(data.shape[0], rows, 1, -1) >> _shifts(data, (0, 2, 4, 6), 4)) & 3


def _bits(data: torch.Tensor) -> torch.Tensor:
    """``(n, w)`` bytes -> ``(n, 8, w)``: bit ``i`` of every byte in plane ``i``."""
    return (data.unsqueeze(1) >> _shifts(data, tuple(range(8)), 3)) & 1


def _bits_little(data: torch.Tensor) -> torch.Tensor:
    """``(n, w)`` bytes -> ``(n, 8 * w)``: the bits of a little-endian word, lowest first."""
    return ((data.unsqueeze(-1) >> _shifts(data, tuple(range(8)), 3, last=True)) & 1).flatten(1)


def _shifts(data: torch.Tensor, shifts: tuple[int, ...], ndim: int,
            last: bool = False) -> torch.Tensor:
    """``shifts`` of ``data``'s dtype and device, shaped to broadcast along dimension 1 (2
    of 4), or the last: made once (a tensor from a Python list is a blocking copy to a GPU)."""
    key = (shifts, ndim, last, data.dtype, data.device)
    if key not in _SHIFTS:
        shape = [1] * ndim
        shape[-1 if last else (2 if ndim == 4 else 1)] = len(shifts)
        _SHIFTS[key] = torch.tensor(shifts, dtype=data.dtype).reshape(shape).to(data.device)
    return _SHIFTS[key]


def _fields(data: torch.Tensor, shifts: tuple[int, ...], ndim: int) -> torch.Tensor:
    """``(n, w)`` integers -> ``(n, w * len(shifts))``: each one's fields at ``shifts`` in
    turn, unmasked (the caller masks them)."""
    return (data.unsqueeze(-1) >> _shifts(data, shifts, ndim, last=True)).flatten(1)


def _signs(data: torch.Tensor) -> torch.Tensor:
    """``(n, w)`` sign bytes -> ``(n, 8 * w)`` float32: -1 where a bit is set, else 1, the
    lowest bit first (``db * (grid * sign)`` is bitwise ``(db * grid) * sign``)."""
    return 1 - 2 * _bits_little(data).float()


def _words(data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(n, k)`` bytes as little-endian words of ``dtype`` (copied first: a block's words
    are not aligned for a view in place; the copy is a few bytes a block)."""
    copy = data.clone(memory_format=torch.contiguous_format)  # offset 0: aligned
    return copy.view(dtype)


def _q8_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    torch.mul(blocks[:, 2:34].view(torch.int8), _f16(blocks, 0), out=out)


def _q4_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    q = _nibbles(blocks[:, 2:18], 1).reshape(-1, 32).to(torch.int8) - 8
    torch.mul(_f16(blocks, 0), q, out=out)


def _q4_1(blocks: torch.Tensor, out: torch.Tensor) -> None:
    q = _nibbles(blocks[:, 4:20], 1).reshape(-1, 32)
    dm = _f16(blocks, 0, 2)
    torch.add(dm[:, 0:1] * q, dm[:, 1:2], out=out)


def _q5(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """Q5_0's and Q5_1's 5-bit quants: 4 bytes of fifth bits at ``start``, then nibbles."""
    low = _nibbles(blocks[:, start + 4 : start + 20], 1).reshape(-1, 32)
    return low | (_bits_little(blocks[:, start : start + 4]) << 4)


def _q5_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    torch.mul(_f16(blocks, 0), _q5(blocks, 2).to(torch.int8) - 16, out=out)


def _q5_1(blocks: torch.Tensor, out: torch.Tensor) -> None:
    dm = _f16(blocks, 0, 2)
    torch.add(dm[:, 0:1] * _q5(blocks, 4), dm[:, 1:2], out=out)


def _q2_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    scales, n = blocks[:, 0:16], blocks.shape[0]
    dm = _f16(blocks, 80, 2)
    dl = (dm[:, 0:1] * (scales & 15)).reshape(n, 16, 1)
    ml = (dm[:, 1:2] * (scales >> 4)).reshape(n, 16, 1)
    q = _crumbs(blocks[:, 16:80], 2).reshape(n, 16, 16)
    torch.sub(dl * q, ml, out=out.view(n, 16, 16))


def _q3_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]
    low = _nibbles(blocks[:, 96:104], 1).reshape(n, 16)
    high = _crumbs(blocks[:, 104:108], 1).reshape(n, 16)
    scale = (low | (high << 4)).to(torch.int8) - 32
    dl = (_f16(blocks, 108) * scale).reshape(n, 16, 1)
    ql = _crumbs(blocks[:, 32:96], 2).reshape(n, 16, 16)
    # the high bit is an inverted borrow: 4 comes off where the mask bit is clear
    qh = (_bits(blocks[:, 0:32]).reshape(n, 16, 16) ^ 1) << 2
    torch.mul(dl, ql.to(torch.int8) - qh.to(torch.int8), out=out.view(n, 16, 16))


def _k_scales(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's and Q5_K's ``d * sc`` and ``dmin * m``, ``(n, 8, 1)`` each (get_scale_min)."""
    d, m, md = blocks[:, 4:8], blocks[:, 8:12], blocks[:, 12:16]
    sc = torch.cat([d & 63, (md & 15) | ((d >> 2) & 48)], dim=1)
    mn = torch.cat([m & 63, (md >> 4) | ((m >> 2) & 48)], dim=1)
    n, dm = blocks.shape[0], _f16(blocks, 0, 2)
    return (dm[:, 0:1] * sc).reshape(n, 8, 1), (dm[:, 1:2] * mn).reshape(n, 8, 1)


def _q4_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    d, dm = _k_scales(blocks)
    q = _nibbles(blocks[:, 16:144], 4).reshape(-1, 8, 32)
    torch.sub(d * q, dm, out=out.view(-1, 8, 32))


def _q5_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    d, dm = _k_scales(blocks)
    low = _nibbles(blocks[:, 48:176], 4).reshape(-1, 8, 32)
    torch.sub(d * (low | (_bits(blocks[:, 16:48]) << 4)), dm, out=out.view(-1, 8, 32))


def _q6_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]
    d = (_f16(blocks, 208) * blocks[:, 192:208].view(torch.int8)).reshape(n, 16, 1)
    low = _nibbles(blocks[:, 0:128], 2).reshape(n, 8, 32)
    high = _crumbs(blocks[:, 128:192], 2).reshape(n, 8, 32)
    q = ((low | (high << 4)).to(torch.int8) - 32).reshape(n, 16, 16)
    torch.mul(d, q, out=out.view(n, 16, 16))


def _iq_meta(meta: torch.Tensor, d: torch.Tensor, step: float) -> tuple[torch.Tensor, ...]:
    """IQ2_XXS's and IQ3_XXS's meta words, ``(n, 8)`` int32: ``(n, 8, 1, 1)`` float32 ``d *
    (0.5 + s) * step`` of each word's top four bits, and ``(n, 8, 4)`` int64 ksigns indices
    (the word's four 7-bit fields)."""
    # float32 before the Python float: an integer tensor plus a float takes torch's default
    # dtype, which a caller (transformers' loading) may have changed
    db = (d * (0.5 + ((meta >> 28) & 15).float()) * step).reshape(*meta.shape, 1, 1)
    signs = (meta.unsqueeze(-1) >> _shifts(meta, (0, 7, 14, 21), 3, last=True)) & 127
    return db, signs.long()


def _iq2_xxs(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]
    qs = _words(blocks[:, 2:66], torch.int32)  # per 32 values: 4 grid indices, a meta word
    db, signs = _iq_meta(qs[:, 1::2], _f16(blocks, 0), 0.25)
    index = (qs.view(torch.uint8).reshape(n, 8, 8)[:, :, 0:4].long() << 7) | signs
    torch.mul(db, _table("IQ2_XXS", blocks.device)[index], out=out.view(n, 8, 4, 8))


def _iq2_xs(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]
    qs = _words(blocks[:, 2:66], torch.int16)  # a 9-bit grid index, 7 bits of signs
    scale = _nibbles(blocks[:, 66:74].reshape(n * 8, 1), 1).reshape(n, 16).float()
    db = (_f16(blocks, 0) * (0.5 + scale) * 0.25).reshape(n, 16, 1, 1)
    index = ((qs & 511).long() << 7) | ((qs >> 9) & 127)
    signed = _table("IQ2_XS", blocks.device)[index]
    torch.mul(db, signed.reshape(n, 16, 2, 8), out=out.view(n, 16, 2, 8))


def _iq3_xxs(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]
    db, signs = _iq_meta(_words(blocks[:, 66:98], torch.int32), _f16(blocks, 0), 0.5)
    # a sign byte covers two 4-value grid points: its low nibble the first, its high the second
    halves = _table("ksigns_halves", blocks.device)[signs]
    index = (blocks[:, 2:66].reshape(n, 8, 4, 2).long() << 4) | halves
    signed = _table("IQ3_XXS", blocks.device)[index]
    torch.mul(db, signed.reshape(n, 8, 4, 8), out=out.view(n, 8, 4, 8))


def _iq4_xs(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]
    high_word = blocks[:, 2:4].to(torch.int32)
    high_word = high_word[:, 0:1] | (high_word[:, 1:2] << 8)
    high = (high_word >> _shifts(high_word, tuple(range(0, 16, 2)), 2, last=True)) & 3
    low = _nibbles(blocks[:, 4:8].reshape(n * 4, 1), 1).reshape(n, 8).to(torch.int32)
    scale = (low | (high << 4)) - 32
    dl = (_f16(blocks, 0) * scale).reshape(n, 8, 1)
    q = _nibbles(blocks[:, 8:136], 8).reshape(n, 8, 32)
    torch.mul(dl, _table("iq4", blocks.device)[q.long()], out=out.view(n, 8, 32))


def _iq2_s(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]
    scale = _nibbles(blocks[:, 74:82].reshape(n * 8, 1), 1).reshape(n, 16).float()
    db = (_f16(blocks, 0) * (0.5 + scale) * 0.25).reshape(n, 16, 1)
    high = _fields(blocks[:, 66:74], (0, 2, 4, 6), 3) & 3  # 2 bits a grid index, 4 a byte
    index = blocks[:, 2:34].long() | (high.long() << 8)
    grid = _table("IQ2_S", blocks.device)[index].reshape(n, 16, 16)
    torch.mul(db, grid * _signs(blocks[:, 34:66]).reshape(n, 16, 16), out=out.view(n, 16, 16))


def _iq3_s(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]
    scale = _nibbles(blocks[:, 106:110].reshape(n * 4, 1), 1).reshape(n, 8)
    db = (_f16(blocks, 0) * (1 + 2 * scale)).reshape(n, 8, 1)  # 1 + 2 * scale: uint8, exact
    index = blocks[:, 2:66].long() | (_bits_little(blocks[:, 66:74]).long() << 8)
    grid = _table("IQ3_S", blocks.device)[index].reshape(n, 8, 32)
    torch.mul(db, grid * _signs(blocks[:, 74:106]).reshape(n, 8, 32), out=out.view(n, 8, 32))


def _iq1(blocks: torch.Tensor, dl: torch.Tensor, qs: torch.Tensor, high: torch.Tensor,
         negative: torch.Tensor, out: torch.Tensor) -> None:
    """IQ1_S's and IQ1_M's ``dl * (grid + delta)`` (``dl``: ``(n, groups, 1)``), each grid
    index ``qs | high << 8``, its delta -1/8 where ``negative``, else +1/8 (both exact)."""
    n = blocks.shape[0]
    delta = torch.where(negative != 0, -0.125, 0.125).to(torch.float32).unsqueeze(-1)
    grid = _table("IQ1_S", blocks.device)[qs.long() | (high.long() << 8)]
    torch.mul(dl, (grid + delta).reshape(n, dl.shape[1], -1), out=out.view(n, dl.shape[1], -1))


def _iq1_s(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]
    qh = _words(blocks[:, 34:50], torch.int16).to(torch.int32) & 0xFFFF  # a word a 32 values
    dl = (_f16(blocks, 0) * (2 * ((qh >> 12) & 7) + 1)).reshape(n, 8, 1)
    high = _fields(qh, (0, 3, 6, 9), 3) & 7  # 3 bits a grid index, 4 a word
    negative = (qh & 0x8000).repeat_interleave(4, dim=1)
    _iq1(blocks, dl, blocks[:, 2:34], high, negative, out)


def _iq1_m(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]
    words = _words(blocks[:, 48:56], torch.int16).to(torch.int32) & 0xFFFF
    # the float16 scale is the top nibbles of the four scale words, the first word's lowest
    bits = ((words[:, 0:1] >> 12) | ((words[:, 1:2] >> 8) & 0xF0)
            | ((words[:, 2:3] >> 4) & 0xF00) | (words[:, 3:4] & 0xF000))
    d = (bits - ((bits >> 15) << 16)).to(torch.int16).view(torch.float16).float()
    dl = (d * (2 * (_fields(words, (0, 3, 6, 9), 3) & 7) + 1)).reshape(n, 16, 1)
    nibbles = _fields(blocks[:, 32:48], (0, 4), 3) & 15  # a nibble a grid index, 2 a byte
    _iq1(blocks, dl, blocks[:, 0:32], nibbles & 7, nibbles & 8, out)


def _iq4_nl(blocks: torch.Tensor, out: torch.Tensor) -> None:
    q = _nibbles(blocks[:, 2:18], 1).reshape(-1, 32)
    torch.mul(_f16(blocks, 0), _table("iq4", blocks.device)[q.long()], out=out)


def _mxfp4(blocks: torch.Tensor, out: torch.Tensor) -> None:
    e = blocks[:, 0:1].to(torch.int32)
    # ggml_e8m0_to_fp32_half: 2 ** (e - 128) as float32 bits, subnormal for e < 2
    bits = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23)
    q = _nibbles(blocks[:, 1:17], 1).reshape(-1, 32)
    torch.mul(bits.view(torch.float32), _table("mxfp4", blocks.device)[q.long()], out=out)


def _nvfp4(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]  # four UE4M3 scales, then 8 bytes a 16 values: low nibbles first
    d = _table("ue4m3", blocks.device)[blocks[:, 0:4].long()].reshape(n, 4, 1)
    q = _nibbles(blocks[:, 4:36], 4).reshape(n, 4, 16)
    torch.mul(d, _table("mxfp4", blocks.device)[q.long()], out=out.view(n, 4, 16))


ROUTINES: dict[int, Routine] = {
    Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q5_0: _q5_0, Q.Q5_1: _q5_1, Q.Q8_0: _q8_0,
    Q.Q2_K: _q2_k, Q.Q3_K: _q3_k, Q.Q4_K: _q4_k, Q.Q5_K: _q5_k, Q.Q6_K: _q6_k,
    Q.IQ2_XXS: _iq2_xxs, Q.IQ2_XS: _iq2_xs, Q.IQ2_S: _iq2_s, Q.IQ3_XXS: _iq3_xxs,
    Q.IQ3_S: _iq3_s, Q.IQ1_S: _iq1_s, Q.IQ1_M: _iq1_m, Q.IQ4_NL: _iq4_nl, Q.IQ4_XS: _iq4_xs,
    Q.MXFP4: _mxfp4, Q.NVFP4: _nvfp4,
}
"""ggml type id -> its routine: every quantized type moestream dequantizes."""
