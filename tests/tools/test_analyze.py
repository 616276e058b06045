"""Tests for tools.logread and tools.analyze: reading, tolerance, summary, CSV, plots, CLI."""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog

from moestream.pipeline.foundation.errors import TraceError
from moestream.pipeline.runlog.read import read_log
from moestream.tools.analyze.cli import main, summarize
from moestream.tools.analyze.intervals import CSV_COLUMNS, interval_rows
from tests.synthetic_logs import SyntheticRun, write_synthetic_log

UNIT = 1000


@pytest.fixture(autouse=True)
def _reset_structlog() -> Iterator[None]:
    yield
    structlog.reset_defaults()


@pytest.fixture
def synthetic(tmp_path: Path) -> tuple[Path, dict[str, int]]:
    """A 300-token, 4-layer x 32-expert log that switches to resident mode at token 150."""
    path = tmp_path / "run.jsonl"
    run = SyntheticRun(tokens=300, moe_layers=4, n_experts=32, top_k=4, expert_bytes=UNIT,
                       budget_experts=40, switch_at=150, seed=5, layer_lines=True)
    return path, write_synthetic_log(path, run)


def event(name: str, **fields: Any) -> str:
    return json.dumps({"event": name, "schema": 1, "ts": "2026-12-02T12:00:00Z", **fields})


def header(layers: int = 2) -> str:
    return event(
        "run_start", config={"tokens": 4}, budget_bytes=8 * UNIT, policy="lru",
        model={"path": "m.gguf", "file_bytes": 10**6, "moe_layers": list(range(1, layers + 1)),
               "n_experts": 8, "top_k": 2, "expert_bytes": [UNIT] * layers,
               "non_routed_bytes": 5000},
        machine={"gpu": None, "ram_total_bytes": 2**34, "cpu_count": 2, "disk": None})


def token(t: int, *, wall: float = 10.0, hits: int = 2, misses: int = 2, mode: str = "direct",
          storage: int = 1000, **extra: Any) -> str:
    fields: dict[str, Any] = {
        "token": t, "wall_ms": wall, "read_ms": 1.0, "stage_ms": 0.5, "upload_ms": 0.25,
        "install_ms": 0.125, "stall_ms": wall / 4, "compute_ms": wall / 2, "hits": hits,
        "misses": misses, "evictions": misses, "file_bytes": misses * UNIT,
        "cache_bytes": hits * UNIT, "storage_bytes": storage, "mode": mode,
        "ram_available_bytes": 4 * 10**9, "cache_live_bytes": 4 * UNIT,
        "cache_parked_bytes": 0, "experts": [[t % 8, (t + 1) % 8], [2, 3]],
    }
    fields.update(extra)
    return event("token", **fields)


def write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


class TestReadLog:
    """read_log turns a valid log into header, numpy columns, controller events and totals."""

    def test_columns_and_events(self, synthetic: tuple[Path, dict[str, int]]) -> None:
        path, totals = synthetic
        run = read_log(path)
        assert run.header is not None and run.header.moe_layers == (0, 1, 2, 3)
        assert run.header.expert_bytes == (UNIT,) * 4
        assert len(run.tokens) == 300
        assert run.tokens.experts.shape == (300, 4, 4)
        assert run.tokens.total("hits") == totals["hits"]
        assert run.tokens["token"].tolist() == list(range(300))
        assert run.tokens.mode_names == ("direct", "resident")
        assert int(run.tokens.mode_mask("resident").sum()) == 150
        assert [s.token for s in run.switches] == [150]
        assert len(run.decisions) == 2
        assert run.end is not None and run.end.exit == "ok" and run.end.tokens == 300
        assert run.layers["layer"].size == 300 * 4
        assert "prefetch_predicted" in run.tokens
        assert run.counts.skipped == 0 and not run.problems

    def test_prefill_and_deduplicated_lists_are_well_formed(self, tmp_path: Path) -> None:
        """A prefill token lists every expert its prompt routed to (more than top-k per
        layer), a layer fetched twice lists each expert once (fewer): neither is a problem;
        a token that is not one list per layer is."""
        lines = [header(), token(0, hits=0, misses=10, experts=[[0, 1, 2, 3, 4, 5], [2, 3, 4, 5]]),
                 token(1, hits=1, misses=1, experts=[[1], [2]])]
        run = read_log(write(tmp_path / "prefill.jsonl", lines))
        assert not run.problems
        assert run.tokens.experts.shape == (2, 2, 6)
        bad = read_log(write(tmp_path / "bad.jsonl", [header(), token(0, experts=[[0, 1]])]))
        assert any("unexpected shape" in p for p in bad.problems)

    def test_inconsistent_counts_are_reported(self, tmp_path: Path) -> None:
        path = write(tmp_path / "bad.jsonl", [header(), token(0, hits=3, misses=3)])
        run = read_log(path)
        assert any("hits + misses" in p for p in run.problems)


class TestTolerance:
    """Damaged or newer logs are read as far as possible and what was skipped is counted."""

    def test_truncated_last_line(self, synthetic: tuple[Path, dict[str, int]]) -> None:
        path, _ = synthetic
        text = path.read_text()
        lines = text.splitlines()
        cut = "\n".join(lines[:-2]) + "\n" + lines[-2][: len(lines[-2]) // 2]
        path.write_text(cut)
        run = read_log(path)
        assert run.counts.truncated == 1
        assert run.counts.malformed == 0
        assert len(run.tokens) == 299
        assert run.end is None

    def test_blank_unknown_and_malformed_lines(self, tmp_path: Path) -> None:
        lines = [
            "", header(), "   ", token(0, future_field=1), event("gpu_temperature", celsius=60),
            "{not json", token(1, future_field=2, other=3), "[1, 2]",
            json.dumps({"event": "token", "schema": 2, "token": 2}), token(2), "",
        ]
        run = read_log(write(tmp_path / "mixed.jsonl", lines))
        counts = run.counts
        assert len(run.tokens) == 3
        assert counts.blank == 3
        assert counts.malformed == 2
        assert counts.truncated == 0
        assert counts.other_schema == 1
        assert counts.unknown_events == {"gpu_temperature": 1}
        assert counts.unknown_fields == {"token.future_field": 2, "token.other": 1}
        assert counts.skipped == 4

    def test_missing_optional_and_required_fields(self, tmp_path: Path) -> None:
        lines = [header(), token(0), event("token", token=1, wall_ms=5.0, hits=1, misses=3,
                                           experts=[[1, 2], [3, 4]], mode="direct")]
        run = read_log(write(tmp_path / "missing.jsonl", lines))
        assert "prefetch_predicted" not in run.tokens
        assert math.isnan(run.tokens["storage_bytes"][1])
        assert run.counts.missing_fields["token.storage_bytes"] == 1
        summary = summarize(run)
        assert summary["tokens"] == 2
        assert summary["prefetch_accuracy"] is None

    def test_second_run_stops_reading(self, tmp_path: Path) -> None:
        lines = [header(), token(0), header(), token(0), token(1)]
        run = read_log(write(tmp_path / "two.jsonl", lines))
        assert len(run.tokens) == 1
        assert run.counts.after_second_run == 3

    def test_token_without_mode(self, tmp_path: Path) -> None:
        fields = {k: v for k, v in json.loads(token(1)).items()
                  if k not in ("mode", "event", "schema")}
        run = read_log(write(tmp_path / "nomode.jsonl", [header(), token(0),
                                                         event("token", **fields)]))
        assert run.tokens.mode_codes.tolist() == [0, -1]
        assert summarize(run)["mode_s.direct"] == pytest.approx(0.01)


class TestNotALog:
    """A file that is not a moestream log is refused on one line with exit status 2."""

    @pytest.mark.parametrize(
        ("content", "reason"),
        [
            ("hello world\n", "first line is not JSON"),
            ("[1, 2, 3]\n", "not a JSON object"),
            ('{"event": "request", "schema": 1}\n', "first event is 'request'"),
            ('{"event": "token", "token": 0}\n', "no 'schema' field"),
            ("\n\n", "empty"),
        ],
    )
    def test_refused(self, tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str,
                     reason: str) -> None:
        path = tmp_path / "other.txt"
        path.write_text(content)
        with pytest.raises(TraceError, match="not a moestream log") as info:
            read_log(path)
        assert reason in str(info.value)
        assert main([str(path)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1
        assert str(path) in err and "Traceback" not in err

    def test_newer_schema_is_refused(self, tmp_path: Path) -> None:
        path = tmp_path / "v3.jsonl"
        path.write_text('{"event": "run_start", "schema": 3}\n')
        with pytest.raises(TraceError, match="schema 3 is not supported"):
            read_log(path)

    def test_missing_file(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        assert main([str(tmp_path / "absent.jsonl")]) == 2
        assert "cannot read" in capsys.readouterr().err


class TestSummary:
    """summarize derives the headline figures from the token columns."""

    def test_known_values(self, tmp_path: Path) -> None:
        lines = [
            header(),
            token(0, wall=10.0, storage=2000),
            token(1, wall=20.0, storage=2000),
            event("controller_decision", mode="resident", reason="ram", readings={}, token=2),
            event("mode_switch", readings={}, reason="ram", token=2,
                  **{"from": "direct", "to": "resident"}),
            token(2, wall=30.0, mode="resident", hits=4, misses=0, storage=0),
            token(3, wall=40.0, mode="resident", hits=4, misses=0, storage=0),
        ]
        s = summarize(read_log(write(tmp_path / "known.jsonl", lines)))
        assert s["tokens"] == 4
        assert s["tokens_per_s"] == pytest.approx(40.0)  # 4 tokens in 100 ms
        assert s["latency_p50_ms"] == pytest.approx(25.0)
        assert s["hit_rate"] == pytest.approx(12 / 16)
        assert s["file_mb_per_token"] == pytest.approx(4 * UNIT / 4 / 1e6)
        assert s["storage_mb_per_token"] == pytest.approx(4000 / 4 / 1e6)
        assert s["page_cache_mb_per_token"] == 0.0
        assert s["storage_gbps"] == pytest.approx(4000 / 1e9 / 0.1)
        assert s["stall_share"] == pytest.approx(0.25)
        assert s["mode_s.direct"] == pytest.approx(0.03)
        assert s["mode_s.resident"] == pytest.approx(0.07)
        assert s["switches"] == 1 and s["decisions"] == 1
        assert s["exit"] == "no run_end (killed?)"

    def test_table_output(self, synthetic: tuple[Path, dict[str, int]],
                          capsys: pytest.CaptureFixture[str]) -> None:
        path, _ = synthetic
        assert main([str(path)]) == 0
        out = capsys.readouterr().out
        for label in ("decode tokens/s", "token latency p99", "cache hit rate",
                      "storage GB/s during decode", "time in resident mode", "mode switches",
                      "log lines skipped"):
            assert label in out

    def test_json_output(self, synthetic: tuple[Path, dict[str, int]],
                         capsys: pytest.CaptureFixture[str]) -> None:
        path, totals = synthetic
        assert main([str(path), "--json"]) == 0
        document = json.loads(capsys.readouterr().out)
        assert document["runs"][0]["tokens"] == 300
        assert document["runs"][0]["hits"] == totals["hits"]
        assert document["runs"][0]["lines"]["skipped"] == 0


class TestCsv:
    """--csv writes ds4-bench-style interval rows with the I/O columns."""

    def test_columns_and_rows(self, synthetic: tuple[Path, dict[str, int]],
                              tmp_path: Path) -> None:
        path, totals = synthetic
        out = tmp_path / "rows.csv"
        assert main([str(path), "--csv", str(out)]) == 0
        with out.open() as handle:
            rows = list(csv.DictReader(handle))
        assert tuple(rows[0].keys()) == CSV_COLUMNS
        assert CSV_COLUMNS[:3] == ("ctx_tokens", "gen_tokens", "gen_tps")
        assert len(rows) == math.ceil(300 / 32)
        assert int(rows[-1]["ctx_tokens"]) == 300
        assert sum(int(r["gen_tokens"]) for r in rows) == 300
        assert sum(int(r["hits"]) for r in rows) == totals["hits"]
        assert rows[0]["mode"] == "direct" and rows[-1]["mode"] == "resident"
        assert rows[4]["mode"] == "direct/resident"  # tokens 128-159, switch at 150

    def test_interval_and_several_logs(self, synthetic: tuple[Path, dict[str, int]],
                                       tmp_path: Path) -> None:
        path, _ = synthetic
        other = tmp_path / "other.jsonl"
        write_synthetic_log(other, SyntheticRun(tokens=100, moe_layers=4, n_experts=32,
                                                top_k=4, expert_bytes=UNIT, budget_experts=40))
        out = tmp_path / "rows.csv"
        assert main([str(path), str(other), "--csv", str(out), "--interval", "10"]) == 0
        with out.open() as handle:
            rows = list(csv.DictReader(handle))
        assert [r["run"] for r in rows].count("run.jsonl") == 30
        assert [r["run"] for r in rows].count("other.jsonl") == 10

    def test_rows_match_summary(self, synthetic: tuple[Path, dict[str, int]]) -> None:
        path, _ = synthetic
        run = read_log(path)
        rows = interval_rows(run, 300)
        assert len(rows) == 1
        summary = summarize(run)
        assert rows[0]["gen_tps"] == pytest.approx(summary["tokens_per_s"])
        assert rows[0]["hit_rate"] == pytest.approx(summary["hit_rate"])


class TestCompare:
    """Two or more logs give a side-by-side table with deltas against the first."""

    def test_before_after(self, synthetic: tuple[Path, dict[str, int]], tmp_path: Path,
                          capsys: pytest.CaptureFixture[str]) -> None:
        path, _ = synthetic
        after = tmp_path / "after.jsonl"
        write_synthetic_log(after, SyntheticRun(tokens=200, moe_layers=4, n_experts=32,
                                                top_k=4, expert_bytes=UNIT, budget_experts=80))
        assert main([str(path), str(after)]) == 0
        out = capsys.readouterr().out
        head = out.splitlines()[0].split()
        assert head == ["metric", "run.jsonl", "after.jsonl", "delta", "change"]
        tokens_row = next(line for line in out.splitlines() if line.startswith("tokens "))
        assert tokens_row.split()[1:] == ["300", "200", "-100", "-33.3%"]

    def test_three_logs(self, synthetic: tuple[Path, dict[str, int]], tmp_path: Path,
                        capsys: pytest.CaptureFixture[str]) -> None:
        path, _ = synthetic
        copies = []
        for name in ("b.jsonl", "c.jsonl"):
            copies.append(tmp_path / name)
            copies[-1].write_bytes(path.read_bytes())
        assert main([str(path), *map(str, copies)]) == 0
        head = capsys.readouterr().out.splitlines()[0]
        assert "b.jsonl vs run.jsonl" in head and "c.jsonl vs run.jsonl" in head


class TestPlots:
    """--plot writes one PNG per view."""

    def test_pngs_written(self, synthetic: tuple[Path, dict[str, int]], tmp_path: Path) -> None:
        path, _ = synthetic
        out = tmp_path / "plots"
        assert main([str(path), str(path), "--plot", str(out)]) == 0
        names = sorted(p.name for p in out.iterdir())
        assert names == ["bytes_per_token.png", "hit_rate.png", "latency.png",
                         "mode_timeline.png", "stages.png", "summary.png",
                         "time_breakdown.png"]
        for png in out.iterdir():
            assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


class TestUsage:
    """Bad options are usage errors: one line, exit status 2."""

    @pytest.mark.parametrize(
        "extra",
        [["--budgets", "10"], ["--interval", "0"], ["--what-if", "--budgets", "lots"],
         ["--what-if", "--policies", "mru"], ["--what-if", "--target", "2"]],
    )
    def test_exit_2(self, synthetic: tuple[Path, dict[str, int]], extra: list[str],
                    capsys: pytest.CaptureFixture[str]) -> None:
        path, _ = synthetic
        assert main([str(path), *extra]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err

    def test_no_arguments(self, capsys: pytest.CaptureFixture[str]) -> None:
        assert main([]) == 2



class TestStreamingSums:
    """Without per-token columns (``read_log(columns=False)``, the CLI without --csv, --plot
    or --what-if) the summary, time split and checks come out the same."""

    @staticmethod
    def _same(path: Path) -> tuple[Any, Any]:
        from moestream.tools.analyze.time_report import time_report

        whole, lean = read_log(path), read_log(path, columns=False)
        assert set(lean.tokens.values) == {"wall_ms"}
        assert len(lean.tokens) == len(whole.tokens)
        assert summarize(lean) == summarize(whole)
        assert time_report(lean) == time_report(whole)
        assert lean.problems == whole.problems
        return whole, lean

    def test_synthetic_run(self, synthetic: tuple[Path, dict[str, int]]) -> None:
        whole, _ = self._same(synthetic[0])
        assert whole.problems == ()

    def test_problems_are_the_same(self, tmp_path: Path) -> None:
        lines = [header(), token(0), token(1, hits=3), token(3), token(4, hits=9)]
        _, lean = self._same(write(tmp_path / "bad.jsonl", lines))
        assert lean.problems == ("token indices are not consecutive from row 2",
                                 "2 tokens have hits + misses != experts used (first: token 1)")

    def test_header_after_tokens(self, tmp_path: Path) -> None:
        self._same(write(tmp_path / "late.jsonl", [token(0), token(1), header(), token(2)]))

    def test_sums_over_several_blocks(self, tmp_path: Path) -> None:
        """Blocks of 4096 rows are summed one at a time: equal to a whole column's sum up to
        the rounding of the last bits."""
        import numpy as np

        from moestream.tools.analyze.time_report import time_report

        path = tmp_path / "long.jsonl"
        write_synthetic_log(path, SyntheticRun(tokens=9000, moe_layers=2, n_experts=16,
                                               top_k=2, expert_bytes=UNIT, budget_experts=8,
                                               switch_at=5000))
        whole, lean = read_log(path), read_log(path, columns=False)
        for name, column in whole.tokens.values.items():
            assert lean.tokens.total(name) == pytest.approx(float(np.nansum(column)), rel=1e-12)
        full, sums = time_report(whole), time_report(lean)
        assert full is not None and sums is not None
        assert sums.parts_ms_per_token == pytest.approx(full.parts_ms_per_token, rel=1e-12)
        assert (sums.bound, sums.bound_by_mode) == (full.bound, full.bound_by_mode)
        assert summarize(lean)["latency_p99_ms"] == summarize(whole)["latency_p99_ms"]


class TestHostileValues:
    """Strings from a log reach the report escaped; numbers no column takes are bad lines."""

    def test_control_characters_escaped(self, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
        path = write(tmp_path / "run.jsonl", [
            header(), token(0), token(1, mode="\x1b[2J"), event("\x1b]0;title\x07"),
            event("run_end", tokens=2, exit="ok\x1b[31m\nfake line", **{"odd\x1bkey": 1})])
        for argv in ([str(path)], [str(path), str(path)], [str(path), "--what-if"]):
            assert main(argv) == 0
            out = capsys.readouterr().out
            assert "\x1b" not in out and "\x07" not in out
            assert not any(line.startswith("fake line") for line in out.splitlines())
        assert main([str(path)]) == 0
        out = capsys.readouterr().out
        assert "\\x1b[2J" in out and "ok\\x1b[31m\\nfake line" in out
        assert "\\x1b]0;title\\x07" in out

    def test_an_integer_no_float_holds_is_a_skipped_line(self, tmp_path: Path) -> None:
        big = token(2).replace('"wall_ms": 10.0', '"wall_ms": ' + "9" * 4000)
        path = write(tmp_path / "run.jsonl", [header(), token(0), token(1), big, token(3)])
        run = read_log(path)
        assert run.counts.out_of_range == 1 and run.counts.skipped == 1
        assert len(run.tokens) == 3
        assert summarize(run)["lines_skipped"] == 1

    def test_nineteen_digits_that_fit_are_read(self, tmp_path: Path) -> None:
        fits = token(1).replace('"storage_bytes": 1000', f'"storage_bytes": {2**63 - 1}')
        path = write(tmp_path / "run.jsonl", [header(), token(0), fits])
        run = read_log(path)
        assert run.counts.skipped == 0 and len(run.tokens) == 2
