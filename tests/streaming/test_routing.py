"""Tests for pipeline.streaming.routing: trace replay, history guesses, the live router."""

from __future__ import annotations

import numpy as np
import pytest

from moestream.gpu.backend import Backend
from moestream.pipeline.foundation.table import ExpertTable
from moestream.pipeline.proxy.routing import TraceRouting
from moestream.pipeline.proxy.synthetic import synthetic_trace
from moestream.pipeline.streaming.routing import LiveRouter


class TestTraceRouting:
    """Replays rows cyclically; predicts a layer from the previous token."""

    def test_route_and_predict(self) -> None:
        trace = synthetic_trace("ds4-flash", 5, n_layers=3, n_experts=16, top_k=4)
        r = TraceRouting(trace)
        assert r.route(6, 1, None)[0] == trace.experts[1, 1].tolist()
        assert r.predict(3, 2, None) == trace.experts[2, 2].tolist()
        assert r.predict(0, 2, None) == []


class TestLiveRouter:
    """Applies the file's router to the hidden state, on every backend."""

    def test_top_k_matches_numpy(self, tiny_table: ExpertTable, backend: Backend) -> None:
        router = LiveRouter(tiny_table, backend)
        hidden = router.embedding(7)
        layer = tiny_table.moe_layers[-1]
        info = tiny_table.layers[layer].router
        assert info is not None
        with tiny_table.path.open("rb") as f:
            f.seek(info.offset)
            w = np.frombuffer(f.read(info.nbytes), "<f4").reshape(tiny_table.n_experts, -1)
        h = hidden if isinstance(hidden, np.ndarray) else hidden.get()
        want = np.argsort(-(w @ h))[: tiny_table.top_k]
        experts, weights = router.route(7, len(tiny_table.moe_layers) - 1, hidden)
        assert experts == want.tolist()
        assert sum(weights) == pytest.approx(1.0, abs=1e-5)
        assert weights == sorted(weights, reverse=True)

    def test_hash_routed_layer_uses_the_token(self, tiny_table: ExpertTable,
                                              backend: Backend) -> None:
        assert tiny_table.layers[tiny_table.moe_layers[0]].router is None
        router = LiveRouter(tiny_table, backend)
        a = router.route(1, 0, router.embedding(1))[0]
        assert a == router.route(1, 0, router.embedding(2))[0]  # hidden does not matter
        assert len(set(a)) == tiny_table.top_k

    def test_tokens_route_differently(self, tiny_table: ExpertTable, backend: Backend) -> None:
        router = LiveRouter(tiny_table, backend)
        i = len(tiny_table.moe_layers) - 1
        choices = {tuple(router.route(t, i, router.embedding(t))[0]) for t in range(20)}
        assert len(choices) > 5
