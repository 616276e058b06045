"""Fault injection: every kind at its stage, on the host backend.

Per kind: the run retries (transient read errors, a refused O_DIRECT, a refused staging or
device allocation it can live without) or stops that token with a typed error on one line
and a non-zero exit. Either way no expert is installed from partial or wrong bytes, the
pool and cache accounting is exact, and every staging slot is back when the ring closes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from moestream.gpu.backend import aligned_host_array
from moestream.gpu.cache.store import DeviceCache
from moestream.gpu.host import HostBackend
from moestream.pipeline.cli.run import RunSummary, run
from moestream.pipeline.foundation.config import Budget
from moestream.pipeline.foundation.errors import (
    DeviceMemoryError,
    ModelChangedError,
    ReadError,
    StageError,
    UploadError,
    UsageError,
)
from moestream.pipeline.foundation.faults import KINDS, STAGES, FaultPlan, parse_faults
from moestream.pipeline.run import main
from moestream.stages import reader as reader_module
from moestream.stages.reader import ModelReader
from moestream.stages.staging import StagingRing
from moestream.stages.upload import Uploader
from tests.fault_matrix import CASES, FaultCase, case_config, observe, run_case

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _events(logs: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == name]


class TestFaultPlan:
    """Specs parse to rules; calls are counted per kind; what fired is counted."""

    def test_every_kind_has_a_stage(self) -> None:
        assert set(KINDS) == set(STAGES)
        assert set(STAGES.values()) == {"prefetch", "staging", "upload", "cache"}

    @pytest.mark.parametrize("text", ["read_eio@3", "slow_ms=50@1+", "short@2,upload@4+"])
    def test_round_trip(self, text: str) -> None:
        assert str(parse_faults(text)) == text

    @pytest.mark.parametrize("text", ["nope@1", "read_eio", "read_eio@0", "read_eio@x",
                                      "slow_ms=-5@1"])
    def test_bad_spec(self, text: str) -> None:
        with pytest.raises(UsageError, match="cannot read fault"):
            parse_faults(text)

    def test_empty_plan_is_off(self) -> None:
        assert not parse_faults("") and not FaultPlan()

    @given(st.integers(1, 20), st.booleans(), st.integers(0, 40))
    def test_counting(self, at: int, repeat: bool, calls: int) -> None:
        plan = parse_faults(f"upload@{at}{'+' if repeat else ''}")
        hits = [plan.hit("upload") is not None for _ in range(calls)]
        expected = [n == at or (repeat and n > at) for n in range(1, calls + 1)]
        assert hits == expected
        assert plan.fired.get("upload", 0) == sum(expected)
        assert plan.calls("upload") == calls and plan.hit("read_eio") is None


class TestReaderRetries:
    """Transient read errors are retried with backoff and logged; lasting ones fail typed."""

    @pytest.mark.parametrize("fault", ["read_eio@2", "short@2"])
    def test_transient_is_retried(self, tiny_model: Path, fault: str) -> None:
        buf = aligned_host_array(3 * 8192)
        with capture_logs() as logs, ModelReader(tiny_model, direct=True,
                                                 faults=parse_faults(fault)) as reader:
            for i in range(3):
                reader.read_into(buf[i * 8192 : (i + 1) * 8192], i * 8192, direct=True)
            assert reader.retries == 1
        assert buf.tobytes() == tiny_model.read_bytes()[: 3 * 8192]
        (retry,) = _events(logs, "read_retry")
        assert retry["attempt"] == 1 and retry["backoff_ms"] == reader_module.RETRY_BACKOFF_MS

    def test_lasting_error_after_all_attempts(self, tiny_model: Path) -> None:
        buf = aligned_host_array(8192)
        with capture_logs() as logs, ModelReader(
            tiny_model, direct=True, faults=parse_faults("read_eio@1+"), backoff_ms=1.0
        ) as reader, pytest.raises(ReadError, match="failed after 4 attempts: Input/output"):
            reader.read_into(buf, 0, direct=True)
        assert [e["backoff_ms"] for e in _events(logs, "read_retry")] == [1.0, 4.0, 16.0]

    def test_o_direct_refused_mid_run(self, tiny_model: Path) -> None:
        buf = aligned_host_array(8192)
        with capture_logs() as logs, ModelReader(
            tiny_model, direct=True, faults=parse_faults("odirect_einval@3")
        ) as reader:
            for i in range(6):
                reader.read_into(buf, i * 8192, direct=True)
                assert reader.direct == (i < 2)
                assert buf.tobytes() == _file_bytes(tiny_model, i * 8192, 8192)
        assert len(_events(logs, "o_direct_fallback")) == 1

    def test_o_direct_refused_under_concurrent_reads(self, tiny_model: Path) -> None:
        """The refused descriptor stays open until close: readers still using it are not
        cut off, and its number is never reused under them."""
        from concurrent.futures import ThreadPoolExecutor

        data = tiny_model.read_bytes()
        with ModelReader(tiny_model, direct=True,
                         faults=parse_faults("odirect_einval@40")) as reader:

            def read(i: int) -> bool:
                buf = aligned_host_array(16384)
                offset = (i * 16384) % (len(data) - 16384) // 4096 * 4096
                reader.read_into(buf, offset, direct=True)
                return buf.tobytes() == data[offset : offset + 16384]

            with ThreadPoolExecutor(8) as pool:
                assert all(pool.map(read, range(400)))
            assert not reader.direct

    def test_slow_read_is_late_not_wrong(self, tiny_model: Path) -> None:
        buf = aligned_host_array(8192)
        with ModelReader(tiny_model, direct=True, faults=parse_faults("slow_ms=30@1")) as r:
            r.read_into(buf, 4096, direct=True)
        assert buf.tobytes() == _file_bytes(tiny_model, 4096, 8192)


def _file_bytes(path: Path, offset: int, nbytes: int) -> bytes:
    with path.open("rb") as f:
        f.seek(offset)
        return f.read(nbytes)


class TestModelChanged:
    """A file truncated, written, replaced or removed under the reader is never read on."""

    @pytest.fixture
    def copy(self, tiny_model: Path, tmp_path: Path) -> Path:
        return Path(shutil.copy(tiny_model, tmp_path / "model.gguf"))

    def test_truncated(self, copy: Path) -> None:
        buf = aligned_host_array(8192)
        with ModelReader(copy, direct=True, backoff_ms=0.1) as reader:
            reader.read_into(buf, 0, direct=True)
            os.truncate(copy, 4096)
            with pytest.raises(ModelChangedError, match="truncated while running"):
                reader.read_into(buf, 65536, direct=True)
            assert reader.retries == 0  # detected on the first short read, not retried

    def test_written_in_place(self, copy: Path) -> None:
        buf = aligned_host_array(8192)
        with ModelReader(copy, direct=True) as reader:
            reader.read_into(buf, 0, direct=True)
            with copy.open("r+b") as f:
                f.seek(70000)
                f.write(b"\xff")
            with pytest.raises(ModelChangedError, match="modified while running"):
                reader.read_into(buf, 65536, direct=True)

    def test_replaced(self, copy: Path, tmp_path: Path) -> None:
        buf = aligned_host_array(8192)
        with ModelReader(copy, direct=True) as reader:
            reader.read_into(buf, 0, direct=True)
            other = tmp_path / "other.gguf"
            shutil.copy(copy, other)
            os.replace(other, copy)
            with pytest.raises(ModelChangedError, match="replaced by another file"):
                reader.check_unchanged(path=True)

    def test_removed(self, copy: Path) -> None:
        with ModelReader(copy, direct=True) as reader:
            copy.unlink()
            with pytest.raises(ModelChangedError, match="removed while running"):
                reader.check_unchanged(path=True)

    def test_replacement_seen_by_reads(self, copy: Path, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(reader_module, "_PATH_CHECK_S", 0.0)
        buf = aligned_host_array(8192)
        with ModelReader(copy, direct=True) as reader:
            shutil.copy(copy, tmp_path / "new.gguf")
            os.replace(tmp_path / "new.gguf", copy)
            with pytest.raises(ModelChangedError, match="replaced"):
                reader.read_into(buf, 0, direct=True)

    @pytest.mark.parametrize(("fault", "words"), [("truncate@2", "truncated"),
                                                  ("replace@2", "replaced")])
    def test_injected(self, tiny_model: Path, fault: str, words: str) -> None:
        buf = aligned_host_array(8192)
        with ModelReader(tiny_model, direct=True, faults=parse_faults(fault)) as reader:
            reader.read_into(buf, 0, direct=True)
            with pytest.raises(ModelChangedError, match=words):
                reader.read_into(buf, 8192, direct=True)
        assert tiny_model.stat().st_size > 8192 * 4  # the file itself was not touched


class TestStagingFaults:
    """A refused pinned allocation shrinks the ring, or with no slot at all fails typed."""

    def test_shrinks(self) -> None:
        with capture_logs() as logs:
            ring = StagingRing(HostBackend(), 8, 8192, parse_faults("staging_oom@4"))
        assert ring.n_slots == ring.n_free == 3 and ring.requested_slots == 8
        (event,) = _events(logs, "staging_shrunk")
        assert event["slots"] == 3 and event["requested_slots"] == 8
        ring.close()

    def test_no_slot(self) -> None:
        with pytest.raises(DeviceMemoryError, match="no slot could be allocated"):
            StagingRing(HostBackend(), 8, 8192, parse_faults("staging_oom@1"))

    async def test_close_wakes_waiters(self) -> None:
        ring = StagingRing(HostBackend(), 1, 4096)
        slot = await ring.acquire()
        waiter = asyncio.ensure_future(ring.acquire())
        await asyncio.sleep(0)
        ring.close()
        with pytest.raises(StageError, match="closed while waiting"):
            await waiter
        with pytest.raises(StageError, match="closed"):
            await ring.acquire()
        ring.release(slot, None)


class _RecordingStream:
    """A host stream that counts synchronizes."""

    def __init__(self) -> None:
        self.synchronized = 0

    def wait(self, event: Any) -> None:
        pass

    def record(self) -> Any:
        from moestream.gpu.host import HostEvent

        return HostEvent()

    def synchronize(self) -> None:
        self.synchronized += 1


class TestUploadFaults:
    """A failed upload raises UploadError after the stream settled; the entry stays unset."""

    def _entry(self, cache: DeviceCache) -> Any:
        plan = cache.plan_layer([(0, 0)], [8192])
        return plan.misses[0]

    def test_injected(self) -> None:
        backend = HostBackend()
        cache = DeviceCache(backend, 1 << 20)
        entry = self._entry(cache)
        uploader = Uploader(backend, 2, parse_faults("upload@1"))
        stream = _RecordingStream()
        src = np.arange(4096, dtype=np.uint8)
        with pytest.raises(UploadError, match="injected"):
            uploader.upload(entry, [(0, src), (4096, src)], stream)  # type: ignore[arg-type]
        assert entry.upload is None and stream.synchronized == 1
        assert uploader.copies == 0
        cache.close()

    def test_backend_error_is_mapped(self) -> None:
        backend = HostBackend()
        cache = DeviceCache(backend, 1 << 20)
        entry = self._entry(cache)
        too_big = np.zeros(16384, dtype=np.uint8)
        with pytest.raises(UploadError, match="copy to the device failed"):
            Uploader(backend).upload(entry, [(0, too_big)], backend.new_stream())
        cache.close()


SIZE = 8192


class TestDeviceOOM:
    """A refused device allocation shrinks the budget to what is held, logged, and goes on."""

    def test_shrink_and_continue(self) -> None:
        cache = DeviceCache(HostBackend(), 16 * SIZE, min_bytes=4 * SIZE,
                            faults=parse_faults("device_oom@7"))
        first = cache.plan_layer([(0, e) for e in range(4)], [SIZE] * 4)
        cache.release(first.misses, None)
        with capture_logs() as logs:
            plan = cache.plan_layer([(1, e) for e in range(4)], [SIZE] * 4)
        (event,) = _events(logs, "device_oom_budget_shrunk")
        assert event["old_budget_bytes"] == 16 * SIZE
        assert event["new_budget_bytes"] == 6 * SIZE  # 4 live + 2 reserved, then undone
        assert cache.budget_bytes == 6 * SIZE and cache.counters.budget_shrinks == 1
        assert len(plan.misses) == 4 and cache.device_bytes <= cache.budget_bytes
        cache.release(plan.misses, None)
        cache.close()
        assert cache.pool.allocations == cache.pool.frees

    def test_nothing_held(self) -> None:
        cache = DeviceCache(HostBackend(), 16 * SIZE, min_bytes=4 * SIZE,
                            faults=parse_faults("device_oom@1"))
        with capture_logs() as logs, pytest.raises(DeviceMemoryError, match="cannot shrink"):
            cache.plan_layer([(0, e) for e in range(4)], [SIZE] * 4)
        assert _events(logs, "device_oom_fatal")
        assert len(cache) == 0 and cache.live_bytes == 0 and cache.budget_bytes == 16 * SIZE

    def test_second_refusal_leaves_nothing(self) -> None:
        """Failing again after the shrink: the lookup is undone, index and entries agree."""
        cache = DeviceCache(HostBackend(), 16 * SIZE, min_bytes=2 * SIZE,
                            faults=parse_faults("device_oom@5+"))
        small = cache.plan_layer([(0, e) for e in range(4)], [SIZE] * 4)
        cache.release(small.misses, None)
        with pytest.raises(DeviceMemoryError):
            cache.plan_layer([(1, 0), (1, 1)], [2 * SIZE] * 2)  # a size class never held
        assert (1, 0) not in cache and (1, 1) not in cache
        assert cache.live_bytes == sum(e.nbytes for e in cache.entries())
        # the index forgot the keys too: asked again, they are misses (refused), not hits
        with pytest.raises(DeviceMemoryError):
            cache.plan_layer([(1, 0)], [2 * SIZE])
        cache.close()
        assert cache.pool.allocations == cache.pool.frees

    @settings(max_examples=60, deadline=None)
    @given(st.lists(st.lists(st.integers(0, 11), min_size=2, max_size=2, unique=True),
                    min_size=1, max_size=30),
           st.integers(1, 12), st.booleans())
    def test_accounting_under_refusals(self, layers: list[list[int]], at: int,
                                       repeat: bool) -> None:
        cache = DeviceCache(HostBackend(), 8 * SIZE, min_bytes=2 * SIZE,
                            faults=parse_faults(f"device_oom@{at}{'+' if repeat else ''}"))
        first_budget = cache.budget_bytes
        for i, experts in enumerate(layers):
            keys = [(i % 3, e) for e in experts]
            try:
                plan = cache.plan_layer(keys, [SIZE] * len(keys))
            except DeviceMemoryError:
                assert all(e.ready for e in cache.entries())  # the lookup left nothing
                continue
            for entry in plan.misses:
                cache.mark_ready([entry])
            cache.release([*plan.hits, *plan.misses], None)
            assert cache.device_bytes <= cache.budget_bytes <= first_budget
            assert cache.live_bytes == sum(e.nbytes for e in cache.entries())
        cache.close()
        assert cache.pool.allocations == cache.pool.frees


class TestMatrix:
    """Every case of the matrix, observed at close (tools.faultmatrix)."""

    @pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
    def test_case(self, case: FaultCase, tiny_model: Path) -> None:
        result = run_case(case, tiny_model)
        assert result.problems() == []
        if case.kind == "staging_oom" and case.survives:
            assert result.observed.n_slots < result.observed.requested_slots
        if case.kind == "device_oom" and case.survives:
            assert result.observed.budget_shrinks == 1
        if case.kind in ("read_eio", "short") and case.survives:
            assert result.observed.read_retries == 1

    def test_covers_every_kind_at_its_stage(self) -> None:
        assert {c.kind for c in CASES} == set(KINDS)
        assert {c.kind for c in CASES if not c.survives} >= {"read_eio", "short", "truncate",
                                                             "replace", "staging_oom",
                                                             "upload", "device_oom"}


class TestCommandLine:
    """Through ``main``: the exit code, one error line for a stop, a summary either way."""

    @pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
    def test_case(self, case: FaultCase, tiny_model: Path,
                  capsys: pytest.CaptureFixture[str]) -> None:
        code = main(["-m", str(tiny_model), "-n", "4", "--backend", "host", "--mode", case.mode,
                     "--cache-budget", "12", "--compute", "digest", "--queue-depth", "4",
                     "--staging-slots", "4", "--chunk", "64KiB", "--json",
                     "--inject", case.spec])
        out, err = capsys.readouterr()
        assert "Traceback" not in err
        errors = [line for line in err.splitlines() if line.startswith("moestream: error:")]
        if case.survives:
            assert code == 0 and errors == []
            summary = json.loads(out)
            assert summary["mismatches"] == 0 and summary["tokens"] == 4
            assert summary["allocations"] == summary["frees"]
            assert summary["peak_device_bytes"] <= summary["budget_bytes"]
        else:
            assert code != 0 and len(errors) == 1 and err.splitlines()[-1] == errors[0]
            if out:  # decoding had started: its summary is printed
                assert (json.loads(out)["mismatches"] > 0) == case.corrupts
            if case.corrupts:
                assert code == 3 and "differ from the file" in errors[0]
        assert "faults_injected" in err

    def test_bad_spec(self, tiny_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
        code = main(["-m", str(tiny_model), "--backend", "host", "--inject", "gremlins@1"])
        _, err = capsys.readouterr()
        assert code == 2 and err.count("\n") == 1 and "cannot read fault" in err


class TestRealFileChanges:
    """The model file really truncated, written or replaced while a run reads it."""

    async def _run_until(self, model: Path, change: Any, tokens_first: int = 2) -> Any:
        cfg = dataclasses.replace(case_config(FaultCase("", "direct", False, ""), model,
                                              tokens=10_000), budget=Budget(experts=5))
        summary = RunSummary()
        with observe() as seen:
            task = asyncio.ensure_future(run(cfg, summary=summary))
            while summary.tokens < tokens_first and not task.done():
                await asyncio.sleep(0.005)
            change()
            with pytest.raises(ModelChangedError) as info:  # its own class: exit 2
                await asyncio.wait_for(task, 30)
        assert summary.mismatches == 0 and summary.verified > 0
        assert seen.slots_free_at_close == seen.n_slots
        assert seen.unready_at_close == 0
        assert seen.allocations == seen.frees_after_close
        return info.value

    @pytest.fixture
    def copy(self, tiny_model: Path, tmp_path: Path) -> Path:
        return Path(shutil.copy(tiny_model, tmp_path / "model.gguf"))

    async def test_truncated(self, copy: Path) -> None:
        error = await self._run_until(copy, lambda: os.truncate(copy, 1 << 20))
        assert isinstance(error, ModelChangedError)
        assert "truncated while running" in str(error)

    async def test_written(self, copy: Path) -> None:
        def scribble() -> None:
            with copy.open("r+b") as f:
                f.seek(copy.stat().st_size // 2)
                f.write(b"\x00" * 4096)

        error = await self._run_until(copy, scribble)
        assert isinstance(error, ModelChangedError)

    async def test_replaced(self, copy: Path, tmp_path: Path) -> None:
        def replace() -> None:
            shutil.copy(copy, tmp_path / "new.gguf")
            os.replace(tmp_path / "new.gguf", copy)

        error = await self._run_until(copy, replace)
        assert isinstance(error, ModelChangedError)
        assert "replaced" in str(error)
