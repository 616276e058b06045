"""Cancellation and shutdown: SIGINT/SIGTERM to the CLI, and cancelling ``run`` as a library.

A signal or a cancel mid-token stops the run with its whole cleanup: in-flight reads finish
(or, still queued, are abandoned), uploads are synchronized, pinned and device memory is
released, reader threads are joined, the log ends with ``run_end`` (``exit: cancelled``).
The CLI exits 130 (SIGINT) or 143 (SIGTERM); a second SIGINT exits at once.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.faultmatrix import observe
from gpu.host import HostBackend
from pipeline.foundation.config import Budget, ComputeSpec, RunConfig
from pipeline.run import RunSummary, run

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _lines(log: Path) -> list[dict[str, Any]]:
    if not log.exists():
        return []
    out = []
    for line in log.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written right now
            break
    return out


def _wait_until(proc: subprocess.Popen[str], ready: Any, what: str, limit_s: float = 60) -> None:
    """Poll (the run's log flushes every 200 ms) until ``ready()``; fail if the run ends."""
    deadline = time.monotonic() + limit_s
    while not ready():
        if proc.poll() is not None:
            pytest.fail(f"run ended (exit {proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"no {what} within {limit_s} s")
        time.sleep(0.05)


class _Run:
    """``python -m pipeline.run`` in a subprocess, its log and stderr in files."""

    def __init__(self, model: Path, tmp: Path, *extra: str) -> None:
        self.log = tmp / "run.jsonl"
        self.err_path = tmp / "stderr.txt"
        self._err = self.err_path.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pipeline.run", "-m", str(model), "-n", "100000",
             "--compute", "fixed:1", "--backend", "host", "--log", str(self.log), *extra],
            cwd=REPO, stdout=subprocess.PIPE, stderr=self._err, text=True,
        )

    def events(self) -> list[dict[str, Any]]:
        return _lines(self.log)

    def has(self, event: str) -> bool:
        return any(e["event"] == event for e in self.events())

    def finish(self, limit_s: float = 60) -> tuple[int, str, str]:
        out, _ = self.proc.communicate(timeout=limit_s)
        self._err.close()
        return self.proc.returncode, out, self.err_path.read_text()


class TestSignals:
    """The CLI stops cleanly on SIGINT (130) and SIGTERM (143); a second SIGINT is final."""

    @pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)],
                             ids=["SIGINT", "SIGTERM"])
    def test_stop_mid_run(self, tiny_model: Path, tmp_path: Path, signum: int,
                          code: int) -> None:
        r = _Run(tiny_model, tmp_path)
        _wait_until(r.proc, lambda: r.has("token"), "token event")
        r.proc.send_signal(signum)
        rc, out, err = r.finish()
        assert rc == code
        last = r.events()[-1]
        assert last["event"] == "run_end" and last["exit"] == "cancelled"
        assert last["tokens"] >= 1 and last["mismatches"] == 0
        assert last["allocations"] == last["frees"]
        assert "verified:" in out  # the summary is printed
        name = signal.Signals(signum).name
        assert err.splitlines()[-1].startswith(f"moestream: interrupted by {name}")
        assert "Traceback" not in err

    def test_second_sigint_exits_at_once(self, tiny_model: Path, tmp_path: Path) -> None:
        """Cleanup waits for in-flight reads (5 s each here); a second SIGINT does not."""
        r = _Run(tiny_model, tmp_path, "--mode", "direct", "--queue-depth", "2",
                 "--inject", "slow_ms=5000@1+")
        _wait_until(r.proc, lambda: r.has("run_start"), "run_start event")
        r.proc.send_signal(signal.SIGINT)
        _wait_until(r.proc, lambda: "stopping" in r.err_path.read_text(), "first stop")
        t0 = time.monotonic()
        r.proc.send_signal(signal.SIGINT)
        rc, _, err = r.finish(limit_s=20)
        assert time.monotonic() - t0 < 2.5  # the reads in flight had ~5 s to go
        assert rc == 130
        assert "second interrupt: exiting at once" in err
        assert not r.has("run_end")  # no cleanup ran


def _moestream_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("moestream")]


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
def host_memory(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    """Every pinned-stand-in and device buffer the host backend hands out."""
    buffers: list[Any] = []
    alloc_host, alloc_device = HostBackend.alloc_host, HostBackend.alloc_device

    def host(self: HostBackend, nbytes: int) -> Any:
        buffers.append(alloc_host(self, nbytes))
        return buffers[-1]

    def device(self: HostBackend, nbytes: int) -> Any:
        buffers.append(alloc_device(self, nbytes))
        return buffers[-1]

    monkeypatch.setattr(HostBackend, "alloc_host", host)
    monkeypatch.setattr(HostBackend, "alloc_device", device)
    yield buffers


class TestLibraryCancel:
    """Cancelling the task running ``run`` does the CLI's cleanup and raises CancelledError."""

    def _cfg(self, model: Path, log: Path | None, **kw: Any) -> RunConfig:
        base: dict[str, Any] = {"model": model, "tokens": 100_000, "backend": "host",
                                "compute": ComputeSpec("fixed", 0.2), "log": log,
                                "budget": Budget(experts=6), "mode": "direct"}
        return RunConfig(**{**base, **kw})

    async def _cancel(self, cfg: RunConfig, *, after_tokens: int) -> RunSummary:
        summary = RunSummary()
        task = asyncio.ensure_future(run(cfg, summary=summary))
        # ``budget_bytes`` is set when decoding starts; tokens count as they end
        while summary.budget_bytes == 0 or summary.tokens < after_tokens:
            await asyncio.sleep(0.002)
            assert not task.done(), task
        if after_tokens == 0:
            await asyncio.sleep(0.05)  # the first token's loads are in flight
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 30)
        return summary

    @pytest.mark.parametrize(("extra", "after_tokens"), [
        ({}, 3),
        ({"faults": "slow_ms=200@1+", "queue_depth": 2}, 0),
        ({"mode": "resident"}, 3),
        ({"prefetch": "oracle", "lookahead": 2, "budget": Budget(experts=14)}, 2),
    ], ids=["mid-run", "reads-in-flight", "resident", "oracle-prefetch"])
    async def test_cancel_releases_everything(self, tiny_model: Path, tmp_path: Path,
                                              host_memory: list[Any], extra: dict[str, Any],
                                              after_tokens: int) -> None:
        fds = _open_fds()
        log = tmp_path / "run.jsonl"
        with observe() as seen:
            summary = await self._cancel(self._cfg(tiny_model, log, **extra),
                                         after_tokens=after_tokens)
        assert summary.exit == "cancelled" and summary.mismatches == 0
        assert _moestream_threads() == []
        assert _open_fds() == fds
        assert host_memory and all(b.array.size == 0 for b in host_memory), "memory not freed"
        assert seen.allocations == seen.frees_after_close
        pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        assert pending == []
        last = _lines(log)[-1]
        assert last["event"] == "run_end" and last["exit"] == "cancelled"
        assert last["tokens"] == summary.tokens

    async def test_cancel_at_first_suspension(self, tiny_model: Path) -> None:
        fds = _open_fds()
        task = asyncio.ensure_future(run(self._cfg(tiny_model, None)))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert _moestream_threads() == [] and _open_fds() == fds

    @pytest.mark.filterwarnings("ignore::ResourceWarning")
    async def test_cancel_while_the_log_opens(self, tiny_model: Path, tmp_path: Path) -> None:
        """The open, on an executor thread, completes after the cancel; the file it made is
        closed as soon as it does (not left to the garbage collector)."""
        fds = _open_fds()
        task = asyncio.ensure_future(run(self._cfg(tiny_model, tmp_path / "run.jsonl")))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        deadline = time.monotonic() + 5
        while _open_fds() != fds and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert _open_fds() == fds and _moestream_threads() == []
