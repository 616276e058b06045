"""The CUDA FP8 dequantization kernel: ``torch.equal`` to torch's ops on the device for
every E4M3 code, random blocks (partial edges included), extreme scales and each output
type (gpu mark)."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("cupy")

from moestream.transformers._dequant import fp8_blocks, fp8_blocks_torch  # noqa: E402
from moestream.transformers._dequant_cuda import fp8_blocks_cuda  # noqa: E402

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
    ours = fp8_blocks_cuda(codes, scales, block, dtype)
    theirs = fp8_blocks_torch(codes, scales, block, dtype)
    assert _same(ours, theirs)
    assert _same(fp8_blocks(codes[0], scales[0], block, dtype), theirs[0])


def test_bf16_scales_and_every_code() -> None:
    codes = torch.arange(256, dtype=torch.uint8, device="cuda").reshape(16, 16)
    scales = torch.tensor([[0.5, 3.0], [2.0**-30, 2.0**30]], device="cuda").to(torch.bfloat16)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert _same(fp8_blocks_cuda(codes, scales, (8, 8), dtype),
                     fp8_blocks_torch(codes, scales, (8, 8), dtype))
