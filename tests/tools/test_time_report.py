"""Where the time goes, on real runs of the tiny model (host backend): the token events'
``time`` adds up to the wall time, ``tools.analyze`` names the bound, old logs still read."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from moestream.pipeline.run import main as run_main
from moestream.pipeline.runlog.read import read_log
from moestream.tools.analyze.cli import CSV_INTERVAL
from moestream.tools.analyze.cli import main as analyze_main
from moestream.tools.analyze.intervals import interval_rows
from moestream.tools.analyze.plots import PLOT_FILES, plot_interval, write_plots

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

SCHEMA_1_LOG = Path(__file__).resolve().parents[1] / "data" / "run-schema1.jsonl"
"""A real log of the schema-1 writer: 12 tokens of the tiny model, direct mode."""


def _run(tmp_path: Path, model: Path, *args: str, tokens: int = 16) -> Path:
    log = tmp_path / "run.jsonl"
    assert run_main(["-m", str(model), "-n", str(tokens), "--backend", "host", "--log",
                     str(log), "--json", *args]) == 0
    return log


def _analysis(log: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    capsys.readouterr()
    assert analyze_main([str(log), "--json"]) == 0
    entry: dict[str, Any] = json.loads(capsys.readouterr().out)["runs"][0]
    return entry


class TestTheSplitAddsUp:
    """Every token's parts add up to its wall time, and the analysis's to the mean wall."""

    @pytest.mark.parametrize("args", [
        pytest.param(["--mode", "direct", "--cache-budget", "12"], id="direct"),
        pytest.param(["--mode", "resident", "--cache-budget", "12"], id="resident"),
        pytest.param(["--mode", "resident"], id="all-cached"),  # the default budget holds all
        pytest.param(["--mode", "direct", "--cache-budget", "12", "--devices", "0,1"],
                     id="two-devices"),
        pytest.param(["--mode", "direct", "--cache-budget", "14", "--prefetch", "predict"],
                     id="predict"),
    ])
    def test_sums_to_wall(self, tmp_path: Path, tiny_model: Path, args: list[str],
                          capsys: pytest.CaptureFixture[str]) -> None:
        log = _run(tmp_path, tiny_model, *args)
        tokens = [e for e in map(json.loads, log.read_text().splitlines())
                  if e["event"] == "token"]
        assert all(e["schema"] == 2 for e in tokens)
        for e in tokens:
            parts = e["time"]
            assert set(parts) == {"compute_ms", "read_ms", "upload_ms", "slot_ms", "switch_ms",
                                  "host_ms"}
            assert min(parts.values()) >= 0
            assert sum(parts.values()) == pytest.approx(e["wall_ms"], rel=0.05, abs=0.003)
            # the loop thread's CPU within the token's wall (clock granularity aside), and
            # within the process's, which counts every thread
            assert 0.0 <= e["cpu_ms"] <= e["wall_ms"] + 1.0
            assert e["process_cpu_ms"] >= e["cpu_ms"] - 1.0
        entry = _analysis(log, capsys)
        split = entry["time_breakdown_ms_per_token"]
        assert sum(split.values()) == pytest.approx(entry["wall_ms_per_token"], rel=0.05)
        assert sum(entry["time_breakdown_shares"].values()) == pytest.approx(1.0, rel=0.05)
        assert entry["bound"] in ("compute", "storage", "copy", "staging", "controller", "host")
        if "direct" not in args:
            assert split["read"] == 0.0  # resident misses are copies, never reads
        if "--mode" in args and "resident" in args and "--cache-budget" not in args:
            assert split["slot"] == 0.0  # nothing is staged from the page cache


class TestTheBound:
    """A bound forced on the run is the one named, with the figure that would move it."""

    def test_compute_bound(self, tmp_path: Path, tiny_model: Path,
                           capsys: pytest.CaptureFixture[str]) -> None:
        log = _run(tmp_path, tiny_model, "--mode", "resident", "--compute", "fixed:5")
        entry = _analysis(log, capsys)
        assert entry["bound"] == "compute"
        assert entry["verdict"].startswith("compute-bound: ")

    def test_storage_bound(self, tmp_path: Path, tiny_model: Path,
                           capsys: pytest.CaptureFixture[str]) -> None:
        log = _run(tmp_path, tiny_model, "--mode", "direct", "--cache-budget", "12",
                   "--inject", "slow_ms=20@1+", tokens=8)
        entry = _analysis(log, capsys)
        assert entry["bound"] == "storage"
        assert entry["time_breakdown_shares"]["read"] > 0.5
        assert "waiting on reads" in entry["verdict"] and "GB/s" in entry["verdict"]

    def test_copy_bound(self, tmp_path: Path, q2_model: Path,
                        capsys: pytest.CaptureFixture[str]) -> None:
        # 6.75 MiB experts copied out of the page cache, no compute: the copies are the time
        log = _run(tmp_path, q2_model, "--mode", "resident", "--cache-budget", "7",
                   "--compute", "fixed:0", tokens=6)
        entry = _analysis(log, capsys)
        assert entry["bound"] == "copy", entry["verdict"]

    def test_device_limit_from_told_bandwidths(self, tmp_path: Path, tiny_model: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
        log = _run(tmp_path, tiny_model, "--mode", "direct", "--cache-budget", "12",
                   "--limits", "read=1GB/s,copy=10GB/s", tokens=8)
        start = json.loads(log.read_text().splitlines()[0])
        assert start["limits"] == {"source": "told", "read_bytes_per_s": 1e9,
                                   "copy_bytes_per_s": 1e10}
        entry = _analysis(log, capsys)
        low = entry["lower_bound"]
        split = entry["time_breakdown_ms_per_token"]
        # direct misses read at 1 GB/s: the limit is their bytes over it, or the compute
        misses_ms = entry["file_mb_per_token"] * 1e6 / 1e9 * 1000.0
        assert low["io_ms_per_token"] == pytest.approx(misses_ms, rel=1e-6)
        assert low["compute_ms_per_token"] == pytest.approx(split["compute"], rel=1e-6)
        assert low["ms_per_token"] >= max(low["io_ms_per_token"], low["compute_ms_per_token"])
        assert "device limit" in entry["verdict"]

    def test_limits_are_checked(self, tiny_model: Path,
                                capsys: pytest.CaptureFixture[str]) -> None:
        for bad in ("read=1GB", "disk=1GB/s", "read=1GB/s,read=2GB/s", "read=0GB/s"):
            assert run_main(["-m", str(tiny_model), "--limits", bad]) == 2
            assert "--limits" in capsys.readouterr().err


class TestOldLogs:
    """A schema-1 log (no ``time``) still analyses, plots and says why it has no split."""

    def test_analyses(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        run = read_log(SCHEMA_1_LOG)
        assert run.schema == 1 and len(run.tokens) == 12 and not run.counts.skipped
        entry = _analysis(SCHEMA_1_LOG, capsys)
        assert entry["tokens"] == 12 and entry["hits"] == 40
        assert entry["bound"] is None and entry["time_breakdown_ms_per_token"] is None
        assert analyze_main([str(SCHEMA_1_LOG)]) == 0
        assert "no time breakdown in this log (schema 1" in capsys.readouterr().out
        written = write_plots([run], tmp_path / "plots")
        assert [p.name for p in written] == list(PLOT_FILES)

    def test_compares_with_a_new_log(self, tmp_path: Path, tiny_model: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
        log = _run(tmp_path, tiny_model, "--mode", "direct", "--cache-budget", "12", tokens=6)
        capsys.readouterr()
        assert analyze_main([str(SCHEMA_1_LOG), str(log)]) == 0
        out = capsys.readouterr().out
        assert "run-schema1.jsonl: no time breakdown" in out
        assert "run.jsonl: " in out and "-bound: " in out


class TestPlots:
    """``--plot`` writes summary.png first, with points spaced from the run's length."""

    @pytest.mark.parametrize("tokens", [1, 19, 20, 64, 99, 100, 101, 150, 2000, 4321, 100_000])
    def test_interval_gives_enough_points(self, tokens: int) -> None:
        step = plot_interval(tokens)
        points = -(-tokens // step)
        assert points >= min(tokens, 20)  # at least 20 points, one per token below that
        assert points <= 250 or step == 1  # about 100, a round step: at most 2.5 x as many
        assert str(step).strip("0") in ("1", "2", "5")

    def test_summary_first_and_interval_override(self, tmp_path: Path, tiny_model: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
        log = _run(tmp_path, tiny_model, "--mode", "direct", "--cache-budget", "12",
                   tokens=40)
        capsys.readouterr()
        out = tmp_path / "plots"
        assert analyze_main([str(log), "--plot", str(out)]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert lines[-len(PLOT_FILES)] == f"wrote {out / 'summary.png'}"
        for name in PLOT_FILES:
            assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        run = read_log(log)
        assert len(interval_rows(run, plot_interval(40))) == 40  # one point per token
        assert len(interval_rows(run, CSV_INTERVAL)) == 2  # the CSV's default stays 32
        assert analyze_main([str(log), "--plot", str(out), "--interval", "10"]) == 0
