"""Tests of the live router on ds4's layout: hash-routed layers take the file's tid2eid."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

from moestream.gpu.backend import Backend
from moestream.pipeline.foundation.errors import ExpertLayoutError
from moestream.pipeline.foundation.table import open_table
from moestream.pipeline.makers.modelgen import spec_for, write_model
from moestream.pipeline.streaming.routing import LiveRouter


@pytest.fixture(scope="module")
def ds4_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # F16 experts so the live router runs; 4 layers: three hash-routed, one top-k
    spec = spec_for("ds4-flash-f16", layers=4, experts=8)
    return write_model(spec, tmp_path_factory.mktemp("ds4") / "f16.gguf")


class TestHashTable:
    """A hash-routed layer routes a token to its row of the file's table, whatever the
    hidden state; the top-k layer still applies its router."""

    def test_rows(self, ds4_path: Path, backend: Backend) -> None:
        table = open_table(ds4_path)
        router = LiveRouter(table, backend)
        tensors = {t.name: t for t in GGUFReader(ds4_path).tensors}
        for i in range(table.hash_routed):
            ids = np.asarray(tensors[f"blk.{i}.ffn_gate_tid2eid.weight"].data)
            for token in (0, 5, ids.shape[0] + 5):
                hidden = router.embedding(token)
                experts, weights = router.route(token, i, hidden)
                assert experts == ids[token % ids.shape[0]].tolist()
                assert weights == [1.0 / table.top_k] * table.top_k
                assert router.predict(token, i, hidden) == experts
        experts, _ = router.route(5, 3, router.embedding(5))
        assert len(set(experts)) == table.top_k

    def test_out_of_range_refused(self, ds4_path: Path, tmp_path: Path,
                                  backend: Backend) -> None:
        bad = tmp_path / "bad.gguf"
        bad.write_bytes(ds4_path.read_bytes())
        t = {t.name: t for t in GGUFReader(bad).tensors}["blk.0.ffn_gate_tid2eid.weight"]
        with bad.open("r+b") as f:  # token 0's first expert: one past the last
            f.seek(int(t.data_offset))
            f.write(np.array([8], dtype="<i4").tobytes())
        router = LiveRouter(open_table(bad), backend)
        with pytest.raises(ExpertLayoutError, match=r"outside 0\.\.7"):
            router.route(0, 0, router.embedding(0))
