"""One file identity per run (issue 27): a model renamed over, replaced or written while a run
opens or reads it is caught, or never read; no byte of another file is ever reported verified.
"""

from __future__ import annotations

import os
import random
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import moestream
from moestream.gpu.host import HostBackend
from moestream.pipeline.foundation.errors import ModelChangedError, MoestreamError
from moestream.pipeline.foundation.manifest import DigestManifest
from moestream.pipeline.foundation.table import ExpertTable, open_table
from moestream.pipeline.makers.checkpointgen import CheckpointOptions, write_checkpoint
from moestream.pipeline.makers.modelgen import spec_for, write_model
from moestream.stages.manifest_build import ManifestBuilder
from moestream.stages.mapping import ModelMapping
from moestream.stages.reader import ModelReader
from moestream.stages.residency import Residency
from moestream.stages.warm import WarmEngine


@pytest.fixture(scope="module")
def twins(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two files of one size and layout, different bytes (seeds 0 and 7), no digests."""
    d = tmp_path_factory.mktemp("twins")
    a = write_model(spec_for("tiny", layers=2, experts=8), d / "a.gguf", record_digests=False)
    b = write_model(spec_for("tiny", layers=2, experts=8, seed=7), d / "b.gguf",
                    record_digests=False)
    assert a.stat().st_size == b.stat().st_size
    return a, b


def _expert_bytes(path: Path, table: ExpertTable, key: tuple[int, int]) -> bytes:
    with path.open("rb") as f:
        out = b""
        for r in table.slices(key).ranges:
            f.seek(r.offset)
            out += f.read(r.nbytes)
    return out


class TestBetweenHeaderAndOpen:
    """The table was read from one file; the path names another by the time a part opens it."""

    @pytest.fixture
    def swapped(self, twins: tuple[Path, Path], tmp_path: Path) -> ExpertTable:
        model = tmp_path / "model.gguf"
        shutil.copy(twins[0], model)
        table = open_table(model)
        spare = tmp_path / "spare.gguf"
        shutil.copy(twins[1], spare)
        os.replace(spare, model)
        return table

    def test_reader_refuses(self, swapped: ExpertTable) -> None:
        with pytest.raises(ModelChangedError, match="replaced"):
            ModelReader(swapped.files)

    def test_mapping_refuses(self, swapped: ExpertTable) -> None:
        with pytest.raises(ModelChangedError, match="replaced"):
            ModelMapping(swapped.files, HostBackend())

    def test_residency_and_warm_refuse(self, swapped: ExpertTable) -> None:
        with pytest.raises(ModelChangedError):
            Residency.of_files(swapped.files)
        with pytest.raises(ModelChangedError):
            WarmEngine(swapped.files)

    async def test_manifest_builder_refuses(self, swapped: ExpertTable) -> None:
        with pytest.raises(ModelChangedError):
            async with ManifestBuilder(swapped, DigestManifest.empty(swapped)) as builder:
                await builder.build()

    def test_in_place_write_refused(self, twins: tuple[Path, Path], tmp_path: Path) -> None:
        model = tmp_path / "model.gguf"
        shutil.copy(twins[0], model)
        table = open_table(model)
        with model.open("r+b") as f:
            f.seek(table.files[0].nbytes // 2)
            f.write(b"\x55" * 64)
        with pytest.raises(ModelChangedError, match="modified"):
            ModelReader(table.files)


@pytest.mark.parametrize("mode", ["direct", "resident"])
def test_rename_at_random_moments(twins: tuple[Path, Path], tmp_path: Path, mode: str) -> None:
    """A rename of the twin over the model at a random moment of open, decode or close: the
    session raises a moestream error, or every byte it handed out is of the one file whose
    header it read (the first, or the twin when the rename came first)."""
    table = open_table(twins[0])  # the twins share one layout
    keys = [(layer, e) for layer in table.moe_layers for e in range(8)]
    truths = [{key: _expert_bytes(twin, table, key) for key in keys} for twin in twins]

    def session(model: Path, seen: dict[tuple[int, int], bytes]) -> None:
        ms = moestream.open_sync(model, budget="8", mode=mode)  # type: ignore[arg-type]
        try:
            for token in range(6):
                for layer in ms.model.moe_layers:
                    experts = [(token * 3 + layer + i) % 8 for i in range(ms.model.top_k)]
                    with ms.fetch(layer, experts) as lease:
                        for h in lease:
                            seen[h.key] = b"".join(
                                np.asarray(m.bytes).tobytes() for m in h.matrices)
                ms.end_token()
        finally:
            ms.close()

    started = time.perf_counter()
    session(twins[0], {})
    span_s = time.perf_counter() - started  # renames land anywhere in a session's life
    rng = random.Random(27)
    outcomes = {"caught": 0, "clean": 0}
    for attempt in range(16):
        model = tmp_path / f"model{attempt}.gguf"
        spare = tmp_path / f"spare{attempt}.gguf"
        shutil.copy(twins[0], model)
        shutil.copy(twins[1], spare)
        timer = threading.Timer(rng.uniform(0.0, span_s), os.replace, (spare, model))
        timer.start()
        seen: dict[tuple[int, int], bytes] = {}
        try:
            session(model, seen)
        except MoestreamError:
            outcomes["caught"] += 1
        else:
            outcomes["clean"] += 1
        finally:
            timer.join()
        # renamed before the session read the header: the model is the twin, consistently
        assert any(all(got == truth[key] for key, got in seen.items()) for truth in truths), \
            f"attempt {attempt}: the session handed out bytes of both files"
    assert sum(outcomes.values()) == 16, outcomes


@pytest.mark.parametrize("mode", ["direct", "resident"])
def test_checkpoint_shard_written_mid_decode(tmp_path: Path, mode: str) -> None:
    """A shard of a checkpoint written in place while a session decodes: the session raises
    (a changed file, or bytes that fail verification) before it can close clean."""
    model = tmp_path / "ckpt"
    write_checkpoint(spec_for("tiny", layers=2, experts=8), model,
                     CheckpointOptions(shard_bytes=1 << 20))
    table = open_table(model)
    assert len(table.files) > 2
    with pytest.raises((ModelChangedError, moestream.VerificationError)):
        ms = moestream.open_sync(model, budget="8", mode=mode)  # type: ignore[arg-type]
        try:
            for token in range(8):
                if token == 2:
                    for f in table.files:
                        with f.path.open("r+b") as out:
                            out.seek(f.nbytes - 64)
                            out.write(b"\xff" * 64)
                for layer in ms.model.moe_layers:
                    experts = [(token * 2 + i) % 8 for i in range(ms.model.top_k)]
                    with ms.fetch(layer, experts) as lease:
                        for _ in lease:
                            pass
                ms.end_token()
        finally:
            ms.close()
