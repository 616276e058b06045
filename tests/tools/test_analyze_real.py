"""The analysis tool on logs of real runs of the tiny model (not synthetic logs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moestream.pipeline.run import main as run_main
from moestream.tools.analyze.cli import main as analyze_main


def _run(tmp_path: Path, model: Path, name: str, *args: str) -> Path:
    log = tmp_path / f"{name}.jsonl"
    assert run_main(["-m", str(model), "-n", "24", "--backend", "host", "--log", str(log),
                     "--cache-budget", "12", *args]) == 0
    return log


class TestRealLogs:
    """Summary, comparison, CSV and an exact what-if replay of live runs."""

    @pytest.mark.parametrize("policy", ["lru", "freq"])
    def test_whatif_replays_the_live_hits_exactly(
        self, tmp_path: Path, tiny_model: Path, policy: str, capsys: pytest.CaptureFixture[str]
    ) -> None:
        log = _run(tmp_path, tiny_model, policy, "--policy", policy, "--mode", "direct")
        capsys.readouterr()
        assert analyze_main([str(log), "--what-if", "--budgets", "8,12,16",
                             "--policies", policy]) == 0
        out = capsys.readouterr().out
        hits = sum(json.loads(x)["hits"] for x in log.read_text().splitlines()
                   if '"event":"token"' in x)
        assert f"{hits} hits, log {hits}: exact" in out

    def test_summary_comparison_and_csv(self, tmp_path: Path, tiny_model: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
        a = _run(tmp_path, tiny_model, "a", "--mode", "direct")
        b = _run(tmp_path, tiny_model, "b", "--mode", "resident")
        csv = tmp_path / "out.csv"
        capsys.readouterr()
        assert analyze_main([str(a), str(b), "--csv", str(csv), "--interval", "8"]) == 0
        out = capsys.readouterr().out
        assert "a.jsonl" in out and "b.jsonl" in out and "delta" in out
        header, *rows = csv.read_text().splitlines()
        assert header.startswith("run,") or "gen_tps" in header
        assert len(rows) == 2 * 3
