"""The CUDA FP8 dequantization kernel: ``torch.equal`` to torch's ops on the device for
every E4M3 code, random blocks (partial edges included), extreme scales and each output
type (gpu mark)."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("cupy")

from moestream.transformers._dequant import fp8_blocks  # noqa: E402
from moestream.transformers._dequant_cuda import fp8_experts_cuda  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")]


def _same(a: Any, b: Any) -> bool:
    return bool(torch.equal(a.isnan(), b.isnan())
                and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n, rows, cols, block", [
    (1, 16, 16, (8, 8)), (3, 64, 48, (16, 16)), (2, 100, 70, (32, 16)),
    (8, 768, 2048, (128, 128)), (5, 2880, 2880, (128, 128))])
def test_kernel_equals_torch(n: int, rows: int, cols: int, block: tuple[int, int],
                             dtype: Any) -> None:
    gen = torch.Generator(device="cuda").manual_seed(rows * cols + n)
    codes = torch.randint(0, 256, (n, rows, cols), dtype=torch.uint8, device="cuda",
                          generator=gen)
    sr, sc = -(-rows // block[0]), -(-cols // block[1])
    exponents = torch.randint(-60, 60, (n, sr, sc), device="cuda", generator=gen)
    scales = torch.rand((n, sr, sc), device="cuda", generator=gen) * torch.exp2(
        exponents.to(torch.float32))
    theirs = fp8_blocks(codes, scales, block, dtype)
    order = list(range(n))[::-1]  # any experts, any order: each matrix's own scales
    ours = torch.empty((n, rows, cols), dtype=dtype, device="cuda")
    fp8_experts_cuda([codes[e].data_ptr() for e in order], order, scales, ours, block)
    assert _same(ours, theirs[order])


def test_into_a_strided_target() -> None:
    """The gate and up halves of a stacked gate_up: rows contiguous, experts apart."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    codes = torch.randint(0, 256, (4, 32, 48), dtype=torch.uint8, device="cuda", generator=gen)
    scales = torch.rand((4, 2, 3), device="cuda", generator=gen)
    gate_up = torch.zeros((4, 64, 48), dtype=torch.bfloat16, device="cuda")
    fp8_experts_cuda([codes[e].data_ptr() for e in range(4)], list(range(4)), scales,
                     gate_up[:, 32:], (16, 16))
    assert _same(gate_up[:, 32:], fp8_blocks(codes, scales, (16, 16), torch.bfloat16))
    assert not gate_up[:, :32].any()


def test_bf16_scales_and_every_code() -> None:
    codes = torch.arange(256, dtype=torch.uint8, device="cuda").reshape(1, 16, 16)
    scales = torch.tensor([[[0.5, 3.0], [2.0**-30, 2.0**30]]], device="cuda")
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        ours = torch.empty((1, 16, 16), dtype=dtype, device="cuda")
        fp8_experts_cuda([codes[0].data_ptr()], [0], scales, ours, (8, 8))
        assert _same(ours, fp8_blocks(codes, scales.to(torch.bfloat16).float(), (8, 8), dtype))
