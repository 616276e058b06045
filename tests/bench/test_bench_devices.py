"""Tests for tools.bench_devices: one device against two emulated ones, and bad input."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.devices import device_window, main
from bench.h2d_copies import DeviceCopier, h2d_figures
from moestream.gpu.host import HostBackend

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

RUNS = [f"{mode}_{n}dev" for mode in ("direct", "resident") for n in (1, 2)]
# small token counts: direct 6 (skip 1), resident 6 (skip 2)
TOKENS = ["--tokens", "6", "--skip-tokens", "2", "--direct-tokens", "6",
          "--direct-skip-tokens", "1", "--layer-ms", "0.1"]


def _token_events(log: Path) -> list[dict[str, Any]]:
    with log.open() as f:
        return [e for e in map(json.loads, f) if e.get("event") == "token"]


@pytest.fixture(scope="module")
def result(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Both modes on devices 0,1 of the host backend, logs kept."""
    tmp = tmp_path_factory.mktemp("devices")
    out = tmp / "devices.json"
    code = main(["--model", str(tiny_model), "--backend", "host", "--devices", "0,1",
                 *TOKENS, "--log-dir", str(tmp / "logs"), "--out", str(out)])
    assert code == 0
    loaded: dict[str, Any] = json.loads(out.read_text())
    return loaded


class TestBench:
    """Direct and resident, one device and two: every run is there and adds up."""

    def test_runs(self, result: dict[str, Any]) -> None:
        runs = result["runs"]
        assert list(runs) == RUNS
        for name, run in runs.items():
            assert run["tokens"] == (4 if name.startswith("resident") else 5), name
            assert run["tokens_per_s"] > 0 and 0.0 <= run["hit_rate"] <= 1.0, name
            assert run["devices"] == ([0] if name.endswith("1dev") else [0, 1])
            assert run["budget_never_exceeded"] is True, name
            assert run["summary"]["mismatches"] == 0
            assert len(run["per_device"]) == len(run["devices"])
        assert runs["resident_2dev"]["before"]["warmed"]["resident_share"] == 1.0
        assert runs["direct_1dev"]["before"] == {"dropped": True}
        assert result["figures"]["budget_never_exceeded"] is True

    def test_device_entries_add_up(self, result: dict[str, Any]) -> None:
        for name in ("direct_2dev", "resident_2dev"):
            run = result["runs"][name]
            assert run["device_counts_add_up"] is True
            events = _token_events(Path(run["log"]))
            assert events
            for e in events:
                assert [d["device"] for d in e["devices"]] == [0, 1]
                for key in ("hits", "misses", "file_bytes"):
                    assert sum(d[key] for d in e["devices"]) == e[key], (name, key)
            # the window's per-device figures add up to the window's own
            per_device = run["per_device"]
            looks = sum(d["hits"] + d["misses"] for d in per_device)
            window = [e for e in events if e["token"] >= run["skipped_tokens"]]
            assert looks == sum(e["hits"] + e["misses"] for e in window)
            assert run["device_balance"] >= 1.0
        assert result["runs"]["direct_1dev"]["device_counts_add_up"] is None

    def test_same_budget_per_device(self, result: dict[str, Any]) -> None:
        runs = result["runs"]
        one = runs["resident_1dev"]["per_device"][0]["budget_bytes"]
        for d in runs["resident_2dev"]["per_device"]:
            # split by free memory: each share is near the one-device budget
            assert abs(d["budget_bytes"] - one) <= one // 10
            assert d["peak_device_bytes"] <= d["budget_bytes"]

    def test_figures(self, result: dict[str, Any]) -> None:
        figures = result["figures"]
        assert figures["h2d"] == {"skipped": "backend host"}
        assert any("host-to-device part skipped" in n for n in result["notes"])
        for mode in ("direct", "resident"):
            fig = figures["modes"][mode]
            assert fig["devices"] == 2 and fig["all_over_one"] > 0
            assert fig["hit_rate_one"] == result["runs"][f"{mode}_1dev"]["hit_rate"]
            assert set(fig["device_hit_rates"]) == {"0", "1"}
        assert result["machine"]["devices"] == {"0": "host", "1": "host:1"}
        assert result["command"].startswith("python -m bench.devices")
        assert result["commit"]


class TestDeviceWindow:
    """Per-device figures from token events."""

    def test_one_device_takes_the_tokens_figures(self) -> None:
        events = [{"token": t, "hits": 3, "misses": 1, "file_bytes": 10, "stall_ms": 1.0,
                   "compute_ms": 2.0} for t in range(2)]
        start = {"devices": [{"device": 1, "name": "gpu", "budget_bytes": 100}]}
        summary = {"devices": [{"device": 1, "budget_bytes": 100, "peak_device_bytes": 90}]}
        [row] = device_window(events, start, summary)
        assert row["device"] == 1 and row["hits"] == 6 and row["misses"] == 2
        assert row["file_share"] == 1.0 and row["peak_within_budget"] is True

    def test_peak_over_budget(self) -> None:
        start = {"devices": [{"device": 0, "name": "a", "budget_bytes": 100}]}
        summary = {"devices": [{"device": 0, "budget_bytes": 100, "peak_device_bytes": 101}]}
        [row] = device_window([], start, summary)
        assert row["peak_within_budget"] is False and row["hit_rate"] is None


class TestCopies:
    """The copy part's mechanics (alone, together behind a barrier) on host devices; the
    command itself runs it on CuPy only."""

    def test_figures(self) -> None:
        fig = h2d_figures([HostBackend(0), HostBackend(1)], 1 << 20, copies=2, rounds=2)
        assert set(fig["single_gbps"]) == {"0", "1"} and len(fig["together_gbps"]) == 2
        assert fig["best_single_gbps"] == max(fig["single_gbps"].values())
        assert fig["aggregate_over_best_single"] > 0 and fig["target"] == 1.8
        assert all(len(v) == 2 for v in fig["together_device_gbps"].values())

    def test_copies_land(self) -> None:
        with DeviceCopier([HostBackend(0), HostBackend(1)], 4096) as copier:
            copier.together_gbps(1)
            lanes = copier._lanes
            assert all((lane.device.array == 1).all() for lane in lanes)  # type: ignore[attr-defined]
        assert copier.devices == []


class TestBadInput:
    """Bad input: one line, exit 2, no result."""

    @pytest.mark.parametrize("case", ["missing", "not_gguf", "one_device", "bad_devices",
                                      "bad_mode"])
    def test_exit_2(self, case: str, tiny_model: Path, tmp_path: Path,
                    capsys: pytest.CaptureFixture[str]) -> None:
        model = tiny_model
        extra: list[str] = []
        if case == "missing":
            model = tmp_path / "absent.gguf"
        elif case == "not_gguf":
            model = tmp_path / "text.gguf"
            model.write_text("not a model\n")
        elif case == "one_device":
            extra = ["--devices", "0"]
        elif case == "bad_devices":
            extra = ["--devices", "0,x"]
        else:
            extra = ["--modes", "auto"]
        out = tmp_path / "devices.json"
        code = main(["--model", str(model), "--backend", "host", *extra, "--out", str(out)])
        assert code == 2
        err = capsys.readouterr().err
        assert err.startswith("bench_devices: error: ") and err.count("\n") == 1
        assert not out.exists()
