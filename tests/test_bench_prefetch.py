"""Tests for tools.bench_prefetch: every run on a tiny model, its figures, and bad input."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tools.bench_prefetch import gain_figures, main, prefetch_figures

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

RUNS = [f"{mode}_{prefetch}" for mode in ("direct", "resident")
        for prefetch in ("none", "predict", "oracle")]


def _run(tmp_path: Path, *args: str) -> tuple[int, dict[str, Any]]:
    out = tmp_path / "prefetch.json"
    code = main([*args, "--out", str(out), "--backend", "host"])
    return code, json.loads(out.read_text()) if out.exists() else {}


class TestBench:
    """Both modes, each prefetch, on the tiny model: every run is there and sane."""

    def test_all_runs(self, tiny_model: Path, tmp_path: Path,
                      capsys: pytest.CaptureFixture[str]) -> None:
        code, result = _run(tmp_path, "--model", str(tiny_model), "--tokens", "8",
                            "--skip-tokens", "2", "--direct-tokens", "6",
                            "--direct-skip-tokens", "2", "--layer-ms", "0.1")
        assert code == 0
        runs = result["runs"]
        assert set(RUNS) <= runs.keys()
        for name in RUNS:
            run = runs[name]
            assert run["tokens_per_s"] > 0, name
            assert run["summary"]["peak_device_bytes"] <= run["summary"]["budget_bytes"], name
            assert run["budget_ok"] and run["summary"]["mismatches"] == 0
            assert run["tokens"] == (6 if name.startswith("resident") else 4)
            assert (run["prefetch_stats"] is not None) == name.endswith("predict")
        for mode in ("direct", "resident"):
            accuracy = runs[f"{mode}_predict"]["prefetch_stats"]["accuracy"]
            assert 0.0 <= accuracy <= 1.0
            assert result["figures"][mode]["predict_accuracy"] == accuracy
            assert result["figures"][mode]["predict_over_none"] > 0
        # the tiny model has routers and F16 experts: the live router runs with real compute
        live = runs["resident_predict_live"]
        assert "error" not in live and live["compute"] == "real"
        assert 0.0 <= live["prefetch_stats"]["accuracy"] <= 1.0
        assert result["figures"]["budget_never_exceeded"] is True
        assert result["commit"] and result["command"].startswith("python -m tools.bench_prefetch")
        assert result["warmup"]["before_none"]["resident_share"] == 1.0
        out = capsys.readouterr().out
        assert "direct_predict" in out and "written: " in out

    def test_one_mode_no_live(self, tiny_model: Path, tmp_path: Path) -> None:
        code, result = _run(tmp_path, "--model", str(tiny_model), "--modes", "direct",
                            "--direct-tokens", "4", "--direct-skip-tokens", "1", "--no-live")
        assert code == 0
        assert set(result["runs"]) == {"direct_none", "direct_predict", "direct_oracle"}
        assert set(result["figures"]) == {"direct", "budget_never_exceeded"}


class TestFigures:
    """Gains per mode, with the share of the oracle's gain guarded against a zero gain."""

    @staticmethod
    def _runs(none: float, predict: float, oracle: float) -> dict[str, dict[str, Any]]:
        pf = {"accuracy": 0.5, "wasted_bytes_per_token": 10.0}
        return {f"direct_{p}": {"mode": "direct", "tokens_per_s": tps, "hit_rate": 0.5,
                                "prefetch_stats": pf if p == "predict" else None}
                for p, tps in (("none", none), ("predict", predict), ("oracle", oracle))}

    def test_share_of_the_oracle_gain(self) -> None:
        fig = gain_figures(self._runs(10.0, 12.0, 14.0))["direct"]
        assert fig["predict_over_none"] == 1.2 and fig["oracle_over_none"] == 1.4
        assert fig["share_of_oracle_gain"] == 0.5
        assert fig["predict_accuracy"] == 0.5 and fig["predict_wasted_bytes_per_token"] == 10.0

    @pytest.mark.parametrize("oracle", [10.0, 10.05, 9.0])
    def test_no_share_without_an_oracle_gain(self, oracle: float) -> None:
        assert gain_figures(self._runs(10.0, 11.0, oracle))["direct"][
            "share_of_oracle_gain"] is None

    def test_prefetch_figures(self) -> None:
        events: list[dict[str, Any]] = [
            {"prefetch": {"predicted": 4, "correct": 3, "wasted_bytes": 100}},
            {"prefetch": {"predicted": 4, "correct": 1, "wasted_bytes": 300}},
        ]
        fig = prefetch_figures(events)
        assert fig == {"predicted": 8, "correct": 4, "accuracy": 0.5, "wasted_bytes": 400,
                       "wasted_bytes_per_token": 200.0}
        assert prefetch_figures([{"token": 0}]) is None


class TestErrors:
    """Bad input: one line on stderr, exit 2, no result written."""

    def test_missing_model(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        code, result = _run(tmp_path, "--model", str(tmp_path / "absent.gguf"))
        err = capsys.readouterr().err
        assert code == 2 and result == {}
        assert err.count("\n") == 1 and "no such file" in err

    def test_not_gguf(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        bad = tmp_path / "bad.gguf"
        bad.write_bytes(b"not a gguf file at all" * 100)
        code, _ = _run(tmp_path, "--model", str(bad))
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and str(bad) in err

    def test_skip_leaves_no_tokens(self, tiny_model: Path, tmp_path: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
        code, _ = _run(tmp_path, "--model", str(tiny_model), "--tokens", "4",
                       "--skip-tokens", "4")
        assert code == 2 and "--tokens 4" in capsys.readouterr().err
