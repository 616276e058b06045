"""bench.quantized: its device quantizer is the format's rule, and a tiny run's FP8 tokens
equal transformers' dequantized model's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from bench.quantized import main, quantize_fp8_blocks  # noqa: E402
from tests.quantized import quantize_fp8  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.mark.parametrize("shape, block", [((64, 32), (16, 16)), ((100, 70), (32, 16))])
def test_quantizer_is_the_rule(shape: tuple[int, int], block: tuple[int, int]) -> None:
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 0.02
    ours, ours_scales = quantize_fp8_blocks(weight, block)
    theirs, theirs_scales = quantize_fp8(weight, block)
    assert torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8))
    assert torch.equal(ours_scales, theirs_scales)


def test_tiny_run(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    code = main(["--make", str(tmp_path / "m"), "--shape", "tiny", "--tokens", "3",
                 "--warmup", "1", "--total", "200KiB", "--device", "cpu",
                 "--runs", "reference,fp8,bf16", "--out", str(out)])
    report = json.loads(out.read_text())
    assert code == 0 and report["runs"]["fp8"]["same_tokens"]
    assert report["ratios"]["fp8_over_bf16"] > 0
    assert report["runs"]["fp8"]["hit_rate"] >= report["runs"]["bf16"]["hit_rate"]
