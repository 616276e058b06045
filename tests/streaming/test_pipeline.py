"""The streaming pipeline end to end: ordering contracts, verification, modes, prefetch.

``DeferredBackend`` makes host copies and kernels really asynchronous: a copy reads its
source only when its stream runs, which happens when an event on it is synchronized. A
staging slot reused before its upload ran, or compute that did not wait for an upload,
then consumes wrong bytes, and verification counts mismatches.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from moestream.gpu.host import HostBackend
from moestream.gpu.kernels import HostKernels
from moestream.pipeline.cli.run import RunSummary, run
from moestream.pipeline.foundation.config import Budget, ComputeSpec
from moestream.pipeline.foundation.errors import VerificationError
from moestream.pipeline.proxy.config import RunConfig
from moestream.pipeline.proxy.loop import DecodeLoop
from moestream.stages.staging import StagingSlot
from tests.gguf_files import write_plain_moe


class DeferredStream:
    """Work queued here runs only when an event on it (or the stream) is synchronized."""

    def __init__(self) -> None:
        self._ops: list[Callable[[], None]] = []
        self._ran = 0
        self._lock = threading.RLock()

    def enqueue(self, op: Callable[[], None]) -> None:
        with self._lock:
            self._ops.append(op)

    def run_until(self, upto: int) -> None:
        with self._lock:
            while self._ran < upto:
                op = self._ops[self._ran]
                self._ran += 1
                op()

    def wait(self, event: Any) -> None:
        self.enqueue(event.synchronize)

    def record(self) -> DeferredEvent:
        with self._lock:
            return DeferredEvent(self, len(self._ops))

    def synchronize(self) -> None:
        with self._lock:
            self.run_until(len(self._ops))


class DeferredEvent:
    def __init__(self, stream: DeferredStream, upto: int) -> None:
        self._stream = stream
        self._upto = upto

    def done(self) -> bool:
        return self._stream._ran >= self._upto

    def synchronize(self) -> None:
        self._stream.run_until(self._upto)


class DeferredBackend(HostBackend):
    """Host memory, but copies read their source when their stream runs."""

    async_copies = False

    def new_stream(self) -> DeferredStream:  # type: ignore[override]
        return DeferredStream()

    def copy_h2d(self, dst: Any, dst_offset: int, src: Any, stream: Any) -> None:
        def op() -> None:
            dst.array[dst_offset : dst_offset + src.size] = src

        stream.enqueue(op)

    def copy_h2d_batch(self, copies: Any, stream: Any) -> None:
        stream.enqueue(lambda: HostBackend.copy_h2d_batch(self, copies, stream))


class DeferredKernels(HostKernels):
    """Digests and busy work run in stream order too."""

    def digest3(self, buf: Any, ranges: Any, results: Any, row: int, stream: Any) -> None:
        stream.enqueue(lambda: super(DeferredKernels, self).digest3(buf, ranges, results, row,
                                                                     stream))

    def digest_views(self, views: Any, results: Any, row: int, stream: Any) -> None:
        stream.enqueue(lambda: super(DeferredKernels, self).digest_views(views, results, row,
                                                                          stream))

    def busy(self, ms: float, data: Any, stream: Any) -> None:
        stream.enqueue(lambda: None)

    def gather(self, copies: Any, stream: Any) -> None:
        rows = copies.copy()  # the caller's array may be reused before the stream runs
        stream.enqueue(lambda: super(DeferredKernels, self).gather(rows, stream))


def _decode(cfg: RunConfig, monkeypatch: pytest.MonkeyPatch, tokens: int) -> RunSummary:
    """``pipeline.cli.run`` in direct mode on the deferred backend and kernels (the session's
    streamer and the proxy engine's compute alike), every token verified; a mismatch
    stops the run, and the summary says what was found."""
    import moestream.pipeline.proxy.decode as decode_module
    import moestream.pipeline.streaming.session as session_module

    monkeypatch.setattr(session_module, "open_backends", lambda cfg: [DeferredBackend()])
    monkeypatch.setattr(session_module, "make_kernels", lambda name, *_: DeferredKernels())
    monkeypatch.setattr(decode_module, "make_kernels", lambda name, *_: DeferredKernels())
    summary = RunSummary()
    with contextlib.suppress(VerificationError):
        asyncio.run(run(replace(cfg, tokens=tokens, mode="direct", backend="host"),
                        summary=summary))
    return summary


class TestOrdering:
    """No use before the upload event; no staging slot reused before its upload ran."""

    def _cfg(self, model: Path, compute: str) -> RunConfig:
        from moestream.pipeline.foundation.config import Budget

        return RunConfig(model=model, staging_slots=1, queue_depth=4, chunk_bytes=16384,
                         budget=Budget(experts=12), compute=ComputeSpec(compute))  # type: ignore[arg-type]

    @pytest.mark.parametrize("compute", ["digest", "fixed"])
    def test_deferred_copies_verify(self, tiny_model: Path, compute: str,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
        summary = _decode(self._cfg(tiny_model, compute), monkeypatch, 6)
        assert summary.mismatches == 0 and summary.exit == "ok"
        assert summary.verified > 0

    def test_reusing_a_busy_slot_is_caught(self, tiny_model: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
        """Negative control: without the wait on the slot's event, bytes get mixed up."""
        monkeypatch.setattr(StagingSlot, "wait_reusable", lambda self: None)
        summary = _decode(self._cfg(tiny_model, "fixed"), monkeypatch, 3)
        assert summary.mismatches > 0


class TestPlanAhead:
    """With trace routing, a layer whose experts are all cached and ready is leased while the
    layer before it computes (``DecodeLoop._meanwhile``, ``Session.ready``), across token
    boundaries too, its handles taken then within a token; nothing else changes."""

    @staticmethod
    def _run(model: Path, monkeypatch: pytest.MonkeyPatch, *, ahead: bool
             ) -> tuple[RunSummary, list[bool]]:
        planned: list[bool] = []
        original = DecodeLoop._meanwhile

        def spy(self: DecodeLoop, position: int) -> None:
            before = position in self._fetched
            if ahead:
                original(self, position)
            now = position in self._fetched
            first = position % len(self._layers) == 0  # a token's first layer: not taken yet
            assert not now or first or position in self._taken
            planned.append(not before and now)

        monkeypatch.setattr(DecodeLoop, "_meanwhile", spy)
        cfg = RunConfig(model=model, tokens=24, mode="resident", backend="host",
                        compute=ComputeSpec("fixed", 0.0), budget=Budget(experts=40))
        return asyncio.run(run(cfg)), planned

    def test_only_all_ready_layers_and_same_figures(self, tiny_model: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
        ahead, planned = self._run(tiny_model, monkeypatch, ahead=True)
        inline, _ = self._run(tiny_model, monkeypatch, ahead=False)
        assert any(planned), "warm layers are planned during the layer before"
        assert not all(planned), "layers with misses wait for their turn"
        for name in ("hits", "misses", "evictions", "verified", "mismatches"):
            assert getattr(ahead, name) == getattr(inline, name), name
        assert ahead.verified > 0 and ahead.mismatches == 0


def _save_pretrained_moe(path: Path) -> Path:
    """A Qwen3-MoE checkpoint as transformers writes it (sharded safetensors, bf16)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        hidden_size=64, num_hidden_layers=3, vocab_size=128, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, num_experts_per_tok=2, intermediate_size=96,
        moe_intermediate_size=48, num_experts=8)
    model = transformers.Qwen3MoeForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path, max_shard_size="40KB")
    return path


def _registering_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs and sessions get a GPU-like device that registers host memory (the resident
    copies from the mapping, gather or copy engines) and runs copies and kernels in stream
    order."""
    import moestream.pipeline.proxy.decode as decode_module
    import moestream.pipeline.streaming.session as session_module

    backend = type("RegisteringBackend", (DeferredBackend,), {
        "async_copies": True, "registers_host": True,
        "register_host": lambda self, array: True, "unregister_host": lambda self, a: None})
    monkeypatch.setattr(session_module, "open_backends", lambda cfg: [backend()])
    monkeypatch.setattr(session_module, "make_kernels", lambda name, *_: DeferredKernels())
    monkeypatch.setattr(decode_module, "make_kernels", lambda name, *_: DeferredKernels())


def _counted(monkeypatch: pytest.MonkeyPatch, cls: type, name: str) -> list[int]:
    """Count the calls of ``cls.name`` (the returned list's one item), still made."""
    calls = [0]
    method = getattr(cls, name)

    def spy(self: Any, *args: Any) -> Any:
        calls[0] += 1
        return method(self, *args)

    monkeypatch.setattr(cls, name, spy)
    return calls


class TestRegisteredCopies:
    """Resident misses from the registered mapping on a GPU-like device, both paths (the
    gather; verified copy engines: a layer on one stream, one digest launch, one event) on
    files this project did not write, without recorded digests (the run builds the
    manifest): every expert verified, the same counts either way."""

    @pytest.mark.parametrize("kind", ["gguf-writer", "save-pretrained"])
    def test_both_paths_verify(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                               kind: str) -> None:
        from moestream.stages.upload import Uploader

        model = (write_plain_moe(tmp_path / "plain.gguf") if kind == "gguf-writer"
                 else _save_pretrained_moe(tmp_path / "hf"))
        _registering_device(monkeypatch)
        digested = _counted(monkeypatch, Uploader, "upload_layer")
        summaries = {}
        for gather in (True, False):
            cfg = RunConfig(model=model, tokens=12, mode="resident", backend="host",
                            compute=ComputeSpec("fixed", 0.1), budget=Budget(experts=10),
                            gather=gather)
            summaries[gather] = asyncio.run(run(cfg))
            assert (digested[0] > 0) == (not gather)
        for summary in summaries.values():
            assert summary.mismatches == 0 and summary.verified == summary.misses > 0
        assert summaries[True].misses == summaries[False].misses


class TestGatheredLayerWithAFailure:
    """A layer gathered in one launch lands at once, through one delivery: with an upload
    failing in its middle, an engine's ``available()`` hands out the experts before the
    failed one, iterating raises the failure (naming the expert), then goes on with the
    rest; the failed expert leaves the cache, the others stay, no pin is left."""

    async def test_before_the_failure_then_the_rest(self, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
        import moestream
        from moestream.stages.upload import Uploader

        model = write_plain_moe(tmp_path / "plain.gguf")
        _registering_device(monkeypatch)
        launches = _counted(monkeypatch, Uploader, "gather")
        tuning = moestream.Tuning(faults="upload@2")
        async with moestream.open(model, backend="host", mode="resident",
                                  tuning=tuning) as ms:
            layer = ms.model.moe_layers[0]
            async with ms.fetch(layer, [0, 1, 2, 3]) as lease:
                await asyncio.sleep(0)  # the layer's one delivery
                assert launches == [1]
                assert [h.expert for h in lease.available()] == [0]
                with pytest.raises(moestream.UploadError, match=f"layer {layer} expert 1"):
                    await lease.__anext__()
                assert [h.expert for h in lease.available()] == [2, 3]
                assert lease.remaining == 0
            assert ms.ready(layer, [0, 2, 3]) and not ms.ready(layer, [1])
            assert not any(e.pins for c in ms._streaming.caches for e in c.entries())


class TestEndBeside:
    """With trace routing, a token whose last layer loaded nothing and whose next token's
    first layer is leased already ends while the devices compute that last layer
    (``DecodeLoop._end_beside``), and a planned layer's compute is queued right after the
    wait for the one before (``DecodeLoop._launch``): the same figures and log lines as
    without either, the last layer's time counted in the next token."""

    @staticmethod
    def _run(model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, beside: bool,
             mode: str = "resident") -> tuple[RunSummary, list[dict[str, Any]], int]:
        import moestream.pipeline.proxy.decode as decode_module
        import moestream.pipeline.streaming.session as session_module

        # a device that computes after the host queued the work, as a GPU does
        backend = type("QueuingBackend", (DeferredBackend,), {"async_copies": True})
        monkeypatch.setattr(session_module, "open_backends", lambda cfg: [backend()])
        monkeypatch.setattr(session_module, "make_kernels", lambda name, *_: DeferredKernels())
        monkeypatch.setattr(decode_module, "make_kernels", lambda name, *_: DeferredKernels())
        original = DecodeLoop._end_beside
        early = 0

        async def spy(self: DecodeLoop, position: int, last: Any, work: Any) -> None:
            nonlocal early
            if not beside:
                self._meanwhile(position)
                return
            await original(self, position, last, work)
            early += self._ended is not None

        monkeypatch.setattr(DecodeLoop, "_end_beside", spy)
        launch = DecodeLoop._launch
        launched = 0

        def launch_spy(self: DecodeLoop, position: int) -> None:
            nonlocal launched
            if beside:
                launch(self, position)
                launched += position in self._launched

        monkeypatch.setattr(DecodeLoop, "_launch", launch_spy)
        log = tmp_path / f"beside-{beside}.jsonl"
        cfg = RunConfig(model=model, tokens=24, mode=mode, backend="host",  # type: ignore[arg-type]
                        compute=ComputeSpec("fixed", 0.2), budget=Budget(experts=40), log=log)
        summary = asyncio.run(run(cfg))
        lines = [json.loads(line) for line in log.read_text().splitlines()]
        assert (launched > 0) == beside  # planned layers' compute queued right after a wait
        return summary, lines, early

    @pytest.mark.parametrize("mode", ["resident", "direct"])
    @pytest.mark.parametrize("kind", ["ours", "gguf-writer"])
    def test_same_figures_and_lines(self, tiny_model: Path, tmp_path: Path,
                                    monkeypatch: pytest.MonkeyPatch,
                                    capfd: pytest.CaptureFixture[str], kind: str,
                                    mode: str) -> None:
        """On this project's model and on one gguf's writer made (slices at odd offsets, no
        recorded digests: the run builds its manifest), in both modes."""
        model = tiny_model if kind == "ours" else write_plain_moe(tmp_path / "plain.gguf")
        beside, lines, early = self._run(model, tmp_path, monkeypatch, beside=True, mode=mode)
        assert "engine_time_clamped" not in "".join(capfd.readouterr())
        after, after_lines, none = self._run(model, tmp_path, monkeypatch, beside=False,
                                             mode=mode)
        assert 0 < early < 23 and none == 0  # warm tokens end beside; others after the wait
        for name in ("tokens", "hits", "misses", "evictions", "verified", "mismatches"):
            assert getattr(beside, name) == getattr(after, name), name
        tokens = [e for e in lines if e["event"] == "token"]
        assert [e["experts"] for e in tokens] == [
            e["experts"] for e in after_lines if e["event"] == "token"]
        assert [e["token"] for e in tokens] == list(range(24))
        # every token's wall time is counted once: they add up to (nearly) the run's
        elapsed_ms = beside.elapsed_s * 1000.0
        assert 0.9 * elapsed_ms <= sum(e["wall_ms"] for e in tokens) <= elapsed_ms * 1.0001
        # the last layer's compute went to the next token, inside its wall time
        assert all(e["compute_ms"] <= e["wall_ms"] for e in tokens)

    @pytest.mark.parametrize("compute", ["digest", "fixed"])
    def test_never_without_a_queuing_device_or_with_digest_compute(
            self, tiny_model: Path, monkeypatch: pytest.MonkeyPatch, compute: str) -> None:
        """On the host backend the compute is done when the layer is queued: nothing to end
        beside. ``digest`` compute's use digests are read once its kernels ran: after."""
        calls: list[int] = []
        monkeypatch.setattr(DecodeLoop, "_end_beside",
                            lambda self, position, *_: calls.append(position))
        cfg = RunConfig(model=tiny_model, tokens=6, mode="resident", backend="host",
                        compute=ComputeSpec(compute))  # type: ignore[arg-type]
        summary = asyncio.run(run(cfg))
        assert calls == [] and summary.mismatches == 0 and summary.verified > 0
