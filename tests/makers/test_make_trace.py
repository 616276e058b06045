"""Tests for tools.make_trace and pipeline.proxy.calibrate: calibration, the generator, the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moestream.gpu.cache.policy import CacheIndex, LRUPolicy
from moestream.pipeline.foundation.errors import UsageError
from moestream.pipeline.foundation.trace import Trace, load_trace
from moestream.pipeline.proxy.calibrate import (
    CALIBRATION,
    calibration_table,
    consecutive_overlap,
    per_layer_lru_hit_rates,
    shared_lru_hit_rate,
    unbounded_hit_rate,
)
from moestream.pipeline.proxy.synthetic import PRESETS, synthetic_trace
from moestream.tools.make_trace import main

POINTS = 0.05
"""How close a synthetic trace must come to a published figure: 5 points."""

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def published() -> dict[str, Any]:
    """The published locality measurements, from the test data (the source of truth)."""
    with open(Path(__file__).resolve().parents[1] / "data" / "routing_locality.json") as source:
        data: dict[str, Any] = json.load(source)
    return data


@pytest.fixture(scope="module")
def qwen() -> Trace:
    return synthetic_trace("qwen3.5-35b-a3b", 1000, seed=0)


@pytest.fixture(scope="module")
def ds4() -> Trace:
    return synthetic_trace("ds4-flash", 3000, seed=0)


def per_layer_cache_index_hits(trace: Trace, capacity: int) -> int:
    """Hits of one CacheIndex(capacity, LRU) per layer, nbytes 1: the definition."""
    caches = [CacheIndex(capacity, LRUPolicy()) for _ in range(trace.n_layers)]
    hits = 0
    for row in trace.experts.tolist():
        for layer, chosen in enumerate(row):
            outcome = caches[layer].access_layer([(layer, e) for e in chosen], [1] * len(chosen))
            hits += len(outcome.hits)
    return hits


class TestPublishedFigures:
    """The figures the presets are calibrated to are the ones in the test data."""

    def test_qwen_figures(self, published: dict[str, Any]) -> None:
        source = published["qwen3.5-35b-a3b"]
        lru = {
            point.capacity: point.low
            for point in CALIBRATION["qwen3.5-35b-a3b"]
            if point.kind == "per_layer_lru"
        }
        assert lru == {
            int(k): v for k, v in source["lru_hit_rate_by_cached_experts_per_layer"].items()
        }
        overlap = {p.kind: p.low for p in CALIBRATION["qwen3.5-35b-a3b"] if "overlap" in p.kind}
        assert [overlap["overlap_min"], overlap["overlap_max"]] == source[
            "consecutive_token_overlap_per_layer"
        ]
        preset = PRESETS["qwen3.5-35b-a3b"]
        assert (preset.n_experts, preset.top_k) == (source["experts_per_layer"], source["top_k"])

    def test_ds4_figures(self, published: dict[str, Any]) -> None:
        source = published["deepseek-v4-flash"]
        shared, short, long = CALIBRATION["ds4-flash"]
        observations = source["observations"]
        assert (shared.capacity, shared.low) == (
            observations[0]["budget_entries_total"],
            observations[0]["hit_rate"],
        )
        assert short.low == observations[1]["hit_rate"]
        assert [long.low, long.high] == observations[2]["hit_rate"]
        preset = PRESETS["ds4-flash"]
        assert (preset.n_layers, preset.n_experts, preset.top_k) == (
            source["layers"],
            source["experts_per_layer"],
            source["top_k"],
        )


class TestQwenCalibration:
    """The 256-expert top-8 preset matches the published per-layer LRU curve and overlap."""

    def test_per_layer_lru_curve(self, qwen: Trace, published: dict[str, Any]) -> None:
        figures = published["qwen3.5-35b-a3b"]["lru_hit_rate_by_cached_experts_per_layer"]
        capacities = [int(size) for size in figures]
        measured = per_layer_lru_hit_rates(qwen, capacities, n_tokens=128)
        for size, expected in figures.items():
            assert measured[int(size)] == pytest.approx(expected, abs=POINTS), size

    @pytest.mark.parametrize("seed", [1, 2])
    def test_curve_holds_for_other_seeds(self, seed: int, published: dict[str, Any]) -> None:
        figures = published["qwen3.5-35b-a3b"]["lru_hit_rate_by_cached_experts_per_layer"]
        trace = synthetic_trace("qwen3.5-35b-a3b", 128, seed=seed)
        measured = per_layer_lru_hit_rates(trace, [int(size) for size in figures])
        for size, expected in figures.items():
            assert measured[int(size)] == pytest.approx(expected, abs=POINTS), size

    def test_consecutive_overlap_range(self, qwen: Trace, published: dict[str, Any]) -> None:
        low, high = published["qwen3.5-35b-a3b"]["consecutive_token_overlap_per_layer"]
        overlap = consecutive_overlap(qwen)
        assert overlap.min() == pytest.approx(low, abs=POINTS)
        assert overlap.max() == pytest.approx(high, abs=POINTS)

    def test_uniform_routing_is_far_from_the_curve(self, published: dict[str, Any]) -> None:
        figures = published["qwen3.5-35b-a3b"]["lru_hit_rate_by_cached_experts_per_layer"]
        trace = synthetic_trace("uniform", 128, n_layers=8, n_experts=256, top_k=8)
        measured = per_layer_lru_hit_rates(trace, [16])
        assert measured[16] < figures["16"] - 0.3


class TestDs4Calibration:
    """The DeepSeek V4 Flash preset matches ds4's shared-budget and 100 GB hit rates."""

    @pytest.mark.parametrize("seed", [0, 1])
    def test_shared_budget_of_2522_entries(self, seed: int, published: dict[str, Any]) -> None:
        observation = published["deepseek-v4-flash"]["observations"][0]
        trace = synthetic_trace("ds4-flash", 220, seed=seed)
        cache = CacheIndex(observation["budget_entries_total"], LRUPolicy())
        hits = 0
        for row in trace.experts.tolist():
            for layer, chosen in enumerate(row):
                hits += len(cache.access_layer([(layer, e) for e in chosen], [1] * 6).hits)
        assert hits / trace.experts.size == pytest.approx(observation["hit_rate"], abs=POINTS)

    def test_100gb_short_bench(self, ds4: Trace, published: dict[str, Any]) -> None:
        expected = published["deepseek-v4-flash"]["observations"][1]["hit_rate"]
        assert unbounded_hit_rate(ds4, n_tokens=220) == pytest.approx(expected, abs=POINTS)

    def test_100gb_long_session_climbs(self, ds4: Trace, published: dict[str, Any]) -> None:
        low, high = published["deepseek-v4-flash"]["observations"][2]["hit_rate"]
        curve = [unbounded_hit_rate(ds4, n_tokens=n) for n in (220, 500, 1000, 2000, 3000)]
        assert curve == sorted(curve)
        assert curve[-2] >= 0.95 and curve[-1] >= 0.95
        assert low - POINTS <= curve[-2] <= high + POINTS

    def test_every_expert_fits_in_a_100gb_budget(self) -> None:
        expert_bytes = 6.75 * 2**20  # IQ2_XXS gate/up + Q2_K down
        assert 43 * 256 * expert_bytes < 100e9

    def test_calibration_table_agrees(self) -> None:
        rows = calibration_table("ds4-flash", seed=0)
        assert [row.point for row in rows] == list(CALIBRATION["ds4-flash"])
        assert all(abs(row.delta) <= POINTS for row in rows)


class TestSimulators:
    """The fast per-layer LRU simulator counts exactly what CacheIndex counts."""

    @pytest.mark.parametrize("preset", ["qwen3.5-35b-a3b", "ds4-flash", "uniform"])
    def test_per_layer_lru_equals_cache_index(self, preset: str) -> None:
        trace = synthetic_trace(preset, 80, seed=3, n_layers=4, n_experts=48, top_k=5)
        capacities = [5, 7, 12, 30, 48]
        rates = per_layer_lru_hit_rates(trace, capacities)
        for capacity in capacities:
            expected = per_layer_cache_index_hits(trace, capacity) / trace.experts.size
            assert rates[capacity] == expected, capacity

    def test_capacity_below_top_k_is_refused(self) -> None:
        with pytest.raises(ValueError, match="below top_k"):
            per_layer_lru_hit_rates(synthetic_trace("uniform", 4), [3])

    def test_shared_lru_with_room_for_everything_is_unbounded(self) -> None:
        trace = synthetic_trace("ds4-flash", 300, seed=2, n_layers=5, n_experts=64, top_k=4)
        assert shared_lru_hit_rate(trace, 5 * 64) == pytest.approx(unbounded_hit_rate(trace))

    def test_overlap_of_a_repeated_token_is_one(self) -> None:
        trace = synthetic_trace("uniform", 1, n_layers=2, n_experts=16, top_k=3)
        twice = Trace(
            np.concatenate([trace.experts] * 2), np.concatenate([trace.weights] * 2), 16, "x"
        )
        np.testing.assert_array_equal(consecutive_overlap(twice), [1.0, 1.0])


class TestGenerator:
    """Traces are valid, deterministic, prefix-stable, and keep their character when reshaped."""

    def test_deterministic(self) -> None:
        first = synthetic_trace("ds4-flash", 300, seed=7)
        again = synthetic_trace("ds4-flash", 300, seed=7)
        other = synthetic_trace("ds4-flash", 300, seed=8)
        np.testing.assert_array_equal(first.experts, again.experts)
        np.testing.assert_array_equal(first.weights, again.weights)
        assert not np.array_equal(first.experts, other.experts)

    def test_shorter_trace_is_a_prefix(self) -> None:
        short = synthetic_trace("qwen3.5-35b-a3b", 200, seed=1)
        long = synthetic_trace("qwen3.5-35b-a3b", 1500, seed=1)
        np.testing.assert_array_equal(short.experts, long.experts[:200])

    @pytest.mark.parametrize("preset", sorted(PRESETS))
    def test_preset_shape(self, preset: str) -> None:
        spec = PRESETS[preset]
        trace = synthetic_trace(preset, 10)
        assert trace.experts.shape == (10, spec.n_layers, spec.top_k)
        assert (trace.n_experts, trace.preset) == (spec.n_experts, preset)

    @pytest.mark.parametrize("preset", ["qwen3.5-35b-a3b", "ds4-flash"])
    @pytest.mark.parametrize("shape", [(4, 32, 4), (20, 256, 6)])
    def test_reshaped_trace_keeps_locality(self, preset: str, shape: tuple[int, int, int]) -> None:
        layers, n_experts, top_k = shape
        kwargs = {"n_layers": layers, "n_experts": n_experts, "top_k": top_k}
        trace = synthetic_trace(preset, 600, **kwargs)
        uniform = synthetic_trace("uniform", 600, **kwargs)
        assert trace.experts.shape == (600, layers, top_k)
        quarter = n_experts // 4
        local = per_layer_lru_hit_rates(trace, [quarter])[quarter]
        flat = per_layer_lru_hit_rates(uniform, [quarter])[quarter]
        assert local > flat + 0.15
        overlap = consecutive_overlap(trace)
        assert 0.08 <= overlap.mean() <= 0.34

    def test_weights_are_router_like(self) -> None:
        trace = synthetic_trace("ds4-flash", 500)
        np.testing.assert_allclose(trace.weights.sum(axis=2), 1.0, atol=1e-5)
        assert trace.weights.min() > 0

    @pytest.mark.parametrize(
        ("kwargs", "match"),
        [
            ({"preset": "nope"}, "unknown trace preset"),
            ({"n_tokens": 0}, "tokens must be positive"),
            ({"n_layers": 0}, "layers must be positive"),
            ({"n_experts": 4, "top_k": 5}, "top-k"),
            ({"top_k": 0}, "top-k"),
            ({"seed": -1}, "seed"),
        ],
    )
    def test_bad_arguments(self, kwargs: dict[str, Any], match: str) -> None:
        arguments: dict[str, Any] = {"preset": "ds4-flash", "n_tokens": 5, **kwargs}
        preset, tokens = arguments.pop("preset"), arguments.pop("n_tokens")
        with pytest.raises(UsageError, match=match):
            synthetic_trace(preset, tokens, **arguments)

    @settings(max_examples=30, deadline=None)
    @given(
        preset=st.sampled_from(sorted(PRESETS)),
        tokens=st.integers(1, 40),
        layers=st.integers(1, 6),
        n_experts=st.integers(1, 80),
        data=st.data(),
    )
    def test_any_generated_trace_is_valid(
        self, preset: str, tokens: int, layers: int, n_experts: int, data: st.DataObject
    ) -> None:
        top_k = data.draw(st.integers(1, min(n_experts, 10)))
        seed = data.draw(st.integers(0, 2**31))
        trace = synthetic_trace(
            preset, tokens, seed=seed, n_layers=layers, n_experts=n_experts, top_k=top_k
        )
        experts = trace.experts
        assert experts.shape == (tokens, layers, top_k)
        assert experts.min() >= 0 and experts.max() < n_experts
        ordered = np.sort(experts, axis=2)
        assert not (ordered[:, :, 1:] == ordered[:, :, :-1]).any()
        np.testing.assert_allclose(trace.weights.sum(axis=2), 1.0, atol=1e-5)


class TestCli:
    """The CLI writes traces, prints the calibration table, and fails in one line."""

    @pytest.mark.parametrize("name", ["t.npz", "t.jsonl"])
    def test_writes_a_trace(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
    ) -> None:
        out = tmp_path / name
        argv = [str(out), "--preset", "qwen3.5-35b-a3b", "--tokens", "12", "--seed", "4"]
        assert main([*argv, "--layers", "4", "--experts", "32", "--top-k", "4"]) == 0
        trace = load_trace(out)
        assert trace.experts.shape == (12, 4, 4) and trace.n_experts == 32
        expected = synthetic_trace("qwen3.5-35b-a3b", 12, seed=4, n_layers=4, n_experts=32, top_k=4)
        np.testing.assert_array_equal(trace.experts, expected.experts)
        assert "wrote" in capsys.readouterr().out

    def test_check_prints_the_table(self, capsys: pytest.CaptureFixture[str]) -> None:
        assert main(["--check", "--preset", "qwen3.5-35b-a3b"]) == 0
        out = capsys.readouterr().out
        assert "per-layer LRU of 16 experts" in out and "0.490" in out
        assert len(out.splitlines()) == 2 + len(CALIBRATION["qwen3.5-35b-a3b"])

    @pytest.mark.parametrize(
        ("argv", "match"),
        [
            ([], "OUT"),
            (["{out}"], "--tokens is required"),
            (["{out}", "--tokens", "0"], "tokens must be positive"),
            (["{out}", "--tokens", "abc"], "invalid int"),
            (["{out}", "--tokens", "5", "--preset", "gpt"], "invalid choice"),
            (["{out}", "--tokens", "5", "--top-k", "300"], "top-k"),
            (["{missing}", "--tokens", "5"], "cannot write"),
            (["--check", "--bogus"], "unrecognized"),
        ],
    )
    def test_bad_options(
        self,
        tmp_path: Path,
        capsys: pytest.CaptureFixture[str],
        argv: list[str],
        match: str,
    ) -> None:
        paths = {"out": str(tmp_path / "t.npz"), "missing": str(tmp_path / "no" / "t.npz")}
        assert main([arg.format(**paths) for arg in argv]) == 2
        captured = capsys.readouterr()
        assert captured.out == ""
        assert len(captured.err.splitlines()) == 1 and match in captured.err

    def test_runs_as_a_module(self, tmp_path: Path) -> None:
        out = tmp_path / "t.jsonl"
        done = subprocess.run(
            [sys.executable, "-m", "tools.make_trace", str(out), "--tokens", "3"],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        assert load_trace(out).experts.shape == (3, 43, 6)
