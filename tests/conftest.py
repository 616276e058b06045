"""Shared fixtures: small real model files, and the backends every device test runs on."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from moestream.gpu.backend import Backend
from moestream.gpu.cuda import unavailable_reason
from moestream.gpu.host import HostBackend
from moestream.pipeline.foundation.table import ExpertTable, open_table
from moestream.pipeline.makers.modelgen import spec_for, write_model

_NO_CUDA = unavailable_reason()
BACKENDS = [
    pytest.param("host", id="host"),
    pytest.param(
        "cupy", id="cupy",
        marks=[pytest.mark.gpu, pytest.mark.skipif(_NO_CUDA is not None, reason=str(_NO_CUDA))],
    ),
]


@pytest.fixture(autouse=True)
def _reset_structlog() -> Iterator[None]:
    """Each test starts with structlog's defaults (the CLI reconfigures it)."""
    structlog.reset_defaults()
    yield
    structlog.reset_defaults()


@pytest.fixture(scope="session")
def _session_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("xdg-cache")


@pytest.fixture(autouse=True)
def _user_cache(monkeypatch: pytest.MonkeyPatch, _session_cache: Path) -> None:
    """Runs keep digest manifests (and the default model) in a cache of the session's, never
    in the user's (``XDG_CACHE_HOME``; subprocesses inherit it)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(_session_cache))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny preset, scaled down: 4 layers (1 dense, 3 MoE), 16 experts, F16."""
    path = tmp_path_factory.mktemp("models") / "tiny.gguf"
    return write_model(spec_for("tiny", layers=4, experts=16), path)


@pytest.fixture(scope="session")
def tiny_table(tiny_model: Path) -> ExpertTable:
    return open_table(tiny_model)


@pytest.fixture(scope="session")
def q2_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ds4-flash-q2 sizes (6.75 MiB experts), 2 layers x 8 experts."""
    path = tmp_path_factory.mktemp("models") / "q2.gguf"
    return write_model(spec_for("ds4-flash-q2", layers=2, experts=8), path)


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    """Every available backend: host always, CuPy where a CUDA device answers."""
    if request.param == "host":
        yield HostBackend()
    else:
        from moestream.gpu.cuda import CupyBackend

        b = CupyBackend()
        yield b
        b.close()
