"""Random valid GGUF quantized blocks and their reference values (``gguf.quants``), for the
proxy dequantizer's tests on the host and on CUDA, and the quantized models they write."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES, GGUFWriter
from gguf import GGMLQuantizationType as Q

from moestream.pipeline.foundation.ggml_blocks import put_scales, scale_count
from tests.gguf_files import finish_gguf


def random_blocks(qtype: Q, n: int, seed: int = 0, extreme: bool = True) -> np.ndarray:
    """``n`` valid random blocks of ``qtype``, (n, block bytes) uint8: random bytes, finite
    float16 scales (``extreme``: any finite half, the smallest subnormal, -0 and +-65504
    among them, and any MXFP4 scale byte; else small positive scales, whose values a SwiGLU
    keeps finite)."""
    rng = np.random.default_rng([seed, int(qtype)])
    blocks = rng.integers(0, 256, (n, GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8)
    fields = scale_count(qtype)
    if extreme:
        halves = rng.integers(0, 1 << 16, (n, fields), dtype=np.uint16)
        halves[(halves & 0x7C00) == 0x7C00] &= 0xBFFF  # exponent 31 (inf, NaN) -> 15
        # every field of the first blocks: the smallest subnormal, -0 and +-65504
        halves[: min(n, 4)] = np.array([[0x0001], [0x8000], [0x7BFF], [0xFBFF]])[: min(n, 4)]
    else:
        halves = rng.uniform(2.0**-12, 2.0**-8, (n, fields)).astype(np.float16).view(np.uint16)
    put_scales(blocks, qtype, halves)
    if qtype == Q.MXFP4 and not extreme:  # its E8M0 scale: 2**(e - 128), here 2**-10..2**-6
        blocks[:, 0] = rng.integers(118, 123, n)
    return blocks


def every_pattern(qtype: Q) -> np.ndarray:
    """Blocks of ``qtype`` (IQ2_XXS, IQ2_XS, IQ3_XXS or MXFP4) holding each of its codes at
    least once, random otherwise: IQ2_XXS's every grid point under every sign pattern,
    IQ2_XS's every 16-bit word (a 9-bit point, 7 bits of signs), IQ3_XXS's every grid point
    and every sign index, MXFP4's every E8M0 scale and every 4-bit code."""
    if qtype == Q.MXFP4:
        blocks = random_blocks(qtype, 256, seed=7)
        blocks[:, 0] = np.arange(256)
        blocks[:, 1:] = np.arange(16, dtype=np.uint8) * 17  # both nibbles: every code
        return blocks
    if qtype == Q.IQ2_XS:
        blocks = random_blocks(qtype, 65536 // 32, seed=7)
        blocks[:, 2:66] = np.arange(65536, dtype="<u2").reshape(-1, 32).view(np.uint8)
        return blocks
    pairs = np.arange(256 * 128)  # (grid point, sign index), 32 a block: 8 words of 4 signs
    n = len(pairs) // 32
    blocks = random_blocks(qtype, n, seed=7)
    signs = (pairs & 127).astype(np.uint32).reshape(n, 8, 4)
    packed = signs[..., 0] | signs[..., 1] << 7 | signs[..., 2] << 14 | signs[..., 3] << 21
    if qtype == Q.IQ2_XXS:  # a sub-block: a word of 4 one-byte points, then the meta word
        words = blocks[:, 2:].copy().view("<u4").reshape(n, 8, 2)
        points = (pairs >> 7).astype(np.uint32).reshape(n, 8, 4)
        words[:, :, 0] = points[..., 0] | points[..., 1] << 8 | points[..., 2] << 16 \
            | points[..., 3] << 24
        words[:, :, 1] = (words[:, :, 1] & 0xF0000000) | packed
        blocks[:, 2:] = words.reshape(n, 16).view(np.uint8)
        return blocks
    # IQ3_XXS: 64 one-byte points (every point in every 4 blocks), then 8 meta words
    blocks[:, 2:66] = np.arange(256, dtype=np.uint8).reshape(4, 64)[np.arange(n) % 4]
    words = blocks[:, 66:98].copy().view("<u4")
    blocks[:, 66:98] = ((words & 0xF0000000) | packed).astype("<u4").view(np.uint8)
    return blocks


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Bitwise equal float32, NaN to NaN whatever its payload (inf - inf is NaN in both)."""
    nan = np.isnan(a)
    return bool(np.array_equal(nan, np.isnan(b))
                and np.array_equal(a[~nan].view(np.uint32), b[~nan].view(np.uint32)))


def reference(qtype: Q, data: np.ndarray) -> np.ndarray:
    """gguf-py's float32 values of ``data`` (blocks of ``qtype``), flat."""
    with np.errstate(all="ignore"):
        values: np.ndarray = gguf.quants.dequantize(np.ascontiguousarray(data).reshape(-1),
                                                    qtype)
    return values.reshape(-1)


def write_quantized_moe(path: Path, types: Sequence[tuple[Q, Q]], *, experts: int = 6,
                        hidden: int = 256, ffn: int = 256, top_k: int = 3,
                        seed: int = 0) -> Path:
    """A qwen3moe GGUF whose MoE layer ``i`` has gate/up of ``types[i][0]`` and down of
    ``types[i][1]`` (F16 or a quantized type: random valid blocks, small scales), with F32
    routers: what the proxy engine's real compute runs on."""
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(path, "qwen3moe")
    writer.add_uint32("qwen3moe.block_count", len(types))
    writer.add_uint32("qwen3moe.expert_used_count", top_k)
    writer.add_embedding_length(hidden)
    writer.add_tensor("token_embd.weight", rng.standard_normal((16, hidden)).astype(np.float16))
    for layer, (gate_up, down) in enumerate(types):
        writer.add_tensor(f"blk.{layer}.ffn_gate_inp.weight",
                          rng.standard_normal((experts, hidden)).astype(np.float32))
        for m, (matrix, qtype, (rows, cols)) in enumerate((("gate", gate_up, (ffn, hidden)),
                                                           ("up", gate_up, (ffn, hidden)),
                                                           ("down", down, (hidden, ffn)))):
            name = f"blk.{layer}.ffn_{matrix}_exps.weight"
            if qtype == Q.F16:
                writer.add_tensor(name, (rng.standard_normal((experts, rows, cols)) * 0.05)
                                  .astype(np.float16))
                continue
            elems, size = GGML_QUANT_SIZES[qtype]
            blocks = random_blocks(qtype, experts * rows * cols // elems,
                                   seed=seed * 1000 + layer * 3 + m, extreme=False)
            writer.add_tensor(name, blocks.reshape(experts, rows, cols // elems * size),
                              raw_dtype=qtype)
    return finish_gguf(writer, path, {})
