"""pipeline.foundation.ggml_blocks: every scale ``put_scales`` writes is the scale gguf-py
reads back, for every quantized type moestream dequantizes (IQ1_M's split one included), and
no other byte changes."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from hypothesis import given, settings
from hypothesis import strategies as st

from moestream.pipeline.foundation.compute import DEQUANTIZED
from moestream.pipeline.foundation.ggml_blocks import F16_SCALES, put_scales, scale_count

TYPES = sorted(DEQUANTIZED, key=lambda q: q.name)


def test_every_dequantized_type_has_its_scales() -> None:
    assert set(TYPES) - set(F16_SCALES) == {Q.IQ1_M}  # its one scale is split
    assert scale_count(Q.IQ1_M) == 1 and scale_count(Q.Q4_K) == 2 and scale_count(Q.MXFP4) == 0


@pytest.mark.parametrize("qtype", [q for q in TYPES if scale_count(q)], ids=lambda q: q.name)
@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), half=st.floats(width=16, allow_nan=False,
                                                        allow_infinity=False))
def test_the_scale_read_back(qtype: Q, seed: int, half: float) -> None:
    """gguf-py reads the scales where they were put: zero scales make every value zero
    (the mins of Q4_1, Q5_1 and the K-quants too), any finite ones finite values; and only
    the scale fields' bytes change (IQ1_M: the top nibbles of its four scale words)."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (3, GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8)
    before = blocks.copy()
    bits = np.full((3, scale_count(qtype)), np.float16(half).view(np.uint16))
    put_scales(blocks, qtype, bits)
    changed = np.flatnonzero((blocks != before).any(axis=0))
    zero = blocks.copy()
    put_scales(zero, qtype, np.zeros_like(bits))
    with np.errstate(all="ignore"):
        values = gguf.quants.dequantize(zero.reshape(-1), qtype)
        scaled = gguf.quants.dequantize(blocks.reshape(-1), qtype)
    assert not np.any(values) and np.isfinite(scaled).all()
    fields = [49, 51, 53, 55] if qtype == Q.IQ1_M else [
        at + i for at in F16_SCALES[qtype] for i in (0, 1)]
    assert set(changed) <= set(fields)


@pytest.mark.parametrize("qtype", [q for q in TYPES if scale_count(q) == 1],
                         ids=lambda q: q.name)
@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), exponent=st.integers(-10, 10))
def test_the_values_scale_with_it(qtype: Q, seed: int, exponent: int) -> None:
    """One scale a block: the values under scale ``2 ** exponent`` are those under scale 1
    times it (a power of two scales exactly), so the scale is read from where it was put,
    its bits in the order gguf-py reads them (IQ1_M's four nibbles included)."""
    blocks = np.random.default_rng(seed).integers(0, 256, (3, GGML_QUANT_SIZES[qtype][1]),
                                                  dtype=np.uint8)
    one, scaled = blocks.copy(), blocks.copy()
    put_scales(one, qtype, np.full((3, 1), np.float16(1.0).view(np.uint16)))
    put_scales(scaled, qtype, np.full((3, 1), np.float16(2.0**exponent).view(np.uint16)))
    want = gguf.quants.dequantize(one.reshape(-1), qtype) * np.float32(2.0**exponent)
    assert np.array_equal(gguf.quants.dequantize(scaled.reshape(-1), qtype), want)
