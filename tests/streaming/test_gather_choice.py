"""Which path resident misses take on a GPU, and the settings that choose it.

The gather kernel serves models whose expert matrices are small (there the host's work a
layer is lightest: one launch copies and digests); larger matrices go to the copy engines,
a layer's copies as one batched call, as fast or faster and leaving the SMs to the engine
(``moestream.pipeline.streaming.streamer.GATHER_BELOW_BYTES``).
``gather_blocks`` is the gather's SM budget, settable from the CLI, ``RunConfig`` and
``moestream.Tuning``, checked where it is given.
"""

from __future__ import annotations

import dataclasses
import functools
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import moestream
from moestream.gpu.kernels import GATHER_BLOCKS, HostKernels, make_kernels
from moestream.pipeline.foundation.errors import UsageError
from moestream.pipeline.foundation.table import open_table
from moestream.pipeline.makers.modelgen import spec_for, write_model
from moestream.pipeline.proxy.config import RunConfig
from moestream.pipeline.streaming.registered import GATHER_BELOW_BYTES, _small_ranges
from moestream.pipeline.streaming.streamer import ExpertStreamer


def test_small_matrices_gather_large_ones_copy(tiny_model: Path, tmp_path: Path) -> None:
    assert _small_ranges(open_table(tiny_model))  # 256 KiB F16 matrices
    # 2048 x 1024 F16: 4 MiB matrices, over the line
    spec = dataclasses.replace(spec_for("tiny", layers=2, experts=2), hidden=2048,
                               expert_ffn=1024)
    big = open_table(write_model(spec, tmp_path / "big.gguf"))
    ranges = big.slices((big.moe_layers[0], 0)).ranges
    assert min(r.nbytes for r in ranges) >= GATHER_BELOW_BYTES
    assert not _small_ranges(big)


@pytest.mark.parametrize("gather", [True, False])
def test_small_experts_gather_unless_told(tiny_model: Path, gather: bool,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Small matrices (the tiny preset's 256 KiB) go through one gather launch a layer;
    with ``gather=False`` a layer is one batched copy on the copy engines."""
    import asyncio

    from moestream.gpu.cache.store import DeviceCache
    from moestream.pipeline.foundation.config import ComputeSpec
    from moestream.stages.layout import plan_expert
    from moestream.stages.upload import Uploader
    from tests.streaming.test_pipeline import DeferredKernels
    from tests.streaming.test_streamer import RegisteringDeferredBackend

    table = open_table(tiny_model)
    backend = RegisteringDeferredBackend()
    called: list[str] = []

    def spy(self: Uploader, name: str, real: Any, *args: Any) -> Any:
        called.append(name)
        return real(self, *args)

    for name in ("gather", "upload_layer"):
        real = getattr(Uploader, name)
        monkeypatch.setattr(Uploader, name, functools.partialmethod(spy, name, real))

    async def go() -> None:
        size = plan_expert(table.slices((table.moe_layers[0], 0))).device_bytes
        cache = DeviceCache(backend, 1 << 30, "lru", min_bytes=table.top_k * size)
        cfg = RunConfig(model=table.path, compute=ComputeSpec("digest"), gather=gather)
        streamer = ExpertStreamer(cfg, table, backend, cache, DeferredKernels())
        with table.path.open("rb") as f:  # only windows with every page resident register
            while f.read(8 << 20):
                pass
        try:
            await streamer.set_mode("resident")
            load = streamer.start_layer(table.moe_layers[0], [0, 1])
            for _ in range(load.pending):
                assert load.arrived is not None
                _, error = await load.arrived.get()
                assert error is None
        finally:
            await streamer.aclose()
            cache.close()

    asyncio.run(go())
    assert called == (["gather"] if gather else ["upload_layer"])


def test_gather_blocks_checked_everywhere(tiny_model: Path) -> None:
    with pytest.raises(UsageError, match="--gather-blocks must be >= 1"):
        RunConfig(model=tiny_model, gather_blocks=0)
    with pytest.raises(UsageError, match=r"Tuning\.gather_blocks"):
        moestream.Tuning(gather_blocks=0)
    with pytest.raises(TypeError, match=r"Tuning\.gather must be True or False"):
        moestream.Tuning(gather=1)  # type: ignore[arg-type]
    assert RunConfig(model=tiny_model).gather_blocks == GATHER_BLOCKS
    assert isinstance(make_kernels("host", 2), HostKernels)


def test_cli_refuses_a_zero_budget(tiny_model: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "pipeline.run", "-m", str(tiny_model),
                           "-n", "1", "--gather-blocks", "0"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--gather-blocks must be >= 1" in done.stderr
    assert "Traceback" not in done.stderr


def test_session_with_copy_engines_only(tiny_model: Path) -> None:
    """An engine that wants every SM for itself opens with ``Tuning(gather=False)``."""
    with moestream.open_sync(tiny_model, backend="host",
                             tuning=moestream.Tuning(gather=False, gather_blocks=2)) as ms:
        with ms.fetch(ms.model.moe_layers[0], [0, 1]) as lease:
            assert len(lease.gather()) == 2
        ms.end_token()
