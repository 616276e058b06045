"""``SyncSession.used``: experts an engine computed on without leasing them, told once a
token, count as ``fetch``, ``available`` and ``release`` of each layer would: the same hits,
misses, LRU order and token stats, in one hop to the loop."""

from __future__ import annotations

from pathlib import Path

from structlog.testing import capture_logs

import moestream


def _token(ms: moestream.SyncSession, uses: list[tuple[int, list[int]]], batched: bool
           ) -> moestream.TokenStats:
    if batched:
        ms.used(uses)
    else:
        for layer, experts in uses:
            with ms.fetch(layer, experts) as lease:
                lease.available()
    return ms.end_token(compute_ms=0.0)


def test_used_counts_as_leases_would(tiny_model: Path) -> None:
    """Two sessions, one told by ``used`` and one by leases, over the same tokens (warm
    layers and a cold one): the same stats a token, the same experts cached after."""
    tokens = [[(0, [0, 1]), (1, [3])], [(0, [1, 0]), (1, [3, 4])], [(2, [5])]]
    stats = {}
    for batched in (False, True):
        with moestream.open_sync(tiny_model, backend="host", mode="direct",
                                 budget="64") as ms:
            layers = ms.model.moe_layers
            for layer, experts in tokens[0]:  # warm the first token's experts
                with ms.fetch(layers[layer], experts) as lease:
                    lease.gather()
            ms.end_token()
            got = []
            for uses in tokens:
                calls = [(layers[layer], experts) for layer, experts in uses]
                s = _token(ms, calls, batched)
                got.append((s.hits, s.misses))
            # the warm experts stay cached (whether a miss has landed yet is timing)
            cached = [ms.ready(layers[layer], experts) for layer, experts in tokens[0]]
            stats[batched] = (got, cached, ms.counters().hits, ms.counters().misses)
    assert stats[True] == stats[False]
    got, cached, _, _ = stats[True]
    assert got == [(3, 0), (3, 1), (0, 1)] and all(cached)


def test_a_miss_told_as_used_is_loaded_and_warned(tiny_model: Path) -> None:
    """An expert the engine took for cached but was not: loaded as a fetch would load it,
    counted as a miss, and said in a warning (the engine's compute on it may be wrong)."""
    with moestream.open_sync(tiny_model, backend="host", mode="direct") as ms:
        layer = ms.model.moe_layers[0]
        with capture_logs() as logs:
            ms.used([(layer, [2])])
        stats = ms.end_token(compute_ms=0.0)
        assert (stats.hits, stats.misses) == (0, 1)
        warned = [e for e in logs if e["event"] == "used.missed"]
        assert warned and warned[0]["layer"] == layer and warned[0]["misses"] == 1
