"""Which path resident misses take on a GPU, and the settings that choose it.

The gather kernel serves models whose expert matrices are small (there it copies twice as
fast as the copy engines on the H200); larger matrices go to the copy engines, as fast
there and leaving the SMs to the engine (``pipeline.streamer.GATHER_BELOW_BYTES``).
``gather_blocks`` is the gather's SM budget, settable from the CLI, ``RunConfig`` and
``moestream.Tuning``, checked where it is given.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

import moestream
from gpu.kernels import GATHER_BLOCKS, HostKernels, make_kernels
from pipeline.foundation.config import RunConfig
from pipeline.foundation.errors import UsageError
from pipeline.foundation.table import open_table
from pipeline.modelgen import spec_for, write_model
from pipeline.streamer import GATHER_BELOW_BYTES, _small_ranges


def test_small_matrices_gather_large_ones_copy(tiny_model: Path, tmp_path: Path) -> None:
    assert _small_ranges(open_table(tiny_model))  # 256 KiB F16 matrices
    # 2048 x 1024 F16: 4 MiB matrices, over the line
    spec = dataclasses.replace(spec_for("tiny", layers=2, experts=2), hidden=2048,
                               expert_ffn=1024)
    big = open_table(write_model(spec, tmp_path / "big.gguf"))
    ranges = big.slices((big.moe_layers[0], 0)).ranges
    assert min(r.nbytes for r in ranges) >= GATHER_BELOW_BYTES
    assert not _small_ranges(big)


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
