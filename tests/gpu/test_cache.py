"""Tests for gpu.cache.store and gpu.cache.pool: the byte budget, pinning, reuse and release."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from moestream.gpu.backend import Backend
from moestream.gpu.cache.store import DeviceCache
from moestream.gpu.host import HostBackend, HostEvent
from moestream.pipeline.foundation.errors import UsageError

SIZES = {0: 4096, 1: 6144, 2: 4096}  # layers of two size classes


class CacheMachine(RuleBasedStateMachine):
    """Random installs, hits, evictions, pins, budget changes and clears."""

    def __init__(self) -> None:
        super().__init__()
        self.cache = DeviceCache(HostBackend(), 12 * 6144, "lru", min_bytes=3 * 6144)
        self.pinned: list[list] = []  # entries of "layers being computed"

    @rule(layer=st.sampled_from(sorted(SIZES)),
          experts=st.lists(st.integers(0, 15), min_size=1, max_size=3, unique=True),
          keep_pinned=st.booleans())
    def plan(self, layer: int, experts: list[int], keep_pinned: bool) -> None:
        keys = [(layer, e) for e in experts]
        pinned_keys = {e.key for group in self.pinned for e in group}
        before = {k: self.cache.get(k) for k in pinned_keys}
        try:
            plan = self.cache.plan_layer(keys, [SIZES[layer]] * len(keys))
        except UsageError:
            return  # pins left no room: refused whole, nothing changed
        for key, entry in before.items():
            assert self.cache.get(key) is entry, "a pinned entry was evicted"
        for entry in plan.misses:
            self.cache.mark_ready([entry])
        if keep_pinned and len(self.pinned) < 2:
            self.pinned.append([*plan.hits, *plan.misses])
        else:
            self.cache.release([*plan.hits, *plan.misses], None)

    @rule(layer=st.sampled_from(sorted(SIZES)),
          experts=st.lists(st.integers(0, 15), min_size=1, max_size=3, unique=True))
    def prefetch(self, layer: int, experts: list[int]) -> None:
        """A guess for a later layer: admitted only where room allows, never evicting pins."""
        pinned_keys = {e.key for group in self.pinned for e in group}
        before = {k: self.cache.get(k) for k in pinned_keys}
        plan = self.cache.prefetch([(layer, e) for e in experts], [SIZES[layer]] * len(experts))
        for key, entry in before.items():
            assert self.cache.get(key) is entry, "a prefetch evicted a pinned entry"
        assert not plan.hits
        for entry in plan.misses:
            self.cache.mark_ready([entry])
        if len(self.pinned) < 2:
            self.pinned.append(plan.misses)
        else:
            self.cache.release(plan.misses, None)

    @rule()
    def unpin(self) -> None:
        if self.pinned:
            self.cache.release(self.pinned.pop(0), None)

    @rule(budget_entries=st.integers(9, 20))
    def change_budget(self, budget_entries: int) -> None:
        self.cache.resize(budget_entries * 6144)

    @rule()
    def clear(self) -> None:
        self.cache.clear()

    @invariant()
    def within_budget(self) -> None:
        c = self.cache
        if c.live_bytes + c.pool.parked_bytes > c.budget_bytes:
            # only a budget cut below what pinned experts hold; nothing may be parked then
            assert self.pinned and c.pool.parked_bytes == 0

    @invariant()
    def accounting_exact(self) -> None:
        c = self.cache
        live = sum(c.get(k).nbytes for k in list(c._entries))
        assert live == c.live_bytes
        held = len(c) + sum(len(b) for b in c.pool._parked.values())
        assert c.pool.allocations - c.pool.frees == held

    def teardown(self) -> None:
        self.cache.close()
        assert self.cache.pool.allocations == self.cache.pool.frees


TestCacheStateMachine = CacheMachine.TestCase
TestCacheStateMachine.settings = settings(max_examples=60, stateful_step_count=40,
                                          deadline=None)


class TestDeviceCache:
    """Budget, pool reuse and release on every backend."""

    def test_steady_state_misses_allocate_nothing(self, backend: Backend) -> None:
        cache = DeviceCache(backend, 8 * 4096, "lru", min_bytes=4096)
        for e in range(8):
            plan = cache.plan_layer([(0, e)], [4096])
            cache.release(plan.misses, None)
        allocs = cache.pool.allocations
        for e in range(8, 40):
            plan = cache.plan_layer([(0, e)], [4096])
            cache.release(plan.misses, None)
        assert cache.pool.allocations == allocs == 8
        assert cache.counters.peak_device_bytes <= cache.budget_bytes
        cache.close()
        assert cache.pool.frees == cache.pool.allocations

    def test_other_size_class_trims_parked_first(self) -> None:
        cache = DeviceCache(HostBackend(), 4 * 6144, "lru", min_bytes=6144)
        for e in range(4):
            cache.release(cache.plan_layer([(0, e)], [4096]).misses, None)
        for e in range(4):
            cache.release(cache.plan_layer([(1, e)], [6144]).misses, None)
            assert cache.device_bytes <= cache.budget_bytes
        cache.close()

    def test_a_victims_buffer_goes_to_a_miss_after_its_last_use(self) -> None:
        """A miss evicting an expert of its size takes that expert's buffer, to be
        written only after the victim's last compute (its ``last_use``); a victim of
        another size is parked first, where the budget counts it, before anything new is
        allocated."""
        cache = DeviceCache(HostBackend(), 3 * 4096, "lru", min_bytes=4096)
        first = cache.plan_layer([(0, 0), (0, 1), (0, 2)], [4096] * 3)
        used = HostEvent()
        cache.release(first.misses, used)
        victim_buffers = {id(e.buffer) for e in first.misses}
        allocs = cache.pool.allocations
        second = cache.plan_layer([(0, 3), (0, 4), (0, 5)], [4096] * 3)
        assert {id(e.buffer) for e in second.misses} == victim_buffers
        assert all(e.reuse_after is used for e in second.misses)
        assert cache.pool.allocations == allocs
        cache.release(second.misses, None)
        third = cache.plan_layer([(1, 0), (0, 6)], [6144, 4096])  # one new size, one reused
        assert cache.device_bytes <= cache.budget_bytes
        assert cache.counters.peak_device_bytes <= cache.budget_bytes
        assert [e.nbytes for e in third.misses] == [6144, 4096]
        cache.release(third.misses, None)
        cache.close()
        assert cache.pool.frees == cache.pool.allocations

    def test_budget_below_one_layer_is_refused(self) -> None:
        with pytest.raises(UsageError, match="cannot hold one layer"):
            DeviceCache(HostBackend(), 100, "lru", min_bytes=4096)

    def test_budget_above_device_memory_is_clamped(self) -> None:
        class Small(HostBackend):
            def device_free_bytes(self) -> int:
                return 1 << 20

        cache = DeviceCache(Small(), 1 << 30, "lru")
        assert cache.budget_bytes == 1 << 20

    def test_hit_counts_and_bytes(self) -> None:
        cache = DeviceCache(HostBackend(), 10 * 4096, "lru")
        cache.release(cache.plan_layer([(0, 1), (0, 2)], [4096, 4096]).misses, None)
        plan = cache.plan_layer([(0, 1), (0, 3)], [4096, 4096])
        assert [e.key for e in plan.hits] == [(0, 1)]
        assert cache.counters.bytes_from_cache == 4096
        assert cache.counters.bytes_from_file == 3 * 4096

    def test_dropped_entry_is_never_installed(self) -> None:
        cache = DeviceCache(HostBackend(), 10 * 4096, "lru")
        plan = cache.plan_layer([(0, 1)], [4096])
        cache.release(plan.misses, None)
        cache.drop((0, 1))
        assert (0, 1) not in cache
        assert cache.plan_layer([(0, 1)], [4096]).misses  # read again, not served


class TestWrongGuess:
    """A wrong prefetch guess still loading is never evicted, so its buffer is never
    written by two loads at once; it becomes evictable once its load lands."""

    @pytest.mark.asyncio
    async def test_pinned_until_its_load_lands(self) -> None:
        import asyncio

        cache = DeviceCache(HostBackend(), 4 * 4096, "lru", min_bytes=4096)
        guess = cache.prefetch([(0, 9)], [4096]).misses[0]
        guess.loaded = asyncio.get_running_loop().create_future()
        cache.release_guess([guess])  # its layer is over; the load is not
        for e in range(6):  # fill the cache over and over: the guess must survive
            cache.release(cache.plan_layer([(0, e)], [4096]).misses, None)
        assert cache.get((0, 9)) is guess
        guess.loaded.set_result(None)
        await asyncio.sleep(0)  # the done callback runs
        for e in range(20, 26):
            cache.release(cache.plan_layer([(0, e)], [4096]).misses, None)
        assert (0, 9) not in cache
        cache.close()

    @pytest.mark.asyncio
    async def test_a_failed_guess_dropped_meanwhile_is_left_alone(self) -> None:
        import asyncio

        cache = DeviceCache(HostBackend(), 4 * 4096, "lru", min_bytes=4096)
        guess = cache.prefetch([(0, 9)], [4096]).misses[0]
        guess.loaded = asyncio.get_running_loop().create_future()
        cache.release_guess([guess])
        cache.drop((0, 9))  # the load failed: the streamer drops a failed guess
        again = cache.plan_layer([(0, 9)], [4096]).misses[0]  # read afresh, pinned
        guess.loaded.cancel()
        await asyncio.sleep(0)
        assert again.pins == 1 and cache.get((0, 9)) is again
        cache.release([again], None)
        cache.close()
