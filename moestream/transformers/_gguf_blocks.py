"""GGUF quantized blocks to float32 with torch ops, bitwise what gguf-py computes.

Each routine takes ``(n, block_bytes)`` uint8 blocks on any device and returns ``(n,
block_elems)`` float32 computed there. They are transcriptions of gguf-py's numpy
``dequantize_blocks`` (``gguf/quants.py``, the reference ``gguf.quants.dequantize``), kept
operation for operation where a float is rounded: the same products in the same order
(``d * sc`` before ``* q``, ``dl * q - ml``, ``(db * grid) * sign``), every intermediate in
float32, so the results are bitwise equal on the CPU and on CUDA (eager torch fuses no
multiply-add). Only the integer unpacking differs in form: bit fields are read byte by byte
(a GGUF block's fields are not aligned for a wider view) and sign patterns are looked up as
±1 rows. The IQ types' grids and the IQ4 levels come from gguf-py itself.

:mod:`moestream.transformers._gguf_dequant` is the interface; it uses transformers' own
routine for a type where the installed transformers has one, and these otherwise.
"""

from __future__ import annotations

from collections.abc import Callable

import gguf
import numpy as np
import torch  # type: ignore[import-not-found, unused-ignore]

__all__ = ["ROUTINES", "Routine"]

Routine = Callable[[torch.Tensor], torch.Tensor]
"""``(n, block_bytes)`` uint8 -> ``(n, block_elems)`` float32, on the blocks' device."""

Q = gguf.GGMLQuantizationType

# MXFP4's E2M1 values doubled (its scale is read as half the power of two): gguf-py's
# ``MXFP4.kvalues``, the OCP microscaling spec's table
_MXFP4_LEVELS = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)

_TABLES: dict[tuple[str, torch.device], torch.Tensor] = {}


def _table(name: str, device: torch.device) -> torch.Tensor:
    """A float32 lookup table on ``device``, made once a device (a grid, levels, signs)."""
    key = (name, device)
    if key not in _TABLES:
        _TABLES[key] = torch.from_numpy(_host_table(name)).to(device)
    return _TABLES[key]


def _host_table(name: str) -> np.ndarray:
    if name in ("IQ2_XXS", "IQ2_XS", "IQ3_XXS"):
        kind = getattr(gguf.quants, name)
        kind.init_grid()
        return np.ascontiguousarray(kind.grid.reshape(kind.grid_shape), dtype=np.float32)
    if name == "signs":  # ksigns_iq2xs: a 7-bit index -> its 8 signs as ±1 (the 8th is parity)
        codes = np.frombuffer(gguf.quants.IQ2_XXS.ksigns, dtype=np.uint8).reshape(128, 1)
        bits = (codes >> np.arange(8, dtype=np.uint8)) & 1
        return np.where(bits == 0, np.float32(1), np.float32(-1))
    if name == "iq4":
        return np.array(gguf.quants.IQ4_NL.kvalues, dtype=np.float32)
    return np.array(_MXFP4_LEVELS, dtype=np.float32)


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 at byte ``start`` of each block, as ``(n, 1)`` float32."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


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
    shape = [1] * ndim
    shape[-1 if last else (2 if ndim == 4 else 1)] = len(shifts)
    return torch.tensor(shifts, dtype=torch.uint8, device=data.device).reshape(shape)


def _word28(data: torch.Tensor) -> torch.Tensor:
    """``(n, k * 4)`` bytes -> ``(n, k)`` int32: each little-endian word's low 28 bits."""
    b = data.reshape(data.shape[0], -1, 4).to(torch.int32)
    return b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | ((b[..., 3] & 15) << 24)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    return blocks[:, 2:34].view(torch.int8).float() * _f16(blocks, 0)


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    q = _nibbles(blocks[:, 2:18], 1).reshape(-1, 32).to(torch.int8) - 8
    return _f16(blocks, 0) * q.float()


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    q = _nibbles(blocks[:, 4:20], 1).reshape(-1, 32).float()
    return _f16(blocks, 0) * q + _f16(blocks, 2)


def _q5(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """Q5_0's and Q5_1's 5-bit quants: 4 bytes of fifth bits at ``start``, then nibbles."""
    low = _nibbles(blocks[:, start + 4 : start + 20], 1).reshape(-1, 32)
    return low | (_bits_little(blocks[:, start : start + 4]) << 4)


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    q = _q5(blocks, 2).to(torch.int8) - 16
    return _f16(blocks, 0) * q.float()


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    return _f16(blocks, 0) * _q5(blocks, 4).float() + _f16(blocks, 2)


def _q2_k(blocks: torch.Tensor) -> torch.Tensor:
    scales, n = blocks[:, 0:16], blocks.shape[0]
    dl = (_f16(blocks, 80) * (scales & 15).float()).reshape(n, 16, 1)
    ml = (_f16(blocks, 82) * (scales >> 4).float()).reshape(n, 16, 1)
    q = _crumbs(blocks[:, 16:80], 2).reshape(n, 16, 16).float()
    return (dl * q - ml).reshape(n, 256)


def _q3_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    low = _nibbles(blocks[:, 96:104], 1).reshape(n, 16)
    high = _crumbs(blocks[:, 104:108], 1).reshape(n, 16)
    scale = ((low | (high << 4)).to(torch.int8) - 32).float()
    dl = (_f16(blocks, 108) * scale).reshape(n, 16, 1)
    ql = _crumbs(blocks[:, 32:96], 2).reshape(n, 16, 16)
    # the high bit is an inverted borrow: 4 comes off where the mask bit is clear
    qh = (_bits(blocks[:, 0:32]).reshape(n, 16, 16) ^ 1) << 2
    q = (ql.to(torch.int8) - qh.to(torch.int8)).float()
    return (dl * q).reshape(n, 256)


def _k_scales(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's and Q5_K's ``d * sc`` and ``dmin * m``, ``(n, 8, 1)`` each (get_scale_min)."""
    d, m, md = blocks[:, 4:8], blocks[:, 8:12], blocks[:, 12:16]
    sc = torch.cat([d & 63, (md & 15) | ((d >> 2) & 48)], dim=1).float()
    mn = torch.cat([m & 63, (md >> 4) | ((m >> 2) & 48)], dim=1).float()
    n = blocks.shape[0]
    return (_f16(blocks, 0) * sc).reshape(n, 8, 1), (_f16(blocks, 2) * mn).reshape(n, 8, 1)


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    d, dm = _k_scales(blocks)
    q = _nibbles(blocks[:, 16:144], 4).reshape(-1, 8, 32).float()
    return (d * q - dm).reshape(-1, 256)


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    d, dm = _k_scales(blocks)
    low = _nibbles(blocks[:, 48:176], 4).reshape(-1, 8, 32)
    q = (low | (_bits(blocks[:, 16:48]) << 4)).float()
    return (d * q - dm).reshape(-1, 256)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d = (_f16(blocks, 208) * blocks[:, 192:208].view(torch.int8).float()).reshape(n, 16, 1)
    low = _nibbles(blocks[:, 0:128], 2).reshape(n, 8, 32)
    high = _crumbs(blocks[:, 128:192], 2).reshape(n, 8, 32)
    q = ((low | (high << 4)).to(torch.int8) - 32).reshape(n, 16, 16).float()
    return (d * q).reshape(n, 256)


def _iq_signs(words: torch.Tensor) -> torch.Tensor:
    """``(n, g)`` int32 words -> ``(n, g, 4, 8)`` ±1: four 7-bit ksigns indices a word."""
    index = (words.unsqueeze(-1) >> _shifts(words, (0, 7, 14, 21), 3, last=True).int()) & 127
    return _table("signs", words.device)[index.long()]


def _iq2_xxs(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    groups = blocks[:, 2:66].reshape(n, 8, 8)  # per 32 values: 4 grid indices, 1 word of meta
    scale = (groups[:, :, 7] >> 4).float()
    db = (_f16(blocks, 0) * (0.5 + scale) * 0.25).reshape(n, 8, 1, 1)
    signs = _iq_signs(_word28(groups[:, :, 4:8].reshape(n, 32)))
    grid = _table("IQ2_XXS", blocks.device)[groups[:, :, 0:4].long()]
    return (db * grid * signs).reshape(n, 256)


def _iq2_xs(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    words = blocks[:, 2:66].reshape(n, 32, 2).to(torch.int32)
    words = words[..., 0] | (words[..., 1] << 8)
    scale = _nibbles(blocks[:, 66:74].reshape(n * 8, 1), 1).reshape(n, 16).float()
    db = (_f16(blocks, 0) * (0.5 + scale) * 0.25).reshape(n, 16, 1, 1)
    signs = _table("signs", blocks.device)[(words >> 9).long()].reshape(n, 16, 2, 8)
    grid = _table("IQ2_XS", blocks.device)[(words & 511).long()].reshape(n, 16, 2, 8)
    return (db * grid * signs).reshape(n, 256)


def _iq3_xxs(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    meta = blocks[:, 66:98].reshape(n, 8, 4)
    scale = (meta[:, :, 3] >> 4).float()
    db = (_f16(blocks, 0) * (0.5 + scale) * 0.5).reshape(n, 8, 1, 1)
    signs = _iq_signs(_word28(meta.reshape(n, 32)))
    grid = _table("IQ3_XXS", blocks.device)[blocks[:, 2:66].long()].reshape(n, 8, 4, 8)
    return (db * grid * signs).reshape(n, 256)


def _iq4_xs(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    high_word = blocks[:, 2:4].to(torch.int32)
    high_word = high_word[:, 0:1] | (high_word[:, 1:2] << 8)
    high = (high_word >> torch.arange(0, 16, 2, device=blocks.device, dtype=torch.int32)) & 3
    low = _nibbles(blocks[:, 4:8].reshape(n * 4, 1), 1).reshape(n, 8).to(torch.int32)
    scale = ((low | (high << 4)) - 32).float()
    dl = (_f16(blocks, 0) * scale).reshape(n, 8, 1)
    q = _nibbles(blocks[:, 8:136], 8).reshape(n, 8, 32)
    return (dl * _table("iq4", blocks.device)[q.long()]).reshape(n, 256)


def _mxfp4(blocks: torch.Tensor) -> torch.Tensor:
    e = blocks[:, 0:1].to(torch.int32)
    # ggml_e8m0_to_fp32_half: 2 ** (e - 128) as float32 bits, subnormal for e < 2
    bits = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23)
    q = _nibbles(blocks[:, 1:17], 1).reshape(-1, 32)
    return bits.view(torch.float32) * _table("mxfp4", blocks.device)[q.long()]


ROUTINES: dict[int, Routine] = {
    Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q5_0: _q5_0, Q.Q5_1: _q5_1, Q.Q8_0: _q8_0,
    Q.Q2_K: _q2_k, Q.Q3_K: _q3_k, Q.Q4_K: _q4_k, Q.Q5_K: _q5_k, Q.Q6_K: _q6_k,
    Q.IQ2_XXS: _iq2_xxs, Q.IQ2_XS: _iq2_xs, Q.IQ3_XXS: _iq3_xxs, Q.IQ4_XS: _iq4_xs,
    Q.MXFP4: _mxfp4,
}
"""ggml type id -> its routine: every quantized type moestream dequantizes."""
