"""Outputs against hostile files, moments and neighbours (``moestream.pipeline.foundation.outputs``,
``moestream.pipeline.cli.common``).

Every output (run log, recorded trace, CSV, plots, model, trace) is checked before any work:
a directory, a FIFO or a device is refused with one line and exit 2 and never replaced; a
symbolic link is followed and stays a link; a log another run holds is refused; a log the
file system stops taking ends the run with its summary and whole lines; control characters
in error lines are escaped; a closed stdout ends a command quietly.

Devices are only ever *checked* here (``check_output``), never written: the tests run as
root in CI, where a write that went wrong would replace ``/dev/null``. Writes are tried on
FIFOs and links in ``tmp_path``.
"""

from __future__ import annotations

import fcntl
import json
import os
import resource
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from moestream.pipeline.cli.common import printable
from moestream.pipeline.foundation.errors import OutputError
from moestream.pipeline.foundation.outputs import (
    atomic_output,
    check_output,
    check_output_dir,
    open_exclusive,
    write_atomic,
)

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def _is_fifo(path: Path) -> bool:
    return stat.S_ISFIFO(os.lstat(path).st_mode)


def _one_line(err: str) -> bool:
    return err.count("\n") == 1 and "Traceback" not in err


def _run_main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    from moestream.pipeline.run import main

    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def _host(model: Path, *args: str) -> list[str]:
    return ["-m", str(model), "--backend", "host", "--compute", "fixed:0.01", *args]


class TestPrintable:
    """Error lines escape control characters as repr does and leave the rest alone."""

    def test_plain_text_is_unchanged(self) -> None:
        text = "moestream: error: /data/modèle 模型.gguf: no such file (exit 2)"
        assert printable(text) == text

    def test_controls_are_escaped(self) -> None:
        raw = "a\nb\x1b[31mc\td\re\x7f\x9b\x00" + b"\xff".decode("utf-8", "surrogateescape")
        assert printable(raw) == "a\\nb\\x1b[31mc\\td\\re\\x7f\\x9b\\x00\\udcff"


class TestCheckOutput:
    """What may receive an output: absent or regular files in directories that take files."""

    def test_absent_file_in_a_directory(self, tmp_path: Path) -> None:
        assert check_output(tmp_path / "out.csv") == tmp_path / "out.csv"
        assert list(tmp_path.iterdir()) == []  # the probe file is gone

    def test_directory(self, tmp_path: Path) -> None:
        with pytest.raises(OutputError, match=r"--log .*: cannot write: is a directory"):
            check_output(tmp_path, what="--log")

    def test_fifo(self, tmp_path: Path) -> None:
        fifo = _fifo(tmp_path / "pipe")
        with pytest.raises(OutputError, match="is a FIFO"):
            check_output(fifo)
        assert _is_fifo(fifo)

    @pytest.mark.parametrize("device", ["/dev/null", "/dev/full"])
    def test_character_device_is_only_checked(self, device: str, tmp_path: Path) -> None:
        if not os.path.exists(device):
            pytest.skip(f"no {device}")
        with pytest.raises(OutputError, match="is a character device"):
            check_output(device)
        link = tmp_path / "link"
        link.symlink_to(device)
        with pytest.raises(OutputError, match=f"a link to {device}"):
            check_output(link)
        assert stat.S_ISCHR(os.stat(device).st_mode)

    def test_missing_directory(self, tmp_path: Path) -> None:
        with pytest.raises(OutputError, match="does not exist"):
            check_output(tmp_path / "no" / "out.csv")

    def test_missing_directories_with_make_parents(self, tmp_path: Path) -> None:
        check_output(tmp_path / "a" / "b" / "out.csv", make_parents=True)
        assert list(tmp_path.iterdir()) == []  # checked, nothing made

    def test_parent_is_a_file(self, tmp_path: Path) -> None:
        (tmp_path / "file").write_text("x")
        for make_parents in (False, True):
            with pytest.raises(OutputError, match="is not a directory"):
                check_output(tmp_path / "file" / "out.csv", make_parents=make_parents)

    def test_pseudo_file_system(self) -> None:
        if not os.path.isdir("/proc/self"):
            pytest.skip("no /proc")
        with pytest.raises(OutputError, match="cannot create a file in /proc"):
            check_output("/proc/version")

    def test_link_loop(self, tmp_path: Path) -> None:
        (tmp_path / "a").symlink_to(tmp_path / "b")
        (tmp_path / "b").symlink_to(tmp_path / "a")
        with pytest.raises(OutputError, match="cannot write"):
            check_output(tmp_path / "a")

    def test_directory_output(self, tmp_path: Path) -> None:
        (tmp_path / "file").write_text("x")
        with pytest.raises(OutputError, match="is not a directory"):
            check_output_dir(tmp_path / "file", what="--plot")
        made = check_output_dir(tmp_path / "plots" / "run1", create=True)
        assert made.is_dir()


class TestAtomicWrites:
    """Atomic outputs follow links, refuse special files, and never leave a temporary."""

    def test_link_is_followed_and_kept(self, tmp_path: Path) -> None:
        target = tmp_path / "real.txt"
        target.write_text("old")
        link = tmp_path / "link.txt"
        link.symlink_to(target)
        write_atomic(link, "new")
        assert link.is_symlink() and target.read_text() == "new"
        assert sorted(p.name for p in tmp_path.iterdir()) == ["link.txt", "real.txt"]

    def test_dangling_link_makes_its_target(self, tmp_path: Path) -> None:
        link = tmp_path / "link.txt"
        link.symlink_to(tmp_path / "later.txt")
        write_atomic(link, "made")
        assert link.is_symlink() and (tmp_path / "later.txt").read_text() == "made"

    def test_fifo_is_refused_not_replaced(self, tmp_path: Path) -> None:
        fifo = _fifo(tmp_path / "out.npz")
        with pytest.raises(OutputError, match="FIFO"):
            write_atomic(fifo, b"bytes")
        assert _is_fifo(fifo) and os.listdir(tmp_path) == ["out.npz"]

    def test_special_file_appearing_meanwhile_is_not_replaced(self, tmp_path: Path) -> None:
        path = tmp_path / "out.bin"
        with pytest.raises(OutputError, match="FIFO"), atomic_output(path) as out:
            out.write(b"bytes")
            os.mkfifo(path)
        assert _is_fifo(path) and os.listdir(tmp_path) == ["out.bin"]

    def test_write_error_is_an_output_error(self, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
        target = tmp_path / "out.bin"
        target.write_bytes(b"old")

        def full_disk(fd: int) -> None:
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(os, "fsync", full_disk)
        with pytest.raises(OutputError, match="No space left"):
            write_atomic(target, b"new")
        assert target.read_bytes() == b"old" and os.listdir(tmp_path) == ["out.bin"]


class TestExclusiveLog:
    """A file written in place is locked: a second writer is refused before it truncates."""

    def test_second_writer_is_refused(self, tmp_path: Path) -> None:
        path = tmp_path / "run.jsonl"
        fd = open_exclusive(path)
        try:
            os.write(fd, b"first run\n")
            with pytest.raises(OutputError, match="in use by another run"):
                open_exclusive(path)
            with pytest.raises(OutputError, match="in use by another run"):
                check_output(path, in_place=True)
            assert path.read_bytes() == b"first run\n"
        finally:
            os.close(fd)
        os.close(open_exclusive(path))  # released with the descriptor
        assert path.read_bytes() == b""


@pytest.fixture
def own_model(tiny_model: Path, tmp_path: Path) -> Path:
    """A copy of the tiny model a test may see overwritten without harming other tests."""
    return Path(shutil.copy(tiny_model, tmp_path / "model.gguf"))


class TestRunOutputs:
    """``moestream.pipeline.cli.run`` checks --log and --record-trace before the model is opened."""

    @pytest.mark.parametrize("kind", ["directory", "missing directory", "FIFO",
                                      "file as directory"])
    def test_bad_log(self, capsys: pytest.CaptureFixture[str], tmp_path: Path,
                     kind: str) -> None:
        (tmp_path / "file").write_text("x")
        log = {"directory": tmp_path, "missing directory": tmp_path / "no" / "run.jsonl",
               "FIFO": tmp_path / "pipe", "file as directory": tmp_path / "file" / "run.jsonl",
               }[kind]
        if kind == "FIFO":
            _fifo(log)
        # the model does not exist: the log is checked first, so the error names the log
        code, out, err = _run_main(capsys, *_host(tmp_path / "absent.gguf", "--log", str(log)))
        assert code == 2 and out == ""
        assert _one_line(err) and err.startswith("moestream: error: --log ")
        if kind == "FIFO":
            assert _is_fifo(log)

    def test_record_trace_to_a_directory_fails_before_the_run(
        self, capsys: pytest.CaptureFixture[str], tiny_model: Path, tmp_path: Path
    ) -> None:
        log = tmp_path / "run.jsonl"
        code, out, err = _run_main(capsys, *_host(tiny_model, "-n", "4", "--log", str(log),
                                                  "--record-trace", str(tmp_path)))
        assert code == 2 and out == "" and not log.exists()  # nothing ran
        assert _one_line(err) and "--record-trace" in err and "is a directory" in err

    def test_record_trace_to_a_fifo(self, capsys: pytest.CaptureFixture[str],
                                    tiny_model: Path, tmp_path: Path) -> None:
        fifo = _fifo(tmp_path / "trace.npz")
        code, _, err = _run_main(capsys, *_host(tiny_model, "-n", "4",
                                                "--record-trace", str(fifo)))
        assert code == 2 and _one_line(err) and "FIFO" in err
        assert _is_fifo(fifo)

    def test_links_are_written_through(self, capsys: pytest.CaptureFixture[str],
                                       tiny_model: Path, tmp_path: Path) -> None:
        from moestream.pipeline.foundation.trace import load_trace

        (tmp_path / "real").mkdir()
        log_link, trace_link = tmp_path / "run.jsonl", tmp_path / "trace.npz"
        log_link.symlink_to(tmp_path / "real" / "run.jsonl")
        trace_link.symlink_to(tmp_path / "real" / "trace.npz")
        code, _, _ = _run_main(capsys, *_host(tiny_model, "-n", "4", "--log", str(log_link),
                                              "--record-trace", str(trace_link)))
        assert code == 0 and log_link.is_symlink() and trace_link.is_symlink()
        lines = (tmp_path / "real" / "run.jsonl").read_text().splitlines()
        assert json.loads(lines[-1])["event"] == "run_end"
        assert load_trace(tmp_path / "real" / "trace.npz").n_tokens == 4

    def test_log_over_the_model_is_refused(self, capsys: pytest.CaptureFixture[str],
                                           own_model: Path) -> None:
        before = own_model.read_bytes()
        code, _, err = _run_main(capsys, *_host(own_model, "-n", "2", "--log", str(own_model)))
        assert code == 2 and _one_line(err) and "it is the --model file" in err
        assert own_model.read_bytes() == before

    def test_log_in_use_is_refused(self, capsys: pytest.CaptureFixture[str],
                                   tiny_model: Path, tmp_path: Path) -> None:
        log = tmp_path / "run.jsonl"
        log.write_text("the other run's lines\n")
        with log.open("rb") as other:  # another run holds the log
            fcntl.flock(other.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            code, out, err = _run_main(capsys, *_host(tiny_model, "-n", "2", "--log", str(log)))
        assert code == 2 and out == ""
        assert _one_line(err) and "in use by another run" in err
        assert log.read_text() == "the other run's lines\n"

    def test_two_runs_on_one_log(self, capsys: pytest.CaptureFixture[str],
                                 tiny_model: Path, tmp_path: Path) -> None:
        log = tmp_path / "run.jsonl"
        first = subprocess.Popen(
            [sys.executable, "-m", "pipeline.run", *_host(tiny_model, "-n", "1000000",
                                                          "--log", str(log))],
            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 60
            while not (log.exists() and b"run_start" in log.read_bytes()):
                assert first.poll() is None and time.monotonic() < deadline
                time.sleep(0.05)
            code, _, err = _run_main(capsys, *_host(tiny_model, "-n", "2", "--log", str(log)))
            assert code == 2 and _one_line(err) and "in use by another run" in err
        finally:
            first.send_signal(signal.SIGTERM)
            assert first.wait(timeout=60) == 143
        events = [json.loads(line)["event"] for line in log.read_text().splitlines()]
        assert events[0] == "run_start" and events[-1] == "run_end"
        assert events.count("run_start") == 1

    @pytest.mark.parametrize("tokens", [20, 3000])
    def test_log_the_file_system_refuses(self, tiny_model: Path, tmp_path: Path,
                                         tokens: int) -> None:
        """RLIMIT_FSIZE makes the kernel refuse the log past 6000 bytes (EFBIG), part way
        through a line: a short run meets it at the final flush, a long one mid-run."""
        limit = 6000
        log = tmp_path / "run.jsonl"

        def small_files() -> None:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a kill
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

        done = subprocess.run(
            [sys.executable, "-m", "pipeline.run", *_host(tiny_model, "-n", str(tokens),
                                                          "--log", str(log), "--json")],
            cwd=REPO, capture_output=True, text=True, preexec_fn=small_files, timeout=120)
        assert done.returncode == 2
        assert _one_line(done.stderr) and "--log" in done.stderr
        assert "cannot write the run log" in done.stderr
        summary = json.loads(done.stdout)  # the summary is still printed
        assert "cannot write the run log" in summary["exit"]
        assert summary["mismatches"] == 0 and summary["allocations"] == summary["frees"]
        text = log.read_text()
        assert 0 < len(text) <= limit and text.endswith("\n")  # cut back to whole lines
        assert all(json.loads(line) for line in text.splitlines())
        if tokens == 3000:
            assert summary["tokens"] < tokens  # stopped at the next token boundary

    def test_cache_home_is_a_file(self, capsys: pytest.CaptureFixture[str],
                                  tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        (tmp_path / "cache").write_text("not a directory")
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
        code, out, err = _run_main(capsys, "-n", "1", "--backend", "host")
        assert code == 2 and out == ""
        assert _one_line(err) and "XDG_CACHE_HOME" in err and "not a directory" in err

    def test_cache_home_is_proc(self, capsys: pytest.CaptureFixture[str],
                                monkeypatch: pytest.MonkeyPatch) -> None:
        if not os.path.isdir("/proc/self"):
            pytest.skip("no /proc")
        monkeypatch.setenv("XDG_CACHE_HOME", "/proc")
        code, _, err = _run_main(capsys, "-n", "1", "--backend", "host")
        assert code == 2 and _one_line(err) and "XDG_CACHE_HOME" in err

    def test_control_characters_in_a_path(self, capsys: pytest.CaptureFixture[str],
                                          tmp_path: Path) -> None:
        model = tmp_path / "evil\nname\x1b[2J.gguf"
        code, _, err = _run_main(capsys, *_host(model))
        assert code == 2 and _one_line(err) and "\x1b" not in err
        assert "evil\\nname\\x1b[2J.gguf" in err


def _closed_stdout(*args: str) -> subprocess.CompletedProcess[str]:
    """Run ``python ARGS`` with stdout a pipe whose reader is gone before it starts."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run([sys.executable, *args], cwd=REPO, stdout=write,
                              stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write)


class TestClosedStdout:
    """A reader that leaves (``| true``, ``| head``) ends a command quietly, exit 0."""

    def test_run(self, tiny_model: Path) -> None:
        done = _closed_stdout("-m", "pipeline.run", *_host(tiny_model, "-n", "2"))
        assert done.returncode == 0 and done.stderr == ""

    def test_analyze(self, run_log: Path) -> None:
        done = _closed_stdout("-m", "tools.analyze", str(run_log))
        assert done.returncode == 0 and done.stderr == ""


@pytest.fixture(scope="module")
def run_log(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The log of a 40-token run of the tiny model."""
    from moestream.pipeline.run import main

    log = tmp_path_factory.mktemp("logs") / "run.jsonl"
    assert main([*_host(tiny_model, "-n", "40"), "--log", str(log), "--json"]) == 0
    return log


class TestAnalyzeOutputs:
    """``tools.analyze`` checks --csv and --plot before reading any log."""

    def _main(self, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
        from moestream.tools.analyze.cli import main

        code = main(list(args))
        out, err = capsys.readouterr()
        return code, out, err

    def test_csv_fifo_checked_before_the_logs(self, capsys: pytest.CaptureFixture[str],
                                              tmp_path: Path) -> None:
        fifo = _fifo(tmp_path / "rows.csv")
        code, _, err = self._main(capsys, str(tmp_path / "absent.jsonl"), "--csv", str(fifo))
        assert code == 2 and _one_line(err) and "--csv" in err and "FIFO" in err
        assert _is_fifo(fifo)

    def test_csv_fifo_is_not_replaced(self, capsys: pytest.CaptureFixture[str],
                                      run_log: Path, tmp_path: Path) -> None:
        fifo = _fifo(tmp_path / "rows.csv")
        code, _, err = self._main(capsys, str(run_log), "--csv", str(fifo))
        assert code == 2 and _one_line(err) and _is_fifo(fifo)

    def test_csv_through_a_link(self, capsys: pytest.CaptureFixture[str], run_log: Path,
                                tmp_path: Path) -> None:
        link = tmp_path / "rows.csv"
        link.symlink_to(tmp_path / "real.csv")
        code, _, _ = self._main(capsys, str(run_log), "--csv", str(link))
        assert code == 0 and link.is_symlink()
        assert (tmp_path / "real.csv").read_text().startswith("ctx_tokens,")

    def test_plot_file_fifo_checked_before_the_logs(self, capsys: pytest.CaptureFixture[str],
                                                    tmp_path: Path) -> None:
        fifo = _fifo(tmp_path / "hit_rate.png")
        code, _, err = self._main(capsys, str(tmp_path / "absent.jsonl"),
                                  "--plot", str(tmp_path))
        assert code == 2 and _one_line(err) and "--plot" in err and "FIFO" in err
        assert _is_fifo(fifo)

    def test_plot_dir_is_a_file(self, capsys: pytest.CaptureFixture[str],
                                tmp_path: Path) -> None:
        (tmp_path / "plots").write_text("x")
        code, _, err = self._main(capsys, str(tmp_path / "absent.jsonl"),
                                  "--plot", str(tmp_path / "plots"))
        assert code == 2 and _one_line(err) and "--plot" in err

    def test_control_characters_in_a_path(self, capsys: pytest.CaptureFixture[str],
                                          tmp_path: Path) -> None:
        code, _, err = self._main(capsys, str(tmp_path / "log\x1b]0;owned\x07\n.jsonl"))
        assert code == 2 and _one_line(err) and "\x1b" not in err and "\\x07" in err


class TestToolOutputs:
    """make_model, make_trace and warmup: the same rules and the same one-line errors."""

    @pytest.fixture(autouse=True)
    def _reset_logging(self) -> Iterator[None]:
        import structlog

        yield
        structlog.reset_defaults()

    def test_make_model_force_over_a_fifo(self, capsys: pytest.CaptureFixture[str],
                                          tmp_path: Path) -> None:
        from moestream.tools.make_model import main

        fifo = _fifo(tmp_path / "m.gguf")
        assert main([str(fifo), "--layers", "2", "--experts", "2", "--force"]) == 2
        err = capsys.readouterr().err
        assert _one_line(err) and "FIFO" in err and _is_fifo(fifo)
        assert os.listdir(tmp_path) == ["m.gguf"]

    def test_make_model_force_through_a_link(self, capsys: pytest.CaptureFixture[str],
                                             tmp_path: Path) -> None:
        from gguf import GGUFReader

        from moestream.tools.make_model import main

        target = tmp_path / "real.gguf"
        target.write_bytes(b"old")
        link = tmp_path / "m.gguf"
        link.symlink_to(target)
        assert main([str(link), "--layers", "2", "--experts", "2", "--force"]) == 0
        assert link.is_symlink()
        assert GGUFReader(target).fields["moestream.preset"].contents() == "tiny"

    def test_make_model_control_characters(self, capsys: pytest.CaptureFixture[str],
                                           tmp_path: Path) -> None:
        from moestream.tools.make_model import main

        assert main([str(tmp_path / "no\x1b[31m\ndir" / "m.gguf")]) == 2
        err = capsys.readouterr().err
        assert _one_line(err) and "\x1b" not in err and "\\x1b[31m\\ndir" in err

    def test_default_model_cache_unusable(self, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
        from moestream.pipeline.makers.modelgen import ensure_default_model

        (tmp_path / "cache").write_text("x")
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
        with pytest.raises(OutputError, match="XDG_CACHE_HOME"):
            ensure_default_model()

    def test_make_trace_over_a_fifo(self, capsys: pytest.CaptureFixture[str],
                                    tmp_path: Path) -> None:
        from moestream.tools.make_trace import main

        fifo = _fifo(tmp_path / "t.npz")
        assert main([str(fifo), "--tokens", "3"]) == 2
        err = capsys.readouterr().err
        assert _one_line(err) and "FIFO" in err and _is_fifo(fifo)

    def test_warmup_control_characters(self, capsys: pytest.CaptureFixture[str],
                                       tmp_path: Path) -> None:
        from moestream.tools.warmup.cli import main

        assert main([str(tmp_path / "m\x9b2J\r.gguf")]) == 2
        err = capsys.readouterr().err
        assert _one_line(err) and "\x9b" not in err and "\\x9b2J\\r" in err
