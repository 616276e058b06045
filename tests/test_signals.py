"""Cancellation and shutdown: SIGINT/SIGTERM to the CLI, and cancelling ``run`` as a library.

A signal or a cancel mid-token stops the run with its whole cleanup: in-flight reads finish
(or, still queued, are abandoned), uploads are synchronized, pinned and device memory is
released, reader threads are joined, the log ends with ``run_end`` (``exit: cancelled``).
The CLI exits 130 (SIGINT), 143 (SIGTERM) or 129 (SIGHUP); a second SIGINT exits at once.
A signal at any earlier or later moment (imports, before or while the log opens, during the
cleanup, after it) gives the same status, a log that ends with ``run_end`` or no log, no
traceback and no temporary file; inputs that would block (FIFOs, devices) and compute that
would never end are refused up front.
"""

from __future__ import annotations

import asyncio
import contextlib
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

from moestream.gpu.host import HostBackend
from moestream.pipeline.cli.run import RunSummary, run
from moestream.pipeline.foundation.config import Budget, ComputeSpec
from moestream.pipeline.proxy.config import RunConfig
from tests.fault_matrix import observe

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
    """The CLI stops cleanly on SIGINT (130), SIGTERM (143) and SIGHUP (129); a second
    SIGINT is final."""

    @pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143),
                                                  (signal.SIGHUP, 129)],
                             ids=["SIGINT", "SIGTERM", "SIGHUP"])
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


_STOPS = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGHUP: 129}


def _name(value: object) -> str:
    """Test ids: signals by name."""
    return value.name if isinstance(value, signal.Signals) else str(value)


def _assert_stopped(signum: int, rc: int, err: str, log: Path, directory: Path) -> None:
    """The promise for a signal at any moment: its status, a log that ends with ``run_end``
    (or none), no traceback, no temporary file left next to the outputs."""
    assert rc == _STOPS[signum], err
    assert "Traceback" not in err
    assert f"interrupted by {signal.Signals(signum).name}" in err
    events = _lines(log)
    assert not log.exists() or (events and events[-1]["event"] == "run_end"), events[-1:]
    assert [p.name for p in directory.iterdir() if p.name.startswith(".")] == []


# Runs the CLI in-process after patching one step of the run to signal the process itself:
# the signal lands exactly at that step, whatever the machine's speed.
_SIGNAL_AT = """
import os, signal, sys
import moestream.pipeline.cli.run as cli
import moestream.pipeline.streaming.session as session

step, signum, argv = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
owner, name = {
    "before-log": (cli, "open_table"),          # the run's first step, no await yet
    "log-opening": (session.RunLog, "open"),    # the run's first await (the session's open)
    "log-open": (session, "machine_info"),      # the log is open, run_start not yet written
    "first-token": (cli.DecodeLoop, "token"),
    "closing": (cli, "_close"),                 # the run is done and cleaning up
    "after-run": (cli, "print_summary"),        # the loop is gone, the log closed
}[step]
original = getattr(owner, name)
sent = []

def signal_first(*args, **kwargs):
    if not sent:
        sent.append(signum)
        os.kill(os.getpid(), signum)
    return original(*args, **kwargs)

setattr(owner, name, signal_first)
sys.exit(cli.main(argv))
"""


class TestSignalAtAnyMoment:
    """From the first instruction to the last, a signal gives its status and a log that
    ends with ``run_end`` or no log (it used to exit 0 with an empty log when it came while
    the log opened, print a traceback during the imports, and die of SIGHUP)."""

    @pytest.mark.parametrize(("step", "signum"), [
        ("before-log", signal.SIGINT),
        ("log-opening", signal.SIGTERM),
        ("log-opening", signal.SIGHUP),
        ("log-opening", signal.SIGINT),
        ("log-open", signal.SIGHUP),
        ("first-token", signal.SIGTERM),
        ("closing", signal.SIGINT),
        ("after-run", signal.SIGHUP),
    ], ids=_name)
    def test_signal_at_each_step(self, tiny_model: Path, tmp_path: Path, step: str,
                                 signum: int) -> None:
        log = tmp_path / "run.jsonl"
        proc = subprocess.run(
            [sys.executable, "-c", _SIGNAL_AT, step, str(int(signum)), "-m", str(tiny_model),
             "-n", "3", "--compute", "fixed:0.1", "--backend", "host", "--log", str(log),
             "--record-trace", str(tmp_path / "routing.npz")],
            cwd=REPO, capture_output=True, text=True, timeout=60, check=False,
        )
        _assert_stopped(signum, proc.returncode, proc.stderr, log, tmp_path)
        if step in ("log-opening", "log-open", "first-token", "closing"):
            assert _lines(log)[-1]["event"] == "run_end"  # the log was open: it is closed
        if step == "closing":
            assert _lines(log)[-1]["exit"] == "ok"  # the run had finished

    @pytest.mark.parametrize("signum", list(_STOPS), ids=_name)
    def test_signal_during_imports(self, tiny_model: Path, tmp_path: Path, signum: int) -> None:
        """``-X importtime`` reports each import as it ends: the signal comes once numpy's
        first module is in, with the rest of the imports to go."""
        log, err_path = tmp_path / "run.jsonl", tmp_path / "stderr.txt"
        with err_path.open("w") as err:
            proc = subprocess.Popen(
                [sys.executable, "-X", "importtime", "-m", "pipeline.run", "-m",
                 str(tiny_model), "-n", "100000", "--compute", "fixed:1", "--backend", "host",
                 "--log", str(log)],
                cwd=REPO, stdout=subprocess.DEVNULL, stderr=err, text=True,
            )
            _wait_until(proc, lambda: "numpy" in err_path.read_text(), "numpy import")
            proc.send_signal(signum)
            rc = proc.wait(timeout=60)
        _assert_stopped(signum, rc, err_path.read_text(), log, tmp_path)

    @pytest.mark.parametrize(("signum", "delay_s"), [
        (signal.SIGINT, 0.1), (signal.SIGTERM, 0.3), (signal.SIGHUP, 0.5),
    ], ids=_name)
    def test_sweep_of_early_moments(self, tiny_model: Path, tmp_path: Path, signum: int,
                                    delay_s: float) -> None:
        """A signal some time after the start, whatever it hits (imports, start, decode)."""
        r = _Run(tiny_model, tmp_path)
        time.sleep(delay_s)
        r.proc.send_signal(signum)
        rc, _, err = r.finish()
        if rc == -signum:  # it came before the module's first line: nothing was made
            assert not r.log.exists()
            return
        _assert_stopped(signum, rc, err, r.log, tmp_path)


class TestInputsThatWouldBlock:
    """Inputs that are FIFOs or devices, and compute that never ends, are refused at once
    with one line and exit 2 (they used to hang the run beyond the reach of signals)."""

    @pytest.mark.parametrize("option", ["--trace", "--model"])  # --log: tests/test_outputs.py
    def test_fifo_option(self, tiny_model: Path, tmp_path: Path, option: str) -> None:
        fifo = tmp_path / "fifo"
        os.mkfifo(fifo)
        args = {"--model": str(tiny_model), option: str(fifo)}
        proc = subprocess.run(
            [sys.executable, "-m", "pipeline.run", "-n", "2", "--backend", "host",
             *[x for kv in args.items() for x in kv]],
            cwd=REPO, capture_output=True, text=True, timeout=30, check=False,
        )
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.splitlines()[-1].startswith("moestream: error: ")
        assert "FIFO" in proc.stderr.splitlines()[-1] or "regular" in proc.stderr
        assert "Traceback" not in proc.stderr

    @pytest.mark.parametrize("path", ["fifo", "/dev/zero"])
    def test_analyze_refuses_special_files(self, tmp_path: Path, path: str) -> None:
        target = tmp_path / path if path == "fifo" else Path(path)
        if path == "fifo":
            os.mkfifo(target)
        proc = subprocess.run(
            [sys.executable, "-m", "tools.analyze", str(target)],
            cwd=REPO, capture_output=True, text=True, timeout=30, check=False,
        )
        assert proc.returncode == 2
        assert proc.stderr.splitlines() == [
            f"moestream-analyze: {target}: cannot read (is a "
            f"{'FIFO' if path == 'fifo' else 'character device'}, not a regular file)"]

    @pytest.mark.parametrize("value", ["inf", "-inf", "nan", "1e9", "-1", "1000.5"])
    def test_fixed_compute_out_of_range(self, value: str) -> None:
        from moestream.pipeline.foundation.config import ComputeSpec, parse_compute
        from moestream.pipeline.foundation.errors import UsageError

        with pytest.raises(UsageError, match="0 to 1000 ms"):
            parse_compute(f"fixed:{value}")
        with pytest.raises(UsageError, match="0 to 1000 ms"):
            RunConfig(compute=ComputeSpec("fixed", float(value)))

    def test_fixed_inf_on_the_command_line(self, tiny_model: Path) -> None:
        proc = subprocess.run(
            [sys.executable, "-m", "pipeline.run", "-m", str(tiny_model), "--backend", "host",
             "--compute", "fixed:inf"],
            cwd=REPO, capture_output=True, text=True, timeout=60, check=False,
        )
        assert proc.returncode == 2
        assert proc.stderr.splitlines() == [
            "moestream: error: --compute 'fixed:inf': fixed:MS takes 0 to 1000 ms of compute "
            "per layer, got inf"]


class TestHostComputeYields:
    """``fixed`` compute on the host backend spins on the event loop's thread in slices:
    a cancel (a signal) lands within one slice, not after the layer."""

    async def test_cancel_within_one_slice(self, tiny_model: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
        from moestream.gpu.kernels import HostKernels

        asked_ms: list[float] = []
        busy = HostKernels.busy
        cfg = RunConfig(model=tiny_model, tokens=3, backend="host",
                        compute=ComputeSpec("fixed", 800.0))
        task = asyncio.ensure_future(run(cfg))

        def busy_then_cancel(self: HostKernels, ms: float, buf: Any, stream: Any) -> None:
            asked_ms.append(ms)
            if len(asked_ms) == 1:
                task.cancel()  # as the signal handler does, from the loop's thread
            busy(self, ms, buf, stream)

        monkeypatch.setattr(HostKernels, "busy", busy_then_cancel)
        with pytest.raises(asyncio.CancelledError):
            await task
        # the expert's 800 / top_k ms were asked for in slices; none after the cancel
        assert len(asked_ms) == 1 and asked_ms[0] <= 10.0, asked_ms


def _make_model(out: Path) -> subprocess.Popen[str]:
    # 3 MoE layers of 32 experts of 6.75 MiB: 0.65 GB, long enough to be stopped mid-write
    return subprocess.Popen(
        [sys.executable, "-m", "tools.make_model", str(out), "--preset", "ds4-flash-q2",
         "--layers", "4", "--experts", "32"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


class TestAtomicWritersStop:
    """SIGTERM and SIGHUP clean up as SIGINT does: ``tools.make_model`` stopped mid-write
    leaves no hidden ``.NAME.*.tmp`` (it used to leave hundreds of MB), exit 128 + N."""

    @pytest.mark.parametrize("signum", list(_STOPS), ids=_name)
    def test_make_model_leaves_no_temp_file(self, tmp_path: Path, signum: int) -> None:
        out = tmp_path / "model.gguf"
        proc = _make_model(out)

        def writing() -> bool:  # the temporary file has data in it
            for p in tmp_path.glob(".*.tmp"):
                with contextlib.suppress(FileNotFoundError):
                    if p.stat().st_size > 1 << 20:
                        return True
            return False

        _wait_until(proc, writing, "a temporary file being written")
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == _STOPS[signum], err
        assert err.splitlines()[-1] == ("moestream-make-model: interrupted by "
                                        f"{signal.Signals(signum).name}")
        assert list(tmp_path.iterdir()) == []

    def test_stoppable_runs_finally_blocks(self) -> None:
        """In process: the decorated entry turns SIGTERM into cleanup and status 143."""
        from moestream.pipeline.cli.interrupts import stoppable

        cleaned: list[str] = []

        @stoppable("test")
        def main() -> int:
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)  # never reached: the handler raises at once
                return 0
            finally:
                cleaned.append("finally")

        previous = signal.getsignal(signal.SIGTERM)
        assert main() == 143
        assert cleaned == ["finally"]
        assert signal.getsignal(signal.SIGTERM) == previous  # handlers given back
