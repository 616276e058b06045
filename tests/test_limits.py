"""Upper bounds on every tuning value, the staging ring's memory, and error lines cut short.

A tuning value is refused in one line (``UsageError``, exit 2 from the CLI) by one table,
``moestream.pipeline.foundation.config.TUNING_BOUNDS``, which the API's ``Tuning`` and the command
line's flags both check. A staging ring is refused before it is allocated when it would
take more than half the RAM available; a ``MemoryError`` met while a session opens becomes
``DeviceMemoryError`` with everything released. Every error message is one readable line:
control characters escaped, cut to ``MAX_MESSAGE_CHARS`` in the middle.
"""

from __future__ import annotations

import asyncio
import resource
import subprocess
import sys
from collections import namedtuple
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
from hypothesis import given
from hypothesis import strategies as st

import moestream
from moestream.gpu.host import HostBackend, HostPinned
from moestream.pipeline.cli.common import print_error
from moestream.pipeline.foundation.config import TUNING_BOUNDS
from moestream.pipeline.foundation.errors import (
    MAX_MESSAGE_CHARS,
    DeviceMemoryError,
    ModelFileError,
    MoestreamError,
    ReadError,
    UsageError,
    one_line,
)
from moestream.pipeline.proxy.config import RunConfig
from moestream.pipeline.run import main as run_main
from moestream.stages.staging import StagingRing, StagingSlot, check_ring_fits

REPO = Path(__file__).resolve().parents[1]
AS_LIMIT = 2 << 30
"""The address space a CLI subprocess gets: a bound that was not enforced dies there."""

TUNING_NAMES = ("queue_depth", "chunk_bytes", "staging_slots", "upload_streams",
                "gather_blocks", "layers_in_flight", "sample_ms", "dwell_s", "ram_limit",
                "margin_bytes")
CONFIG_NAMES = ("queue_depth", "chunk_bytes", "staging_slots", "upload_streams",
                "gather_blocks", "lookahead", "sample_ms", "dwell_s", "ram_limit",
                "margin_bytes")


def _above(name: str) -> int | float:
    """A value just above ``name``'s upper bound, of the setting's type."""
    high = TUNING_BOUNDS[name].high
    if name == "chunk_bytes":
        return int(high) + 4096
    if name in ("sample_ms", "dwell_s"):
        return float(high) * 1.5
    return int(high) + 1


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (AS_LIMIT, AS_LIMIT))


def _one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, text[-2000:]
    assert "Traceback" not in text
    return lines[0]


class TestTuningBounds:
    """Each tuning value has an upper bound, refused in one line by the API and the CLI."""

    @pytest.mark.parametrize("name", TUNING_NAMES)
    def test_api_refuses_above(self, name: str) -> None:
        given: dict[str, Any] = {name: _above(name)}
        with pytest.raises(UsageError, match=rf"Tuning\.{name} must be <= ") as caught:
            moestream.Tuning(**given)
        assert "\n" not in str(caught.value)

    @pytest.mark.parametrize("name", TUNING_NAMES)
    def test_api_takes_the_bound_itself(self, name: str) -> None:
        high = TUNING_BOUNDS[name].high
        given: dict[str, Any] = {
            name: float(high) if name in ("sample_ms", "dwell_s") else int(high)}
        assert getattr(moestream.Tuning(**given), name) == given[name]

    @pytest.mark.parametrize("name", CONFIG_NAMES)
    def test_run_config_refuses_above(self, name: str) -> None:
        bound = TUNING_BOUNDS[name]
        given: dict[str, Any] = {name: _above(name)}
        with pytest.raises(UsageError, match=f"{bound.flag or name} must be <= "):
            RunConfig(**given)

    def test_defaults_lie_within(self) -> None:
        tuning, config = moestream.Tuning(), RunConfig()
        for name in TUNING_NAMES:
            value = getattr(tuning, name)
            assert value is None or TUNING_BOUNDS[name].low <= value <= TUNING_BOUNDS[name].high
        for name in CONFIG_NAMES:
            value = getattr(config, name)
            assert value is None or TUNING_BOUNDS[name].low <= value <= TUNING_BOUNDS[name].high

    def test_a_number_of_thousands_of_digits_is_named_by_its_size(self) -> None:
        with pytest.raises(UsageError) as caught:
            moestream.Tuning(staging_slots=10**4000)
        assert "2**13287 or more" in str(caught.value)
        assert len(str(caught.value)) < 200

    def test_nan_is_outside_every_range(self) -> None:
        with pytest.raises(UsageError, match="--sample-ms must be >= 1"):
            RunConfig(sample_ms=float("nan"))

    @pytest.mark.parametrize(("argv", "words"), [
        (["--queue-depth", "100000"], "--queue-depth must be <= 64"),
        (["--streams", "1000"], "--streams must be <= 16"),
        (["--chunk", "1GiB"], "--chunk must be <= 268435456"),
        (["--gather-blocks", "100000"], "--gather-blocks must be <= 1024"),
        (["--lookahead", "100000"], "--lookahead must be <= 256"),
        (["--sample-ms", "1e9"], "--sample-ms must be <= 60000"),
        (["--ram-limit", "8000000TiB"], "larger than"),
    ])
    def test_cli_refuses_in_one_line(self, capsys: pytest.CaptureFixture[str],
                                     tiny_model: Path, argv: list[str], words: str) -> None:
        code = run_main(["-m", str(tiny_model), "-n", "1", "--backend", "host", *argv])
        line = _one_line(capsys.readouterr().err)
        assert code == 2 and line.startswith("moestream: error: ") and words in line

    @pytest.mark.parametrize("argv", [["--staging-slots", "10000000"],
                                      ["--queue-depth", "100000"]])
    def test_cli_subprocess_exits_2_at_once(self, argv: list[str]) -> None:
        """The runs that were OOM-killed and that made 22,119 threads, under 2 GiB."""
        done = subprocess.run([sys.executable, "-m", "pipeline.run", *argv], cwd=REPO,
                              capture_output=True, text=True, preexec_fn=_limited,
                              timeout=120, check=False)
        line = _one_line(done.stderr)
        assert done.returncode == 2 and "must be <= " in line


class TestStagingRingMemory:
    """A staging ring is measured against the RAM available before it is allocated."""

    def test_too_many_slots_name_those_that_fit(self) -> None:
        with pytest.raises(UsageError, match="give at most 5 staging slots"):
            check_ring_fits(1024, 1 << 20, available_bytes=10 << 20)
        check_ring_fits(5, 1 << 20, available_bytes=10 << 20)

    def test_not_even_one_slot(self) -> None:
        with pytest.raises(DeviceMemoryError, match="one staging slot"):
            check_ring_fits(1, 8 << 20, available_bytes=10 << 20)

    def test_open_refuses_before_allocating(self, tiny_model: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
        allocated: list[int] = []

        def alloc_host(self: HostBackend, nbytes: int) -> HostPinned:
            allocated.append(nbytes)
            return HostPinned(nbytes)

        monkeypatch.setattr(HostBackend, "alloc_host", alloc_host)
        memory = namedtuple("memory", "available")
        machine = SimpleNamespace(virtual_memory=lambda: memory(64 << 20))
        monkeypatch.setattr("moestream.stages.staging.psutil", machine)  # the ring's reading only
        with pytest.raises(UsageError, match="staging slots") as caught:
            moestream.open_sync(tiny_model, backend="host",
                                tuning=moestream.Tuning(staging_slots=1024))
        assert allocated == []
        assert "\n" not in str(caught.value)


class _Tracked(HostPinned):
    """A host staging buffer that records its release."""

    closed: ClassVar[list[int]] = []

    def close(self) -> None:
        _Tracked.closed.append(self.nbytes)
        super().close()


class TestMemoryErrorOnOpen:
    """A ``MemoryError`` while opening is the documented ``DeviceMemoryError``."""

    def test_host_allocation(self, monkeypatch: pytest.MonkeyPatch) -> None:
        def refuse(nbytes: int, align: int = 4096) -> Any:
            raise MemoryError

        monkeypatch.setattr("moestream.gpu.host.aligned_host_array", refuse)
        with pytest.raises(DeviceMemoryError, match="allocation of 4096 bytes failed"):
            HostBackend().alloc_host(4096)
        with pytest.raises(DeviceMemoryError):
            HostBackend().alloc_device(4096)

    def test_ring_releases_what_it_got(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """A failure part way that is not an allocation's frees the slots made before."""
        made: list[int] = []

        def slot(index: int, buffer: HostPinned) -> StagingSlot:
            made.append(index)
            if len(made) == 3:
                raise MemoryError
            return StagingSlot(index, buffer)

        _Tracked.closed = []
        monkeypatch.setattr(HostBackend, "alloc_host", lambda self, n: _Tracked(n))
        monkeypatch.setattr("moestream.stages.staging.StagingSlot", slot)
        with pytest.raises(MemoryError):
            StagingRing(HostBackend(), 8, 4096)
        assert len(_Tracked.closed) == 2

    def test_open_releases_and_says_device_memory(self, tiny_model: Path, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
        def out_of_memory(*args: object, **kwargs: object) -> None:
            raise MemoryError

        _Tracked.closed = []
        monkeypatch.setattr(HostBackend, "alloc_host", lambda self, n: _Tracked(n))
        # after the ring
        monkeypatch.setattr("moestream.pipeline.streaming.session.EventJoiner", out_of_memory)
        log = tmp_path / "run.jsonl"

        async def go() -> None:
            await moestream.open(tiny_model, backend="host", log=log)

        with pytest.raises(DeviceMemoryError, match="memory ran out while opening") as caught:
            asyncio.run(go())
        assert caught.value.__context__ is None and caught.value.__cause__ is None
        assert len(_Tracked.closed) == moestream.Tuning().staging_slots  # the ring, freed
        assert '"run_end"' in log.read_text().splitlines()[-1]


class TestErrorLength:
    """Every error message is one line of readable length, whoever built it."""

    def test_long_detail_is_cut_in_the_middle(self) -> None:
        detail = ", ".join(str(n) for n in range(20_000))
        error = UsageError(f"the trace routes layers {detail}; the model has 48")
        text = str(error)
        assert len(text) <= MAX_MESSAGE_CHARS
        assert text.startswith("the trace routes layers 0, 1, 2")
        assert text.endswith("the model has 48")
        assert "more characters) ..." in text

    def test_a_100k_character_detail(self) -> None:
        for error in (MoestreamError("x" * 100_000), ReadError("y" * 100_000),
                      ModelFileError("model.gguf", "shape (" + "9" * 100_000 + ")")):
            assert len(str(error)) <= MAX_MESSAGE_CHARS
        assert isinstance(ReadError("x"), OSError)
        assert str(ModelFileError("m.gguf", "bad")) == "m.gguf: bad"

    def test_control_characters_escaped(self) -> None:
        assert str(UsageError("mode '\x1b[2J'\nnext")) == "mode '\\x1b[2J'\\nnext"

    def test_cli_line_is_cut(self, capsys: pytest.CaptureFixture[str],
                             tiny_model: Path) -> None:
        code = run_main(["-m", str(tiny_model), "--backend", "host",
                         "--compute", "fixed:" + "9" * 5000])
        line = _one_line(capsys.readouterr().err)
        assert code == 2 and len(line) <= MAX_MESSAGE_CHARS + len("moestream: error: ")

    def test_print_error_cuts_any_error(self, capsys: pytest.CaptureFixture[str]) -> None:
        print_error("tool: ", ValueError("z" * 100_000 + "\x1b"))
        line = _one_line(capsys.readouterr().err)
        assert len(line) <= MAX_MESSAGE_CHARS + len("tool: ") and "\x1b" not in line

    @given(st.text(max_size=2000))
    def test_one_line_is_short_and_printable(self, text: str) -> None:
        cut = one_line(text)
        assert len(cut) <= MAX_MESSAGE_CHARS
        assert "\n" not in cut and "\x1b" not in cut and "\r" not in cut
        if text.isprintable() and len(text) <= MAX_MESSAGE_CHARS:
            assert cut == text
