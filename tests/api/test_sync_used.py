"""``SyncSession.used``: experts an engine computed on without leasing them, told once a
token, count as ``fetch``, ``available`` and ``release`` of each layer would: the same hits,
misses, LRU order and token stats, in one hop to the loop."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from structlog.testing import capture_logs

import moestream


def _token(ms: moestream.SyncSession, uses: list[tuple[int, list[int]]], batched: bool
           ) -> moestream.TokenStats:
    if batched:
        ms.used(uses)  # (a cold layer's miss: False, tested below)
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
            assert ms.used([(layer, [2])]) is False  # the engine's addresses no longer hold
        stats = ms.end_token(compute_ms=0.0)
        assert (stats.hits, stats.misses) == (0, 1)
        warned = [e for e in logs if e["event"] == "used.missed"]
        assert warned and warned[0]["layer"] == layer and warned[0]["misses"] == 1


@pytest.mark.parametrize("mode", ["direct", "resident"])
def test_used_keeps_lru_order_and_token_lines_as_leases_would(tiny_model: Path,
                                                              tmp_path: Path,
                                                              mode: str) -> None:
    """A budget that evicts: the experts ``used`` touched (with no lease, every one cached:
    ``LeaseDesk.use_cached``) stay as leases of them would keep them, a layer used twice in
    a token counts each expert once, and the log's token lines are the same."""
    outcome: dict[bool, tuple[object, ...]] = {}
    for batched in (False, True):
        log = tmp_path / f"{batched}.jsonl"
        with moestream.open_sync(tiny_model, backend="host", mode=mode,  # type: ignore[arg-type]
                                 budget="12", log=log) as ms:
            a, b = ms.model.moe_layers[:2]
            for layer in (a, b):  # six experts of each layer cached, 0 the oldest
                for expert in range(6):
                    with ms.fetch(layer, [expert]) as lease:
                        lease.gather()
            ms.end_token()
            # expert 0 and 1 of each layer touched (told twice for layer a), then misses
            # that evict the least recently used
            s1 = _token(ms, [(a, [0, 1]), (b, [1, 0]), (a, [1])], batched)
            s2 = _token(ms, [(a, [6, 7]), (b, [6, 7])], batched)
            # the warm ones (whether the misses have landed yet is timing)
            kept = [(layer, e) for layer in (a, b) for e in range(6) if ms.ready(layer, [e])]
        lines = [json.loads(line) for line in log.read_text().splitlines()]
        outcome[batched] = ((s1.hits, s1.misses), (s2.hits, s2.misses), kept,
                            [(t["hits"], t["misses"], t["experts"]) for t in lines
                             if t.get("event") == "token"])
    assert outcome[True] == outcome[False]
    assert outcome[True][0] == (4, 0)


def test_used_of_cached_layers_takes_no_lease(tiny_model: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Every expert cached and the engine's compute done (the host backend's always is):
    ``used`` counts them with no lease made; a layer with a miss takes one."""
    leases = []
    made = moestream.Session._fetch

    def fetch(self: moestream.Session, *args: object) -> object:
        leases.append(args[0])
        return made(self, *args)  # type: ignore[arg-type]

    with moestream.open_sync(tiny_model, backend="host", mode="direct") as ms:
        a, b = ms.model.moe_layers[:2]
        with ms.fetch(a, [0, 1]) as lease:
            lease.gather()
        ms.end_token()
        monkeypatch.setattr(moestream.Session, "_fetch", fetch)
        assert ms.used([(a, [1, 0])]) is True  # every one cached: no lease
        ms.used([(b, [2])])
        stats = ms.end_token(compute_ms=0.0)
    assert leases == [b] and (stats.hits, stats.misses) == (2, 1)


def test_a_bad_call_counts_nothing(tiny_model: Path) -> None:
    """A token's calls are checked before any is counted: an expert out of range in the
    last call leaves the first, all cached, uncounted too."""
    with moestream.open_sync(tiny_model, backend="host", mode="direct") as ms:
        a, b = ms.model.moe_layers[:2]
        with ms.fetch(a, [0]) as lease:
            lease.gather()
        ms.end_token()
        before = ms.counters().hits
        with pytest.raises(moestream.UsageError, match="not 999"):
            ms.used([(a, [0]), (b, [999])])
        assert ms.counters().hits == before
        assert ms.end_token(compute_ms=0.0).hits == 0


def test_cached_calls_are_counted_before_a_miss_evicts(tiny_model: Path) -> None:
    """A full cache and a token whose middle call misses: the cached calls are counted
    (touched) first, so the miss evicts an expert the token did not use, never the last
    call's (which would then miss too)."""
    with moestream.open_sync(tiny_model, backend="host", mode="direct", budget="8") as ms:
        a, b, c = ms.model.moe_layers[:3]
        # the cache full: c's expert 0 the least recently used, then a's 0..3, b's 4..6
        for layer, experts in ((c, [0]), (a, [0, 1, 2, 3]), (b, [4, 5, 6])):
            with ms.fetch(layer, experts) as lease:
                lease.gather()
        ms.end_token()
        assert ms.used([(a, [0]), (b, [1]), (c, [0])]) is False  # b's expert 1 missed
        stats = ms.end_token(compute_ms=0.0)
        assert (stats.hits, stats.misses) == (2, 1)
        assert ms.ready(c, [0]) and not ms.ready(a, [1])  # a's 1 went for it
