"""Tests for tools.bench_prefetch (every run on a tiny model, and bad input) and
tools.prefetch_figures (the figures read from the runs' logs)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, ClassVar

import pytest
from gguf import GGMLQuantizationType as QType

from bench.prefetch import main
from bench.prefetch_figures import (
    gain_figures,
    guess_loads,
    prefetch_figures,
    routing_agreement,
)
from moestream.pipeline.makers.modelgen import ModelSpec, spec_for, write_model

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

RUNS = [f"{mode}_{prefetch}" for mode in ("direct", "resident")
        for prefetch in ("none", "predict", "oracle")]
LIVE_RUNS = [f"{mode}_{prefetch}_live" for mode in ("direct", "resident")
             for prefetch in ("none", "predict")]
# small live-run token counts: direct 4 (skip 1), resident 6 (skip 2)
LIVE_TOKENS = ["--live-tokens", "6", "--live-skip-tokens", "2", "--live-direct-tokens", "4",
               "--live-direct-skip-tokens", "1"]


@pytest.fixture(scope="module")
def live_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """F16, 1 dense + 4 MoE layers of 8 experts, top-2, the first 2 MoE layers hash-routed:
    one of the 3 layers guessed per token is hash-routed (its guess is exact)."""
    spec = dataclasses.replace(spec_for("tiny", layers=5, experts=8), hash_routed=2, top_k=2)
    return write_model(spec, tmp_path_factory.mktemp("live") / "live.gguf")


@pytest.fixture(scope="module")
def q2_routed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Quantized experts (fixed compute only) and a router: 1 dense + 3 MoE layers."""
    spec = ModelSpec("tiny-q2", 4, 1, 1, 16, 4, 512, 256, QType.IQ2_XXS, QType.Q2_K)
    return write_model(spec, tmp_path_factory.mktemp("q2") / "q2.gguf")


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
            stats = runs[f"{mode}_predict"]["prefetch_stats"]
            assert 0 <= stats["loaded"] <= stats["predicted"]
        for name in RUNS:  # every install is a layer's miss, or a guess that was loaded
            loads = runs[name]["guesses_loaded"]
            assert loads["installs_beyond_misses"] == loads["loaded"], name
            if not name.endswith("predict"):
                assert loads["loaded"] == 0 and loads["source"] == "no prediction"
        # the tiny model has routers and F16 experts: the live router runs with real compute
        live = runs["resident_predict_live"]
        assert "error" not in live and live["compute"] == "real"
        assert live["exact_by_construction"] is False
        assert 0.0 <= live["prefetch_stats"]["accuracy"] <= 1.0
        assert result["figures"]["live_predict"]["accuracy"] == live["prefetch_stats"][
            "accuracy"]
        loads = live["guesses_loaded"]
        assert loads["source"] == "token events (prefetch.loaded)"
        assert loads["loaded"] == loads["used"] + loads["wasted"]
        assert loads["wasted"] * result["model"]["expert_bytes"] == live["run_wasted_bytes"]
        assert result["figures"]["budget_never_exceeded"] is True
        assert result["commit"] and result["command"].startswith("python -m bench.prefetch")
        assert result["warmup"]["before_none"]["resident_share"] == 1.0
        out = capsys.readouterr().out
        assert "direct_predict" in out and "written: " in out

    def test_one_mode_no_live(self, tiny_model: Path, tmp_path: Path) -> None:
        code, result = _run(tmp_path, "--model", str(tiny_model), "--modes", "direct",
                            "--direct-tokens", "4", "--direct-skip-tokens", "1", "--no-live")
        assert code == 0
        assert set(result["runs"]) == {"direct_none", "direct_predict", "direct_oracle"}
        assert set(result["figures"]) == {"direct", "budget_never_exceeded"}


class TestLiveModel:
    """--live-model: live none and predict with real compute on an F16 model, per mode."""

    def test_live_runs(self, tiny_model: Path, live_model: Path, tmp_path: Path) -> None:
        code, result = _run(tmp_path, "--model", str(tiny_model), "--modes", "resident",
                            "--tokens", "6", "--skip-tokens", "2", "--live-model",
                            str(live_model), *LIVE_TOKENS)
        assert code == 0
        runs = result["runs"]
        # the trace model's own live run gives way to the live model's
        assert set(runs) == {"resident_none", "resident_predict", "resident_oracle",
                             *LIVE_RUNS}
        assert result["live_model"]["expert_types"] == "F16/F16"
        for name in LIVE_RUNS:
            run = runs[name]
            assert "error" not in run, run.get("error")
            assert run["compute"] == "real" and run["router"] == "live"
            assert run["model"] == result["live_model"]["path"]
            assert run["exact_by_construction"] is False and run["budget_ok"]
            assert run["summary"]["mismatches"] == 0
            assert run["tokens"] == (4 if name.startswith("resident") else 3)
        for mode in ("direct", "resident"):
            assert runs[f"{mode}_none_live"]["guesses_loaded"]["loaded"] == 0
            stats = runs[f"{mode}_predict_live"]["prefetch_stats"]
            # 1 of the 3 guessed layers is hash-routed: 2 exact guesses a token
            assert stats["predicted"] == 3 * 2 * runs[f"{mode}_predict_live"]["tokens"]
            assert stats["correct"] >= 2 * runs[f"{mode}_predict_live"]["tokens"]
            assert 0.0 <= stats["router_layer_accuracy"] <= stats["accuracy"] <= 1.0
            fig = result["figures"]["live"][mode]
            assert fig["predict_over_none"] > 0
            assert fig["predict_accuracy"] == stats["accuracy"]
            assert fig["predict_router_layer_accuracy"] == stats["router_layer_accuracy"]
            assert fig["predict_guesses_loaded_per_token"] == stats["loaded_per_token"]
            # both runs route alike: real compute does not depend on the cache
            assert fig["routing_agreement_with_none"] >= 0.9
        assert "live_predict" not in result["figures"]
        assert any("compute real" in n for n in result["notes"])
        assert any("hash-routed" in n for n in result["notes"])

    def test_live_only(self, live_model: Path, tmp_path: Path) -> None:
        code, result = _run(tmp_path, "--live-only", "--live-model", str(live_model),
                            "--live-modes", "resident", *LIVE_TOKENS)
        assert code == 0
        assert set(result["runs"]) == {"resident_none_live", "resident_predict_live"}
        assert result["model"] is None and result["live_model"]["layers"] == 4
        assert set(result["figures"]) == {"live", "budget_never_exceeded"}
        assert result["warmup"]["before_live_none"]["resident_share"] == 1.0


class TestFixedComputeLive:
    """Without --live-model, a quantized model's live run has fixed compute: its guess is
    exact by construction, so no accuracy figure is reported for it."""

    def test_not_a_measurement(self, q2_routed: Path, tmp_path: Path) -> None:
        code, result = _run(tmp_path, "--model", str(q2_routed), "--modes", "resident",
                            "--tokens", "6", "--skip-tokens", "2", "--layer-ms", "0.1")
        assert code == 0
        live = result["runs"]["resident_predict_live"]
        assert live["compute"] == "fixed:0.1" and live["exact_by_construction"] is True
        # the hidden state is the token embedding at every layer: every guess is right
        assert live["prefetch_stats"]["accuracy"] == 1.0
        assert result["figures"]["live_predict"] == {
            "mode": "resident", "tokens_per_s": live["tokens_per_s"],
            "compute": "fixed:0.1", "exact_by_construction": True}
        assert any("exact by construction" in n for n in result["notes"])


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


    def test_live_figures_by_suffix(self) -> None:
        runs = {f"direct_{p}_live": {**r, "routing_agreement_with_none": 1.0}
                for p, r in (("none", {"mode": "direct", "tokens_per_s": 10.0,
                                       "hit_rate": 0.25, "prefetch_stats": None}),
                             ("predict", {"mode": "direct", "tokens_per_s": 15.0,
                                          "hit_rate": 0.5, "prefetch_stats": {
                                              "accuracy": 0.75, "router_layer_accuracy": 0.5,
                                              "wasted_bytes_per_token": 4.0,
                                              "loaded_per_token": 2.5}}))}
        assert gain_figures(runs, "_live") == {"direct": {
            "predict_over_none": 1.5, "predict_hit_rate_gain": 0.25, "predict_accuracy": 0.75,
            "predict_router_layer_accuracy": 0.5, "predict_wasted_bytes_per_token": 4.0,
            "routing_agreement_with_none": 1.0, "predict_guesses_loaded_per_token": 2.5}}

    def test_loaded_and_exact_guesses(self) -> None:
        events: list[dict[str, Any]] = [
            {"prefetch": {"predicted": 6, "correct": 4, "loaded": 3, "wasted_bytes": 10}},
            {"prefetch": {"predicted": 6, "correct": 2, "loaded": 1, "wasted_bytes": 0}},
        ]
        fig = prefetch_figures(events, exact_per_token=2)
        assert fig is not None
        assert fig["loaded"] == 4 and fig["loaded_per_token"] == 2.0
        # 4 exact guesses left out: (6 - 4) / (12 - 4)
        assert fig["router_layer_accuracy"] == 0.25
        assert "loaded" not in (prefetch_figures([{"prefetch": {
            "predicted": 1, "correct": 1, "wasted_bytes": 0}}]) or {})


class TestGuessLoads:
    """Guessed experts loaded: from token events, else from the run's install checks."""

    SUMMARY: ClassVar[dict[str, int]] = {"verified": 30, "mismatches": 0, "misses": 22}

    def test_from_token_events(self) -> None:
        events = [{"prefetch": {"loaded": 5, "wasted_bytes": 300}},
                  {"prefetch": {"loaded": 3, "wasted_bytes": 100}}]
        loads = guess_loads(events, self.SUMMARY, 100, counts_installs=True)
        assert loads == {"loaded": 8, "used": 4, "wasted": 4, "loaded_per_token": 4.0,
                         "source": "token events (prefetch.loaded)",
                         "installs_beyond_misses": 8}

    def test_from_install_checks(self) -> None:
        events = [{"prefetch": {"wasted_bytes": 200}}, {"prefetch": {"wasted_bytes": 0}}]
        loads = guess_loads(events, self.SUMMARY, 100, counts_installs=True)
        assert (loads["loaded"], loads["used"], loads["wasted"]) == (8, 6, 2)
        assert loads["source"].startswith("run_end")
        loads = guess_loads(events, self.SUMMARY, None, counts_installs=False)
        assert loads["loaded"] is None and loads["used"] is None and loads["wasted"] is None
        assert loads["source"].startswith("not logged")

    def test_no_prediction(self) -> None:
        loads = guess_loads([{"token": 0}], {"verified": 4, "mismatches": 0, "misses": 4},
                            100, counts_installs=True)
        assert loads["loaded"] == 0 and loads["installs_beyond_misses"] == 0

    def test_routing_agreement(self) -> None:
        a = [{"token": 0, "experts": [[1, 2], [3, 4]]}, {"token": 1, "experts": [[5, 6], [7, 8]]}]
        b = [{"token": 0, "experts": [[2, 1], [3, 5]]}, {"token": 1, "experts": [[5, 6], [7, 8]]}]
        assert routing_agreement(a, b) == 0.75
        assert routing_agreement(a, []) is None


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

    def test_live_model_needs_f16(self, tiny_model: Path, q2_routed: Path, tmp_path: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
        code, result = _run(tmp_path, "--model", str(tiny_model), "--live-model",
                            str(q2_routed))
        err = capsys.readouterr().err
        assert code == 2 and result == {}
        assert err.count("\n") == 1 and "F16" in err and "ds4-flash-f16" in err

    @pytest.mark.parametrize(("args", "message"), [
        (["--live-only"], "--live-only needs --live-model"),
        ([], "--model is required"),
        (["--live-only", "--live-model", "x.gguf", "--no-live"], "--live-only needs"),
        (["--model", "x.gguf", "--live-modes", "disk"], "--live-modes takes"),
        (["--model", "x.gguf", "--live-direct-tokens", "2", "--live-direct-skip-tokens", "2"],
         "--live-direct-tokens 2"),
    ])
    def test_bad_live_options(self, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                              args: list[str], message: str) -> None:
        code, _ = _run(tmp_path, *args)
        assert code == 2 and message in capsys.readouterr().err
