"""Cache bookkeeping without memory: which experts are held, what to evict, byte budget.

The live ``DeviceCache`` and the analysis tool's what-if simulator both make their decisions
through ``CacheIndex``, so a replay of a logged access sequence with the same policy and
budget reproduces the live hit count exactly. The index knows keys and byte sizes only;
buffers, events and the pool belong to ``moestream.gpu.cache.store``.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Collection, Container, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from moestream.pipeline.foundation.table import ExpertKey

__all__ = [
    "CacheIndex",
    "EvictionPolicy",
    "ExpertKey",
    "FreqDecayPolicy",
    "LRUPolicy",
    "LayerOutcome",
    "make_policy",
]



class EvictionPolicy(Protocol):
    """Orders held keys for eviction. Implementations never hold bytes, only keys."""

    def insert(self, key: ExpertKey) -> None:
        """A key was admitted."""

    def touch(self, key: ExpertKey) -> None:
        """A held key was used (a hit)."""

    def touch_all(self, keys: Iterable[ExpertKey]) -> None:
        """Each of ``keys``, all held, was used, in order (``touch`` of each)."""

    def remove(self, key: ExpertKey) -> None:
        """A key left the cache (evicted or dropped)."""

    def victim(self, protected: Container[ExpertKey]) -> ExpertKey | None:
        """The key to evict next, never one in ``protected``; None if all are protected."""

    def advance_token(self) -> None:
        """One token of decode has passed (policies with decay age their scores)."""


class LRUPolicy:
    """Least recently used first."""

    __slots__ = ("_order",)

    def __init__(self) -> None:
        self._order: OrderedDict[ExpertKey, None] = OrderedDict()

    def insert(self, key: ExpertKey) -> None:
        self._order[key] = None

    def touch(self, key: ExpertKey) -> None:
        self._order.move_to_end(key)

    def touch_all(self, keys: Iterable[ExpertKey]) -> None:
        move = self._order.move_to_end  # a layer's experts each token: no call a key
        for key in keys:
            move(key)

    def remove(self, key: ExpertKey) -> None:
        del self._order[key]

    def victim(self, protected: Container[ExpertKey]) -> ExpertKey | None:
        for key in self._order:
            if key not in protected:
                return key
        return None

    def advance_token(self) -> None:
        pass


class FreqDecayPolicy:
    """Route hotness: exponentially decayed use count, least hot first, LRU on ties.

    The default half-life of 4 tokens was chosen on the calibrated ds4-flash trace (300
    tokens, one cache over 43 layers): at 1300 / 2522 / 5000 entries it hits 0.434 / 0.521 /
    0.652 against LRU's 0.423 / 0.519 / 0.653; with 64 tokens, old heat kept new experts
    out and it fell to 0.168 / 0.331 / 0.620.

    A use at token ``t`` adds ``2 ** (t / half_life_tokens)`` to the key's score; comparing
    scores at any later time is then the same as comparing decayed counts. Scores are kept
    as logarithms so they never overflow, in a heap with lazy deletion, so eviction costs
    O(log n) rather than a scan of the whole cache.
    """

    __slots__ = ("_heap", "_lambda", "_log_score", "_seq", "_stamp", "_token")

    def __init__(self, half_life_tokens: float = 4.0) -> None:
        if half_life_tokens <= 0:
            raise ValueError(f"half_life_tokens must be positive, got {half_life_tokens}")
        self._lambda = math.log(2.0) / half_life_tokens
        self._token = 0
        self._seq = 0
        self._log_score: dict[ExpertKey, float] = {}
        self._stamp: dict[ExpertKey, int] = {}
        self._heap: list[tuple[float, int, ExpertKey]] = []

    def _bump(self, key: ExpertKey) -> None:
        add = self._token * self._lambda
        old = self._log_score.get(key)
        score = add if old is None else max(old, add) + math.log1p(math.exp(-abs(old - add)))
        self._seq += 1
        self._log_score[key] = score
        self._stamp[key] = self._seq
        heapq.heappush(self._heap, (score, self._seq, key))
        if len(self._heap) > 4 * len(self._stamp) + 64:
            self._compact()

    def _compact(self) -> None:
        """Drop stale heap entries (every touch leaves one behind), keeping memory bounded."""
        self._heap = [
            (self._log_score[key], seq, key)
            for _, seq, key in self._heap
            if self._stamp.get(key) == seq
        ]
        heapq.heapify(self._heap)

    def insert(self, key: ExpertKey) -> None:
        self._bump(key)

    def touch(self, key: ExpertKey) -> None:
        self._bump(key)

    def touch_all(self, keys: Iterable[ExpertKey]) -> None:
        for key in keys:
            self._bump(key)

    def remove(self, key: ExpertKey) -> None:
        del self._log_score[key]
        del self._stamp[key]

    def victim(self, protected: Container[ExpertKey]) -> ExpertKey | None:
        skipped: list[tuple[float, int, ExpertKey]] = []
        found: ExpertKey | None = None
        while self._heap:
            entry = self._heap[0]
            _, seq, key = entry
            if self._stamp.get(key) != seq:
                heapq.heappop(self._heap)  # stale: the key was touched or removed since
                continue
            if key in protected:
                skipped.append(heapq.heappop(self._heap))
                continue
            found = key
            break
        for entry in skipped:
            heapq.heappush(self._heap, entry)
        return found

    def advance_token(self) -> None:
        self._token += 1


class _Either:
    """Membership in either of two collections, without copying the first (the pinned
    keys, a few layers of them, were copied for every miss admitted)."""

    __slots__ = ("base", "extra")

    def __init__(self, base: Container[ExpertKey], extra: set[ExpertKey]) -> None:
        self.base = base
        self.extra = extra

    def __contains__(self, key: object) -> bool:
        return key in self.extra or key in self.base


def make_policy(name: str) -> EvictionPolicy:
    """Build a policy by its CLI name: ``lru`` or ``freq`` (frequency with decay)."""
    if name == "lru":
        return LRUPolicy()
    if name == "freq":
        return FreqDecayPolicy()
    raise ValueError(f"unknown eviction policy {name!r} (expected 'lru' or 'freq')")


@dataclass(frozen=True, slots=True)
class LayerOutcome:
    """What one layer's lookup decided: the keys that hit, missed, and were evicted, and
    the misses that were not admitted (larger than the capacity, or only protected keys
    left to evict): the caller serves those without caching them, or refuses."""

    hits: tuple[ExpertKey, ...]
    misses: tuple[ExpertKey, ...]
    evicted: tuple[ExpertKey, ...]
    refused: tuple[ExpertKey, ...] = ()


class CacheIndex:
    """Which keys are held, at what byte sizes, under a byte capacity.

    Args:
        capacity_bytes: the most bytes live entries may hold.
        policy: the eviction order.
    """

    __slots__ = ("_policy", "_sizes", "capacity_bytes", "live_bytes")

    def __init__(self, capacity_bytes: int, policy: EvictionPolicy) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        """As given, or as ``resize`` set it."""
        self._policy = policy
        self._sizes: dict[ExpertKey, int] = {}
        self.live_bytes = 0
        """The bytes of the keys held (``admit`` and ``remove`` keep it; read only)."""

    def __len__(self) -> int:
        return len(self._sizes)

    def __contains__(self, key: object) -> bool:
        return key in self._sizes

    def keys(self) -> Iterable[ExpertKey]:
        return self._sizes.keys()

    def lookup(self, key: ExpertKey) -> bool:
        """True and counts a use if ``key`` is held."""
        if key in self._sizes:
            self._policy.touch(key)
            return True
        return False

    def used(self, keys: Iterable[ExpertKey]) -> None:
        """A use of each of ``keys``, all held, in order (an all-hit layer: ``lookup``'s
        count without a call a key)."""
        self._policy.touch_all(keys)

    def admit(
        self, key: ExpertKey, nbytes: int, protected: Container[ExpertKey]
    ) -> tuple[bool, list[ExpertKey]]:
        """Make room for ``key`` by evicting unprotected keys, then hold it.

        Returns:
            (admitted, evicted). Not admitted when the entry is larger than the capacity
            or only protected keys are left to evict; then nothing was evicted either, and
            the caller serves the expert without caching it.
        """
        if key in self._sizes:
            raise ValueError(f"{key} is already held")
        if nbytes > self.capacity_bytes:
            return False, []
        victims: list[ExpertKey] = []
        freed = 0
        while self.live_bytes - freed + nbytes > self.capacity_bytes:
            # past the first victim (rare: one usually frees room for one expert) those
            # chosen are skipped too, without copying ``protected``
            victim = self._policy.victim(_Either(protected, set(victims)) if victims
                                         else protected)
            if victim is None:
                return False, []
            victims.append(victim)
            freed += self._sizes[victim]
        for victim in victims:
            self.remove(victim)
        self._sizes[key] = nbytes
        self.live_bytes += nbytes
        self._policy.insert(key)
        return True, victims

    def remove(self, key: ExpertKey) -> None:
        """Drop ``key`` (it must be held)."""
        self.live_bytes -= self._sizes.pop(key)
        self._policy.remove(key)

    def resize(self, capacity_bytes: int, protected: Collection[ExpertKey]) -> list[ExpertKey]:
        """Change the capacity; evicts unprotected keys until the live bytes fit."""
        self.capacity_bytes = capacity_bytes
        evicted: list[ExpertKey] = []
        while self.live_bytes > self.capacity_bytes:
            victim = self._policy.victim(set(protected) | set(evicted))
            if victim is None:
                break
            evicted.append(victim)
            self.remove(victim)
        return evicted

    def advance_token(self) -> None:
        """Mark a token boundary for policies with decay."""
        self._policy.advance_token()

    def access_layer(
        self,
        keys: Sequence[ExpertKey],
        nbytes: Sequence[int],
        pinned: Collection[ExpertKey] = (),
    ) -> LayerOutcome:
        """Look up one layer's experts, then admit its misses with the layer protected.

        This is the exact decision sequence the live cache follows for a layer, which the
        what-if simulator replays. ``pinned`` adds keys that must not be evicted either
        (experts still in use or in flight elsewhere).
        """
        held, policy = self._sizes, self._policy
        hits: list[ExpertKey] = []
        misses: list[ExpertKey] = []
        miss_sizes: list[int] = []
        for key, size in zip(keys, nbytes, strict=True):
            if key in held:
                policy.touch(key)
                hits.append(key)
            else:
                misses.append(key)
                miss_sizes.append(size)
        evicted: list[ExpertKey] = []
        refused: list[ExpertKey] = []
        protected: _Either | None = None  # made once an eviction is asked for
        for key, size in zip(misses, miss_sizes, strict=True):
            # the two common cases inline, as ``admit`` decides them (a miss a layer cost
            # five calls through it): room left (a cache still filling), or a full cache
            # where one victim frees room; anything else goes through ``admit``
            capacity = self.capacity_bytes
            if self.live_bytes + size <= capacity and key not in held:
                held[key] = size
                self.live_bytes += size
                policy.insert(key)
                continue
            if protected is None:
                protected = _Either(pinned, set(keys))
            victim = policy.victim(protected) if self.live_bytes + size > capacity else None
            if (victim is not None and key not in held
                    and self.live_bytes - held[victim] + size <= capacity):
                self.live_bytes += size - held.pop(victim)
                policy.remove(victim)
                held[key] = size
                policy.insert(key)
                evicted.append(victim)
                continue
            admitted, out = self.admit(key, size, protected)
            evicted.extend(out)
            if not admitted:
                refused.append(key)
        return LayerOutcome(tuple(hits), tuple(misses), tuple(evicted), tuple(refused))
