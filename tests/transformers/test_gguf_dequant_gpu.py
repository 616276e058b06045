"""moestream.transformers._gguf_dequant on a CUDA device: every type bitwise equal to
gguf-py's float32 reference (computed on the host) cast to the compute dtype, on random
valid blocks, every IQ grid index and sign, every E8M0 scale, and a whole Qwen3-30B-A3B-
shaped expert matrix per type written into reused scratch (``out=``)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")

from moestream.transformers import _gguf_dequant as gd  # noqa: E402
from tests.transformers.test_gguf_dequant import (  # noqa: E402
    DTYPES,
    EXTREMES,
    TYPES,
    Q,
    assert_bitwise,
    blocks,
    check,
    exhaustive,
    own,
    reference,
    with_scales,
)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")]

NAMES = [Q(t).name for t in TYPES]


@pytest.mark.parametrize("ggml_type", TYPES, ids=NAMES)
def test_random_blocks(ggml_type: int) -> None:
    @settings(max_examples=15, deadline=None)
    @given(raw=blocks(ggml_type, most=40))
    def run(raw: np.ndarray) -> None:
        check(raw, ggml_type, "cuda")

    run()


@pytest.mark.parametrize("ggml_type", [Q.IQ2_XXS, Q.IQ2_XS, Q.IQ3_XXS],
                         ids=["IQ2_XXS", "IQ2_XS", "IQ3_XXS"])
def test_every_grid_index_and_sign(ggml_type: int) -> None:
    check(exhaustive(ggml_type), ggml_type, "cuda")


def test_every_e8m0_scale() -> None:
    codes = np.arange(256, dtype=np.uint8).reshape(16, 16)
    raw = np.concatenate([np.arange(256, dtype=np.uint8).reshape(256, 1),
                          np.tile(codes, (16, 1))], axis=1)
    check(raw, Q.MXFP4, "cuda")


@pytest.mark.parametrize("ggml_type", TYPES, ids=NAMES)
def test_expert_matrix_into_scratch(ggml_type: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 768 x 2048 expert matrix (Qwen3-30B-A3B's down projection) in six chunks, into
    scratch reused from call to call."""
    monkeypatch.setattr(gd, "CHUNK_VALUES", 1 << 18)
    elems, nbytes = gguf.GGML_QUANT_SIZES[Q(ggml_type)]
    rows, cols = 768, 2048
    rng = np.random.default_rng(ggml_type)
    raw = rng.integers(0, 256, (rows * cols // elems, nbytes), dtype=np.uint8)
    raw = with_scales(raw, ggml_type, list(EXTREMES) + list(rng.standard_normal(37)))
    device_bytes = torch.from_numpy(raw.reshape(rows, -1)).cuda()
    scratch = {dtype: torch.empty(rows, cols, dtype=dtype, device="cuda") for dtype in DTYPES}
    for dtype in DTYPES * 2:
        want = reference(raw, ggml_type, dtype).reshape(rows, cols)
        got = gd.dequantize(device_bytes, ggml_type, dtype, out=scratch[dtype])
        assert got is scratch[dtype]
        assert_bitwise(got, want)
        mine = own(device_bytes.reshape(-1, nbytes), ggml_type, dtype)
        assert_bitwise(mine.reshape(rows, cols), want)


@pytest.mark.parametrize("ggml_type", [Q.F32, Q.F16, Q.BF16], ids=["F32", "F16", "BF16"])
def test_float_types_pass_through(ggml_type: int) -> None:
    values = np.random.default_rng(1).standard_normal(4096).astype(np.float32) * 1e4
    raw = gguf.quants.quantize(values, ggml_type).view(np.uint8)
    for dtype in DTYPES:
        got = gd.dequantize(torch.from_numpy(raw).cuda(), ggml_type, dtype)
        assert got.device.type == "cuda"
        assert_bitwise(got, reference(raw, ggml_type, dtype))
