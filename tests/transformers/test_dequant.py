"""moestream.transformers._dequant: quantized matrices equal to transformers' own
dequantization (bitwise), on random valid blocks, every FP8 and E2M1 code, extreme scales
(every E8M0 byte, 0 and 255 included), on the CPU and, where torch sees one, a GPU."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
finegrained = pytest.importorskip("transformers.integrations.finegrained_fp8")
mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")

from moestream.transformers._dequant import (  # noqa: E402
    e2m1_pairs,
    fp4_blocks,
    fp8_blocks,
    mxfp4_blocks,
    mxfp4_exponents,
)

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _theirs(weights: Any, scales: Any, dtype: Any) -> Any:
    """transformers' FP8 dequantization, as ``FineGrainedFP8Config(dequantize=True)`` runs it."""
    return finegrained.Fp8Dequantize(None)._dequantize_one(weights, scales, output_dtype=dtype)


def _by_block(weights: Any, scales: Any, block: tuple[int, int], dtype: Any) -> Any:
    """The checkpoint's rule written out block by block (partial edge blocks included)."""
    bm, bn = block
    out = torch.empty(weights.shape, dtype=torch.float32)
    w = weights.to(torch.float32)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            out[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn] = (
                w[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn] * scales[i, j].to(torch.float32))
    return out.to(dtype)


@st.composite
def fp8_matrix(draw: st.DrawFn, whole: bool) -> tuple[Any, Any, tuple[int, int]]:
    """Random FP8 bytes (every code, NaN included) and finite scales over a wide range."""
    bm, bn = draw(st.sampled_from([1, 2, 8, 16, 32])), draw(st.sampled_from([1, 4, 16, 32]))
    sr, sc = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    rows = sr * bm if whole else draw(st.integers((sr - 1) * bm + 1, sr * bm))
    cols = sc * bn if whole else draw(st.integers((sc - 1) * bn + 1, sc * bn))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (rows, cols), generator=gen, dtype=torch.uint8)
    exponents = torch.randint(-40, 40, (sr, sc), generator=gen).to(torch.float32)
    scales = torch.rand((sr, sc), generator=gen) * torch.exp2(exponents)
    return codes, scales, (bm, bn)


class TestFp8Blocks:
    """FP8 E4M3 with block scales (``quant_method: fp8``): F32, BF16 or E8M0 (DeepSeek-V4's
    dense weights)."""

    @settings(max_examples=60, deadline=None)
    @given(fp8_matrix(whole=True), st.sampled_from(DTYPES),
           st.sampled_from([torch.float32, torch.bfloat16, torch.float8_e8m0fnu]))
    def test_equal_to_transformers(self, made: tuple[Any, Any, tuple[int, int]], dtype: Any,
                                   scale_dtype: Any) -> None:
        codes, scales, block = made
        scales = scales.to(scale_dtype)
        assert _both_nan_equal(fp8_blocks(codes, scales, block, dtype),
                               _theirs(codes.view(torch.float8_e4m3fn), scales, dtype))

    @settings(max_examples=60, deadline=None)
    @given(fp8_matrix(whole=False), st.sampled_from(DTYPES))
    def test_partial_edge_blocks(self, made: tuple[Any, Any, tuple[int, int]],
                                 dtype: Any) -> None:
        """Blocks that do not divide the matrix (transformers refuses these grids): block
        ``i`` covers rows ``i * bm`` to the edge."""
        codes, scales, block = made
        ours = fp8_blocks(codes, scales, block, dtype)
        assert _both_nan_equal(ours, _by_block(codes.view(torch.float8_e4m3fn), scales, block,
                                               dtype))

    def test_every_code(self) -> None:
        codes = torch.arange(256, dtype=torch.uint8).reshape(16, 16)
        scales = torch.tensor([[0.5, 3.0], [2.0**-30, 2.0**30]])
        for dtype in DTYPES:
            assert _both_nan_equal(fp8_blocks(codes, scales, (8, 8), dtype),
                                   _theirs(codes.view(torch.float8_e4m3fn), scales, dtype))

    def test_batched_experts_equal_one_by_one(self) -> None:
        gen = torch.Generator().manual_seed(3)
        codes = torch.randint(0, 120, (5, 48, 40), generator=gen, dtype=torch.uint8)
        scales = torch.rand((5, 3, 3), generator=gen)
        batched = fp8_blocks(codes, scales, (16, 16), torch.bfloat16)
        for e in range(5):
            assert torch.equal(batched[e], fp8_blocks(codes[e], scales[e], (16, 16),
                                                      torch.bfloat16))


def _both_nan_equal(a: Any, b: Any) -> bool:
    return bool(torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0),
                                                                   b.nan_to_num(0.0)))


@st.composite
def mxfp4_tensor(draw: st.DrawFn) -> tuple[Any, Any]:
    """gpt-oss's blocks ``(E, rows, groups, 16)`` of random bytes and scales of random E8M0
    bytes, the extremes (0, 1, 126..128, 254, 255) drawn often."""
    experts, rows, groups = draw(st.integers(1, 3)), draw(st.integers(1, 9)), draw(
        st.integers(1, 3))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    blocks = torch.randint(0, 256, (experts, rows, groups, 16), generator=gen,
                           dtype=torch.uint8)
    extremes = torch.tensor([0, 1, 126, 127, 128, 254, 255], dtype=torch.uint8)
    scales = torch.randint(0, 256, (experts, rows, groups), generator=gen, dtype=torch.uint8)
    pick = torch.randint(0, 2, scales.shape, generator=gen).bool()
    chosen = extremes[torch.randint(0, len(extremes), scales.shape, generator=gen)]
    return blocks, torch.where(pick, chosen, scales)


def _ours_mxfp4(blocks: Any, scales: Any, dtype: Any, device: str) -> Any:
    """gpt-oss's layout from moestream's function: rows of the untransposed matrices
    (blocks as bytes) dequantized, then transposed as the module keeps them."""
    e, rows, groups, half = blocks.shape
    packed = blocks.reshape(e, rows, groups * half).to(device)
    out = mxfp4_blocks(packed, mxfp4_exponents(scales.to(device)), dtype, e2m1_pairs(device))
    return out.transpose(1, 2).cpu()


class TestMxfp4:
    """gpt-oss's MXFP4 (``quant_method: mxfp4``) against ``convert_moe_packed_tensors``,
    the function ``Mxfp4Config(dequantize=True)`` loads with."""

    @settings(max_examples=60, deadline=None)
    @given(mxfp4_tensor(), st.sampled_from(DTYPES), st.sampled_from(DEVICES))
    def test_equal_to_transformers(self, made: tuple[Any, Any], dtype: Any,
                                   device: str) -> None:
        blocks, scales = made
        theirs = mxfp4.convert_moe_packed_tensors(blocks.to(device), scales.to(device),
                                                  dtype=dtype).cpu()
        assert _both_nan_equal(_ours_mxfp4(blocks, scales, dtype, device), theirs)

    @pytest.mark.parametrize("device", DEVICES)
    def test_every_code_at_every_scale(self, device: str) -> None:
        """Each of the 256 bytes (every pair of E2M1 codes) under each of the 256 E8M0
        scales."""
        blocks = torch.arange(256, dtype=torch.uint8).repeat(256, 1).reshape(1, 256, 16, 16)
        scales = torch.arange(256, dtype=torch.uint8)[:, None].repeat(1, 16).reshape(1, 256, 16)
        for dtype in DTYPES:
            theirs = mxfp4.convert_moe_packed_tensors(blocks.to(device), scales.to(device),
                                                      dtype=dtype).cpu()
            assert _both_nan_equal(_ours_mxfp4(blocks, scales, dtype, device), theirs)

    def test_batched_experts_equal_one_by_one(self) -> None:
        gen = torch.Generator().manual_seed(5)
        packed = torch.randint(0, 256, (4, 24, 32), generator=gen, dtype=torch.uint8)
        exponents = mxfp4_exponents(torch.randint(110, 140, (4, 24, 2), generator=gen,
                                                  dtype=torch.uint8))
        pairs = e2m1_pairs("cpu")
        batched = mxfp4_blocks(packed, exponents, torch.bfloat16, pairs)
        for e in range(4):
            assert torch.equal(batched[e], mxfp4_blocks(packed[e], exponents[e],
                                                        torch.bfloat16, pairs))


@st.composite
def fp4_matrix(draw: st.DrawFn) -> tuple[Any, Any]:
    """DeepSeek-V4's FP4: int8 ``(rows, cols / 2)`` of random bytes and F8_E8M0 scales
    ``(rows, cols / 32)`` of random bytes, the extremes (0, 1, 126..128, 254, 255: NaN)
    drawn often."""
    rows, groups = draw(st.integers(1, 9)), draw(st.integers(1, 4))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    packed = torch.randint(-128, 128, (rows, groups * 16), generator=gen, dtype=torch.int8)
    extremes = torch.tensor([0, 1, 126, 127, 128, 254, 255], dtype=torch.uint8)
    scales = torch.randint(0, 256, (rows, groups), generator=gen, dtype=torch.uint8)
    pick = torch.randint(0, 2, scales.shape, generator=gen).bool()
    chosen = extremes[torch.randint(0, len(extremes), scales.shape, generator=gen)]
    return packed, torch.where(pick, chosen, scales).view(torch.float8_e8m0fnu)


class TestFp4:
    """DeepSeek-V4's FP4 experts (``expert_dtype: fp4``) against ``Fp8Dequantize``'s FP4
    path, which ``FineGrainedFP8Config(dequantize=True)`` loads them with."""

    @settings(max_examples=60, deadline=None)
    @given(fp4_matrix(), st.sampled_from(DTYPES), st.sampled_from(DEVICES))
    def test_equal_to_transformers(self, made: tuple[Any, Any], dtype: Any,
                                   device: str) -> None:
        packed, scales = made
        ours = fp4_blocks(packed.to(device), scales.to(device), dtype, e2m1_pairs(device))
        assert _both_nan_equal(ours.cpu(), _theirs(packed, scales, dtype))

    @pytest.mark.parametrize("device", DEVICES)
    def test_every_code_at_every_scale(self, device: str) -> None:
        """Each of the 256 bytes (every pair of E2M1 codes) under each of the 256 E8M0
        scales; the scales as float32 (how moestream keeps them on the device) too."""
        packed = torch.arange(256, dtype=torch.uint8).repeat(256, 1).view(torch.int8)
        scales = torch.arange(256, dtype=torch.uint8)[:, None].repeat(1, 16)
        scales = scales.view(torch.float8_e8m0fnu)
        pairs = e2m1_pairs(device)
        for dtype in DTYPES:
            theirs = _theirs(packed, scales, dtype)
            for given_scales in (scales, scales.to(torch.float32)):
                ours = fp4_blocks(packed.to(device), given_scales.to(device), dtype, pairs)
                assert _both_nan_equal(ours.cpu(), theirs)

    def test_batched_experts_equal_one_by_one(self) -> None:
        gen = torch.Generator().manual_seed(7)
        packed = torch.randint(-128, 128, (5, 16, 32), generator=gen, dtype=torch.int8)
        scales = torch.randint(110, 140, (5, 16, 2), generator=gen, dtype=torch.uint8)
        scales = scales.view(torch.float8_e8m0fnu).to(torch.float32)
        pairs = e2m1_pairs("cpu")
        batched = fp4_blocks(packed, scales, torch.float16, pairs)
        for e in range(5):
            assert torch.equal(batched[e], fp4_blocks(packed[e], scales[e], torch.float16,
                                                      pairs))
