"""moestream.transformers._gguf_dequant: GGUF blocks of every supported type dequantized
bitwise equal to gguf-py's float32 reference cast to the compute dtype, on random valid
blocks (hypothesis: random bytes with finite, extreme float16 scales; every E8M0 byte),
every IQ grid index, sign pattern and scale nibble; the interface's shapes, ``out=``,
chunks and refusals. The same cases run on a GPU in test_gguf_dequant_gpu.py."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")

from moestream.pipeline.foundation.errors import UsageError, UsageTypeError  # noqa: E402
from moestream.pipeline.foundation.ggml_blocks import put_scales, scale_count  # noqa: E402
from moestream.transformers import _gguf_dequant as gd  # noqa: E402
from moestream.transformers._gguf_blocks import ROUTINES  # noqa: E402
from tests.gguf_blocks import random_blocks  # noqa: E402

Q = gguf.GGMLQuantizationType
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
TYPES = sorted(ROUTINES)

EXTREMES = (65504.0, -65504.0, 6.1e-05, -6.1e-05, 6e-08, -6e-08, 0.0, -0.0, 1.0)
"""float16's largest, smallest normal and smallest subnormal magnitudes, both zeros, one."""

half_floats = st.floats(width=16, allow_nan=False, allow_infinity=False)


def reference(raw: np.ndarray, ggml_type: int, dtype: Any) -> Any:
    """gguf-py's float32 dequantization rounded once to ``dtype``: the contract."""
    with np.errstate(over="ignore"):  # MXFP4's largest scale makes inf, as it should
        values = gguf.quants.dequantize(raw, ggml_type)
    return torch.from_numpy(values).to(dtype)


def assert_bitwise(got: Any, want: Any) -> None:
    """Equal bit for bit (``torch.equal`` also holds: no NaN is ever made)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    ints = {2: torch.int16, 4: torch.int32}[want.element_size()]
    assert torch.equal(got.cpu().view(ints), want.view(ints))


def with_scales(raw: np.ndarray, ggml_type: int, scales: list[float]) -> np.ndarray:
    """``raw`` blocks with their float16 scale fields set, block by block, from ``scales``."""
    raw = raw.copy()
    fields = scale_count(ggml_type)
    at = np.arange(raw.shape[0] * fields) % len(scales)
    halves = np.array(scales, dtype=np.float16)[at].view(np.uint16)
    put_scales(raw, ggml_type, halves.reshape(raw.shape[0], fields))
    return raw


@st.composite
def blocks(draw: Any, ggml_type: int, most: int = 6) -> np.ndarray:
    """Random valid blocks of ``ggml_type``: random bytes, finite float16 scales."""
    _, nbytes = gguf.GGML_QUANT_SIZES[Q(ggml_type)]
    count = draw(st.integers(1, most))
    data = draw(st.binary(min_size=count * nbytes, max_size=count * nbytes))
    raw = np.frombuffer(data, dtype=np.uint8).reshape(count, nbytes)
    scales = draw(st.lists(st.sampled_from(EXTREMES) | half_floats, min_size=1, max_size=12))
    return with_scales(raw, ggml_type, scales)


def _iq_words(count: int, fields: list[tuple[int, int]]) -> np.ndarray:
    """``count`` little-endian uint32 words, as bytes: field ``k`` of word ``i`` is
    ``i * step_k mod 2 ** width_k`` at the running bit offset (a field of step 1 meets
    every value once ``count >= 2 ** width``)."""
    words = np.zeros(count, dtype=np.uint64)
    at = 0
    for width, step in fields:
        words |= ((np.arange(count, dtype=np.uint64) * step) % (1 << width)) << np.uint64(at)
        at += width
    return words.astype(np.uint32).view(np.uint8)


def exhaustive(ggml_type: int) -> np.ndarray:
    """IQ blocks meeting every grid index, every sign index and every scale nibble."""
    if ggml_type == Q.IQ2_XS:  # 32 words of 9-bit index + 7-bit sign, 8 bytes of nibbles
        words = (np.arange(512, dtype=np.uint32) | ((np.arange(512) * 5 % 128) << 9))
        qs = words.astype(np.uint16).view(np.uint8).reshape(16, 64)
        k = np.arange(16 * 8, dtype=np.uint32)
        nibbles = ((k % 16) | ((k // 8 % 16) << 4)).astype(np.uint8).reshape(16, 8)
        body = np.concatenate([qs, nibbles], axis=1)
    elif ggml_type == Q.IQ2_XXS:  # 8 groups: 4 index bytes, a word of 4 signs and a scale
        index = (np.arange(512, dtype=np.uint32) % 256).astype(np.uint8).reshape(16, 8, 4)
        meta = _iq_words(128, [(7, 1), (7, 3), (7, 5), (7, 7), (4, 1)]).reshape(16, 8, 4)
        body = np.concatenate([index, meta], axis=2).reshape(16, 64)
    else:  # IQ3_XXS: 64 index bytes, then 8 words of 4 signs and a scale
        index = (np.arange(1024, dtype=np.uint32) % 256).astype(np.uint8).reshape(16, 64)
        meta = _iq_words(128, [(7, 1), (7, 3), (7, 5), (7, 7), (4, 1)]).reshape(16, 32)
        body = np.concatenate([index, meta], axis=1)
    d = np.zeros((body.shape[0], 2), dtype=np.uint8)
    return with_scales(np.concatenate([d, body], axis=1), ggml_type, list(EXTREMES))


def met(raw: np.ndarray, ggml_type: int) -> tuple[int, int, int]:
    """How many grid indices, sign indices and scale nibbles IQ blocks ``raw`` use."""
    if ggml_type == Q.IQ2_XS:
        qs = raw[:, 2:66].copy().view(np.uint16).astype(np.int64)
        scales = raw[:, 66:74].reshape(-1, 1) >> np.array([0, 4], dtype=np.uint8)
        return (len(set((qs & 511).ravel())), len(set((qs >> 9).ravel())),
                len(set((scales & 15).ravel())))
    if ggml_type == Q.IQ2_XXS:
        words = raw[:, 2:66].copy().view(np.uint32).reshape(-1, 2)
        index, meta = words[:, 0:1].copy().view(np.uint8), words[:, 1]
    else:
        index, meta = raw[:, 2:66], raw[:, 66:98].copy().view(np.uint32).ravel()
    signs = meta.reshape(-1, 1) >> np.array([0, 7, 14, 21], dtype=np.uint32)
    return len(set(index.ravel())), len(set((signs & 127).ravel())), len(set(meta >> 28))


def _fields(data: np.ndarray, shifts: list[int], mask: int) -> np.ndarray:
    """Each integer's fields at ``shifts`` in turn, ``(n, w * len(shifts))``."""
    return ((data[:, :, None] >> np.array(shifts)) & mask).reshape(data.shape[0], -1)


GRID_INDICES: dict[int, tuple[Callable[[np.ndarray], np.ndarray], int]] = {
    # blocks (int64) -> each point's grid index (gguf-py's layouts), and the grid's size
    Q.IQ2_S: (lambda b: b[:, 2:34] | _fields(b[:, 66:74], [0, 2, 4, 6], 3) << 8, 1024),
    Q.IQ3_S: (lambda b: b[:, 2:66] | _fields(b[:, 66:74], list(range(8)), 1) << 8, 512),
    Q.IQ1_S: (lambda b: b[:, 2:34] | _fields(b[:, 34:50:2] | b[:, 35:50:2] << 8,
                                             [0, 3, 6, 9], 7) << 8, 2048),
    Q.IQ1_M: (lambda b: b[:, 0:32] | _fields(b[:, 32:48], [0, 4], 7) << 8, 2048),
}


def own(blocks_t: Any, ggml_type: int, dtype: Any) -> Any:
    """The type's routine called directly, into an ``out`` of ``dtype``."""
    out = torch.empty(blocks_t.shape[0], gd.block_shape(ggml_type)[0], dtype=dtype,
                      device=blocks_t.device)
    ROUTINES[ggml_type](blocks_t, out)
    return out


def check(raw: np.ndarray, ggml_type: int, device: str) -> None:
    """Every dtype through :func:`dequantize` and through our own routine."""
    blocks_t = torch.from_numpy(raw).to(device)
    for dtype in DTYPES:
        want = reference(raw, ggml_type, dtype)
        assert_bitwise(gd.dequantize(blocks_t, ggml_type, dtype), want)
        assert_bitwise(own(blocks_t, ggml_type, dtype), want)


class TestExact:
    """Each type equal to gguf-py's reference cast once, in every compute dtype."""

    @pytest.mark.parametrize("ggml_type", TYPES, ids=[Q(t).name for t in TYPES])
    def test_random_blocks(self, ggml_type: int) -> None:
        @settings(max_examples=15, deadline=None)
        @given(raw=blocks(ggml_type))
        def run(raw: np.ndarray) -> None:
            check(raw, ggml_type, "cpu")

        run()

    @pytest.mark.parametrize("ggml_type", [Q.IQ2_XXS, Q.IQ2_XS, Q.IQ3_XXS],
                             ids=["IQ2_XXS", "IQ2_XS", "IQ3_XXS"])
    def test_every_grid_index_and_sign(self, ggml_type: int) -> None:
        raw = exhaustive(ggml_type)
        assert met(raw, ggml_type) == {Q.IQ2_XS: (512, 128, 16)}.get(ggml_type, (256, 128, 16))
        check(raw, ggml_type, "cpu")

    @pytest.mark.parametrize("ggml_type", list(GRID_INDICES), ids=lambda t: Q(t).name)
    def test_every_grid_index_at_random(self, ggml_type: int) -> None:
        """IQ2_S, IQ3_S, IQ1_S and IQ1_M: random blocks enough to meet every grid index
        (their signs are a bit a value, their scales a few bits: met many times over)."""
        raw = random_blocks(ggml_type, 4096, seed=3)
        indices, size = GRID_INDICES[ggml_type]
        assert len(np.unique(indices(raw.astype(np.int64)))) == size
        check(raw, ggml_type, "cpu")

    def test_every_e8m0_scale(self) -> None:
        codes = np.arange(256, dtype=np.uint8).reshape(16, 16)  # every E2M1 pair, twice
        raw = np.concatenate([np.arange(256, dtype=np.uint8).reshape(256, 1),
                              np.tile(codes, (16, 1))], axis=1)
        check(raw, Q.MXFP4, "cpu")

    def test_every_ue4m3_scale(self) -> None:
        """NVFP4: each of the 256 scale bytes (0 and 0x7F are zero) under every code."""
        raw = np.zeros((64, 36), dtype=np.uint8)
        raw[:, 0:4] = np.arange(256, dtype=np.uint8).reshape(64, 4)
        raw[:, 4:] = np.tile(np.arange(16, dtype=np.uint8) * 17, 2)  # both nibbles
        check(raw, Q.NVFP4, "cpu")

    @pytest.mark.parametrize("ggml_type", [Q.F32, Q.F16, Q.BF16], ids=["F32", "F16", "BF16"])
    def test_float_types_pass_through(self, ggml_type: int) -> None:
        values = np.random.default_rng(1).standard_normal(64).astype(np.float32) * 1e4
        raw = gguf.quants.quantize(values, ggml_type).view(np.uint8)
        misaligned = torch.from_numpy(np.concatenate([[0], raw]).astype(np.uint8))[1:]
        for blocks_t in (torch.from_numpy(raw), misaligned):
            for dtype in DTYPES:
                got = gd.dequantize(blocks_t, ggml_type, dtype)
                assert_bitwise(got, reference(raw, ggml_type, dtype))


class TestInterface:
    """Shapes, reused scratch, chunks and the one-line refusals."""

    def _raw(self, ggml_type: int, count: int) -> np.ndarray:
        _, nbytes = gguf.GGML_QUANT_SIZES[Q(ggml_type)]
        raw = np.random.default_rng(3).integers(0, 256, (count, nbytes), dtype=np.uint8)
        return with_scales(raw, ggml_type, [0.5, -2.0, 3e-3])

    def test_stacked_experts_keep_their_shape(self) -> None:
        raw = self._raw(Q.Q4_K, 2 * 3 * 2).reshape(2, 3, 2 * 144)  # experts, rows, row bytes
        got = gd.dequantize(torch.from_numpy(raw), Q.Q4_K, torch.bfloat16)
        assert got.shape == (2, 3, 512)
        assert_bitwise(got.reshape(-1), reference(raw.reshape(-1, 144), Q.Q4_K,
                                                  torch.bfloat16).reshape(-1))

    def test_out_is_filled_and_returned(self) -> None:
        raw = self._raw(Q.IQ2_XXS, 4)
        out = torch.full((4 * 256,), 7.0, dtype=torch.float16)
        got = gd.dequantize(torch.from_numpy(raw).reshape(-1), Q.IQ2_XXS, torch.float16, out=out)
        assert got is out
        assert_bitwise(out, reference(raw, Q.IQ2_XXS, torch.float16).reshape(-1))

    @pytest.mark.parametrize("ggml_type", TYPES, ids=[Q(t).name for t in TYPES])
    def test_misaligned_view(self, ggml_type: int) -> None:
        """Blocks at an odd address (a view into a larger buffer) read as well."""
        raw = self._raw(ggml_type, 2)
        buffer = torch.from_numpy(np.concatenate([[7], raw.reshape(-1)]).astype(np.uint8))
        got = gd.dequantize(buffer[1:].view(1, -1), ggml_type, torch.bfloat16)
        assert_bitwise(got.reshape(2, -1), reference(raw, ggml_type, torch.bfloat16))

    def test_default_dtype_does_not_matter(self) -> None:
        """transformers' loading may set torch's default dtype; the values stay float32's."""
        raws = {t: self._raw(t, 2) for t in TYPES}
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            got = {t: gd.dequantize(torch.from_numpy(r), t, torch.bfloat16)
                   for t, r in raws.items()}
        finally:
            torch.set_default_dtype(previous)
        for t, raw in raws.items():
            assert_bitwise(got[t], reference(raw, t, torch.bfloat16))

    def test_chunks(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(gd, "CHUNK_VALUES", 3 * 32)
        raw = self._raw(Q.Q5_0, 10)
        got = gd.dequantize(torch.from_numpy(raw), Q.Q5_0, torch.bfloat16)
        assert_bitwise(got, reference(raw, Q.Q5_0, torch.bfloat16))

    @pytest.mark.parametrize("ggml_type", [Q.TQ1_0, Q.TQ2_0, 99])
    def test_unsupported_type_refused(self, ggml_type: int) -> None:
        assert not gd.supported(ggml_type)
        with pytest.raises(UsageError, match="cannot be dequantized") as caught:
            gd.dequantize(torch.zeros(110, dtype=torch.uint8), ggml_type, torch.bfloat16)
        assert "\n" not in str(caught.value)
        name = Q(ggml_type).name if ggml_type != 99 else "99"
        assert name in str(caught.value)

    def test_bad_arguments_refused(self) -> None:
        raw = torch.zeros(2, 34, dtype=torch.uint8)
        with pytest.raises(UsageTypeError, match="uint8"):
            gd.dequantize(raw.float(), Q.Q8_0, torch.bfloat16)
        with pytest.raises(UsageError, match="whole number of blocks"):
            gd.dequantize(raw[:, :33], Q.Q8_0, torch.bfloat16)
        with pytest.raises(UsageError, match=r"not torch\.float64"):
            gd.dequantize(raw, Q.Q8_0, torch.float64)
        with pytest.raises(UsageError, match="out must be"):
            gd.dequantize(raw, Q.Q8_0, torch.bfloat16, out=torch.empty(2, 32))
        assert gd.dequantize(raw.view(torch.int8), Q.Q8_0, torch.float32).shape == (2, 32)

    def test_supported_and_block_shape(self) -> None:
        assert all(gd.supported(t) for t in [*TYPES, Q.F32, Q.F16, Q.BF16])
        assert gd.block_shape(Q.IQ2_XXS) == (256, 66) and gd.block_shape(Q.MXFP4) == (32, 17)


def test_the_transformers_and_proxy_dequantizers_cover_the_same_types() -> None:
    """One list of quantized GGUF types: what the proxy's real compute dequantizes (its
    kernels are made from it) is what the transformers path's torch routines cover."""
    from moestream.gpu.dequantsource import KERNELS
    from moestream.pipeline.foundation.compute import DEQUANTIZED
    from moestream.transformers._gguf_blocks import ROUTINES

    assert set(KERNELS) == set(DEQUANTIZED) == {int(q) for q in ROUTINES}
