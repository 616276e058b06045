"""The streamer's per-layer fast paths: registered misses queued in one pass, all-hit layers.

A resident layer whose misses all lie in registered windows is queued at once on the loop
thread (``ExpertStreamer._queue_registered``, one ``Uploader.upload_layer`` call); an all-hit
layer is planned by the cache's fast path and starts nothing. Both must keep every
contract of the per-expert paths: here on ``DeferredBackend`` copies (a copy runs when its
stream does), a consumer that did not wait on an upload event, or an event recorded before
its copies, digests the wrong bytes and verification counts mismatches.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from moestream.gpu.cache.store import DeviceCache
from moestream.pipeline.foundation.config import Budget, ComputeSpec
from moestream.pipeline.foundation.errors import StageError
from moestream.pipeline.foundation.faults import parse_faults
from moestream.pipeline.foundation.table import ExpertTable, open_table
from moestream.pipeline.proxy.config import RunConfig
from moestream.pipeline.streaming.lease import LayerLease
from moestream.pipeline.streaming.lease_parts import EventJoiner, LeasePart
from moestream.pipeline.streaming.loads import Arrivals
from moestream.pipeline.streaming.streamer import ExpertStreamer
from moestream.pipeline.streaming.verify import DigestRows, Verifier
from moestream.stages.layout import plan_expert
from tests.reclaim import held_resident
from tests.streaming.test_pipeline import DeferredBackend, DeferredKernels, DeferredStream


class RegisteringDeferredBackend(DeferredBackend):
    """Deferred copies, and a mapping that registers like a GPU's: resident misses take
    the registered path (the CuPy backend's), not the host backend's worker copies."""

    registers_host = True

    def register_host(self, array: npt.NDArray[np.uint8]) -> bool:
        return True


Route = list[list[int]]


def _routes(table: ExpertTable, tokens: int, seed: int = 3) -> list[Route]:
    rng = np.random.default_rng(seed)
    return [[rng.choice(table.n_experts, table.top_k, replace=False).tolist()
             for _ in table.moe_layers] for _ in range(tokens)]


async def _resident(table: ExpertTable, faults: str = ""
                    ) -> tuple[RegisteringDeferredBackend, DeviceCache, ExpertStreamer]:
    """A streamer in resident mode on registered deferred copies, with a cache that holds
    every expert. The model's pages are read through first: only windows whose pages are
    all resident register, and the batched path needs them registered."""
    cfg = RunConfig(model=table.path, compute=ComputeSpec("digest"))
    backend = RegisteringDeferredBackend()
    size = plan_expert(table.slices((table.moe_layers[0], 0))).device_bytes
    cache = DeviceCache(backend, 1 << 30, "lru", min_bytes=table.top_k * size)
    plan = parse_faults(faults) if faults else None
    streamer = ExpertStreamer(cfg, table, backend, cache, DeferredKernels(), faults=plan)
    with held_resident(table.path):
        await streamer.set_mode("resident")
    return backend, cache, streamer


async def _stream(table: ExpertTable, routes: list[Route], *, budget_experts: int,
                  wait_uploads: bool = True, faults: str = "", gather: bool = True,
                  ) -> dict[str, Any]:
    """Resident mode on registered deferred copies: each layer's experts consumed by a
    digest on a compute stream (after a device-side wait on each upload unless
    ``wait_uploads`` is False), pins released after it; verified every token."""
    backend = RegisteringDeferredBackend()
    kernels = DeferredKernels()
    cfg = RunConfig(model=table.path, budget=Budget(experts=budget_experts), upload_streams=2,
                    compute=ComputeSpec("digest"), gather=gather)
    size = plan_expert(table.slices((table.moe_layers[0], 0))).device_bytes
    cache = DeviceCache(backend, budget_experts * size, "lru", min_bytes=table.top_k * size)
    plan = parse_faults(faults) if faults else None
    streamer = ExpertStreamer(cfg, table, backend, cache, kernels, faults=plan)
    verifier = Verifier(table)
    used = DigestRows(kernels, len(table.layers) * table.top_k)
    compute = backend.new_stream()
    results: list[tuple[int, int, int, int]] = []  # per layer: hits, misses, evictions, pending
    errors: list[BaseException] = []
    # only windows whose pages are all resident get registered, and the batched path needs
    # them registered: the file's pages held so that a test run before this one that
    # dropped them (an eviction, direct-mode reads), or the machine's reclaim, cannot send
    # the layer down the other path
    try:
        with held_resident(table.path):
            await streamer.set_mode("resident")
        for route in routes:
            for layer, experts in zip(table.moe_layers, route, strict=True):
                load = streamer.start_layer(layer, experts)
                results.append((len(load.plan.hits), len(load.plan.misses), load.plan.evicted,
                                load.pending))
                entries = list(load.plan.hits)
                for _ in range(load.pending):
                    assert load.arrived is not None
                    entry, error = await load.arrived.get()
                    if error is not None:
                        errors.append(error)
                        cache.drop(entry.key)
                        continue
                    entries.append(entry)
                for entry in entries:
                    if wait_uploads and not entry.ready and entry.upload is not None:
                        compute.wait(entry.upload)
                    rows, row = used.reserve(entry.key)
                    ranges = [(s.device_offset, s.nbytes)
                              for s in streamer.layouts[entry.key].ranges]
                    kernels.digest3(entry.buffer, ranges, rows, row, compute)
                    used.complete(rows, row, compute.record())
                done = compute.record()
                cache.release([*load.plan.hits, *load.plan.misses], done)
                done.synchronize()
            streamer.poll_installs()
            cache.advance_token()
            verifier.check(streamer.take_digests())
            verifier.check(used.take())
        verifier.check(streamer.take_digests(wait=True))
        assert streamer.digests is not None
        stuck = streamer.digests.pending  # rows reserved and never completed nor dropped
    finally:
        await streamer.aclose()
        counters = cache.counters
        cache.close()
    return {"verifier": verifier, "layers": results, "counters": counters, "errors": errors,
            "stuck": stuck,
            "bytes_uploaded": streamer.uploader.bytes_uploaded,
            "copies": streamer.uploader.copies}


class TestRegisteredLayerBatch:
    """A layer of registered misses is queued in one pass and still verifies."""

    def test_batched_path_taken_and_verified(self, tiny_table: ExpertTable,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
        calls = {"batch": 0, "task": 0}
        batch, launch = ExpertStreamer._queue_registered, ExpertStreamer._launch

        def spy_batch(self: ExpertStreamer, *args: Any) -> None:
            calls["batch"] += 1
            batch(self, *args)

        async def spy_launch(self: ExpertStreamer, *args: Any) -> None:
            calls["task"] += 1
            await launch(self, *args)

        monkeypatch.setattr(ExpertStreamer, "_queue_registered", spy_batch)
        monkeypatch.setattr(ExpertStreamer, "_launch", spy_launch)
        out = asyncio.run(_stream(tiny_table, _routes(tiny_table, 6), budget_experts=12))
        v = out["verifier"]
        assert v.mismatches == 0
        assert v.verified > 0
        assert calls["task"] == 0  # no per-layer task, no worker
        assert calls["batch"] == sum(1 for _, misses, _, _ in out["layers"] if misses)

    def test_consumer_not_waiting_is_caught(self, tiny_table: ExpertTable) -> None:
        """Negative control: a consumer that skips the wait on the upload event digests
        bytes not yet copied."""
        out = asyncio.run(_stream(tiny_table, _routes(tiny_table, 3), budget_experts=12,
                                  wait_uploads=False))
        assert out["verifier"].mismatches > 0

    def test_same_counters_as_per_expert_path(self, tiny_table: ExpertTable,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
        routes = _routes(tiny_table, 6, seed=11)
        batched = asyncio.run(_stream(tiny_table, routes, budget_experts=12))
        monkeypatch.setattr(ExpertStreamer, "_registered_copies", lambda self, misses: None)
        per_expert = asyncio.run(_stream(tiny_table, routes, budget_experts=12))
        for out in (batched, per_expert):
            assert out["verifier"].mismatches == 0
        assert batched["layers"] == per_expert["layers"]
        assert batched["counters"] == per_expert["counters"]
        assert batched["bytes_uploaded"] == per_expert["bytes_uploaded"]
        assert batched["copies"] == per_expert["copies"]
        assert batched["verifier"].verified == per_expert["verifier"].verified

    @pytest.mark.parametrize("gather", [True, False])
    def test_failed_upload_fails_that_expert_only(self, tiny_table: ExpertTable,
                                                  gather: bool) -> None:
        out = asyncio.run(_stream(tiny_table, _routes(tiny_table, 2), budget_experts=12,
                                  faults="upload@2", gather=gather))
        assert len(out["errors"]) == 1
        assert "injected" in str(out["errors"][0])
        assert out["verifier"].mismatches == 0
        assert out["stuck"] == 0  # the failed expert's digest row does not hold back others

    def test_corrupt_copy_is_caught(self, tiny_table: ExpertTable) -> None:
        """The ``corrupt`` fault inverts a byte as the gather writes it: the install digest
        and the consumer's digest both see it, for that one expert. (The copy engines'
        path flips the byte with a device kernel after the copy, which these deferred
        copies cannot order: ``tests/test_faults.py`` covers it on the host backend.)"""
        out = asyncio.run(_stream(tiny_table, _routes(tiny_table, 3), budget_experts=12,
                                  faults="corrupt@4"))
        assert out["errors"] == []
        assert out["verifier"].mismatches == 2
        assert out["verifier"].first_mismatch.startswith("layer ")

    def test_gather_same_as_copy_engines(self, tiny_table: ExpertTable) -> None:
        """One launch per layer or one batched copy: the same experts, bytes and counts."""
        routes = _routes(tiny_table, 6, seed=5)
        one = asyncio.run(_stream(tiny_table, routes, budget_experts=12, gather=True))
        per = asyncio.run(_stream(tiny_table, routes, budget_experts=12, gather=False))
        for key in ("layers", "counters", "bytes_uploaded"):
            assert one[key] == per[key]
        assert one["verifier"].verified == per["verifier"].verified > 0
        assert one["verifier"].mismatches == per["verifier"].mismatches == 0

    def test_delivery_after_start_returns(self, tiny_table: ExpertTable) -> None:
        """The layer's misses are handed over after ``start_layer`` returns (one callback),
        into the queue it was given (a lease made meanwhile reads it), and each miss's
        ``loaded`` future resolves for lookups that find it in flight."""

        async def go() -> None:
            _, cache, streamer = await _resident(tiny_table)
            try:
                mine: Arrivals[Any] = Arrivals()
                load = streamer.start_layer(tiny_table.moe_layers[0], [0, 1, 2], mine)
                assert load.launcher is None and load.pending == 3 and load.arrived is mine
                assert all(e.upload is not None for e in load.plan.misses)  # queued
                futures = [e.loaded for e in load.plan.misses]
                assert all(f is not None and not f.done() for f in futures)
                assert mine.empty()  # not yet: one callback, after the start returned
                got = [await mine.get() for _ in range(3)]
                assert [e.key for e, _ in got] == [e.key for e in load.plan.misses]
                assert all(error is None for _, error in got)
                assert all(f is not None and f.done() for f in futures)
                cache.release(load.plan.misses, None)
            finally:
                await streamer.aclose()
                cache.close()

        asyncio.run(go())


class TestAllHitLayer:
    """An all-hit layer: the cache's fast plan, nothing started, identical accounting."""

    def test_nothing_started(self, tiny_table: ExpertTable) -> None:
        route = _routes(tiny_table, 1)[0]

        async def go() -> None:
            _, cache, streamer = await _resident(tiny_table)
            try:
                layer = tiny_table.moe_layers[0]
                first = streamer.start_layer(layer, route[0])
                for _ in range(first.pending):
                    assert first.arrived is not None
                    await first.arrived.get()
                cache.release(first.plan.misses, None)
                again = streamer.start_layer(layer, route[0])
                assert again.plan.misses == [] and again.pending == 0
                assert again.arrived is None and again.launcher is None and not again.phases
                assert [e.key for e in again.plan.hits] == [(layer, e) for e in route[0]]
                assert all(e.pins == 1 for e in again.plan.hits)
                cache.release(again.plan.hits, None)
            finally:
                await streamer.aclose()
                cache.close()

        asyncio.run(go())

    def test_same_results_as_normal_path(self, tiny_table: ExpertTable,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
        # a budget that holds everything after the first token, so later tokens re-use
        # the first token's routing as all-hit layers, mixed with fresh misses
        routes = _routes(tiny_table, 2, seed=5)
        routes = routes + routes[:1] * 3 + routes[1:] * 2
        budget = tiny_table.n_experts * len(tiny_table.moe_layers)
        fast = asyncio.run(_stream(tiny_table, routes, budget_experts=budget))
        monkeypatch.setattr(DeviceCache, "_plan_hits", lambda self, keys: None)
        normal = asyncio.run(_stream(tiny_table, routes, budget_experts=budget))
        assert any(misses == 0 for _, misses, _, _ in fast["layers"])
        assert fast["layers"] == normal["layers"]
        assert fast["counters"] == normal["counters"]
        assert fast["verifier"].verified == normal["verifier"].verified
        assert fast["verifier"].mismatches == normal["verifier"].mismatches == 0

    def test_eviction_order_unchanged(self, tiny_table: ExpertTable,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
        """Hits count as uses for the policy in the fast path too: with a small budget,
        the same routing evicts the same experts either way."""
        routes = _routes(tiny_table, 4, seed=9)
        routes = [r for pair in zip(routes, routes, strict=True) for r in pair]  # repeats hit
        fast = asyncio.run(_stream(tiny_table, routes, budget_experts=2 * tiny_table.top_k
                                   * len(tiny_table.moe_layers)))
        monkeypatch.setattr(DeviceCache, "_plan_hits", lambda self, keys: None)
        normal = asyncio.run(_stream(tiny_table, routes, budget_experts=2 * tiny_table.top_k
                                     * len(tiny_table.moe_layers)))
        assert fast["layers"] == normal["layers"]
        assert fast["counters"] == normal["counters"]


def test_mapping_views_dropped_with_the_mapping(tiny_model: Path,
                                                tiny_table: ExpertTable) -> None:
    """Leaving resident mode forgets the copies cut from the released mapping."""

    async def go() -> None:
        _, cache, streamer = await _resident(tiny_table)
        try:
            load = streamer.start_layer(tiny_table.moe_layers[0], [0, 1])
            for _ in range(load.pending):
                assert load.arrived is not None
                await load.arrived.get()
            cache.release(load.plan.misses, None)
            assert streamer._copies
            await streamer.set_mode("direct")
            assert not streamer._copies and streamer._copies_of is None
        finally:
            await streamer.aclose()
            cache.close()

    asyncio.run(go())


class TestMixDigests:
    """The per-token read-back mixes all rows in one numpy pass, as ``mix_digest`` would."""

    def test_same_values_as_one_by_one(self) -> None:
        from moestream.pipeline.foundation.digest import mix_digest, mix_digests

        sums = np.random.default_rng(2).integers(0, 2**64 - 1, size=(300, 2), dtype=np.uint64)
        sums[0] = (2**64 - 1, 2**64 - 1)  # both at the top: the sum wraps
        assert mix_digests(sums).tolist() == [mix_digest(int(a), int(b)) for a, b in sums]
        assert mix_digests(sums[:0]).tolist() == []


class TestDigestRowsTake:
    """A token's end takes the install digests whose copies ran, never waiting for loads
    started ahead; the final take waits for the rest."""

    def test_stops_at_work_still_queued(self) -> None:
        kernels = DeferredKernels()
        ahead = DeferredStream()
        ahead.enqueue(lambda: None)  # a copy still in flight
        rows = DigestRows(kernels, 8)
        for key, event in (((0, 0), True), ((0, 1), ahead.record()), ((0, 2), True)):
            results, row = rows.reserve(key)
            rows.complete(results, row, event if not isinstance(event, bool) else None)
        assert rows.take().keys == [(0, 0)]
        assert rows.take().keys == [] and rows.pending == 2
        assert rows.take(wait=True).keys == [(0, 1), (0, 2)]
        assert rows.pending == 0

    def test_taken_once_its_work_ran(self) -> None:
        ahead = DeferredStream()
        ahead.enqueue(lambda: None)
        rows = DigestRows(DeferredKernels(), 8)
        results, row = rows.reserve((1, 4))
        rows.complete(results, row, ahead.record())
        assert rows.take().keys == []
        ahead.synchronize()
        assert rows.take().keys == [(1, 4)]

    def test_dropped_rows_never_hold_back_the_rest(self) -> None:
        rows = DigestRows(DeferredKernels(), 8)
        reserved = [rows.reserve((2, e)) for e in range(3)]
        rows.drop(*reserved[1])  # that expert's load failed
        rows.complete(*reserved[0], None)
        rows.complete(*reserved[2], None)
        taken = rows.take()
        assert taken.keys == [(2, 0), (2, 2)] and taken.values.shape == (2, 3)
        assert rows.pending == 0


@pytest.fixture
def own_table(tiny_model: Path, tmp_path: Path) -> ExpertTable:
    """The tiny model copied for one test: its pages stay resident for the registered path
    whatever another test's session does to the shared file's (a switch to direct mode
    drops them, and a session closing late may do so while this test runs)."""
    return open_table(Path(shutil.copy(tiny_model, tmp_path / "tiny.gguf")))


class TestTakeLanded:
    """A gathered layer's misses land together: ``take_landed`` hands them out in one call,
    stopping before a failed one, which ``next`` then raises."""

    @staticmethod
    async def _lease(table: ExpertTable, experts: list[int], faults: str = ""
                     ) -> tuple[LayerLease, ExpertStreamer, DeviceCache]:
        backend, cache, streamer = await _resident(table, faults)
        layer = table.moe_layers[0]
        part = LeasePart(0, cache, EventJoiner(backend.new_stream(), backend.activate),
                         streamer.start_layer(layer, experts))
        assert part.load.launcher is None, "the registered (gathered) path"
        return LayerLease(layer, tuple(experts), [part]), streamer, cache

    def test_all_at_once(self, own_table: ExpertTable) -> None:
        async def go() -> None:
            lease, streamer, cache = await self._lease(own_table, [0, 1, 2])
            try:
                assert lease.take_landed() == []  # delivered by a callback, after the start
                await asyncio.sleep(0)
                landed = lease.take_landed()
                assert [a.entry.key[1] for a in landed] == [0, 1, 2]
                assert lease.pending == 0 and await lease.next() is None
            finally:
                lease.release(lambda part: None)
                await streamer.aclose()
                cache.close()

        asyncio.run(go())

    def test_stops_before_a_failure(self, own_table: ExpertTable) -> None:
        async def go() -> None:
            lease, streamer, cache = await self._lease(own_table, [0, 1, 2], "upload@2")
            try:
                await asyncio.sleep(0)
                assert [a.entry.key[1] for a in lease.take_landed()] == [0]
                with pytest.raises(StageError, match="injected"):
                    await lease.next()
                assert [a.entry.key[1] for a in lease.take_landed()] == [2]
                assert lease.pending == 0
            finally:
                lease.release(lambda part: None)
                await streamer.aclose()
                cache.close()

        asyncio.run(go())
