"""Tests for foundation.timesplit and cli.progress: a wait charged by what its load did,
a token's parts that add up to its wall time, and the live line."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from moestream.pipeline.cli.progress import LiveLine
from moestream.pipeline.foundation.timesplit import PARTS, LaunchTimes, LoadPhases, TimeSplit
from moestream.pipeline.run import main as run_main


def _phases(planned: float = 0.0, slot_waits: list[tuple[float, float]] | None = None,
            start: float | None = None, marks: list[tuple[float, str]] | None = None
            ) -> LoadPhases:
    phases = LoadPhases(LaunchTimes(planned, list(slot_waits or [])))
    if start is not None:
        phases.begin(start)
    for at, part in marks or []:
        phases.mark(part, at)  # type: ignore[arg-type]
    return phases


class TestLoadPhases:
    """A wait for one load is split over the phases that load went through meanwhile."""

    def test_a_wait_is_split_by_phase(self) -> None:
        phases = _phases(start=1.0, marks=[(1.5, "slot"), (4.0, "read"), (5.0, "upload")])
        split = TimeSplit()
        phases.charge(split, 0.5, 6.0)  # host before the start and after the arrival
        assert split.slot_ms == pytest.approx(500.0)
        assert split.read_ms == pytest.approx(2500.0)
        assert split.upload_ms == pytest.approx(1000.0)
        assert split.compute_ms == split.switch_ms == 0.0
        assert split.measured_ms == pytest.approx(4000.0)  # of a 5.5 s wait: 1.5 s host

    def test_only_the_overlap_counts(self) -> None:
        phases = _phases(start=0.0, marks=[(10.0, "read"), (12.0, "upload")])
        split = TimeSplit()
        phases.charge(split, 9.0, 11.0)
        assert split.read_ms == pytest.approx(1000.0)
        assert split.upload_ms == pytest.approx(1000.0)

    def test_launcher_waits_for_slots_count_for_later_loads(self) -> None:
        # the launcher waited 1-3 s for an earlier miss's slot, then took this one's at 4 s
        phases = _phases(planned=0.0, slot_waits=[(1.0, 3.0), (3.5, 4.0)], start=4.0,
                         marks=[(6.0, "read")])
        split = TimeSplit()
        phases.charge(split, 0.0, 7.0)
        assert split.slot_ms == pytest.approx(2500.0)
        assert split.read_ms == pytest.approx(2000.0)
        assert split.measured_ms == pytest.approx(4500.0)

    def test_a_load_never_launched_is_host_and_slot_time(self) -> None:
        phases = _phases(planned=0.0, slot_waits=[(1.0, 2.0)])
        split = TimeSplit()
        phases.charge(split, 0.0, 5.0)
        assert split.slot_ms == pytest.approx(1000.0)
        assert split.measured_ms == pytest.approx(1000.0)

    @given(st.lists(st.floats(0.0, 100.0), min_size=2, max_size=8),
           st.floats(0.0, 50.0), st.floats(0.0, 60.0))
    def test_never_more_than_the_wait(self, times: list[float], a: float, length: float) -> None:
        times.sort()
        parts = ["slot", "read", "upload"]
        phases = _phases(start=times[0],
                         marks=[(t, parts[i % 3]) for i, t in enumerate(times[1:])])
        split = TimeSplit()
        phases.charge(split, a, a + length)
        assert split.measured_ms <= length * 1000.0 + 1e-6


class TestTimeSplit:
    """The token event's ``time``: six parts that add up to the wall time."""

    @given(st.lists(st.floats(0.0, 50.0), min_size=5, max_size=5), st.floats(0.0, 100.0))
    def test_record_adds_up_to_the_wall(self, waits: list[float], extra: float) -> None:
        split = TimeSplit(*waits)
        wall = split.measured_ms + extra
        record = split.record(wall)
        assert list(record) == [f"{p}_ms" for p in PARTS]
        # each part is rounded to 3 decimals: five roundings off at most 0.0025 ms
        assert sum(record.values()) == pytest.approx(round(wall, 3), abs=0.003)
        assert record["host_ms"] >= 0

    def test_charge_and_add(self) -> None:
        split = TimeSplit()
        for part in ("compute", "read", "upload", "slot", "switch", "host"):
            split.charge(part, 0.001)  # type: ignore[arg-type]
        assert split.measured_ms == pytest.approx(5.0)  # host is derived, never kept
        total = TimeSplit()
        total.add(split)
        total.add(split)
        assert total.parts(20.0)["host"] == pytest.approx(10.0)


class TestLiveLine:
    """The live line: off by default; on, it shows tokens, hit rate, mode and the bound."""

    def test_off_draws_nothing(self) -> None:
        stream = io.StringIO()
        with LiveLine(4, enabled=False, stream=stream) as line:
            line.update(1, 1, TimeSplit().record(5.0), "direct")
        assert stream.getvalue() == ""

    def test_on_names_the_bound(self) -> None:
        stream = io.StringIO()
        line = LiveLine(3, enabled=True, stream=stream)
        for _ in range(3):
            split = TimeSplit(read_ms=8.0)
            line.update(3, 1, split.record(10.0), "direct")
        line._bar.refresh()  # tqdm redraws at most every 0.1 s: draw the last state now
        text = stream.getvalue()
        line.close()
        assert "3/3" in text and "hit 0.75" in text and "direct" in text
        assert "storage-bound 80%" in text

    def test_only_on_a_terminal_without_json(self, tiny_model: Path,
                                             capsys: pytest.CaptureFixture[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
        args = ["-m", str(tiny_model), "-n", "3", "--backend", "host"]
        assert run_main(args) == 0  # captured stderr is no terminal
        assert "decoding" not in capsys.readouterr().err
        monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
        assert run_main([*args, "--json"]) == 0
        assert "decoding" not in capsys.readouterr().err
        assert run_main(args) == 0  # a terminal, a table summary: the line is drawn
        assert "decoding" in capsys.readouterr().err
