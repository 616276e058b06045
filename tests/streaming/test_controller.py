"""Tests for pipeline.streaming.controller: decisions with fed readings, and live switching."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path

import pytest

from moestream.pipeline.cli.run import run
from moestream.pipeline.foundation.config import Budget, ComputeSpec
from moestream.pipeline.foundation.table import ExpertTable
from moestream.pipeline.proxy.config import RunConfig
from moestream.pipeline.streaming.controller import (
    ControllerReadings,
    MachineSampler,
    ModeController,
    ModeDecider,
    Thresholds,
    default_margin,
)
from moestream.stages.residency import Residency, evict
from tests.reclaim import assert_all_resident, assert_same_reading

GIB = 1 << 30
MODEL = 40 * GIB


def readings(available: int, pinned: int = 0) -> ControllerReadings:
    return ControllerReadings(
        ram_available_bytes=available, ram_total_bytes=128 * GIB, model_bytes=MODEL,
        model_resident_bytes=0, pinned_bytes=pinned, storage_read_bytes=0, disk_read_bytes=0,
    )


class TestDecider:
    """Thresholds, hysteresis, dwell and pressure."""

    TH = Thresholds(enter_margin_bytes=4 * GIB, leave_margin_bytes=2 * GIB, min_dwell_s=2.0)

    def test_enters_resident_with_margin(self) -> None:
        d = ModeDecider(self.TH, "direct", now=-10)
        assert d.decide(readings(MODEL + 3 * GIB), 0)[0] == "direct"
        assert d.decide(readings(MODEL + 4 * GIB), 0)[0] == "resident"

    def test_hysteresis_between_thresholds(self) -> None:
        d = ModeDecider(self.TH, "resident", now=-10)
        # between leave (model+2) and enter (model+4): stays resident
        assert d.decide(readings(MODEL + 3 * GIB), 0)[0] == "resident"
        assert d.decide(readings(MODEL + GIB), 0)[0] == "direct"
        # and back in direct the same reading does not re-enter
        assert d.decide(readings(MODEL + 3 * GIB), 10)[0] == "direct"

    def test_dwell_blocks_flapping(self) -> None:
        d = ModeDecider(self.TH, "direct", now=0)
        assert d.decide(readings(MODEL + 5 * GIB), 1.0)[0] == "direct"
        assert d.decide(readings(MODEL + 5 * GIB), 2.5)[0] == "resident"
        assert d.decide(readings(MODEL + GIB), 3.0)[0] == "resident"  # dwell not passed
        assert d.decide(readings(MODEL + GIB), 4.6)[0] == "direct"

    def test_pressure_leaves_at_once(self) -> None:
        d = ModeDecider(self.TH, "resident", now=0)
        mode, reason = d.decide(readings(MODEL - GIB), 0.1)
        assert mode == "direct" and "pressure" in reason

    def test_pinned_pages_are_not_counted_twice(self) -> None:
        d = ModeDecider(self.TH, "resident", now=-10)
        # the kernel counts our pinned file pages inside "available" already
        assert d.decide(readings(8 * GIB, pinned=MODEL), 0)[0] == "direct"

    def test_thresholds_must_be_ordered(self) -> None:
        with pytest.raises(ValueError):
            Thresholds(enter_margin_bytes=GIB, leave_margin_bytes=2 * GIB)

    def test_default_margin(self) -> None:
        assert default_margin(16 * GIB) == 2 * GIB
        assert default_margin(128 * GIB) == int(6.4 * GIB)


class TestMachineSampler:
    """Real readings: mincore residency, and a RAM limit that caps what is believed."""

    def test_ram_limit_caps(self, tiny_table: ExpertTable) -> None:
        capped = MachineSampler(tiny_table, lambda: 0, ram_limit=1 * GIB)(True)
        assert capped.ram_total_bytes == GIB
        assert capped.ram_available_bytes <= GIB
        assert_same_reading(capped.model_resident_bytes,
                            Residency.of_file(tiny_table.path).file_resident_bytes,
                            tiny_table.file_bytes)

    def test_a_quick_reading_carries_the_last_full_disk_counter(
            self, tiny_table: ExpertTable, monkeypatch: pytest.MonkeyPatch) -> None:
        """The token boundaries' quick readings leave the disks' counters (twice the rest
        of a reading) to the full ones and report the last full one's."""
        import psutil

        sampler = MachineSampler(tiny_table, lambda: 0, ram_limit=None)
        asked = []
        counters = psutil.disk_io_counters

        def disk_io_counters() -> object:
            asked.append(1)
            return counters()

        monkeypatch.setattr(psutil, "disk_io_counters", disk_io_counters)
        first = sampler(False)  # none yet: this quick one reads them
        assert len(asked) == 1 and first.disk_read_bytes >= 0
        assert sampler(False).disk_read_bytes == first.disk_read_bytes and len(asked) == 1
        sampler(True)
        assert len(asked) == 2

    def test_dontneed_releases_pages(self, tiny_table: ExpertTable) -> None:
        path = tiny_table.path
        path.read_bytes()
        evict(path)
        after = MachineSampler(tiny_table, lambda: 0, ram_limit=None)(True)
        assert after.model_resident_bytes < tiny_table.file_bytes // 10


class FedSampler:
    """Plenty of RAM for the first ``flip`` readings, then less than the model."""

    def __init__(self, model_bytes: int, flip: int, back: int | None = None) -> None:
        self.calls = 0
        self.model = model_bytes
        self.flip = flip
        self.back = back

    def __call__(self, full: bool) -> ControllerReadings:
        self.calls += 1
        low = self.calls > self.flip and (self.back is None or self.calls <= self.back)
        available = self.model // 2 if low else self.model + 64 * GIB
        return ControllerReadings(available, 256 * GIB, self.model, 0, 0, 0, 0)


class TestLiveSwitching:
    """A run switches mode mid-run on pressure and back, and still verifies."""

    @pytest.mark.asyncio
    async def test_switch_mid_run(self, tiny_model: Path, tmp_path: Path) -> None:
        log = tmp_path / "run.jsonl"
        cfg = RunConfig(model=tiny_model, tokens=40, budget=Budget(experts=12),
                        compute=ComputeSpec("fixed", 0.5), backend="host", log=log,
                        sample_ms=5.0, dwell_s=0.01)
        sampler = FedSampler(tiny_model.stat().st_size, flip=6, back=30)
        summary = await run(replace(cfg), sampler=sampler)
        assert summary.mismatches == 0 and summary.verified > 0
        events = [json.loads(x) for x in log.read_text().splitlines()]
        switches = [e for e in events if e["event"] == "mode_switch"]
        assert [s["to"] for s in switches][:2] == ["direct", "resident"]
        assert all("readings" in s and "reason" in s for s in switches)
        modes = {e["mode"] for e in events if e["event"] == "token"}
        assert modes == {"direct", "resident"}

    @pytest.mark.asyncio
    async def test_forced_mode_never_switches(self, tiny_model: Path) -> None:
        cfg = RunConfig(model=tiny_model, tokens=10, mode="direct", backend="host",
                        compute=ComputeSpec("fixed", 0.2), sample_ms=5.0)
        summary = await run(cfg, sampler=FedSampler(tiny_model.stat().st_size, flip=0))
        assert summary.switches == 0 and summary.mode == "direct"


class TierSampler:
    """Always RAM below the model but above the margin: direct mode with a host tier."""

    def __init__(self, model_bytes: int) -> None:
        self.model = model_bytes

    def __call__(self, full: bool) -> ControllerReadings:
        return ControllerReadings(self.model // 2, 256 * GIB, self.model, 0, 0, 0, 0)


class TestHostTier:
    """Partial residency: in direct mode the hottest experts' pages are kept."""

    @pytest.mark.asyncio
    async def test_tier_forms_and_verifies(self, tiny_model: Path, tmp_path: Path) -> None:
        log = tmp_path / "run.jsonl"
        size = tiny_model.stat().st_size
        cfg = RunConfig(model=tiny_model, tokens=30, budget=Budget(experts=12),
                        compute=ComputeSpec("fixed", 0.5), backend="host", log=log,
                        sample_ms=5.0, margin_bytes=size // 8)
        summary = await run(cfg, sampler=TierSampler(size))
        assert summary.mismatches == 0 and summary.mode == "direct"
        tiers = [json.loads(x) for x in log.read_text().splitlines() if "host_tier" in x]
        assert tiers and all(t["bytes"] <= t["target_bytes"] for t in tiers)

    @pytest.mark.asyncio
    async def test_hottest_first_and_pages_dropped_on_leaving(
        self, tiny_model: Path, tiny_table: ExpertTable
    ) -> None:
        from moestream.gpu.cache.store import DeviceCache
        from moestream.gpu.host import HostBackend
        from moestream.gpu.kernels import HostKernels
        from moestream.pipeline.streaming.streamer import ExpertStreamer

        backend = HostBackend()
        cache = DeviceCache(backend, 1 << 30, "lru")
        streamer = ExpertStreamer(RunConfig(model=tiny_model), tiny_table, backend, cache,
                                  HostKernels())
        layer = tiny_table.moe_layers[0]
        one = tiny_table.slices((layer, 0)).nbytes
        streamer.miss_counts.update({(layer, 1): 5, (layer, 2): 9, (layer, 3): 1})
        try:
            assert await streamer.set_tier_bytes(2 * one) == 2 * one
            assert streamer.tier == {(layer, 1), (layer, 2)}
            for key in streamer.tier:  # read through the page cache, as the tier does
                for r in tiny_table.slices(key).ranges:
                    streamer.reader.read_range(r.offset, r.nbytes)
            await streamer.set_tier_bytes(one)
            assert streamer.tier == {(layer, 2)}
            left = tiny_table.slices((layer, 1)).ranges
            assert Residency.of_file(tiny_model).resident_bytes(left) < one // 4
        finally:
            await streamer.aclose()
            cache.close()


class RegisterCounter:
    """A streamer stand-in that records the controller's register passes and waits."""

    def __init__(self) -> None:
        self.mode = "direct"
        self.calls: list[str] = []
        self.warm_gate: object = None

    async def set_mode(self, mode: str) -> None:
        self.mode = mode

    def register_resident(self) -> None:
        self.calls.append("register")

    async def registered(self) -> None:
        await asyncio.sleep(0)
        self.calls.append("registered")


class TestBackgroundWarmup:
    """Resident mode warms what is missing and registers windows as the warm-up goes."""

    @pytest.mark.asyncio
    async def test_registers_during_warmup(self, tiny_model: Path, tiny_table: ExpertTable,
                                           tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
        import moestream.pipeline.streaming.controller as controller_module
        from moestream.pipeline.runlog.write import RunLog

        size = tiny_model.stat().st_size
        monkeypatch.setattr(controller_module, "_REGISTER_EVERY", size // 4)
        evict(tiny_model)
        log = tmp_path / "ctl.jsonl"
        runlog = RunLog(log)
        await runlog.open()
        streamer = RegisterCounter()
        emit = runlog.emit

        def record(event: str, **fields: object) -> None:
            streamer.calls.append(event)
            emit(event, **fields)

        monkeypatch.setattr(runlog, "emit", record)
        cfg = RunConfig(model=tiny_model, mode="resident")
        ctl = ModeController(cfg, tiny_table, streamer, runlog,
                             sampler=FedSampler(size, flip=10**6))
        await ctl.start()
        assert ctl._warm_task is not None
        await ctl._warm_task
        await ctl.aclose()
        await runlog.aclose()
        events = [json.loads(x)["event"] for x in log.read_text().splitlines()]
        assert "warmup_done" in events
        assert streamer.calls.count("register") >= 3  # during the warm-up, then at its end
        # done only once the last pass is: the after-warm-up decode is not slowed by it
        assert streamer.calls[-3:] == ["register", "registered", "warmup_done"]
        assert_all_resident(Residency.of_file(tiny_model))
