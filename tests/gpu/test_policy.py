"""Tests for moestream.gpu.cache.policy: eviction orders and the byte-capacity index."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from moestream.gpu.cache.policy import CacheIndex, FreqDecayPolicy, LRUPolicy, make_policy


class TestLRU:
    """LRU evicts the least recently used unprotected key."""

    def test_order_follows_use(self) -> None:
        p = LRUPolicy()
        for k in [(0, 1), (0, 2), (0, 3)]:
            p.insert(k)
        p.touch((0, 1))
        assert p.victim(set()) == (0, 2)
        assert p.victim({(0, 2)}) == (0, 3)
        assert p.victim({(0, 1), (0, 2), (0, 3)}) is None


@pytest.mark.parametrize("name", ["lru", "freq"])
@given(uses=st.lists(st.lists(st.integers(0, 7), min_size=1, max_size=8), max_size=12))
def test_touch_all_is_touch_of_each(name: str, uses: list[list[int]]) -> None:
    """A layer's uses told at once (``touch_all``, the all-hit layer's path) leave the
    eviction order a ``touch`` of each would."""
    one, many = make_policy(name), make_policy(name)
    for policy in (one, many):
        for expert in range(8):
            policy.insert((0, expert))
    for layer in uses:
        keys = [(0, expert) for expert in layer]
        for key in keys:
            one.touch(key)
        many.touch_all(keys)
        one.advance_token()
        many.advance_token()
    left: set[tuple[int, int]] = set()
    while (victim := one.victim(left)) is not None:
        assert many.victim(left) == victim
        left.add(victim)
    assert many.victim(left) is None


class TestFreqDecay:
    """Route hotness: frequent keys survive, old heat decays, ties fall back to LRU."""

    def test_hot_key_survives(self) -> None:
        p = FreqDecayPolicy(half_life_tokens=8)
        p.insert((0, 1))
        p.insert((0, 2))
        for _ in range(5):
            p.touch((0, 1))
        assert p.victim(set()) == (0, 2)

    def test_heat_decays(self) -> None:
        p = FreqDecayPolicy(half_life_tokens=1)
        p.insert((0, 1))
        for _ in range(3):
            p.touch((0, 1))  # score 4 at token 0
        for _ in range(10):
            p.advance_token()
        p.insert((0, 2))  # score 2**10 at token 10
        assert p.victim(set()) == (0, 1)

    def test_tie_breaks_by_recency(self) -> None:
        p = FreqDecayPolicy()
        p.insert((0, 1))
        p.insert((0, 2))
        assert p.victim(set()) == (0, 1)

    def test_rejects_bad_half_life(self) -> None:
        with pytest.raises(ValueError):
            FreqDecayPolicy(0)


class TestCacheIndex:
    """Byte capacity is never exceeded and protected keys are never evicted."""

    @given(
        st.sampled_from(["lru", "freq"]),
        st.integers(6, 40),
        st.lists(st.lists(st.integers(0, 31), min_size=1, max_size=6, unique=True),
                 min_size=1, max_size=60),
    )
    def test_capacity_and_protection(self, policy: str, capacity: int,
                                     layers: list[list[int]]) -> None:
        sizes = {0: 1, 1: 2}  # two size classes
        index = CacheIndex(capacity, make_policy(policy))
        for n, experts in enumerate(layers):
            layer = n % 2
            keys = [(layer, e) for e in experts]
            outcome = index.access_layer(keys, [sizes[layer]] * len(keys))
            assert index.live_bytes <= index.capacity_bytes
            assert not set(outcome.evicted) & set(keys)
            assert len(outcome.hits) + len(outcome.misses) == len(keys)
            assert index.live_bytes == sum(sizes[k[0]] for k in index.keys())  # noqa: SIM118
            index.advance_token()

    @given(
        st.sampled_from(["lru", "freq"]),
        st.integers(0, 40),
        st.lists(st.tuples(st.lists(st.integers(0, 31), min_size=1, max_size=6, unique=True),
                           st.sets(st.integers(0, 31), max_size=8)),
                 min_size=1, max_size=60),
    )
    def test_access_layer_decides_as_lookups_then_admits(
            self, policy: str, capacity: int,
            layers: list[tuple[list[int], set[int]]]) -> None:
        """``access_layer`` (which admits the warm case inline) makes the decisions of
        its definition: each key looked up, then each miss admitted in order with the
        layer and the pinned keys protected; a miss not admitted is told as refused."""
        sizes = {0: 1, 1: 2, 2: 7}  # three size classes; 7 may not fit at all
        index = CacheIndex(capacity, make_policy(policy))
        reference = CacheIndex(capacity, make_policy(policy))
        for n, (experts, pinned_experts) in enumerate(layers):
            layer = n % 3
            keys = [(layer, e) for e in experts]
            pinned = {((layer + 1) % 3, e) for e in pinned_experts}
            outcome = index.access_layer(keys, [sizes[layer]] * len(keys), pinned)
            hits = [k for k in keys if reference.lookup(k)]
            misses = [k for k in keys if k not in hits]
            evicted: list[tuple[int, int]] = []
            refused = []
            for key in misses:
                admitted, out = reference.admit(key, sizes[layer], pinned | set(keys))
                evicted += out
                if not admitted:
                    refused.append(key)
            assert (outcome.hits, outcome.misses, outcome.evicted, outcome.refused) == (
                tuple(hits), tuple(misses), tuple(evicted), tuple(refused))
            assert sorted(index.keys()) == sorted(reference.keys())
            assert index.live_bytes == reference.live_bytes <= capacity
            index.advance_token()
            reference.advance_token()

    def test_entry_larger_than_capacity_is_not_admitted(self) -> None:
        index = CacheIndex(10, LRUPolicy())
        assert index.admit((0, 0), 11, ()) == (False, [])
        assert len(index) == 0

    def test_resize_evicts_unprotected(self) -> None:
        index = CacheIndex(10, LRUPolicy())
        for e in range(5):
            index.admit((0, e), 2, ())
        evicted = index.resize(4, {(0, 0)})
        assert (0, 0) in index and (0, 0) not in evicted
        assert index.live_bytes <= 4

    def test_unknown_policy(self) -> None:
        with pytest.raises(ValueError, match="unknown eviction policy"):
            make_policy("mru")


class TestFreqDecayMemory:
    """Stale heap entries are compacted away, so memory follows the live keys."""

    def test_heap_stays_bounded(self) -> None:
        p = FreqDecayPolicy()
        for k in range(10):
            p.insert((0, k))
        for _ in range(10_000):
            p.touch((0, 3))
        assert len(p._heap) <= 4 * 10 + 64 + 1
        assert p.victim(set()) == (0, 0)
