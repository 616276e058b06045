"""What one ``generate`` call did, beside the session's totals since the model loaded.

``session.counters()`` counts from the open: a program that generates many times (a server,
a notebook) wants each call's own figures without subtracting them itself.
``GenerateStats.between`` is that subtraction, made once by the served model's ``generate``.
"""

from __future__ import annotations

from dataclasses import dataclass

from moestream import Counters

__all__ = ["GenerateStats"]


@dataclass(frozen=True, slots=True)
class GenerateStats:
    """One ``generate`` call's share of the session's counters.

    Attributes:
        tokens: forward passes (moestream tokens): the prefill and one per new token but the
            last, as transformers runs them.
        hits: routed experts the device cache already held.
        misses: routed experts read and uploaded.
        evictions: experts the cache dropped to make room.
        file_bytes: bytes read from the checkpoint's files for the misses.
        cache_bytes: bytes of experts served from the device cache (hits).
        stall_ms: time the model waited for experts to land.
        wall_ms: the call's wall time.
    """

    tokens: int
    hits: int
    misses: int
    evictions: int
    file_bytes: int
    cache_bytes: int
    stall_ms: float
    wall_ms: float

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    @classmethod
    def between(cls, before: Counters, after: Counters, wall_ms: float) -> GenerateStats:
        """The counters' growth from ``before`` to ``after``, over ``wall_ms``."""
        return cls(tokens=after.tokens - before.tokens, hits=after.hits - before.hits,
                   misses=after.misses - before.misses,
                   evictions=after.evictions - before.evictions,
                   file_bytes=after.file_bytes - before.file_bytes,
                   cache_bytes=after.cache_bytes - before.cache_bytes,
                   stall_ms=after.stall_ms - before.stall_ms, wall_ms=wall_ms)
