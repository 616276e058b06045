"""``import moestream``: the engine-facing API, its lifetimes under misuse, DLPack, and the
example engine against ``moestream.pipeline.cli.run``."""

from __future__ import annotations

import asyncio
import importlib.util
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType

import moestream
from moestream.gpu.cuda import unavailable_reason
from moestream.pipeline.foundation.table import ExpertTable
from tests.conftest import BACKENDS

_NO_CUDA = unavailable_reason()
ROOT = Path(__file__).resolve().parents[2]


def _file_bytes(table: ExpertTable, key: tuple[int, int]) -> list[bytes]:
    """The gate, up and down bytes of ``key`` as the file holds them."""
    out = []
    with table.path.open("rb") as f:
        for r in table.slices(key).ranges:
            f.seek(r.offset)
            out.append(f.read(r.nbytes))
    return out


def _device_bytes(handle: moestream.ExpertHandle) -> list[bytes]:
    """What the handle's views hold, copied to the host after the upload."""
    handle.event.synchronize()
    out = []
    for m in handle.matrices:
        raw = m.bytes
        out.append(bytes(raw) if isinstance(raw, np.ndarray) else bytes(raw.get()))
    return out


def _pins(ms: moestream.Session) -> dict[tuple[int, int], int]:
    """Pins of every cached entry (non-zero ones only)."""
    return {e.key: e.pins for c in ms._streaming.caches for e in c.entries() if e.pins}


def _open(model: Path, backend: str = "host", **kwargs: Any) -> moestream.Session:
    kwargs.setdefault("mode", "direct")
    return moestream.open(model, backend=backend, **kwargs)


async def _landed(ms: moestream.Session) -> None:
    """Wait until no load is in flight (its landing callbacks have run)."""
    for _ in range(500):
        if not any(e.loaded is not None and not e.loaded.done()
                   for c in ms._streaming.caches for e in c.entries()):
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0)


class TestOpen:
    """Opening and closing; what a session tells about its model; where it may be called."""

    async def test_model_and_close(self, tiny_model: Path, tiny_table: ExpertTable) -> None:
        async with _open(tiny_model) as ms:
            assert ms.model.moe_layers == tuple(tiny_table.moe_layers)
            assert ms.model.top_k == tiny_table.top_k
            info = ms.model.layers[tiny_table.moe_layers[0]]
            assert info.gate_up_type == GGMLQuantizationType.F16
            assert ms.backend == "host" and ms.devices == (0,)
            assert not ms.closed
        assert ms.closed
        await ms.aclose()  # idempotent

    async def test_await_form(self, tiny_model: Path) -> None:
        ms = await _open(tiny_model)
        try:
            assert ms.mode == "direct"
        finally:
            await ms.aclose()

    async def test_bad_values_fail_at_once(self, tiny_model: Path) -> None:
        with pytest.raises(moestream.UsageError, match="size"):
            _open(tiny_model, budget="lots")
        with pytest.raises(moestream.UsageError, match="mode"):
            _open(tiny_model, mode="fast")

    async def test_budget_below_two_layers(self, tiny_model: Path) -> None:
        with pytest.raises(moestream.UsageError,
                           match=r"top-4 experts for each of the 2 layers in flight \(8 experts"):
            await _open(tiny_model, budget="5")  # top-4: two layers need 8

    async def test_not_a_model(self, tmp_path: Path) -> None:
        bad = tmp_path / "bad.gguf"
        bad.write_bytes(b"not a gguf file at all" * 100)
        with pytest.raises(moestream.ModelFileError):
            await _open(bad)

    async def test_other_thread_is_refused(self, tiny_model: Path) -> None:
        async with _open(tiny_model) as ms:
            layer = ms.model.moe_layers[0]
            with pytest.raises(moestream.UsageError, match="open_sync"):
                await asyncio.to_thread(ms.fetch, layer, [0])

    async def test_log_in_the_run_schema(self, tiny_model: Path, tmp_path: Path) -> None:
        from moestream.pipeline.runlog.read import read_log

        log = tmp_path / "api.jsonl"
        async with _open(tiny_model, log=log) as ms:
            for _ in range(3):
                for layer in ms.model.moe_layers:
                    async with ms.fetch(layer, [0, 1, 2, 3]) as lease:
                        await lease.gather()
                await ms.end_token()
        run = read_log(log)
        assert run.header is not None and run.end is not None
        assert len(run.tokens) == 3 and not run.problems
        assert int(run.tokens.values["hits"].sum()) == 2 * len(ms.model.moe_layers) * 4


class TestFetch:
    """Experts arrive hits first, then misses as they land, with the file's bytes."""

    @pytest.mark.parametrize("backend", BACKENDS)
    async def test_hits_first_and_file_bytes(self, tiny_model: Path, tiny_table: ExpertTable,
                                             backend: str) -> None:
        async with _open(tiny_model, backend) as ms:
            layer = ms.model.moe_layers[1]
            async with ms.fetch(layer, [5, 6]) as lease:
                await lease.gather()
            async with ms.fetch(layer, [1, 5, 2, 6]) as lease:
                assert (lease.hits, lease.misses) == (2, 2)
                order = []
                async for h in lease:
                    order.append(h.expert)
                    assert _device_bytes(h) == _file_bytes(tiny_table, h.key)
                    assert h.ready()
                    # the upload's event, or None once installed: never a device query
                    pending = h.pending_event()
                    assert pending is None or pending is h.event
                assert order[:2] == [5, 6] and sorted(order[2:]) == [1, 2]
            stats = await ms.end_token()
            # each expert counts once in a token: 5 and 6 were the first lease's misses
            assert (stats.hits, stats.misses) == (0, 4)
            assert stats.experts[1] == (5, 6, 1, 2)
            c = ms.counters()
            assert c.verified == 4 and c.mismatches == 0 and c.open_leases == 0

    @pytest.mark.parametrize("backend", BACKENDS)
    async def test_wait_uploads_once_per_pending_event(
            self, tiny_model: Path, tiny_table: ExpertTable, backend: str) -> None:
        """``wait_uploads``: one wait per distinct pending upload, none for installed
        experts; the bytes read after it on the stream are the file's."""
        stream = None
        if backend == "cupy":
            import cupy

            stream = cupy.cuda.Stream(non_blocking=True)
        async with _open(tiny_model, backend) as ms:
            layer = ms.model.moe_layers[0]
            async with ms.fetch(layer, [0, 1, 2, 3]) as lease:
                handles = await lease.gather()
                events = {id(e) for h in handles if (e := h.pending_event()) is not None}
                assert len(events) >= 1  # four misses: one event a launch, shared
                assert moestream.wait_uploads(handles, stream) == len(events)
                if stream is not None:
                    with stream:
                        copies = [h.gate.array.copy() for h in handles]
                    stream.synchronize()
                    for h, copy in zip(handles, copies, strict=True):
                        assert copy.get().tobytes() == _file_bytes(tiny_table, h.key)[0]
                lease.release(after=stream)
            await ms.end_token()
            await _landed(ms)
            await asyncio.sleep(0.05)  # the installer sees the uploads complete
            async with ms.fetch(layer, [0, 1, 2, 3]) as lease:
                handles = await lease.gather()
                installed = [h for h in handles if h.pending_event() is None]
                assert installed and moestream.wait_uploads(installed, stream) == 0
            with pytest.raises(moestream.UsageError):
                moestream.wait_uploads(handles, stream)  # released

    async def test_gather_in_the_order_asked(self, tiny_model: Path) -> None:
        async with _open(tiny_model) as ms:
            layer = ms.model.moe_layers[0]
            async with ms.fetch(layer, [3, 1]) as lease:
                await lease.gather()
            async with ms.fetch(layer, [7, 3, 0, 1]) as lease:
                first = await lease.__anext__()
                assert first.expert == 3  # a hit
                handles = await lease.gather()
                assert [h.expert for h in handles] == [7, 3, 0, 1]
                assert handles[1] is first

    async def test_matrices(self, tiny_model: Path, tiny_table: ExpertTable) -> None:
        hidden, ffn = tiny_table.layers[tiny_table.moe_layers[0]].shape
        async with _open(tiny_model) as ms, ms.fetch(ms.model.moe_layers[0], [0]) as lease:
            (h,) = await lease.gather()
            assert h.gate.shape == h.up.shape == (ffn, hidden)
            assert h.down.shape == (hidden, ffn)
            assert h.gate.array.dtype == np.float16 and h.gate.array.shape == (ffn, hidden)
            assert h.gate.nbytes == ffn * hidden * 2
            assert h.gate.ptr == h.gate.array.ctypes.data
            assert h.cuda_event is None and h.event.done()
            with pytest.raises(ValueError, match="read-only"):
                h.gate.array[0, 0] = 1  # the cache's bytes are not the engine's to write

    async def test_quantized_matrices_are_raw_bytes(self, q2_model: Path) -> None:
        async with _open(q2_model) as ms, ms.fetch(ms.model.moe_layers[0], [0]) as lease:
            (h,) = await lease.gather()
            assert h.gate.ggml_type == GGMLQuantizationType.IQ2_XXS
            assert h.down.ggml_type == GGMLQuantizationType.Q2_K
            assert h.gate.array.dtype == np.uint8 and h.gate.array.size == h.gate.nbytes

    async def test_bad_requests(self, tiny_model: Path) -> None:
        async with _open(tiny_model) as ms:
            layer = ms.model.moe_layers[0]
            with pytest.raises(moestream.UsageError, match="not a MoE layer"):
                ms.fetch(0, [1])  # the dense layer
            with pytest.raises(moestream.UsageError, match=r"experts 0\.\.15"):
                ms.fetch(layer, [16])
            with pytest.raises(moestream.UsageError, match="twice"):
                ms.fetch(layer, [1, 1])
            assert _pins(ms) == {}

    async def test_prefetch_then_fetch_hits(self, tiny_model: Path) -> None:
        async with _open(tiny_model) as ms:
            later = ms.model.moe_layers[2]
            assert ms.prefetch(later, [4, 5, 6]) == 3
            async with ms.fetch(later, [4, 5, 9]) as lease:
                assert (lease.hits, lease.misses) == (2, 1)
                await lease.gather()
            await _landed(ms)
            assert _pins(ms) == {}  # the unused guess (6) was released once landed
            assert ms.counters().prefetched == 3

    async def test_hint_held_until_its_layer_is_released(self, tiny_model: Path) -> None:
        """A hint's unused guesses keep their pins while the layer's lease is held (the
        layer may still ask for them), and lose them at its release."""
        async with _open(tiny_model) as ms:
            later = ms.model.moe_layers[2]
            ms.prefetch(later, [4, 5, 6])
            await _landed(ms)
            lease = ms.fetch(later, [4, 9])
            await lease.gather()
            assert _pins(ms).get((later, 6)) == 1  # the guess not asked for, still held
            lease.release()
            await _landed(ms)
            assert _pins(ms) == {}
            stats = await ms.end_token()
            assert stats.file_bytes == 4 * ms.model.layers[later].expert_bytes  # 3 guessed

    async def test_available_hands_out_what_has_landed(self, tiny_model: Path) -> None:
        async with _open(tiny_model) as ms:
            layer = ms.model.moe_layers[0]
            async with ms.fetch(layer, [2, 3]) as lease:
                await lease.gather()
            await ms.end_token()
            async with ms.fetch(layer, [3, 2, 8]) as lease:
                now = lease.available()
                assert [h.expert for h in now] == [3, 2]  # the hits, in the order asked
                assert lease.available() == []  # handed out once
                await _landed(ms)
                assert [h.expert for h in lease.available()] == [8]
                assert [h.expert async for h in lease] == []
            await ms.end_token()

    async def test_ready_is_a_query(self, tiny_model: Path) -> None:
        async with _open(tiny_model) as ms:
            layer = ms.model.moe_layers[1]
            assert not ms.ready(layer, [0, 1])
            async with ms.fetch(layer, [0, 1]) as lease:
                await lease.gather()
            await _landed(ms)
            assert ms.ready(layer, [1, 0]) and not ms.ready(layer, [0, 2])
            assert _pins(ms) == {} and ms.counters().open_leases == 0

    async def test_a_layer_fetched_ahead_counts_in_its_own_token(self, tiny_model: Path
                                                                  ) -> None:
        """A lease fetched during token 0 and used in token 1 survives the boundary and
        counts there; one used and left held is released at its token's end."""
        async with _open(tiny_model) as ms:
            first, last = ms.model.moe_layers[0], ms.model.moe_layers[-1]
            async with ms.fetch(last, [1, 2]) as lease:
                await lease.gather()
            ahead = ms.fetch(first, [5, 6, 7])
            stats = await ms.end_token()
            assert (stats.hits, stats.misses) == (0, 2) and stats.experts[0] == ()
            assert not ahead.released
            forgotten = ms.fetch(last, [1])
            await ahead.gather()
            forgotten.available()
            ahead.release()
            stats = await ms.end_token()
            assert (stats.hits, stats.misses) == (1, 3) and stats.experts[0] == (5, 6, 7)
            assert forgotten.released and ms.counters().open_leases == 0

    async def test_engine_compute_leaves_host_the_rest(self, tiny_model: Path) -> None:
        async with _open(tiny_model) as ms:
            async with ms.fetch(ms.model.moe_layers[0], [0]) as lease:
                await lease.gather()
            stats = await ms.end_token(compute_ms=0.0, upload_ms=0.0)
            assert stats.time["compute_ms"] == 0.0 and stats.compute_ms == 0.0
            assert stats.time["host_ms"] > 0.0
            assert sum(stats.time.values()) == pytest.approx(stats.wall_ms, abs=0.01)
            stats = await ms.end_token()  # no measure: the rest is the engine's compute
            assert stats.time["host_ms"] <= 0.002  # rounding

    async def test_cpu_time_tells_blocked_from_busy(self, tiny_model: Path) -> None:
        """A token whose loop thread sleeps has a wall well above its CPU time; one that
        spins has them close, and the process's CPU covers the thread's."""
        async with _open(tiny_model) as ms:
            async with ms.fetch(ms.model.moe_layers[0], [0]) as lease:
                await lease.gather()
            time.sleep(0.05)  # blocked outside moestream's waits, as in a full launch queue
            slept = await ms.end_token()
            async with ms.fetch(ms.model.moe_layers[0], [0]) as lease:
                await lease.gather()
            end = time.perf_counter() + 0.05
            while time.perf_counter() < end:
                pass
            spun = await ms.end_token()
        assert slept.wall_ms >= 50.0 and slept.cpu_ms < 0.5 * slept.wall_ms
        assert spun.wall_ms >= 50.0 and spun.cpu_ms > 0.5 * spun.wall_ms

    async def test_unused_hint_released_at_the_next_token_end(self, tiny_model: Path) -> None:
        async with _open(tiny_model) as ms:
            ms.prefetch(ms.model.moe_layers[0], [1, 2])
            await ms.end_token()  # a hint for the next token's first layer: carried over
            await _landed(ms)
            assert _pins(ms) == {(1, 1): 1, (1, 2): 1}
            await ms.end_token()  # not fetched in that token either: ended
            assert _pins(ms) == {}

    async def test_corrupt_expert_fails_the_token(self, tiny_model: Path) -> None:
        tuning = moestream.Tuning(faults="corrupt@2")
        async with _open(tiny_model, tuning=tuning) as ms:
            async with ms.fetch(ms.model.moe_layers[0], [0, 1, 2]) as lease:
                await lease.gather()
            with pytest.raises(moestream.VerificationError,
                               match="differ from the file: 1, first"):
                await ms.end_token()

    async def test_failed_upload_names_the_expert(self, tiny_model: Path) -> None:
        tuning = moestream.Tuning(faults="upload@1", queue_depth=1)
        async with _open(tiny_model, tuning=tuning) as ms:
            layer = ms.model.moe_layers[0]
            async with ms.fetch(layer, [0, 1]) as lease:
                with pytest.raises(moestream.UploadError, match=f"layer {layer} expert 0"):
                    await lease.__anext__()
                h = await lease.__anext__()  # the other expert still arrives
                assert h.expert == 1
            assert _pins(ms) == {}
            # the failed expert was dropped from the cache, the other one kept
            assert ms.ready(layer, [1]) and not ms.ready(layer, [0])

    async def test_model_replaced_raises_its_own_error(self, tiny_model: Path) -> None:
        tuning = moestream.Tuning(faults="replace@1+")
        async with _open(tiny_model, tuning=tuning) as ms:
            layer = ms.model.moe_layers[0]
            with ms.fetch(layer, [0]) as lease, pytest.raises(moestream.ModelChangedError):
                await lease.gather()
            assert not ms.ready(layer, [0])  # dropped from the cache


class TestDevicesAndModes:
    """Experts sharded over (emulated) devices; the controller switching under the engine."""

    async def test_two_devices(self, tiny_model: Path, tiny_table: ExpertTable) -> None:
        async with _open(tiny_model, devices=[0, 1]) as ms:
            assert ms.devices == (0, 1)
            layer = ms.model.moe_layers[0]
            async with ms.fetch(layer, list(range(8))) as lease:
                handles = await lease.gather()
                assert {h.device for h in handles} == {0, 1}
                for h in handles:
                    assert _device_bytes(h) == _file_bytes(tiny_table, h.key)
            stats = await ms.end_token()
            assert stats.misses == 8 and ms.counters().verified == 8

    async def test_auto_mode_switches_while_decoding(self, tiny_model: Path,
                                                     tiny_table: ExpertTable) -> None:
        from moestream.pipeline.streaming.controller import ControllerReadings

        model_bytes = tiny_table.file_bytes
        ram = {"available": model_bytes // 2}

        def sampler(full: bool) -> ControllerReadings:
            return ControllerReadings(ram["available"], 1 << 40, model_bytes, 0, 0, 0, 0)

        tuning = moestream.Tuning(sampler=sampler, sample_ms=5, dwell_s=0, margin_bytes=1,
                                  warmup=False)
        async with _open(tiny_model, mode="auto", tuning=tuning) as ms:
            assert ms.mode == "direct"
            ram["available"] = 4 * model_bytes
            for _ in range(500):
                if ms.mode == "resident":
                    break
                await asyncio.sleep(0.01)
            assert ms.mode == "resident" and ms.counters().switches == 1
            async with ms.fetch(ms.model.moe_layers[2], [3, 4]) as lease:
                for h in await lease.gather():
                    assert _device_bytes(h) == _file_bytes(tiny_table, h.key)
            assert (await ms.end_token()).mode == "resident"


class TestDLPack:
    """Views are exported without a copy, to numpy on the host and CuPy on a GPU."""

    async def test_numpy_from_dlpack_same_pointer(self, tiny_model: Path,
                                                  tiny_table: ExpertTable) -> None:
        async with _open(tiny_model) as ms, ms.fetch(ms.model.moe_layers[0], [2, 3]) as lease:
            for h in await lease.gather():
                for m in h.matrices:
                    arr = np.from_dlpack(m)
                    assert arr.ctypes.data == m.ptr
                    assert arr.dtype == np.float16 and arr.shape == m.shape
                    assert not arr.flags.writeable
                assert np.from_dlpack(h.down).tobytes() == _file_bytes(tiny_table, h.key)[2]
                assert h.gate.__dlpack_device__() == (1, 0)
                with pytest.raises(BufferError, match="no stream"):
                    h.gate.__dlpack__(stream=5)

    async def test_quantized_exports_bytes(self, q2_model: Path) -> None:
        async with _open(q2_model) as ms, ms.fetch(ms.model.moe_layers[0], [1]) as lease:
            (h,) = await lease.gather()
            arr = np.from_dlpack(h.up)
            assert arr.dtype == np.uint8 and arr.ctypes.data == h.up.ptr

    @pytest.mark.gpu
    @pytest.mark.skipif(_NO_CUDA is not None, reason=str(_NO_CUDA))
    async def test_cupy_from_dlpack_same_pointer(self, tiny_model: Path,
                                                 tiny_table: ExpertTable) -> None:
        import cupy

        stream = cupy.cuda.Stream(non_blocking=True)
        async with _open(tiny_model, "cupy") as ms:
            lease = ms.fetch(ms.model.moe_layers[0], [0, 1, 2, 3])
            async for h in lease:
                assert h.cuda_event is not None
                with stream:
                    arr = cupy.from_dlpack(h.gate)  # the stream waits for the upload
                    total = arr.astype(cupy.float32).sum()
                assert arr.data.ptr == h.gate.ptr
                assert arr.dtype == cupy.float16 and arr.shape == h.gate.shape
                stream.synchronize()
                gate = np.frombuffer(_file_bytes(tiny_table, h.key)[0], np.float16)
                assert float(total) == pytest.approx(float(gate.astype(np.float32).sum()),
                                                     rel=1e-5)
            lease.release(after=stream)  # reused only after the stream's sums
            assert _pins(ms) == {}


class TestLifetimes:
    """Misuse gets a clear error or a defined result, never a reused or freed buffer."""

    @pytest.mark.parametrize("backend", BACKENDS)
    async def test_view_used_after_release(self, tiny_model: Path, backend: str) -> None:
        async with _open(tiny_model, backend) as ms:
            with ms.fetch(ms.model.moe_layers[0], [0, 1]) as lease:
                h = (await lease.gather())[0]
            assert h.released and lease.released
            for use in (lambda: h.gate.array, lambda: h.up.bytes, lambda: h.down.ptr,
                        lambda: h.gate.__dlpack__(), lambda: np.from_dlpack(h.up),
                        lambda: h.event, h.ready, h.wait, lambda: h.cuda_event):
                with pytest.raises(moestream.UsageError, match="used after its lease"):
                    use()
            with pytest.raises(moestream.UsageError, match="released"):
                await lease.__anext__()
            lease.release()  # again: nothing happens
            assert _pins(ms) == {}

    async def test_handles_after_close(self, tiny_model: Path) -> None:
        async with _open(tiny_model) as ms:
            lease = ms.fetch(ms.model.moe_layers[0], [0])
            (h,) = await lease.gather()
        with pytest.raises(moestream.UsageError, match="session was closed"):
            h.gate.array  # noqa: B018
        with pytest.raises(moestream.UsageError, match="closed"):
            ms.fetch(ms.model.moe_layers[0], [0])
        with pytest.raises(moestream.UsageError, match="closed"):
            ms.prefetch(ms.model.moe_layers[0], [0])
        with pytest.raises(moestream.UsageError, match="closed"):
            await ms.end_token()

    @pytest.mark.parametrize("backend", BACKENDS)
    async def test_two_fetches_of_one_layer(self, tiny_model: Path, tiny_table: ExpertTable,
                                            backend: str) -> None:
        """Both hold their pins; an expert both ask for is loaded once, handed to both."""
        async with _open(tiny_model, backend) as ms:
            layer = ms.model.moe_layers[1]
            a = ms.fetch(layer, [0, 1, 2, 3])
            b = ms.fetch(layer, [2, 3, 4, 5])
            assert (b.hits, b.misses) == (2, 2)  # 2 and 3 in flight for a
            got_a, got_b = await asyncio.gather(a.gather(), b.gather())
            for h in (*got_a, *got_b):
                assert _device_bytes(h) == _file_bytes(tiny_table, h.key)
            assert got_a[2].gate.ptr == got_b[0].gate.ptr
            assert _pins(ms) == {(layer, e): 1 for e in (0, 1, 4, 5)} | {
                (layer, 2): 2, (layer, 3): 2}
            a.release()
            assert got_b[0].gate.array is not None and _pins(ms)[(layer, 2)] == 1
            b.release()
            assert _pins(ms) == {}
            assert ms.counters().misses == 6

    @pytest.mark.parametrize("backend", BACKENDS)
    async def test_cancelled_mid_fetch(self, tiny_model: Path, tiny_table: ExpertTable,
                                       backend: str) -> None:
        """Loads in flight keep their pins until they land; then the same experts hit,
        with the file's bytes, and verify."""
        tuning = moestream.Tuning(faults="slow_ms=40@1+", queue_depth=1)
        async with _open(tiny_model, backend, tuning=tuning) as ms:
            layer = ms.model.moe_layers[0]
            lease = ms.fetch(layer, [0, 1, 2, 3])

            async def consume() -> None:
                async with lease:
                    async for _ in lease:
                        pass

            task = asyncio.create_task(consume())
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert lease.released and ms.counters().open_leases == 0
            pins = _pins(ms)
            assert pins and all(n == 1 for n in pins.values())  # still loading: pinned
            await _landed(ms)
            assert _pins(ms) == {}
            async with ms.fetch(layer, [0, 1, 2, 3]) as again:
                assert again.hits == 4
                for h in await again.gather():
                    assert _device_bytes(h) == _file_bytes(tiny_table, h.key)
            stats = await ms.end_token()
            assert stats.misses == 4 and ms.counters().mismatches == 0

    async def test_other_fetch_survives_a_cancelled_one(self, tiny_model: Path,
                                                        tiny_table: ExpertTable) -> None:
        tuning = moestream.Tuning(faults="slow_ms=30@1+", queue_depth=1)
        async with _open(tiny_model, tuning=tuning) as ms:
            layer = ms.model.moe_layers[2]
            a = ms.fetch(layer, [7, 8])
            b = ms.fetch(layer, [8, 9])
            a.release()  # before anything landed: 7 and 8 stay pinned while loading
            for h in await b.gather():
                assert _device_bytes(h) == _file_bytes(tiny_table, h.key)
            b.release()
            await _landed(ms)
            assert _pins(ms) == {}

    async def test_release_wakes_a_waiter(self, tiny_model: Path) -> None:
        tuning = moestream.Tuning(faults="slow_ms=50@1+", queue_depth=1)
        async with _open(tiny_model, tuning=tuning) as ms:
            lease = ms.fetch(ms.model.moe_layers[0], [0, 1])
            waiter = asyncio.create_task(lease.gather())
            await asyncio.sleep(0.01)
            lease.release()
            with pytest.raises(moestream.UsageError, match="released"):
                await waiter

    async def test_tasks_iterating_one_lease_all_end(self, tiny_model: Path) -> None:
        """Two tasks gathering one lease at once: each expert is handed out once, and the
        task left waiting when the last was handed out ends too (before the release)."""
        tuning = moestream.Tuning(faults="slow_ms=10@1+", queue_depth=1)
        async with _open(tiny_model, tuning=tuning) as ms:
            async with ms.fetch(ms.model.moe_layers[0], [0, 1, 2, 3, 4]) as lease:
                got: list[list[int]] = [[], []]

                async def take(mine: list[int]) -> None:
                    async for h in lease:
                        mine.append(h.expert)

                await asyncio.wait_for(asyncio.gather(take(got[0]), take(got[1])), 20.0)
                assert sorted(got[0] + got[1]) == [0, 1, 2, 3, 4]
                assert [h.expert for h in await lease.gather()] == [0, 1, 2, 3, 4]
            assert _pins(ms) == {}

    async def test_close_wakes_a_waiter(self, tiny_model: Path) -> None:
        tuning = moestream.Tuning(faults="slow_ms=50@1+", queue_depth=1)
        ms = await _open(tiny_model, tuning=tuning)
        lease = ms.fetch(ms.model.moe_layers[0], [0, 1, 2])
        waiter = asyncio.create_task(lease.gather())
        await asyncio.sleep(0.01)
        await ms.aclose()
        with pytest.raises(moestream.UsageError, match="session was closed"):
            await waiter
        assert ms._streaming.summary.allocations == ms._streaming.summary.frees

    async def test_lease_left_open_ends_with_its_token(self, tiny_model: Path) -> None:
        async with _open(tiny_model) as ms:
            lease = ms.fetch(ms.model.moe_layers[0], [0, 1])
            (h, _) = await lease.gather()
            await ms.end_token()
            assert lease.released and _pins(ms) == {}
            with pytest.raises(moestream.UsageError, match="end of its token"):
                h.gate.bytes  # noqa: B018

    async def test_more_pinned_than_the_budget(self, tiny_model: Path) -> None:
        async with _open(tiny_model, budget="8") as ms:
            layers = ms.model.moe_layers
            held = [ms.fetch(layers[0], [0, 1, 2, 3]), ms.fetch(layers[1], [0, 1, 2, 3])]
            with pytest.raises(moestream.UsageError, match="does not fit"):
                ms.fetch(layers[2], [0, 1, 2, 3])
            for lease in held:
                await lease.gather()
                lease.release()
            assert _pins(ms) == {}


class TestSync:
    """The synchronous API runs the same session on a private loop thread."""

    def test_decode_from_threads(self, tiny_model: Path, tiny_table: ExpertTable) -> None:
        with moestream.open_sync(tiny_model, backend="host", mode="direct") as ms:
            errors: list[BaseException] = []

            def layer_work(layer: int) -> None:
                try:
                    with ms.fetch(layer, [0, 1, 2, 3]) as lease:
                        for h in lease:
                            assert _device_bytes(h) == _file_bytes(tiny_table, h.key)
                except BaseException as exc:  # reported by the main thread
                    errors.append(exc)

            threads = [threading.Thread(target=layer_work, args=(layer,))
                       for layer in ms.model.moe_layers]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert not errors
            stats = ms.end_token()
            assert stats.misses == 4 * len(ms.model.moe_layers)
            assert ms.counters().verified == stats.misses
        assert ms.closed
        with pytest.raises(moestream.UsageError, match="closed"):
            ms.fetch(ms.model.moe_layers[0], [0])
        ms.close()  # idempotent

    def test_warm_layer_in_one_step(self, tiny_model: Path) -> None:
        """The sync face of ``available``, ``remaining``, ``ready`` and the engine's own
        compute at ``end_token``."""
        with moestream.open_sync(tiny_model, backend="host", mode="direct") as ms:
            layer = ms.model.moe_layers[0]
            with ms.fetch(layer, [4, 5]) as lease:
                assert len(lease.gather()) == 2 and lease.remaining == 0
            ms.end_token()
            assert ms.ready(layer, [5, 4])
            with ms.fetch(layer, [5, 4]) as lease:
                assert [h.expert for h in lease.available()] == [5, 4]
                assert lease.remaining == 0
            stats = ms.end_token(compute_ms=0.0)
            assert (stats.hits, stats.misses) == (2, 0) and stats.time["compute_ms"] == 0.0

    def test_misuse(self, tiny_model: Path) -> None:
        with moestream.open_sync(tiny_model, backend="host") as ms:
            with ms.fetch(ms.model.moe_layers[0], [0, 1]) as lease:
                handles = lease.gather()
            with pytest.raises(moestream.UsageError, match="used after its lease"):
                handles[0].gate.array  # noqa: B018
            with pytest.raises(moestream.UsageError, match="twice"):
                ms.fetch(ms.model.moe_layers[0], [3, 3])

    def test_release_and_close_wake_a_blocked_caller(self, tiny_model: Path) -> None:
        """A thread blocked for a loading expert (without the session's lock) is woken by a
        release from another thread, and by the session's close."""
        tuning = moestream.Tuning(faults="slow_ms=50@1+", queue_depth=1)
        ms = moestream.open_sync(tiny_model, backend="host", mode="direct", tuning=tuning)
        for end in ("release", "close"):
            lease = ms.fetch(ms.model.moe_layers[0], [0, 1, 2])
            raised: list[BaseException] = []
            thread = threading.Thread(target=_gather_into, args=(lease, raised))
            thread.start()
            time.sleep(0.02)
            lease.release() if end == "release" else ms.close()
            thread.join(10.0)
            assert not thread.is_alive()
            assert isinstance(raised[0], moestream.UsageError), raised
            assert ("released" if end == "release" else "closed") in str(raised[0])

    @pytest.mark.parametrize("when", ["waiting", "woken"])
    def test_an_interrupted_wait_leaves_the_lease_whole(
            self, tiny_model: Path, tiny_table: ExpertTable, monkeypatch: pytest.MonkeyPatch,
            when: str) -> None:
        """Interrupted while it waits, or once woken and before it took the expert: the
        next iteration still hands every expert out, once, and nothing stays pinned."""
        from moestream.pipeline.streaming.loads import ThreadWaiter

        real, armed = ThreadWaiter.wait, [True]

        def interrupted(waiter: ThreadWaiter) -> None:
            if armed[0] and when == "woken":
                real(waiter)
            if armed[0]:
                armed[0] = False
                raise KeyboardInterrupt
            real(waiter)

        monkeypatch.setattr(ThreadWaiter, "wait", interrupted)
        tuning = moestream.Tuning(faults="slow_ms=30@1+", queue_depth=1)
        with moestream.open_sync(tiny_model, backend="host", mode="direct",
                                 tuning=tuning) as ms:
            layer = ms.model.moe_layers[1]
            with ms.fetch(layer, [4, 5]) as lease:
                with pytest.raises(KeyboardInterrupt):
                    next(lease)
                got = list(lease)
                assert sorted(h.expert for h in got) == [4, 5]
                for h in got:
                    assert _device_bytes(h) == _file_bytes(tiny_table, h.key)
            stats = ms.end_token()
            assert stats.misses == 2 and stats.stall_ms > 0
            assert ms.counters().open_leases == 0 and _pins(ms._session) == {}

    def test_threads_iterating_one_lease_share_its_experts(self, tiny_model: Path) -> None:
        """Threads blocked on one lease at once are woken in turn: each expert is handed
        out once, and once all were, every thread's iteration ends (none waits on)."""
        tuning = moestream.Tuning(faults="slow_ms=10@1+", queue_depth=1)
        with moestream.open_sync(tiny_model, backend="host", mode="direct",
                                 tuning=tuning) as ms:
            experts = list(range(6))
            with ms.fetch(ms.model.moe_layers[0], experts) as lease:
                got: list[list[int]] = [[], [], []]

                def take(mine: list[int]) -> None:
                    mine.extend(h.expert for h in lease)

                threads = [threading.Thread(target=take, args=(g,)) for g in got]
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join(20.0)
                    assert not thread.is_alive()
                assert sorted(e for g in got for e in g) == experts
            assert ms.counters().open_leases == 0 and _pins(ms._session) == {}

    def test_open_failure_stops_the_thread(self, tmp_path: Path) -> None:
        before = threading.active_count()
        with pytest.raises(moestream.ModelFileError):
            moestream.open_sync(tmp_path / "missing.gguf", backend="host")
        assert threading.active_count() == before


def _gather_into(lease: moestream.SyncLease, raised: list[BaseException]) -> None:
    try:
        lease.gather()
    except BaseException as error:  # the test reads it
        raised.append(error)


@pytest.fixture(scope="module")
def engine_example() -> Iterator[ModuleType]:
    spec = importlib.util.spec_from_file_location("engine_example",
                                                  ROOT / "examples" / "engine.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module


class TestExampleEngine:
    """examples/engine.py decodes exactly what ``pipeline.cli.run --compute real --router live``
    decodes: the same routing (experts and float32 weights) at every layer of every token,
    which the hidden state decides. One reader thread on both sides, so misses land (and
    their outputs are summed) in the same order."""

    @pytest.mark.parametrize("mode", ["direct", "resident"])
    def test_equals_pipeline_run(self, engine_example: ModuleType, tiny_model: Path,
                                 tmp_path: Path, mode: str,
                                 capsys: pytest.CaptureFixture[str]) -> None:
        from moestream.pipeline.foundation.trace import load_trace
        from moestream.pipeline.run import main

        tokens, seed = 12, 5
        trace = tmp_path / "run.npz"
        code = main(["-m", str(tiny_model), "-n", str(tokens), "--router", "live",
                     "--compute", "real", "--seed", str(seed), "--queue-depth", "1",
                     "--cache-budget", "12", "--mode", mode, "--backend", "host",
                     "--record-trace", str(trace)])
        assert code == 0
        routes = asyncio.run(engine_example.decode(
            str(tiny_model), tokens, seed=seed, budget="12", backend="host", mode=mode,
            queue_depth=1))
        recorded = load_trace(trace)
        experts = np.array([[r[0] for r in token] for token in routes], dtype=np.int32)
        weights = np.array([[r[1] for r in token] for token in routes], dtype=np.float32)
        np.testing.assert_array_equal(experts, recorded.experts)
        np.testing.assert_array_equal(weights, recorded.weights)
        assert len({tuple(e.ravel()) for e in experts}) > 1  # the routing really moves

    def test_runs_on_the_embedded_model(self, engine_example: ModuleType, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
        assert engine_example.main(["-n", "3", "--backend", "host"]) == 0
        out = capsys.readouterr().out
        assert "token 2:" in out and "mismatches 0" in out


class TestDocs:
    """Every ``python`` block of docs/API.md is a complete program that runs."""

    BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "API.md").read_text(),
                        re.DOTALL)

    def test_there_are_examples(self) -> None:
        assert len(self.BLOCKS) >= 2

    @pytest.mark.parametrize("number", range(len(BLOCKS)))
    def test_example_runs(self, number: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                          capsys: pytest.CaptureFixture[str]) -> None:
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
        code = compile(self.BLOCKS[number], f"docs/API.md block {number}", "exec")
        exec(code, {"__name__": "__main__"})
        assert capsys.readouterr().out
