"""The API as an outside engine meets it (issue 25, issue 27 item 3): each finding of the
engine written from the docs and of the attacks on the API, as a test that failed before."""

from __future__ import annotations

import asyncio
import gc
import json
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import moestream
from moestream._handles import LeaseShared
from moestream.pipeline.foundation.table import ExpertTable
from moestream.pipeline.makers.modelgen import spec_for, write_model
from tests.api.test_api import _landed

ROOT = Path(__file__).resolve().parents[2]


def _open(model: Path, **kwargs: Any) -> moestream.Session:
    kwargs.setdefault("mode", "direct")
    kwargs.setdefault("backend", "host")
    return moestream.open(model, **kwargs)


def _sync(model: Path, **kwargs: Any) -> moestream.SyncSession:
    kwargs.setdefault("mode", "direct")
    kwargs.setdefault("backend", "host")
    return moestream.open_sync(model, **kwargs)


class TestReady:
    """``ready`` says what a fetch right now would find (bug 1)."""

    async def test_true_for_experts_released_this_token(self, tiny_model: Path) -> None:
        async with _open(tiny_model) as ms:
            layer = ms.model.moe_layers[0]
            assert not ms.ready(layer, [0, 1, 2, 3])
            async with ms.fetch(layer, [0, 1, 2, 3]) as lease:
                await lease.gather()
            assert ms.ready(layer, [0, 1, 2, 3])  # the same token
            async with ms.fetch(layer, [0, 1, 2, 3]) as lease:
                assert lease.hits == 4 and len(lease.available()) == 4

    async def test_true_for_a_landed_prefetch(self, tiny_model: Path) -> None:
        async with _open(tiny_model) as ms:
            layer = ms.model.moe_layers[1]
            ms.prefetch(layer, [4, 5])
            await _landed(ms)
            assert ms.ready(layer, [4, 5])
            assert not ms.ready(layer, [4, 6])


class TestTokenAccounting:
    """A token's figures keep LOG_SCHEMA's contracts (bugs 2, 3, 5, 8)."""

    async def test_two_fetches_of_a_layer_count_each_expert_once(self, tiny_model: Path,
                                                                 tmp_path: Path) -> None:
        log = tmp_path / "two.jsonl"
        async with _open(tiny_model, log=log, budget="16") as ms:
            first, second = ms.model.moe_layers[:2]
            for token in range(3):
                async with ms.fetch(first, [0, 1, 2, 3]) as lease:
                    await lease.gather()
                async with ms.fetch(first, [2, 3, 4, 5]) as lease:
                    await lease.gather()
                a = ms.fetch(second, [token, 6, 7])  # two held at once
                b = ms.fetch(second, [7, 8])
                with a, b:
                    await a.gather()
                    await b.gather()
                stats = await ms.end_token()
                assert stats.experts[0] == (0, 1, 2, 3, 4, 5)
                assert stats.hits + stats.misses == sum(len(e) for e in stats.experts)
        run_tokens = [json.loads(line) for line in log.read_text().splitlines()
                      if json.loads(line).get("event") == "token"]
        assert all(t["hits"] + t["misses"] == sum(map(len, t["experts"])) for t in run_tokens)

    async def test_whatif_replays_two_fetches_of_a_layer(self, tiny_model: Path,
                                                        tmp_path: Path) -> None:
        log = tmp_path / "whatif.jsonl"
        async with _open(tiny_model, log=log, budget="16") as ms:
            layer = ms.model.moe_layers[0]
            for token in range(4):
                for experts in ([8 + token, 1, 2, 3], [2, 3, 4 + token]):
                    async with ms.fetch(layer, experts) as lease:
                        await lease.gather()
                await ms.end_token()
        done = subprocess.run([sys.executable, "-m", "tools.analyze", str(log), "--what-if",
                               "--jobs", "1"], cwd=ROOT, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr
        assert "DIVERGES" not in done.stdout + done.stderr, done.stdout + done.stderr

    async def test_computing_inside_async_for_adds_up(self, tiny_model: Path) -> None:
        async with _open(tiny_model, budget="16") as ms:
            for token in range(4):
                for layer in ms.model.moe_layers:
                    experts = [(token * 4 + layer + i) % 16 for i in range(4)]
                    async with ms.fetch(layer, experts) as lease:
                        async for _ in lease:
                            time.sleep(0.002)  # the engine's compute blocks the loop
                stats = await ms.end_token()
                assert stats.stall_ms + stats.compute_ms <= stats.wall_ms + 0.01
                assert sum(stats.time.values()) == pytest.approx(stats.wall_ms, abs=0.01)

    def test_a_sync_engines_wait_for_a_load_is_a_stall(self, tiny_model: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
        """Bug 3, the sync face: the whole time an engine's thread is blocked for a load is
        stall, split by what the load did (here its read), not ``host``; also when the
        blocked thread is slow to wake (simulated: 20 ms before it waits, 5 ms after)."""
        from moestream.pipeline.streaming.loads import ThreadWaiter

        real = ThreadWaiter.wait

        def slow_wake(waiter: ThreadWaiter) -> None:
            time.sleep(0.020)
            real(waiter)
            time.sleep(0.005)

        monkeypatch.setattr(ThreadWaiter, "wait", slow_wake)
        tuning = moestream.Tuning(faults="slow_ms=30@1+")  # every read takes 30 ms
        with _sync(tiny_model, budget="16", verify=False, tuning=tuning) as ms:
            for token in range(2):
                blocked = computing = 0.0
                for layer in ms.model.moe_layers:
                    experts = [(token * 4 + i) % ms.model.n_experts for i in range(4)]
                    with ms.fetch(layer, experts) as lease:
                        while True:
                            t0 = time.perf_counter()
                            h = next(lease, None)
                            t1 = time.perf_counter()
                            blocked += t1 - t0
                            if h is None:
                                break
                            h.down.array.astype(np.float32).sum()  # the engine's compute
                            computing += time.perf_counter() - t1
                stats = ms.end_token(compute_ms=computing * 1000.0)
                blocked_ms = blocked * 1000.0
                assert stats.misses == 4 * len(ms.model.moe_layers)
                assert stats.stall_ms >= 0.8 * blocked_ms, (stats, blocked_ms)
                t = stats.time
                assert t["read_ms"] + t["upload_ms"] + t["slot_ms"] >= 0.5 * blocked_ms, t
                assert t["host_ms"] <= 0.4 * blocked_ms, t
                assert stats.stall_ms + stats.compute_ms <= stats.wall_ms + 0.01

    async def test_an_async_engines_wait_for_a_load_is_a_stall(self, tiny_model: Path) -> None:
        """Bug 3, the async face, as the sync test above: its waits are its own."""
        tuning = moestream.Tuning(faults="slow_ms=30@1+")
        async with _open(tiny_model, budget="16", verify=False, tuning=tuning) as ms:
            for token in range(2):
                blocked = computing = 0.0
                for layer in ms.model.moe_layers:
                    experts = [(token * 4 + i) % ms.model.n_experts for i in range(4)]
                    async with ms.fetch(layer, experts) as lease:
                        while True:
                            t0 = time.perf_counter()
                            h = await anext(lease, None)
                            t1 = time.perf_counter()
                            blocked += t1 - t0
                            if h is None:
                                break
                            h.down.array.astype(np.float32).sum()
                            computing += time.perf_counter() - t1
                stats = await ms.end_token(compute_ms=computing * 1000.0)
                blocked_ms = blocked * 1000.0
                assert stats.stall_ms >= 0.8 * blocked_ms, (stats, blocked_ms)
                t = stats.time
                assert t["read_ms"] + t["upload_ms"] + t["slot_ms"] >= 0.5 * blocked_ms, t
                assert t["host_ms"] <= 0.4 * blocked_ms, t

    async def test_engine_compute_checked_and_bounded(self, tiny_model: Path) -> None:
        async with _open(tiny_model) as ms:
            for bad in (-5, float("nan"), float("inf")):
                with pytest.raises(moestream.UsageError, match="compute_ms") as caught:
                    await ms.end_token(compute_ms=bad)
                assert isinstance(caught.value, ValueError)
            with pytest.raises(TypeError, match="compute_ms"):
                await ms.end_token(compute_ms="5")  # type: ignore[arg-type]
            with pytest.raises(moestream.UsageError, match="2 figures for 1 devices"):
                await ms.end_token(compute_ms=[1.0, 2.0])
            with pytest.raises(moestream.UsageError, match="upload_ms"):
                await ms.end_token(upload_ms=-1.0)
            async with ms.fetch(ms.model.moe_layers[0], [0]) as lease:
                await lease.gather()
            stats = await ms.end_token(compute_ms=1e9)
            assert stats.compute_ms <= stats.wall_ms
            assert sum(stats.time.values()) == pytest.approx(stats.wall_ms, abs=0.01)
            stats = await ms.end_token(compute_ms=[0.0])  # one figure for one device
            assert stats.compute_ms == 0.0

    async def test_engine_wall_time_of_a_token_told_late(self, tiny_model: Path,
                                                         tmp_path: Path) -> None:
        """A token told of after it ran (its uses counted at its end) gives its own wall
        time: the line's wall time and its split are that, the engine's compute within it;
        a bad figure is refused in one line, as compute_ms is."""
        log = tmp_path / "late.jsonl"
        async with _open(tiny_model, log=log) as ms:
            for bad in (-1.0, float("nan")):
                with pytest.raises(moestream.UsageError, match="wall_ms"):
                    await ms.end_token(wall_ms=bad)
            with pytest.raises(TypeError, match="wall_ms"):
                await ms.end_token(wall_ms="5")  # type: ignore[arg-type]
            async with ms.fetch(ms.model.moe_layers[0], [0]) as lease:
                await lease.gather()
            # a wall time no read of the fetch's can fill: the compute fits beside them
            stats = await ms.end_token(compute_ms=9.0, wall_ms=5000.0)
            assert stats.wall_ms == 5000.0 and stats.compute_ms == 9.0
            assert sum(stats.time.values()) == pytest.approx(5000.0, abs=0.01)
            assert stats.time["compute_ms"] == 9.0 and stats.time["host_ms"] > 0
        lines = [json.loads(line) for line in log.read_text().splitlines()]
        told = [line for line in lines if line.get("event") == "token"][-1]
        assert told["wall_ms"] == 5000.0 and told["compute_ms"] == 9.0

    async def test_hint_for_the_next_tokens_first_layer(self, tiny_model: Path,
                                                        tmp_path: Path) -> None:
        log = tmp_path / "hint.jsonl"
        async with _open(tiny_model, log=log) as ms:
            first = ms.model.moe_layers[0]
            async with ms.fetch(first, [0, 1, 2, 3]) as lease:
                await lease.gather()
            assert ms.prefetch(first, [8, 9, 10, 11]) == 4  # the next token's guess
            await ms.end_token()
            await _landed(ms)
            async with ms.fetch(first, [8, 9, 10, 11]) as lease:
                assert lease.hits == 4
                await lease.gather()
            await ms.end_token()
        tokens = [json.loads(line) for line in log.read_text().splitlines()
                  if json.loads(line).get("event") == "token"]
        assert tokens[1]["prefetch"]["correct"] == 4
        assert tokens[1]["prefetch"]["wasted_bytes"] == 0
        assert tokens[0]["prefetch"]["wasted_bytes"] == 0


class TestArguments:
    """Ids, budgets, devices and settings: checked at the boundary, in the API's words
    (bugs 4, 6, 7 and the attacks)."""

    async def test_numpy_ids_are_ints(self, tiny_model: Path) -> None:
        async with _open(tiny_model) as ms:
            layer = ms.model.moe_layers[0]
            async with ms.fetch(np.int64(layer), [np.int64(1), np.int32(2)]) as lease:
                handles = await lease.gather()
            assert [type(x) for h in handles for x in h.key] == [int] * 4
            assert lease.layer == layer and type(lease.layer) is int
            async with ms.fetch(layer, np.array([3, 4])) as lease:
                assert [h.expert for h in await lease.gather()] == [3, 4]
            async with ms.fetch(layer, (5,)) as lease:
                assert (await lease.gather())[0].key == (layer, 5)

    @pytest.mark.parametrize("experts", [[0.9, 1.9], [2.0], [True], "0123", {1, 2},
                                         [None], [complex(1, 0)], [float("nan")],
                                         np.array([1.0, 2.0])], ids=repr)
    async def test_non_integer_experts_refused(self, tiny_model: Path, experts: Any) -> None:
        async with _open(tiny_model) as ms:
            with pytest.raises(moestream.UsageError) as caught:
                ms.fetch(ms.model.moe_layers[0], experts)
            assert isinstance(caught.value, TypeError)
            with pytest.raises(TypeError):
                ms.ready(ms.model.moe_layers[0], experts)
            assert ms.counters().open_leases == 0

    async def test_a_generator_is_refused(self, tiny_model: Path) -> None:
        async with _open(tiny_model) as ms:
            with pytest.raises(moestream.UsageTypeError):
                ms.fetch(ms.model.moe_layers[0], (e for e in [1, 2]))  # type: ignore[arg-type]

    @pytest.mark.parametrize("layer", [2.0, True, "2", None])
    async def test_non_integer_layer_refused(self, tiny_model: Path, layer: Any) -> None:
        async with _open(tiny_model) as ms:
            with pytest.raises(moestream.UsageTypeError, match="layer"):
                ms.fetch(layer, [3])
            with pytest.raises(moestream.UsageTypeError, match="layer"):
                ms.prefetch(layer, [3])

    def test_int_budget_is_experts(self, tiny_model: Path) -> None:
        with _sync(tiny_model, budget=40) as a, _sync(tiny_model, budget="40") as b:
            assert a.counters().budget_bytes == b.counters().budget_bytes > 0

    @pytest.mark.parametrize("budget", [True, 2.5, -1, 0, "0", [16]])
    def test_bad_budgets_fail_at_once(self, tiny_model: Path, budget: Any) -> None:
        with pytest.raises(moestream.UsageError, match="budget"):
            moestream.open(tiny_model, budget=budget)  # no await: refused at once
        with pytest.raises(moestream.UsageError, match="budget"):
            moestream.open_sync(tiny_model, budget=budget)

    def test_budget_message_in_experts(self, tiny_model: Path) -> None:
        with pytest.raises(moestream.UsageError, match=r"\(8 experts, .*at least 8 experts"):
            _sync(tiny_model, budget="7")

    @pytest.mark.parametrize(("kwargs", "words"), [
        ({"devices": -1}, "device indices are >= 0"),
        ({"devices": "0"}, "devices must be a device index"),
        ({"devices": [0, 0]}, "names a device twice"),
        ({"devices": []}, "at least one device"),
        ({"mode": "Resident"}, "mode must be one of"),
        ({"policy": "LRU"}, "policy must be one of"),
        ({"backend": "gpu"}, "backend must be one of"),
        ({"verify": "yes"}, "verify must be True or False"),
        ({"model": 3}, "model must be a path"),
    ], ids=str)
    def test_bad_values_in_the_apis_words(self, tiny_model: Path, kwargs: dict[str, Any],
                                         words: str) -> None:
        kwargs = {"model": tiny_model, **kwargs}
        with pytest.raises(moestream.UsageError, match=words) as caught:
            moestream.open_sync(**kwargs)
        assert "--" not in str(caught.value)

    def test_tuning_checked(self) -> None:
        with pytest.raises(moestream.UsageError, match=r"Tuning\.layers_in_flight"):
            moestream.Tuning(layers_in_flight=0)
        with pytest.raises(moestream.UsageError, match=r"Tuning\.chunk_bytes"):
            moestream.Tuning(chunk_bytes=1000)


class TestConventions:
    """The conventions of a Python library (issue 25, what to build 3)."""

    def test_errors_are_builtins_too(self) -> None:
        assert issubclass(moestream.UsageError, ValueError)
        assert issubclass(moestream.UsageTypeError, TypeError)
        assert issubclass(moestream.UsageTypeError, moestream.UsageError)
        assert issubclass(moestream.ReadError, OSError)
        assert str(moestream.ReadError("x: short read")) == "x: short read"

    def test_version(self) -> None:
        assert isinstance(moestream.__version__, str) and moestream.__version__[0].isdigit()

    def test_public_face_is_the_documented_one(self, tiny_model: Path) -> None:
        """Sessions and leases expose what docs/API.md's reference lists, no internals
        (``table``, ``backends``, ``core``)."""
        session = {"model", "backend", "devices", "mode", "closed", "fetch", "prefetch",
                   "ready", "end_token", "counters", "router", "read_tensor",
                   "read_header"}
        lease = {"layer", "experts", "hits", "misses", "released", "remaining", "available",
                 "gather", "release"}
        with _sync(tiny_model) as ms, ms.fetch(ms.model.moe_layers[0], [0]) as held:
            faces: list[tuple[object, set[str]]] = [
                (ms, session | {"close", "used", "in_place", "in_place_current", "used_in_place"}),
                (ms._session, session | {"aclose"}),
                (held, lease), (moestream.Lease, lease)]
            for face, documented in faces:
                public = {n for n in dir(face) if not n.startswith("_")}
                assert public == documented, face

    def test_read_header_is_the_identified_files(self, tiny_model: Path,
                                                 tmp_path: Path) -> None:
        """``read_header``: the GGUF header (every byte before the tensor data) of the file
        the session identified, and its size; a file renamed over the path after the open is
        refused, never read."""
        import gguf

        path = tmp_path / "model.gguf"
        shutil.copyfile(tiny_model, path)
        data = path.read_bytes()
        with _sync(path) as ms:
            header = ms.read_header()
            assert bytes(header) == data[:gguf.GGUFReader(path).data_offset]
            assert ms.model.file_bytes == len(data)
            staged = tmp_path / "other.gguf"
            staged.write_bytes(data)
            staged.replace(path)
            with pytest.raises(moestream.ModelChangedError, match=r"model\.gguf"):
                ms.read_header()

    def test_host_views_convert(self, tiny_model: Path) -> None:
        with _sync(tiny_model) as ms, ms.fetch(ms.model.moe_layers[0], [0]) as lease:
            (h,) = lease.gather()
            view = np.asarray(h.gate)
            assert view.dtype == np.float16 and view.shape == h.gate.shape
            assert view.ctypes.data == h.gate.ptr and not view.flags.writeable
            assert np.asarray(h.gate, dtype=np.float32).dtype == np.float32
            legacy = np.from_dlpack(_Legacy(h.gate))  # a consumer without max_version
            assert legacy.ctypes.data == h.gate.ptr
            assert h.gate.__dlpack__(stream=-1) is not None
            assert h.gate.__dlpack__() is not None
            assert np.from_dlpack(h.down).ctypes.data == h.down.ptr
            with pytest.raises(BufferError):
                h.gate.__dlpack__(stream=7)
            assert not hasattr(h.gate, "__cuda_array_interface__")

    def test_torch_imports_host_views(self, tiny_model: Path) -> None:
        torch = pytest.importorskip("torch")
        with _sync(tiny_model) as ms, ms.fetch(ms.model.moe_layers[0], [0]) as lease:
            (h,) = lease.gather()
            t = torch.from_dlpack(h.up)
            assert t.data_ptr() == h.up.ptr and tuple(t.shape) == h.up.shape

    def test_library_prints_nothing(self, tiny_model: Path, tmp_path: Path) -> None:
        script = (
            "import moestream\n"
            f"with moestream.open_sync({str(tiny_model)!r}, backend='host', mode='auto',\n"
            "                          budget='1000000GiB') as ms:\n"  # clamped: a warning
            "    with ms.fetch(ms.model.moe_layers[0], [0, 1]) as lease:\n"
            "        lease.gather()\n"
            "    ms.end_token()\n"
        )
        quiet = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                               text=True, timeout=120)
        assert quiet.returncode == 0, quiet.stderr
        assert quiet.stdout == "" and quiet.stderr == ""
        told = subprocess.run(
            [sys.executable, "-c", "import logging; logging.basicConfig(level=logging.INFO)\n"
             + script], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert told.returncode == 0 and told.stdout == ""
        assert "budget_clamped" in told.stderr

    def test_an_applications_structlog_wins(self, tiny_model: Path) -> None:
        import structlog

        with structlog.testing.capture_logs() as events, _sync(tiny_model, budget="1000000GiB"):
            pass
        assert any(e["event"] == "budget_clamped" for e in events)


class _Legacy:
    """A DLPack consumer from before ``max_version`` (it passes only ``stream``)."""

    def __init__(self, matrix: moestream.Matrix) -> None:
        self._matrix = matrix

    def __dlpack__(self, stream: Any = None) -> Any:
        return self._matrix.__dlpack__(stream=stream)

    def __dlpack_device__(self) -> Any:
        return self._matrix.__dlpack_device__()


class TestDroppedLeases:
    """A lease dropped unreleased is released, with a ResourceWarning (bug 9); a fetch that
    cannot fit names who holds the pins; an interrupted fetch keeps nothing (attack)."""

    async def test_dropped_lease_is_released(self, tiny_model: Path) -> None:
        async with _open(tiny_model, budget="16") as ms:
            first = ms.model.moe_layers[0]
            for token in range(10):
                for layer in ms.model.moe_layers:
                    async with ms.fetch(layer, [(token + i) % 16 for i in range(4)]) as lease:
                        await lease.gather()
                with pytest.warns(ResourceWarning, match="dropped without release"):
                    ms.fetch(first, [(token + 8 + i) % 16 for i in range(4)])  # abandoned
                    gc.collect()
                await ms.end_token()
                await _landed(ms)
            assert ms.counters().open_leases == 0

    def test_dropped_lease_on_the_sync_face(self, tiny_model: Path) -> None:
        with _sync(tiny_model, budget="16") as ms:
            first = ms.model.moe_layers[0]
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for token in range(10):
                    for layer in ms.model.moe_layers:
                        with ms.fetch(layer, [(token + i) % 16 for i in range(4)]) as lease:
                            lease.gather()
                    speculative = ms.fetch(first, [(token + 8 + i) % 16 for i in range(4)])
                    speculative.gather()
                    del speculative  # abandoned, never released
                    ms.end_token()
            assert sum(issubclass(w.category, ResourceWarning) for w in caught) == 10
            assert ms.counters().open_leases == 0

    @pytest.mark.parametrize("told_at", ["end_token", "counters"])
    def test_a_drop_whose_finalizer_was_cut_short_is_released(
            self, tiny_model: Path, monkeypatch: pytest.MonkeyPatch, told_at: str) -> None:
        """A signal handler that raises can land on a finalizer's first line, and Python
        then drops what the finalizer had to do (here: its whole body): the lease is still
        released, warned of, at the token's end or the next counters read."""
        with _sync(tiny_model, budget="16") as ms:
            layer = ms.model.moe_layers[0]
            monkeypatch.setattr(LeaseShared, "__del__", lambda self: None)
            lease = ms.fetch(layer, [0, 1, 2, 3])
            lease.gather()
            del lease  # abandoned, and its finalizer told nobody
            gc.collect()
            monkeypatch.undo()
            with pytest.warns(ResourceWarning, match="dropped without release"):
                if told_at == "end_token":
                    ms.end_token()
                assert ms.counters().open_leases == 0
            with ms.fetch(layer, [0, 1, 2, 3]) as again:  # its pins are free again
                again.gather()

    async def test_a_fetch_that_cannot_fit_names_the_holders(self, tiny_model: Path) -> None:
        async with _open(tiny_model, budget="8") as ms:
            first, second, third = ms.model.moe_layers
            held = [ms.fetch(first, [0, 1, 2, 3]), ms.fetch(second, [0, 1, 2, 3])]
            with pytest.raises(moestream.UsageError, match=(
                    rf"pins held by 2 leases: layer {first} experts \[0, 1, 2, 3\] "
                    r"\(fetched in token 0, never used\)")):
                ms.fetch(third, [0, 1, 2, 3])
            for lease in held:
                lease.release()
            await _landed(ms)  # a miss still loading keeps its pin until it lands
            async with ms.fetch(third, [0, 1, 2, 3]) as lease:
                await lease.gather()

    def test_interrupt_after_the_pins_releases_them(self, tiny_model: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
        with _sync(tiny_model, budget="8") as ms:
            core = ms._session._streaming
            real = core.fetch

            def interrupted(*args: Any) -> Any:
                real(*args)
                raise KeyboardInterrupt  # a signal just after the lease was made

            layer = ms.model.moe_layers[0]
            monkeypatch.setattr(core, "fetch", interrupted)
            for _ in range(5):
                with pytest.raises(KeyboardInterrupt):
                    ms.fetch(layer, [0, 1, 2, 3])
            monkeypatch.setattr(moestream.SyncLease, "__init__", _interrupt)
            monkeypatch.setattr(core, "fetch", real)
            for _ in range(5):
                with pytest.raises(KeyboardInterrupt):
                    ms.fetch(layer, [0, 1, 2, 3])
            monkeypatch.undo()
            assert ms.counters().open_leases == 0
            assert ms.counters().live_bytes >= 0
            for other in ms.model.moe_layers:
                with ms.fetch(other, [4, 5, 6, 7]) as lease:
                    lease.gather()

    def test_interrupt_in_a_with_exit_leaves_the_lease_to_its_drop(
            self, tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """Python checks for signals at every function entry, so an interrupt can land in
        a ``with`` block's ``__exit__`` before the release: the lease stays held while the
        ``as`` name refers to it, and is released (warned) once dropped, at the next call."""
        with _sync(tiny_model, budget="16") as ms:
            layer = ms.model.moe_layers[0]
            monkeypatch.setattr(moestream.SyncLease, "release", _interrupt)
            with pytest.raises(KeyboardInterrupt), ms.fetch(layer, [0, 1, 2, 3]) as lease:
                lease.gather()
            monkeypatch.undo()
            assert ms.counters().open_leases == 1  # still referenced: held
            with pytest.warns(ResourceWarning, match="dropped without release"):
                del lease
                gc.collect()
            assert ms.counters().open_leases == 0  # this call released it
            with ms.fetch(layer, [0, 1, 2, 3]) as again:
                again.gather()

    def test_timer_interrupts_never_leak(self, tiny_model: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
        armed = [False]  # interrupts land only in the engine's calls, once per arming
        # an interrupt that lands in a finalizer is reported and dropped, as Python's own
        # hook does: pytest's keeps the exception, whose traceback then holds the
        # finalizer's object (a lease's face) alive past the test's checks
        monkeypatch.setattr(sys, "unraisablehook", lambda hook: None)

        def interrupt(signum: int, frame: Any) -> None:
            if armed[0]:
                armed[0] = False
                raise KeyboardInterrupt

        previous = signal.signal(signal.SIGALRM, interrupt)  # before the session opens
        with _sync(tiny_model) as ms:
            layers = ms.model.moe_layers
            signal.setitimer(signal.ITIMER_REAL, 0.0003, 0.0003)
            failures = interrupts = 0
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", ResourceWarning)
                    warnings.simplefilter("ignore", RuntimeWarning)  # a coroutine never run
                    for i in range(3000):
                        try:
                            armed[0] = True
                            with ms.fetch(layers[i % 3], [i % 16, (i + 1) % 16]) as lease:
                                lease.gather()
                            armed[0] = False
                        except KeyboardInterrupt:
                            interrupts += 1
                        except moestream.UsageError:
                            failures += 1
            finally:
                armed[0] = False
                signal.setitimer(signal.ITIMER_REAL, 0, 0)
                signal.signal(signal.SIGALRM, previous)
            # an interrupt in the last ``__exit__`` before its release left that lease
            # held by the ``as`` name: dropped here, it goes the dropped-lease path
            lease = None
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ResourceWarning)
                gc.collect()
            assert interrupts > 10
            assert failures == 0
            assert ms.counters().open_leases == 0
            for _ in range(200):  # loads a cancelled fetch left in flight keep pins until landed
                pins = {e.key: e.pins for c in ms._session._streaming.caches for e in c.entries()
                        if e.pins}
                if not pins:
                    break
                time.sleep(0.01)
            assert pins == {}
            with ms.fetch(layers[0], [0, 1, 2, 3]) as lease:
                lease.gather()


def _interrupt(self: Any, *args: Any, **kwargs: Any) -> None:
    raise KeyboardInterrupt


class TestUnverifiedAtClose:
    """Issue 27 item 3: a session never closes clean with experts never verified."""

    @pytest.fixture()
    def bare_model(self, tmp_path: Path) -> Path:
        """A tiny model without recorded digests (its manifest is built while running)."""
        path = tmp_path / "bare.gguf"
        return write_model(spec_for("tiny", layers=4, experts=16), path, record_digests=False)

    @pytest.mark.parametrize("mode", ["direct", "resident"])
    async def test_failed_manifest_build_surfaces(self, bare_model: Path, mode: str) -> None:
        ms = await _open(bare_model, mode=mode, verify=True)
        builder = ms._streaming.manifest.builder if ms._streaming.manifest is not None else None
        assert builder is not None
        builder.pause()  # the build has not reached these experts yet
        layer = ms.model.moe_layers[0]
        async with ms.fetch(layer, [0, 1, 2, 3]) as lease:
            await lease.gather()
        builder.error = moestream.ModelChangedError(bare_model, "modified in place")
        with pytest.raises(moestream.ModelChangedError, match="never be computed"):
            await ms.end_token()
        try:
            await ms.aclose()
        except (moestream.ModelChangedError, moestream.VerificationError):
            pass
        else:  # clean only if everything consumed was compared after all (built before)
            assert ms.counters().unverified == 0
        assert ms.closed

    @pytest.mark.parametrize("mode", ["direct", "resident"])
    async def test_file_written_in_place_while_leased(self, bare_model: Path, tmp_path: Path,
                                                      mode: str) -> None:
        copy = tmp_path / f"{mode}.gguf"
        shutil.copyfile(bare_model, copy)
        table_errors = (moestream.ModelChangedError, moestream.VerificationError,
                        moestream.StageError)
        raised: list[BaseException] = []
        ms = await _open(copy, mode=mode, verify=True)
        try:
            layer = ms.model.moe_layers[0]
            async with ms.fetch(layer, [0, 1, 2, 3]) as lease:
                await lease.gather()
                with copy.open("r+b") as f:  # the file written in place, same size
                    f.seek(copy.stat().st_size // 2)
                    f.write(b"\xff" * 65536)
            for token in range(4):
                try:
                    for other in ms.model.moe_layers:
                        async with ms.fetch(other, [4 + token, 8 + token]) as lease:
                            await lease.gather()
                    await ms.end_token()
                except table_errors as exc:
                    raised.append(exc)
        finally:
            try:
                await ms.aclose()
            except table_errors as exc:
                raised.append(exc)
        c = ms.counters()
        assert raised or (c.unverified == 0 and c.mismatches == 0), (raised, c)
        assert c.unverified == 0 or any(
            isinstance(e, (moestream.ModelChangedError, moestream.VerificationError))
            for e in raised)


class TestThreads:
    """Which calls may come from which threads (docs/API.md, the table)."""

    def test_sync_calls_from_a_thread_pool(self, tiny_model: Path,
                                           tiny_table: ExpertTable) -> None:
        from concurrent.futures import ThreadPoolExecutor

        with _sync(tiny_model) as ms:
            layers = ms.model.moe_layers

            def work(i: int) -> int:
                with ms.fetch(layers[i % 3], [i % 16, (i + 5) % 16]) as lease:
                    got = lease.gather()
                    ms.ready(layers[i % 3], [i % 16])
                    ms.counters()
                    return sum(h.down.nbytes for h in got)

            with ThreadPoolExecutor(4) as pool:
                sizes = list(pool.map(work, range(200)))
            assert all(s > 0 for s in sizes)
            ms.end_token()
            assert ms.counters().open_leases == 0

    def test_the_sync_face_refuses_its_own_loop_thread(self, tiny_model: Path) -> None:
        with _sync(tiny_model) as ms:
            loop = ms._thread.loop
            done = asyncio.run_coroutine_threadsafe(_call_on_loop(ms), loop)
            with pytest.raises(moestream.UsageError, match="own loop"):
                done.result(timeout=10)


async def _call_on_loop(ms: moestream.SyncSession) -> None:
    ms.fetch(ms.model.moe_layers[0], [0])
