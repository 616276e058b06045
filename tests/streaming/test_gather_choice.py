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
from moestream.pipeline.foundation.digest import digest_bytes
from moestream.pipeline.foundation.errors import UsageError
from moestream.pipeline.foundation.table import open_table
from moestream.pipeline.makers.modelgen import spec_for, write_model
from moestream.pipeline.proxy.config import RunConfig
from moestream.pipeline.streaming.registered import (
    GATHER_BELOW_BYTES,
    TRIAL_LAYERS,
    PathTrial,
    _small_ranges,
)
from moestream.pipeline.streaming.streamer import ExpertStreamer
from tests.reclaim import held_resident


def test_small_matrices_gather_large_ones_copy(tiny_model: Path, tmp_path: Path) -> None:
    assert _small_ranges(open_table(tiny_model))  # 256 KiB F16 matrices
    # 2048 x 1024 F16: 4 MiB matrices, over the line
    spec = dataclasses.replace(spec_for("tiny", layers=2, experts=2), hidden=2048,
                               expert_ffn=1024)
    big = open_table(write_model(spec, tmp_path / "big.gguf"))
    ranges = big.slices((big.moe_layers[0], 0)).ranges
    assert min(r.nbytes for r in ranges) >= GATHER_BELOW_BYTES
    assert not _small_ranges(big)


def _paths_taken(tiny_model: Path, monkeypatch: pytest.MonkeyPatch, backend: Any,
                 gather: bool = True, layers: int = 1) -> tuple[list[list[str]], list[str]]:
    """The uploader's calls for each of ``layers`` resident layer loads of two misses on
    ``backend`` (registered copies, deferred: run when waited for), each load's experts
    arrived without error and their install digests those of the file's bytes; and the
    streamer's ``registered_path`` before the first load and after the last."""
    import asyncio

    from moestream.gpu.cache.store import DeviceCache
    from moestream.pipeline.foundation.config import ComputeSpec
    from moestream.stages.layout import plan_expert
    from moestream.stages.upload import Uploader
    from tests.streaming.test_pipeline import DeferredKernels

    table = open_table(tiny_model)
    called: list[list[str]] = []
    said: list[str] = []

    def spy(self: Uploader, name: str, real: Any, *args: Any) -> Any:
        called[-1].append(name)
        return real(self, *args)

    for name in ("gather", "upload_layer"):
        real = getattr(Uploader, name)
        monkeypatch.setattr(Uploader, name, functools.partialmethod(spy, name, real))

    async def go() -> None:
        size = plan_expert(table.slices((table.moe_layers[0], 0))).device_bytes
        cache = DeviceCache(backend, 1 << 30, "lru", min_bytes=table.top_k * size)
        cfg = RunConfig(model=table.path, compute=ComputeSpec("digest"), gather=gather)
        streamer = ExpertStreamer(cfg, table, backend, cache, DeferredKernels())
        try:
            with held_resident(table.path):  # only windows with every page resident register
                await streamer.set_mode("resident")
            said.append(streamer.registered_path)
            for i in range(layers):
                called.append([])
                layer = table.moe_layers[i % len(table.moe_layers)]
                load = streamer.start_layer(layer, [2 * (i // len(table.moe_layers)),
                                                    2 * (i // len(table.moe_layers)) + 1])
                for _ in range(load.pending):
                    assert load.arrived is not None
                    _, error = await load.arrived.get()
                    assert error is None
            assert streamer.digests is not None
            made = streamer.digests.take(wait=True)
            assert len(made.keys) == 2 * layers
            for key, values in zip(made.keys, made.values, strict=True):
                assert [int(v) for v in values] == [
                    digest_bytes(table.read_bytes(r.offset, r.nbytes))
                    for r in table.slices(key).ranges]
            said.append(streamer.registered_path)
        finally:
            await streamer.aclose()
            cache.close()

    asyncio.run(go())
    return called, said


@pytest.mark.parametrize("gather", [True, False])
def test_small_experts_gather_unless_told(tiny_model: Path, gather: bool,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Small matrices (the tiny preset's 256 KiB) go through one gather launch a layer;
    with ``gather=False`` a layer is one batched copy on the copy engines. The host
    backend's copies are memcpy either way: no trial there."""
    from tests.streaming.test_streamer import RegisteringDeferredBackend

    called, said = _paths_taken(tiny_model, monkeypatch, RegisteringDeferredBackend(), gather)
    assert called == [["gather"] if gather else ["upload_layer"]]
    assert said == ["gather" if gather else "copy_engines"] * 2


def test_a_devices_first_layers_try_both(tiny_model: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """On a device (not the host stand-in) the first ``TRIAL_LAYERS`` layer loads go both
    ways, in turns which first, each waited for; then the faster one alone, as the trial
    logged it, and its copies cut again for it alone."""
    import structlog

    from tests.streaming.test_streamer import RegisteringDeferredBackend

    class Device(RegisteringDeferredBackend):
        name = "device"

    with structlog.testing.capture_logs() as logs:
        called, said = _paths_taken(tiny_model, monkeypatch, Device(), layers=TRIAL_LAYERS + 3)
    both = [["gather", "upload_layer"], ["upload_layer", "gather"]]
    assert called[:TRIAL_LAYERS] == [both[i % 2] for i in range(TRIAL_LAYERS)]
    chosen = [e for e in logs if e["event"] == "registered_path_chosen"]
    assert len(chosen) == 1 and chosen[0]["gather_gbps"] > 0 and chosen[0]["copy_gbps"] > 0
    alone = "gather" if chosen[0]["path"] == "gather" else "upload_layer"
    assert called[TRIAL_LAYERS:] == [[alone]] * 3
    assert said == ["trial", chosen[0]["path"]]  # what the run's log ends with


def test_the_trial_picks_the_faster() -> None:
    """The first layer's times are not counted (the gather's module loads then); the
    choice comes with the last layer of the trial."""
    trial = PathTrial(layers=3)
    assert trial.add(9.0, 1.0, 100) is None  # not counted
    assert trial.add(1.0, 2.0, 100) is None
    assert trial.add(1.0, 2.0, 100) is True
    assert (trial.gather_s, trial.copy_s, trial.nbytes) == (2.0, 4.0, 200)
    slower = PathTrial(layers=2)
    slower.add(0.0, 5.0, 1)
    assert slower.add(3.0, 2.0, 1) is False


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
