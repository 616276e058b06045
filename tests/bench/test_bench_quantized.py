"""bench.quantized: its device quantizer is the format's rule, and a tiny run's FP8, MXFP4
and FP4 tokens equal transformers' dequantized model's, at a budget below the experts and
holding them all, with the BF16 hit rate of the same bytes replayed."""

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


def test_rounds_take_each_ratio_within_a_round(tmp_path: Path) -> None:
    """``--rounds 2``: every run measured twice in turns, each ratio the median of the
    rounds' own, every round's kept; the in-place runs say they need a GPU."""
    out = tmp_path / "report.json"
    code = main(["--make", str(tmp_path / "m"), "--shape", "tiny", "--tokens", "3",
                 "--warmup", "1", "--repeat", "1", "--total", "200KiB", "--device", "cpu",
                 "--runs", "fp8,bf16,fp8_in_place", "--rounds", "2", "--out", str(out)])
    report = json.loads(out.read_text())
    assert code == 0 and len(report["ratios_rounds"]) == 2
    each = [r["fp8_over_bf16"] for r in report["ratios_rounds"]]
    assert report["ratios"]["fp8_over_bf16"] == pytest.approx(sum(each) / 2, abs=1e-3)
    fp8 = report["runs"]["fp8"]
    assert len(fp8["rounds"]) == 2 and fp8["tokens_per_s"] > 0
    assert all(r["skipped"] for r in report["runs"]["fp8_in_place"]["rounds"])


@pytest.mark.parametrize("fmt, total", [("mxfp4", "512KiB"), ("fp4", "1060KiB")])
def test_tiny_run_fp4_formats(tmp_path: Path, fmt: str, total: str) -> None:
    """The maker's checkpoints: dense ~0.5 (MXFP4) and ~1 MB (FP4), experts 6 KiB, their
    scales 6 KiB in all; ``total`` leaves the cache about half the experts."""
    if fmt == "fp4":
        pytest.importorskip("transformers.models.deepseek_v4")
    out = tmp_path / "report.json"
    code = main(["--make", str(tmp_path / "m"), "--format", fmt, "--shape", "tiny",
                 "--tokens", "3", "--warmup", "1", "--total", total, "--device", "cpu",
                 "--out", str(out)])
    report = json.loads(out.read_text())
    runs = report["runs"]
    assert code == 0 and runs[fmt]["same_tokens"] and runs[f"{fmt}_all"]["same_tokens"]
    assert runs[fmt]["misses"] > 0 and runs[f"{fmt}_all"]["hit_rate"] == 1.0
    # the cache is what the total leaves once the dense weights and the scales are counted
    assert runs[fmt]["budget_bytes"] < report["experts_budget_bytes"]
    assert 0 <= runs[fmt]["bf16_hit_rate_same_bytes"] <= runs[fmt]["hit_rate_replayed"]
    assert 0 <= runs[fmt]["scales_streamed_hit_rate_same_bytes"] <= 1
    assert runs[fmt]["scale_bytes_held"] == 6144  # 1/16 of the experts' 96 KiB
    assert "bf16" not in runs and runs["dequant"]["skipped"]
    assert f"{fmt}_over_resident" in report["ratios"]


def test_a_shape_of_another_format_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        main(["--make", str(tmp_path), "--format", "mxfp4", "--shape", "qwen3-30b-a3b"])


def test_diff_of_a_tiny_fp4_model_finds_nothing_apart(tmp_path: Path) -> None:
    """bench.quantized_diff on a tiny DeepSeek-V4 FP4 checkpoint (bench.quantized's maker):
    every dense tensor and expert compared and equal, logits and tokens equal."""
    from bench.quantized import make_quantized
    from bench.quantized_diff import main as diff

    make_quantized(tmp_path / "fp4", "fp4", "tiny", 2)
    out = tmp_path / "diff.json"
    assert diff(["-m", str(tmp_path / "fp4"), "--format", "fp4", "--device", "cpu",
                 "--tokens", "4", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["dense"]["compared"] > 10 and not report["dense"]["unequal"]
    assert report["experts"] and all(layer["counts"] == {"gate_up": 0, "down": 0}
                                     for layer in report["experts"].values())
    assert report["forwards"]["logits"]["equal"] and report["forwards"]["reference_repeats"]
