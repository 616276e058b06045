"""Tests for the per-device fields of tools.logread and the per-device section of tools.analyze.

Two emulated host devices stand in for two GPUs: the run writes ``devices`` in its
``run_start``, ``token`` and ``run_end`` lines, and the reader and the analysis must agree
with those lines and with the run's own totals. One-device and older logs have no
per-device section.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog

from moestream.pipeline.cli.run import run
from moestream.pipeline.foundation.config import Budget
from moestream.pipeline.proxy.config import RunConfig
from moestream.pipeline.runlog.devices import DEVICE_COLUMNS
from moestream.pipeline.runlog.read import read_log
from moestream.tools.analyze.cli import main, summarize, summary_table
from moestream.tools.analyze.device_report import device_balance, device_rows
from moestream.tools.analyze.report_text import Value
from tests.tools.test_analyze import header, token, write


@pytest.fixture(autouse=True)
def _reset_structlog() -> Iterator[None]:
    yield
    structlog.reset_defaults()


async def _write_log(model: Path, path: Path, devices: tuple[int, ...]) -> Path:
    cfg = RunConfig(model=model, backend="host", devices=devices, tokens=8,
                    budget=Budget(experts=24), log=path)
    await run(cfg)
    return path


@pytest.fixture
async def two_devices(tiny_model: Path, tmp_path: Path) -> Path:
    """A log of 8 tokens decoded on two emulated host devices."""
    return await _write_log(tiny_model, tmp_path / "two.jsonl", (0, 1))


@pytest.fixture
async def one_device(tiny_model: Path, tmp_path: Path) -> Path:
    """A log of 8 tokens decoded on one host device."""
    return await _write_log(tiny_model, tmp_path / "one.jsonl", (0,))


def _events(path: Path, kind: str) -> list[dict[str, Any]]:
    return [e for e in map(json.loads, path.read_text().splitlines()) if e["event"] == kind]


def _sum(rows: list[dict[str, Value]], key: str) -> float:
    values = [r[key] for r in rows]
    assert all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)
    return sum(float(v) for v in values if isinstance(v, int | float))


class TestReadDevices:
    """read_log turns the devices lists into per-device columns, header and end entries."""

    def test_columns_match_the_log(self, two_devices: Path) -> None:
        log = read_log(two_devices)
        tokens = _events(two_devices, "token")
        assert list(log.tokens.devices) == [0, 1]
        for device, columns in log.tokens.devices.items():
            for name in DEVICE_COLUMNS:
                logged = [next(d[name] for d in t["devices"] if d["device"] == device)
                          for t in tokens]
                assert columns[name].tolist() == pytest.approx(logged)
        assert not log.problems
        assert not log.counts.unknown_fields and not log.counts.missing_fields

    def test_header_and_end(self, two_devices: Path) -> None:
        log = read_log(two_devices)
        start = _events(two_devices, "run_start")[0]["devices"]
        end = _events(two_devices, "run_end")[0]["devices"]
        assert log.header is not None and log.end is not None
        assert [(d.device, d.name, d.budget_bytes) for d in log.header.devices] == [
            (d["device"], d["name"], d["budget_bytes"]) for d in start]
        assert [(d.device, d.budget_bytes, d.peak_device_bytes, d.allocations, d.frees,
                 d.registered_path) for d in log.end.devices] == [
            (d["device"], d["budget_bytes"], d["peak_device_bytes"], d["allocations"],
             d["frees"], d["registered_path"]) for d in end]
        # each device says how its resident misses left the mapping (host stand-ins here)
        assert {d["registered_path"] for d in end} <= {"gather", "copy_engines", "trial"}

    def test_one_device_and_older_logs(self, one_device: Path, tmp_path: Path) -> None:
        log = read_log(one_device)
        assert log.tokens.devices == {}
        assert log.header is not None and [d.device for d in log.header.devices] == [0]
        assert not log.counts.unknown_fields and not log.problems
        older = read_log(write(tmp_path / "old.jsonl", [header(), token(0), token(1)]))
        assert older.tokens.devices == {}
        assert older.header is not None and older.header.devices == ()
        assert not older.problems

    @pytest.mark.parametrize("columns", [True, False], ids=["columns", "sums-only"])
    def test_bad_entries_are_reported(self, tmp_path: Path, columns: bool) -> None:
        per = {"hits": 1, "misses": 1, "file_bytes": 1000, "stall_ms": 1.0, "compute_ms": 2.0,
               "cache_live_bytes": 2000}
        lines = [
            header(),
            token(0, devices=[{"device": 0, **per}, {"device": 1, **per}]),
            token(1, devices=[{"device": 0, **per}, "x", {"device": "gpu", **per}]),
            token(2),
        ]
        log = read_log(write(tmp_path / "bad.jsonl", lines), columns=columns)
        assert list(log.tokens.devices) == [0, 1]
        assert log.tokens.devices[1]["hits"].tolist()[0] == 1.0
        assert all(v != v for v in log.tokens.devices[1]["hits"].tolist()[1:])  # NaN
        assert log.tokens.device_total(0, "misses") == 2.0
        assert any("without an int device" in p for p in log.problems)
        assert any("do not add up" in p and "token 1" in p for p in log.problems)

    def test_devices_only_in_a_later_block(self, tmp_path: Path) -> None:
        """Without columns the sums are checked against the token columns of the blocks
        that listed devices (4096 token rows a block); the others are not held."""
        per = {"hits": 1, "misses": 1, "file_bytes": 1000, "stall_ms": 1.0, "compute_ms": 2.0,
               "cache_live_bytes": 2000}
        lines = [header(), *(token(t) for t in range(4100))]
        lines[4099] = token(4098, devices=[{"device": 0, **per}, {"device": 1, **per, "hits": 2}])
        path = write(tmp_path / "late.jsonl", lines)
        whole, lean = read_log(path), read_log(path, columns=False)
        assert lean.problems == whole.problems
        assert any("do not add up" in p and "token 4098" in p for p in lean.problems)


class TestDeviceAnalysis:
    """The per-device figures add up to the run's totals and match the log."""

    def test_figures_sum_to_totals(self, two_devices: Path) -> None:
        log = read_log(two_devices)
        rows = device_rows(log)
        summary = summarize(log)
        assert log.end is not None and log.header is not None
        assert [r["device"] for r in rows] == [0, 1]
        assert _sum(rows, "hits") == summary["hits"]
        assert _sum(rows, "misses") == summary["misses"]
        assert _sum(rows, "file_bytes") == log.tokens.total("file_bytes")
        assert _sum(rows, "file_share") == pytest.approx(1.0)
        assert _sum(rows, "peak_device_bytes") == log.end.peak_device_bytes
        assert _sum(rows, "budget_bytes") == log.header.budget_bytes
        lean = read_log(two_devices, columns=False)  # the CLI without --csv, --plot, --what-if
        assert (device_rows(lean), lean.problems) == (rows, log.problems)
        for event in _events(two_devices, "token"):  # one thread waits for each in turn
            for name in ("stall_ms", "compute_ms"):
                assert sum(d[name] for d in event["devices"]) == pytest.approx(
                    event[name], abs=0.01), name

    def test_figures_match_the_log(self, two_devices: Path) -> None:
        rows = {r["device"]: r for r in device_rows(read_log(two_devices))}
        tokens = _events(two_devices, "token")
        starts = {d["device"]: d for d in _events(two_devices, "run_start")[0]["devices"]}
        ends = {d["device"]: d for d in _events(two_devices, "run_end")[0]["devices"]}
        read: dict[int, int] = {}
        for device, row in rows.items():
            assert isinstance(device, int)
            mine = [d for t in tokens for d in t["devices"] if d["device"] == device]
            hits, misses = sum(d["hits"] for d in mine), sum(d["misses"] for d in mine)
            read[device] = sum(d["file_bytes"] for d in mine)
            assert (row["hits"], row["misses"], row["file_bytes"]) == (hits, misses, read[device])
            assert row["hit_rate"] == pytest.approx(hits / (hits + misses))
            assert row["stall_ms_per_token"] == pytest.approx(
                sum(d["stall_ms"] for d in mine) / len(tokens))
            assert row["name"] == starts[device]["name"]
            assert row["budget_bytes"] == starts[device]["budget_bytes"]
            assert row["peak_device_bytes"] == ends[device]["peak_device_bytes"]
            assert row["peak_within_budget"] is True
        mean = sum(read.values()) / len(read)
        assert device_balance(list(rows.values())) == pytest.approx(max(read.values()) / mean)

    def test_text_and_json(self, two_devices: Path, capsys: pytest.CaptureFixture[str]) -> None:
        assert main([str(two_devices)]) == 0
        text = capsys.readouterr().out
        assert "devices: 2; file bytes balance (max/mean)" in text
        table = text.split("devices: 2;", 1)[1].splitlines()
        assert [line.split()[0] for line in table[3:6]] == ["0", "1", "run"]
        assert main([str(two_devices), "--json"]) == 0
        entry = json.loads(capsys.readouterr().out)["runs"][0]
        assert [d["device"] for d in entry["devices"]] == [0, 1]
        assert entry["devices"] == json.loads(json.dumps(device_rows(read_log(two_devices))))
        assert entry["device_balance"] >= 1.0

    def test_one_device_has_no_section(self, one_device: Path, two_devices: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
        log = read_log(one_device)
        assert device_rows(log) == []
        assert main([str(one_device)]) == 0
        assert capsys.readouterr().out == summary_table(summarize(log), log)
        assert main([str(one_device), "--json"]) == 0
        entry = json.loads(capsys.readouterr().out)["runs"][0]
        assert "devices" not in entry and "device_balance" not in entry
        assert main([str(one_device), str(two_devices)]) == 0
        text = capsys.readouterr().out
        assert text.count("file bytes balance") == 1 and "two.jsonl:\ndevices: 2;" in text

    def test_over_budget_shrink_and_leak_are_shown(self, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
        """A peak above its budget reads NO; a shrunk budget and unequal frees get a note."""
        per = {"hits": 1, "misses": 1, "file_bytes": 1000, "stall_ms": 1.0, "compute_ms": 2.0,
               "cache_live_bytes": 2000}
        start = json.loads(header())
        start["devices"] = [{"device": 0, "name": "a", "budget_bytes": 4000},
                            {"device": 1, "name": "b", "budget_bytes": 4000}]
        end = {"event": "run_end", "schema": 1, "ts": "2026-12-02T12:00:01Z", "devices": [
            {"device": 0, "budget_bytes": 4000, "peak_device_bytes": 5000, "allocations": 3,
             "frees": 3},
            {"device": 1, "budget_bytes": 3000, "peak_device_bytes": 2000, "allocations": 3,
             "frees": 2}]}
        lines = [json.dumps(start), token(0, devices=[{"device": 0, **per}, {"device": 1, **per}]),
                 json.dumps(end)]
        path = write(tmp_path / "odd.jsonl", lines)
        rows = device_rows(read_log(path))
        assert [r["peak_within_budget"] for r in rows] == [False, True]
        assert device_balance(rows) == 1.0
        assert main([str(path)]) == 0
        text = capsys.readouterr().out
        assert "NO" in text.split("devices: 2;", 1)[1]
        assert "device 1: budget 3.91 KiB at the start, 2.93 KiB at the end" in text
        assert "device 1: 3 allocations, 2 frees" in text

    def test_killed_run_has_no_end_figures(self, tmp_path: Path) -> None:
        per = {"hits": 2, "misses": 2, "file_bytes": 2000, "stall_ms": 1.0, "compute_ms": 2.0,
               "cache_live_bytes": 2000}
        path = write(tmp_path / "killed.jsonl", [header(), token(0, devices=[{"device": 3,
                                                                              **per}])])
        (row,) = device_rows(read_log(path))
        assert (row["device"], row["hits"], row["misses"]) == (3, 2, 2)
        assert row["peak_device_bytes"] is None and row["peak_within_budget"] is None
