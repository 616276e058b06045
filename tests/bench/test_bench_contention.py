"""``bench.contention`` on the host backend, small: it runs end to end, writes the result it
describes, and its figures are numbers (what they are worth is measured on the GPU machine,
never in tests)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from bench.contention import engine_rate
from bench.contention import main as contention_main

# tiny's sweep: 3 MoE layers, 4 tokens x top-4 = all 16 experts a pass, 0.75 MiB each; with
# lookahead 1 the session needs 2 layers' top-4 pinned, under half the sweep
_SMALL = ["--backend", "host", "--rounds", "3", "--engine-s", "0.1", "--sweep-tokens", "4",
          "--passes", "10", "--lookahead", "1", "--no-verify"]  # a window many engine steps long


def _positive(value: Any) -> bool:
    return isinstance(value, float | int) and math.isfinite(value) and value > 0


@pytest.fixture(scope="module")
def result(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One small run with both engine workloads, shared by the module's checks. Its own
    ``XDG_CACHE_HOME``: the autouse fixture that sets one is per test, and runs after this."""
    tmp = tmp_path_factory.mktemp("contention")
    out = tmp / "contention.json"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("XDG_CACHE_HOME", str(tmp / "cache"))
        assert contention_main(["--model", str(tiny_model), *_SMALL, "--out", str(out)]) == 0
    loaded: dict[str, Any] = json.loads(out.read_text())
    return loaded


class TestHostRun:
    """The result of a small host run: its header, its rounds, its figures."""

    def test_header(self, result: dict[str, Any]) -> None:
        """What every result carries: machine, commit, command and settings."""
        assert result["machine"]["device"] == "host" and result["machine"]["cpu_count"]
        assert result["commit"]
        assert result["command"].startswith("python -m bench.contention --model ")
        assert result["settings"]["engine"] == "both" and result["settings"]["rounds"] == 3
        assert set(result["engines"]) == {"gemm", "gemv"}
        assert result["engines"]["gemm"]["unit"] == "TFLOP/s"
        assert result["engines"]["gemv"]["unit"] == "GB/s"

    def test_rounds_hold_every_phase(self, result: dict[str, Any]) -> None:
        """Each round: both engines alone, both methods alone, every pair at once; the
        sweeps all missed (half-sweep budget) and the engine ran inside their windows (in
        one pair at least: on a loaded 2-core machine a thread can be kept off the CPU for
        a whole ~0.1 s window, which CI once saw)."""
        assert len(result["rounds"]) == 3
        inside = 0
        for r in result["rounds"]:
            assert set(r["engine_alone"]) == {"gemm", "gemv"}
            assert set(r["loading_alone"]) == {"gather", "copies"}
            assert r["pinned_h2d_gbps"] is None  # a GPU reference: none on the host
            for method in ("gather", "copies"):
                assert r["loading_alone"][method]["hit_rate"] == 0.0
                for engine in ("gemm", "gemv"):
                    pair = r["both"][method][engine]
                    inside += pair["engine"]["steps"]
                    assert (pair["engine"]["steps"] > 0) == (pair["engine"]["busy_s"] > 0)
                    assert 0 <= pair["engine"]["busy_s"] <= pair["engine"]["window_s"]
                    assert pair["loading"]["hit_rate"] == 0.0
        assert inside > 0
        assert result["budget_never_exceeded"] is True

    def test_figures_are_positive_numbers(self, result: dict[str, Any]) -> None:
        """Every figure but the pinned-H2D ratios (no GPU here: None, not a division by
        zero) is a finite positive number, and so is every median."""
        med = result["medians"]
        assert med["pinned_h2d_gbps"] is None
        assert all(_positive(v) for v in med["engine_alone"].values())
        assert all(_positive(v) for v in med["loading_alone"].values())
        for method in ("gather", "copies"):
            assert result["figures"][method]["loading_alone_vs_pinned_h2d"] is None
            for engine in ("gemm", "gemv"):
                pair = med["both"][method][engine]
                assert all(_positive(pair[k])
                           for k in ("engine_rate", "delivered_gbps", "misses_per_s"))
                assert pair["hit_rate"] == 0.0
                fig = result["figures"][method][engine]
                assert _positive(fig["engine_slowdown"]) and _positive(fig["loading_ratio"])
                assert fig["delivered_vs_pinned_h2d"] is None


class TestEngineRate:
    """Only the steps wholly inside the loading window count, idle gaps included."""

    def test_window_cuts_steps(self) -> None:
        ends = [1.0, 2.0, 3.0, 4.0, 5.0]  # steps of 1 s from t0 = 0
        rate = engine_rate(0.0, ends, 2.0, 1.5, 4.5)
        assert rate["steps"] == 2 and rate["busy_s"] == 2.0 and rate["rate"] == 2.0

    def test_gap_counts_as_engine_time(self) -> None:
        """A step queued late starts when the one before it ended: the gap is lost work."""
        rate = engine_rate(0.0, [1.0, 4.0], 3.0, 0.0, 4.0)
        assert rate["steps"] == 2 and rate["rate"] == pytest.approx(6.0 / 4.0)

    def test_nothing_inside(self) -> None:
        assert engine_rate(0.0, [10.0], 1.0, 2.0, 3.0)["rate"] == 0.0


def test_bad_options_exit_2(tiny_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """One line and exit 2, before any phase runs."""
    assert contention_main(["--model", str(tiny_model), "--backend", "host",
                            "--passes", "1"]) == 2
    assert "--passes must be >= 2" in capsys.readouterr().err
