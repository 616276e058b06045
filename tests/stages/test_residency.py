"""Tests of pipeline.residency and stages.warm on real files: mincore, evict, mlock, warm."""

from __future__ import annotations

import asyncio
import errno
import os
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from moestream.pipeline.foundation.errors import ModelFileError, ResidencyError, UsageError
from moestream.pipeline.foundation.files import FileIdentity, ModelFile
from moestream.pipeline.foundation.table import ByteRange
from moestream.stages import cachestat
from moestream.stages import residency as residency_module
from moestream.stages.residency import (
    PAGE_BYTES,
    Residency,
    coalesce,
    evict,
    hint_willneed,
    lock_pages,
    resident_bytes_of,
    resident_pages,
)
from moestream.stages.warm import Loader, TokenBucket, WarmEngine
from tests.reclaim import assert_all_resident, assert_loaded, assert_resident_pages

MIB = 1 << 20


def write_cold(path: Path, nbytes: int, seed: int = 0) -> Path:
    """A file of random bytes whose pages are not in the page cache."""
    data = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    with open(path, "wb") as f:
        f.write(data)
    evict(path)  # fdatasync first: freshly written pages are dirty and DONTNEED skips those
    return path


def read_all(path: Path, r: ByteRange | None = None) -> None:
    """Load pages the ordinary way (a buffered read)."""
    with open(path, "rb") as f:
        if r is None:
            while f.read(8 * MIB):
                pass
        else:
            f.seek(r.offset)
            f.read(r.nbytes)


def page_set(ranges: list[ByteRange]) -> set[int]:
    return {
        page
        for r in ranges
        for page in range(r.offset // PAGE_BYTES, -(-(r.offset + r.nbytes) // PAGE_BYTES))
    }


@pytest.fixture
def cold(tmp_path: Path) -> Path:
    """A 24 MiB + 123 byte file (last page partial), not resident.

    Skips where the temp dir keeps pages resident whatever we ask (tmpfs).
    """
    path = write_cold(tmp_path / "data.bin", 24 * MIB + 123)
    if Residency.of_file(path).resident_page_count:
        pytest.skip(f"{tmp_path} keeps pages resident after DONTNEED (tmpfs?)")
    return path


class TestResidencyMeasure:
    """Residency.of_file reports what mincore says, per page and in bytes."""

    def test_cold_then_read(self, cold: Path) -> None:
        before = Residency.of_file(cold)
        assert before.file_bytes == 24 * MIB + 123
        assert before.n_pages == 24 * MIB // PAGE_BYTES + 1
        assert before.resident_page_count == 0
        read_all(cold)
        assert_all_resident(Residency.of_file(cold))

    def test_accepts_an_open_fd(self, cold: Path) -> None:
        read_all(cold, ByteRange(0, MIB))
        fd = os.open(cold, os.O_RDONLY)
        try:
            assert Residency.of_file(fd).resident_bytes([ByteRange(0, MIB)]) == MIB
            os.fstat(fd)  # still open: the caller owns it
        finally:
            os.close(fd)

    def test_partial_read_is_counted_by_page(self, cold: Path) -> None:
        r = ByteRange(3 * PAGE_BYTES + 100, 5 * PAGE_BYTES)
        read_all(cold, r)
        res = Residency.of_file(cold)
        assert set(np.flatnonzero(res.pages)) == page_set([r])
        assert res.resident_pages_in([r]) == 6
        assert resident_pages(cold, [r]) == 6
        assert res.resident_bytes([r]) == r.nbytes

    def test_many_windows_agree_with_one(self, cold: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        read_all(cold, ByteRange(5 * MIB + 7, 3 * MIB))
        one = Residency.of_file(cold)
        monkeypatch.setattr(residency_module, "_WINDOW_BYTES", 64 * 1024)
        many = Residency.of_file(cold)
        assert np.array_equal(one.pages, many.pages)

    def test_empty_file(self, tmp_path: Path) -> None:
        path = tmp_path / "empty"
        path.write_bytes(b"")
        res = Residency.of_file(path)
        assert res.n_pages == 0 and res.fraction == 1.0
        assert res.resident_bytes([ByteRange(0, 10)]) == 0

    def test_missing_file_is_a_residency_error(self, tmp_path: Path) -> None:
        with pytest.raises(ResidencyError, match="no-such-file"):
            Residency.of_file(tmp_path / "no-such-file")


def _synthetic(pages: list[bool], file_bytes: int) -> Residency:
    return Residency(name="synthetic", file_bytes=file_bytes, pages=np.array(pages, dtype=bool))


_layout = st.integers(1, 12).flatmap(
    lambda n: st.tuples(
        st.lists(st.booleans(), min_size=n, max_size=n),
        st.integers((n - 1) * PAGE_BYTES + 1, n * PAGE_BYTES),
    )
)


class TestResidencyArithmetic:
    """Byte counts over unaligned ranges match a byte-by-byte count (property tests)."""

    @settings(max_examples=200, deadline=None)
    @given(layout=_layout, data=st.data())
    def test_resident_bytes_each(self, layout: tuple[list[bool], int], data: st.DataObject) -> None:
        pages, file_bytes = layout
        res = _synthetic(pages, file_bytes)
        per_byte = np.repeat(np.array(pages), PAGE_BYTES)[:file_bytes]
        ranges = data.draw(st.lists(
            st.tuples(st.integers(0, file_bytes + 10), st.integers(0, 3 * PAGE_BYTES)),
            max_size=6,
        ))
        rs = [ByteRange(o, n) for o, n in ranges]
        each = res.resident_bytes_each(rs)
        for r, got in zip(rs, each, strict=True):
            assert got == int(per_byte[r.offset:r.offset + r.nbytes].sum())
        union = np.zeros(file_bytes, dtype=bool)
        for r in rs:
            union[r.offset:r.offset + r.nbytes] = True
        assert res.resident_bytes(rs) == int((union & per_byte).sum())

    @settings(max_examples=200, deadline=None)
    @given(layout=_layout, data=st.data())
    def test_missing_is_the_absent_part(
        self, layout: tuple[list[bool], int], data: st.DataObject
    ) -> None:
        pages, file_bytes = layout
        res = _synthetic(pages, file_bytes)
        per_byte = np.repeat(np.array(pages), PAGE_BYTES)[:file_bytes]
        offset = data.draw(st.integers(0, file_bytes - 1))
        r = ByteRange(offset, data.draw(st.integers(1, file_bytes - offset)))
        missing = res.missing([r])
        covered = np.zeros(file_bytes, dtype=bool)
        for m in missing:
            assert r.offset <= m.offset and m.end <= r.end
            covered[m.offset:m.end] = True
        inside = np.zeros(file_bytes, dtype=bool)
        inside[r.offset:r.end] = True
        assert np.array_equal(covered, inside & ~per_byte)

    def test_coalesce(self) -> None:
        got = coalesce([ByteRange(10, 5), ByteRange(0, 10), ByteRange(30, 0), ByteRange(12, 8)])
        assert got == [ByteRange(0, 20)]


def _model_files(*paths: Path) -> list[ModelFile]:
    """The files as one model's address space (each at the page after the last one's end)."""
    files: list[ModelFile] = []
    for path in paths:
        base = files[-1].span_end if files else 0
        files.append(ModelFile(path, base, FileIdentity.of(os.stat(path))))
    return files


def _scattered(path: Path) -> None:
    """Make some of ``path``'s pages resident, with unaligned edges and gaps."""
    for start, n in ((0, 3), (PAGE_BYTES * 7 + 5, 9000), (3 * MIB + 1, MIB), (20 * MIB, 4 * MIB)):
        read_all(path, ByteRange(start, n))


_range_lists = st.lists(st.tuples(st.integers(0, 25 * MIB), st.integers(0, 3 * MIB)),
                        max_size=8)


class TestCachedBytes:
    """cachestat's counts (stages.cachestat) agree byte for byte with mincore's page map on
    real files, per file and over a model's files; without cachestat, mincore answers."""

    @pytest.fixture
    def scattered(self, cold: Path) -> Path:
        fd = os.open(cold, os.O_RDONLY)
        try:
            if cachestat.cached_bytes(fd, [(0, 1)]) is None:
                pytest.skip("this kernel has no cachestat (Linux < 6.5)")
        finally:
            os.close(fd)
        _scattered(cold)
        return cold

    @settings(max_examples=60, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(spans=_range_lists)
    def test_agrees_with_mincore(self, scattered: Path, spans: list[tuple[int, int]]) -> None:
        size = scattered.stat().st_size
        ranges = coalesce(ByteRange(o, min(n, size - o)) for o, n in spans if o < size)
        fd = os.open(scattered, os.O_RDONLY)
        try:
            got = cachestat.cached_bytes(fd, [(r.offset, r.nbytes) for r in ranges])
            assert got == Residency.of_file(fd).resident_bytes(ranges)
        finally:
            os.close(fd)

    @settings(max_examples=30, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(spans=_range_lists)
    @example(spans=[(25174017, 3145728)])  # once ran past the second file's end
    def test_model_files_agree_with_mincore(self, scattered: Path, tmp_path: Path,
                                            spans: list[tuple[int, int]]) -> None:
        second = tmp_path / "second.bin"
        if not second.exists():
            write_cold(second, 3 * MIB + 77, seed=1)
            read_all(second, ByteRange(MIB - 3, MIB))
        files = _model_files(scattered, second)
        end = files[-1].span_end  # a selection lies in the model's address space
        selection = [ByteRange(o, min(n, end - o)) for o, n in spans if o < end]
        whole = [ByteRange(f.base, f.nbytes) for f in files]
        residency = Residency.of_files(files)
        assert resident_bytes_of(files, selection, whole) == [
            residency.resident_bytes(selection), residency.file_resident_bytes]

    def test_without_cachestat_mincore_answers(self, scattered: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
        files = _model_files(scattered)
        selection = [ByteRange(PAGE_BYTES * 7, 3 * MIB)]
        with_it = resident_bytes_of(files, selection)
        monkeypatch.setattr(cachestat, "_available", False)
        assert resident_bytes_of(files, iter(selection)) == with_it
        assert with_it == [Residency.of_files(files).resident_bytes(selection)]


class TestEvict:
    """evict drops the pages the ranges touch, and says how much left."""

    def test_evict_an_unaligned_range(self, cold: Path) -> None:
        read_all(cold)
        r = ByteRange(MIB + 1000, 2 * MIB)
        left = evict(cold, [r])
        res = Residency.of_file(cold)
        gone = page_set([r])
        assert left == len(gone) * PAGE_BYTES
        assert_resident_pages(res, set(range(res.n_pages)) - gone)

    def test_pages_the_kernel_drops_elsewhere_meanwhile_are_not_counted(
            self, cold: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """What ``evict`` says left is the asked ranges' pages only: pages of the file the
        kernel reclaims meanwhile (memory pressure, another process's DONTNEED), stood in
        for by a drop of another range during the call, are not counted."""
        read_all(cold)
        asked, elsewhere = ByteRange(MIB + 1000, 2 * MIB), ByteRange(6 * MIB, MIB)
        fadvise = residency_module._fadvise

        def and_elsewhere(fd: int, start: int, length: int, advice: int, name: str) -> None:
            fadvise(fd, start, length, advice, name)
            os.posix_fadvise(fd, elsewhere.offset, elsewhere.nbytes, os.POSIX_FADV_DONTNEED)

        monkeypatch.setattr(residency_module, "_fadvise", and_elsewhere)
        left = evict(cold, [asked])
        assert left == len(page_set([asked])) * PAGE_BYTES
        res = Residency.of_file(cold)
        assert_resident_pages(res, set(range(res.n_pages)) - page_set([asked, elsewhere]))

    def test_evict_whole_file(self, cold: Path) -> None:
        read_all(cold)
        assert evict(cold) == Residency.of_file(cold).n_pages * PAGE_BYTES
        assert Residency.of_file(cold).resident_page_count == 0

    def test_dirty_pages_are_written_then_dropped(self, tmp_path: Path) -> None:
        path = tmp_path / "dirty.bin"
        path.write_bytes(b"x" * (2 * MIB))  # pages resident and dirty
        evict(path)
        assert Residency.of_file(path).resident_page_count == 0


class TestHintWillneed:
    """WILLNEED goes out in 8 MiB pieces and loads the range."""

    async def test_hints_load_the_range(self, cold: Path) -> None:
        r = ByteRange(MIB + 5, 20 * MIB)
        fd = os.open(cold, os.O_RDONLY)
        try:
            assert hint_willneed(fd, [r]) == 3
            for _ in range(200):  # the kernel loads asynchronously
                if Residency.of_file(cold).resident_bytes([r]) == r.nbytes:
                    break
                await asyncio.sleep(0.01)
        finally:
            os.close(fd)
        assert Residency.of_file(cold).resident_bytes([r]) == r.nbytes


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class TestTokenBucket:
    """The bucket averages its rate, allows its burst, and runs requests into debt."""

    def test_rate_and_debt(self) -> None:
        clock = FakeClock()
        bucket = TokenBucket(100.0, clock=clock)
        assert bucket.delay_for(100) == pytest.approx(1.0)
        assert bucket.delay_for(50) == pytest.approx(1.5)  # behind the first request
        clock.now = 1.5
        assert bucket.delay_for(100) == pytest.approx(1.0)

    def test_burst(self) -> None:
        clock = FakeClock()
        bucket = TokenBucket(100.0, burst_bytes=300, clock=clock)
        assert bucket.delay_for(300) == 0.0
        assert bucket.delay_for(100) == pytest.approx(1.0)
        clock.now = 100.0  # a long idle refills only up to the burst
        assert bucket.delay_for(300) == 0.0
        assert bucket.delay_for(1) > 0

    def test_rate_change(self) -> None:
        clock = FakeClock()
        bucket = TokenBucket(100.0, clock=clock)
        bucket.rate_bytes_per_s = 1000.0
        assert bucket.delay_for(1000) == pytest.approx(1.0)

    @pytest.mark.parametrize("rate", [0.0, -5.0])
    def test_bad_rate(self, rate: float) -> None:
        with pytest.raises(UsageError):
            TokenBucket(rate)


class TestWarmEngine:
    """WarmEngine loads exactly the ranges asked, in order, throttled, pausable, cancellable."""

    @pytest.mark.parametrize("loader", ["sendfile", "preadv"])
    async def test_loads_exactly_the_ranges(self, cold: Path, loader: Loader) -> None:
        ranges = [ByteRange(5000, 3 * MIB), ByteRange(9 * MIB + 123, 100_000),
                  ByteRange(15 * MIB, 5 * MIB + 7)]
        async with WarmEngine(cold, threads=4, piece_bytes=MIB, loader=loader) as engine:
            result = await engine.warm(ranges)
        assert result.bytes_read == sum(r.nbytes for r in ranges)
        assert_resident_pages(Residency.of_file(cold), page_set(ranges))

    @pytest.mark.parametrize("loader", ["sendfile", "preadv"])
    async def test_large_stretches_are_streamed(self, cold: Path, loader: Loader) -> None:
        ranges = [ByteRange(100, 6 * MIB), ByteRange(6 * MIB + 100, 10 * MIB),  # touching
                  ByteRange(20 * MIB, MIB)]
        async with WarmEngine(cold, threads=4, piece_bytes=MIB, stream_min_bytes=8 * MIB,
                              stream_piece_bytes=4 * MIB, loader=loader) as engine:
            result = await engine.warm(ranges)
        assert result.pieces == 4 + 1  # 16 MiB streamed in 4 MiB pieces, 1 MiB exactly
        assert result.bytes_read == 17 * MIB
        res = Residency.of_file(cold)
        assert_loaded(res.resident_bytes(ranges), 17 * MIB, res.n_pages * PAGE_BYTES)

    async def test_falls_back_to_preadv_once(
        self, cold: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        def refuse(*args: object) -> int:
            raise OSError(errno.EINVAL, "Invalid argument")

        monkeypatch.setattr(os, "sendfile", refuse)
        with capture_logs() as logs:
            async with WarmEngine(cold, threads=4, piece_bytes=MIB) as engine:
                result = await engine.warm([ByteRange(0, 8 * MIB)])
        assert result.bytes_read == 8 * MIB and engine.loader == "preadv"
        assert [e["event"] for e in logs].count("warm.sendfile_unsupported") == 1
        res = Residency.of_file(cold)
        assert_loaded(res.resident_bytes([ByteRange(0, 8 * MIB)]), 8 * MIB,
                      res.n_pages * PAGE_BYTES)

    async def test_progress_and_clipping(self, cold: Path) -> None:
        seen: list[tuple[int, int]] = []
        size = cold.stat().st_size
        async with WarmEngine(cold, threads=2, piece_bytes=4 * MIB) as engine:
            result = await engine.warm(
                [ByteRange(size - MIB, 10 * MIB)], progress=lambda d, t: seen.append((d, t))
            )
        assert result.bytes_read == MIB
        assert seen[-1] == (MIB, MIB)

    async def test_throttle(self, cold: Path) -> None:
        loop = asyncio.get_running_loop()
        async with WarmEngine(cold, threads=2, piece_bytes=MIB) as engine:
            started = loop.time()
            await engine.warm([ByteRange(0, 8 * MIB)], max_bytes_per_s=32 * MIB)
            elapsed = loop.time() - started
        # One piece of burst, then 7 MiB at 32 MiB/s.
        assert elapsed >= 0.9 * 7 / 32

    async def test_pause_and_resume(self, cold: Path) -> None:
        done: list[int] = []
        async with WarmEngine(cold, threads=2, piece_bytes=MIB) as engine:
            with engine.paused():
                task = asyncio.create_task(
                    engine.warm([ByteRange(0, 4 * MIB)], progress=lambda d, t: done.append(d))
                )
                await asyncio.sleep(0.1)
                assert not done and not task.done()
                assert Residency.of_file(cold).resident_page_count == 0
            await asyncio.wait_for(task, 10)
        assert done[-1] == 4 * MIB
        with pytest.raises(UsageError):
            engine.resume()

    async def test_quiet_time_after_the_last_pause(self, cold: Path) -> None:
        """With ``quiet_s``, reads go on only once no pause came for that long: pauses a
        short gap apart (a token's layers) keep the pieces from starting between them."""
        done: list[int] = []
        async with WarmEngine(cold, threads=2, piece_bytes=MIB, quiet_s=0.4) as engine:
            engine.pause()
            task = asyncio.create_task(
                engine.warm([ByteRange(0, 4 * MIB)], progress=lambda d, t: done.append(d)))
            for _ in range(3):  # layers a short gap apart
                engine.resume()
                await asyncio.sleep(0.05)
                assert engine.paused_now and not done
                engine.pause()
            engine.resume()
            assert engine.paused_now and not done  # the quiet time runs
            await asyncio.wait_for(task, 10)
            assert not engine.paused_now and done[-1] == 4 * MIB
        res = Residency.of_file(cold)
        assert_loaded(res.resident_bytes([ByteRange(0, 4 * MIB)]), 4 * MIB,
                      res.n_pages * PAGE_BYTES)

    async def test_cancel_stops_promptly(self, cold: Path) -> None:
        loop = asyncio.get_running_loop()
        async with WarmEngine(cold, threads=2, piece_bytes=MIB) as engine:
            task = asyncio.create_task(
                engine.warm([ByteRange(0, 24 * MIB)], max_bytes_per_s=8 * MIB)
            )
            await asyncio.sleep(0.2)
            cancelled_at = loop.time()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert loop.time() - cancelled_at < 0.5
            # The engine is usable again after a cancelled warm-up.
            result = await engine.warm([ByteRange(0, MIB)])
            assert result.bytes_read == MIB
        assert Residency.of_file(cold).resident_bytes() < 12 * MIB

    async def test_closed_engine_refuses(self, cold: Path) -> None:
        engine = WarmEngine(cold, threads=1)
        await engine.aclose()
        await engine.aclose()  # idempotent
        with pytest.raises(UsageError, match="closed"):
            await engine.warm([ByteRange(0, 10)])

    def test_bad_arguments(self, cold: Path, tmp_path: Path) -> None:
        with pytest.raises(UsageError):
            WarmEngine(cold, piece_bytes=100)
        with pytest.raises(ModelFileError, match="nope"):
            WarmEngine(tmp_path / "nope")


class TestLockPages:
    """lock_pages pins the pages of the ranges until unlock."""

    def test_lock_and_unlock(self, cold: Path) -> None:
        r = ByteRange(PAGE_BYTES + 10, 2 * MIB)
        before = _vm_locked_kib()
        try:
            with lock_pages(cold, [r]) as lock:
                assert lock.locked_bytes == len(page_set([r])) * PAGE_BYTES
                assert Residency.of_file(cold).resident_pages_in([r]) == len(page_set([r]))
                assert _vm_locked_kib() - before == lock.locked_bytes // 1024
                assert evict(cold, [r]) == 0  # pinned pages stay
        except ResidencyError as exc:
            pytest.skip(f"mlock not permitted here: {exc}")
        assert _vm_locked_kib() == before


def _vm_locked_kib() -> int:
    text = Path("/proc/self/status").read_text()
    match = re.search(r"^VmLck:\s+(\d+) kB", text, re.M)
    assert match is not None
    return int(match.group(1))
