"""bench.gguf_dequant: a CPU run of a few types on the tiny shape reports every figure, its
rows' values are gguf-py's, and transformers' routine (where it has the type) made the same
bits."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")

from bench.gguf_dequant import main, random_blocks  # noqa: E402
from moestream.transformers import _gguf_dequant as gd  # noqa: E402

Q = gguf.GGMLQuantizationType


def test_cpu_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "report.json"
    assert main(["--shapes", "tiny", "--types", "IQ2_XXS,Q5_0,BF16", "--repeats", "1",
                 "--batch", "2", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["type"] for r in rows] == ["IQ2_XXS", "Q5_0", "BF16"]
    for row in rows:
        assert row["one_expert_ms"] > 0 and row["upload_ms"] > 0 and row["batch"] == 2
        assert row["expert_out_bytes"] == 3 * 512 * 256 * 2
    assert rows[0].get("same_values", True)
    assert "IQ2_XXS" in capsys.readouterr().out


@pytest.mark.parametrize("ggml_type", [Q.Q2_K, Q.MXFP4, Q.F16])
def test_random_blocks_are_valid(ggml_type: int) -> None:
    """The bench's blocks dequantize to finite values, as gguf-py reads them."""
    raw = random_blocks(ggml_type, 4, 256, "cpu", torch.Generator().manual_seed(0))
    want = gguf.quants.dequantize(raw.numpy(), ggml_type).reshape(4, 256)
    got = gd.dequantize(raw, ggml_type, torch.float32)
    assert np.isfinite(want).all() and torch.equal(got, torch.from_numpy(want))


def test_median_ms_skips_then_takes_the_median(monkeypatch: pytest.MonkeyPatch) -> None:
    """bench.kit's one timer (the gguf and dequant benches' both): the ``skip`` first calls
    are run but not timed, and the figure is the median of the others, in milliseconds."""
    from bench import kit

    clock = [0]
    monkeypatch.setattr("bench.kit.time.perf_counter_ns", lambda: clock[0])
    costs_ns = iter([7_000_000, 9_000_000, 1_000_000, 4_000_000, 2_000_000])
    calls = []

    def work() -> None:
        calls.append(1)
        clock[0] += next(costs_ns)

    assert kit.median_ms(work, torch.device("cpu"), repeats=3, skip=2) == 2.0
    assert len(calls) == 5
