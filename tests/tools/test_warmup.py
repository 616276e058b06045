"""Tests of the warm-up CLI (tools.warmup, with tools.warmup_select, tools.warmup_report and
tools.ram_guard) on a real, small GGUF model."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from moestream.pipeline.foundation.errors import UsageError
from moestream.pipeline.foundation.table import ByteRange, ExpertTable, open_table
from moestream.pipeline.makers.modelgen import spec_for, write_model
from moestream.stages.residency import PAGE_BYTES, Residency, evict
from moestream.tools.warmup.cli import main
from moestream.tools.warmup.ram_guard import check_ram
from moestream.tools.warmup.select import (
    HotLog,
    build_selection,
    non_routed_ranges,
    parse_index_list,
    read_hot_log,
)
from tests.reclaim import RECLAIM_SLACK, assert_all_resident, assert_loaded, assert_same_reading

REPO = Path(__file__).resolve().parents[2]
GIB = 1 << 30


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Our own tiny model (3 MoE layers x 8 experts of 768 KiB): tests here evict it.

    Skips the tests where the temp dir keeps pages resident whatever we ask (tmpfs).
    """
    path = write_model(spec_for("tiny", layers=4, experts=8),
                       tmp_path_factory.mktemp("warmup") / "tiny.gguf")
    evict(path)
    if Residency.of_file(path).resident_page_count > 16:  # a few header pages may be re-read
        pytest.skip(f"{path.parent} keeps pages resident after DONTNEED (tmpfs?)")
    return path


@pytest.fixture(scope="module")
def table(model: Path) -> ExpertTable:
    return open_table(model)


@pytest.fixture
def cold_model(model: Path) -> Path:
    evict(model)
    return model


def pages_of(ranges: list[ByteRange]) -> set[int]:
    return {
        page
        for r in ranges
        for page in range(r.offset // PAGE_BYTES, -(-(r.offset + r.nbytes) // PAGE_BYTES))
    }


def expert_ranges(table: ExpertTable, keys: list[tuple[int, int]]) -> list[ByteRange]:
    return [r for key in keys for r in table.slices(key).ranges]


def all_keys(table: ExpertTable) -> list[tuple[int, int]]:
    return [(layer, e) for layer, ml in table.layers.items() for e in range(ml.n_experts)]


def assert_exactly(
    table: ExpertTable, selected: list[tuple[int, int]], extra: list[ByteRange] | None = None
) -> None:
    """Every page of the selection is resident; no page only unselected experts use."""
    res = Residency.of_file(table.path)
    resident = set(np.flatnonzero(res.pages).tolist())
    chosen = pages_of(expert_ranges(table, selected) + (extra or []))
    others = pages_of(expert_ranges(table, [k for k in all_keys(table) if k not in selected]))
    missing = len(chosen - resident)
    assert missing <= RECLAIM_SLACK * res.n_pages, f"{missing} selected pages not resident"
    assert not (others - chosen) & resident


def write_log(path: Path, table: ExpertTable, tokens: list[list[list[int]]],
              junk: int = 0) -> Path:
    """A schema-1 moestream run log whose tokens use the given expert ids."""
    lines = [json.dumps({
        "event": "run_start", "schema": 1,
        "model": {"path": str(table.path), "file_bytes": table.file_bytes,
                  "moe_layers": table.moe_layers, "n_experts": table.n_experts,
                  "top_k": len(tokens[0][0]),
                  "expert_bytes": [table.expert_bytes(x) for x in table.moe_layers]},
    })]
    for i, experts in enumerate(tokens):
        lines.append(json.dumps({"event": "token", "schema": 1, "token": i,
                                 "experts": experts}))
        if i < junk:
            lines.append("this line is not JSON {")
    path.write_text("\n".join(lines) + "\n")
    return path


class FakeMemory:
    """A MemoryProbe with fixed figures."""

    def __init__(self, available: int, total: int) -> None:
        self.available, self.total = available, total

    def available_bytes(self) -> int:
        return self.available

    def total_bytes(self) -> int:
        return self.total


class TestParsing:
    """Index lists parse to ranges, expanded to sorted unique indices within a bound; bad ones
    are usage errors."""

    def test_index_lists(self) -> None:
        assert parse_index_list("0,3-5").indices(6, "layer", "") == [0, 3, 4, 5]
        assert parse_index_list("5, 1-2,2").indices(6, "layer", "") == [1, 2, 5]

    def test_out_of_bound_is_refused_before_expanding(self) -> None:
        ranges = parse_index_list("0-99999999999")
        assert ranges.ranges == ((0, 99999999999),)
        with pytest.raises(UsageError, match="layer 99999999999 in '0-99999999999' is out of"):
            ranges.indices(4, "layer", "the model has 4")

    @pytest.mark.parametrize("text", ["", "a", "1-", "3-1", "1,,2", "-1"])
    def test_bad_lists(self, text: str) -> None:
        with pytest.raises(UsageError):
            parse_index_list(text)

    def test_bad_size_is_exit_2(self, model: Path, capsys: pytest.CaptureFixture[str]) -> None:
        assert main([str(model), "--hot", "x", "--max-bytes", "12 parsecs"]) == 2
        assert "12 parsecs" in capsys.readouterr().err


class TestSelection:
    """Layer, expert and hot-list selections warm exactly their byte ranges."""

    def test_grid_selection_ranges(self, table: ExpertTable) -> None:
        sel = build_selection(table, layers=[2, 3], experts=[1, 6])
        keys = [(2, 1), (2, 6), (3, 1), (3, 6)]
        assert pages_of(sel.ranges) == pages_of(expert_ranges(table, keys))
        assert sel.nbytes == 4 * table.expert_bytes(2)

    def test_nothing_selected_means_the_file(self, table: ExpertTable) -> None:
        sel = build_selection(table)
        assert sel.whole_file and sel.ranges == [ByteRange(0, table.file_bytes)]

    def test_unknown_layer_and_expert(self, table: ExpertTable) -> None:
        with pytest.raises(UsageError, match=r"\[0\] are not MoE layers"):
            build_selection(table, layers=[0])
        with pytest.raises(UsageError, match="out of range"):
            build_selection(table, experts=[8])

    def test_cli_warms_exactly_the_grid(
        self, cold_model: Path, table: ExpertTable, capsys: pytest.CaptureFixture[str]
    ) -> None:
        assert main([str(cold_model), "--layers", "2-3", "--experts", "1,3"]) == 0
        assert_exactly(table, [(2, 1), (2, 3), (3, 1), (3, 3)])
        out = capsys.readouterr().out
        assert out.startswith("resident: 3.00 MiB of 3.00 MiB selected (100.0%)")

    def test_cli_non_routed(self, cold_model: Path, table: ExpertTable) -> None:
        assert main([str(cold_model), "--non-routed"]) == 0
        res = Residency.of_file(cold_model)
        nr = non_routed_ranges(table)
        assert_loaded(res.resident_bytes(nr), sum(r.nbytes for r in nr), res.n_pages * PAGE_BYTES)
        assert_exactly(table, [], nr)

    def test_hot_log_hottest_first_within_max_bytes(
        self, cold_model: Path, table: ExpertTable, tmp_path: Path,
        capsys: pytest.CaptureFixture[str],
    ) -> None:
        # (2, 5) used 3 times, (3, 0) twice, everything else once.
        tokens = [
            [[0, 1], [5, 2], [0, 4]],
            [[2, 3], [5, 6], [0, 7]],
            [[4, 6], [5, 7], [1, 2]],
        ]
        log = write_log(tmp_path / "run.jsonl", table, tokens, junk=2)
        hot = read_hot_log(log, table)
        assert hot.tokens == 3 and hot.skipped_lines == 2
        assert hot.hottest()[:2] == [(2, 5), (3, 0)]
        two = 2 * table.expert_bytes(2)
        assert main([str(cold_model), "--hot", str(log), "--max-bytes", str(two)]) == 0
        assert_exactly(table, [(2, 5), (3, 0)])
        assert "skipped 2 lines" in capsys.readouterr().err

    def test_hot_selection_without_cap_takes_all_used(self, table: ExpertTable) -> None:
        hot = HotLog()
        hot.counts.update({(1, 2): 1, (3, 4): 5})
        sel = build_selection(table, hot=hot)
        assert sel.hot_experts == [(3, 4), (1, 2)]
        assert sel.ranges == expert_ranges(table, [(3, 4), (1, 2)])

    @pytest.mark.parametrize("text", [
        "just some text\n",
        '{"event": "something", "schema": 1}\n',
        '{"event": "token", "schema": 1, "experts": [[0]]}\n',
    ])
    def test_not_a_run_log(
        self, model: Path, tmp_path: Path, text: str, capsys: pytest.CaptureFixture[str]
    ) -> None:
        log = tmp_path / "bad.jsonl"
        log.write_text(text)
        assert main([str(model), "--hot", str(log)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "not a moestream" in err

    def test_log_of_another_model(
        self, model: Path, table: ExpertTable, tmp_path: Path,
        capsys: pytest.CaptureFixture[str],
    ) -> None:
        log = write_log(tmp_path / "run.jsonl", table, [[[9], [0], [0]]])
        assert main([str(model), "--hot", str(log)]) == 2
        assert "expert 9 of layer 1" in capsys.readouterr().err


class TestReportAndEvict:
    """--report agrees with mincore per part and per expert; --evict drops the selection."""

    def test_report_json(
        self, cold_model: Path, table: ExpertTable, capsys: pytest.CaptureFixture[str]
    ) -> None:
        assert main([str(cold_model), "--layers", "3", "--experts", "2"]) == 0
        capsys.readouterr()
        assert main([str(cold_model), "--report", "--per-expert", "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        res = Residency.of_file(cold_model)
        assert_same_reading(report["resident_bytes"], res.file_resident_bytes, res.file_bytes)
        layers = {p["layer"]: p for p in report["parts"] if "layer" in p}
        assert sorted(layers) == table.moe_layers
        assert layers[3]["experts_fully_resident"] == 1
        assert layers[3]["expert_resident_bytes"][2] == table.expert_bytes(3)
        assert_same_reading(layers[3]["resident_bytes"], res.resident_bytes(
            expert_ranges(table, [(3, e) for e in range(8)])), res.file_bytes)
        assert layers[1]["resident_bytes"] == 0

    def test_report_text(self, model: Path, capsys: pytest.CaptureFixture[str]) -> None:
        assert main([str(model), "--report", "--per-expert", "--layers", "2"]) == 0
        out = capsys.readouterr().out
        assert "layer 2" in out and "layer 1 " not in out and "selection" in out

    def test_evict_selection(self, model: Path, table: ExpertTable) -> None:
        assert main([str(model), "--force"]) == 0
        assert_all_resident(Residency.of_file(model))
        assert main([str(model), "--evict", "--layers", "2"]) == 0
        res = Residency.of_file(model)
        layer2 = expert_ranges(table, [(2, e) for e in range(8)])
        assert res.resident_pages_in(layer2) == 0
        layer3 = expert_ranges(table, [(3, e) for e in range(8)])
        assert_loaded(res.resident_bytes(layer3), 8 * table.expert_bytes(3),
                      res.n_pages * PAGE_BYTES)

    @pytest.mark.parametrize("args", [["--json"], ["--per-expert"], ["--report", "--evict"]])
    def test_option_misuse(self, model: Path, args: list[str]) -> None:
        assert main([str(model), *args]) == 2


class TestRamGuard:
    """Warming more than available RAM minus the margin is refused unless --force."""

    def test_check_ram_figures(self) -> None:
        with pytest.raises(UsageError) as info:
            check_ram(GIB, FakeMemory(available=2 * GIB + GIB // 2, total=16 * GIB), "warm")
        text = str(info.value)
        assert "1.00 GiB" in text and "2.50 GiB available" in text
        assert "0.50 GiB may be used" in text and "2.00 GiB margin" in text
        check_ram(GIB, FakeMemory(available=4 * GIB, total=16 * GIB), "warm")

    def test_margin_is_five_percent_of_large_ram(self) -> None:
        with pytest.raises(UsageError, match=r"6\.40 GiB margin"):
            check_ram(GIB, FakeMemory(available=7 * GIB, total=128 * GIB), "warm")

    def test_cli_refuses_then_forces(
        self, cold_model: Path, table: ExpertTable, capsys: pytest.CaptureFixture[str]
    ) -> None:
        tight = FakeMemory(available=2 * GIB + (1 << 20), total=8 * GIB)
        assert main([str(cold_model)], memory=tight) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--force" in err and "available" in err
        assert Residency.of_file(cold_model).resident_bytes(
            expert_ranges(table, all_keys(table))) == 0
        assert main([str(cold_model), "--force"], memory=tight) == 0
        assert_all_resident(Residency.of_file(cold_model))

    def test_resident_pages_do_not_count(self, model: Path) -> None:
        assert main([str(model), "--force"]) == 0
        tight = FakeMemory(available=2 * GIB, total=8 * GIB)  # nothing may be loaded
        assert main([str(model)], memory=tight) == 0


def _cli(*args: str, **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(  # type: ignore[call-overload, no-any-return]
        [sys.executable, "-m", "tools.warmup", *args], cwd=REPO, capture_output=True,
        text=True, timeout=60, **kwargs)


class TestErrors:
    """Bad paths and non-GGUF files give one line on stderr and exit 2; --debug traces."""

    @pytest.mark.parametrize("name,content", [
        ("missing.gguf", None), ("text.gguf", b"hello, world\n" * 10), ("dir", "dir"),
        ("short.gguf", b"GG"),
    ])
    def test_one_line_exit_2(
        self, tmp_path: Path, name: str, content: bytes | str | None,
        capsys: pytest.CaptureFixture[str],
    ) -> None:
        path = tmp_path / name
        if content == "dir":
            path.mkdir()
        elif isinstance(content, bytes):
            path.write_bytes(content)
        assert main([str(path)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("moestream-warmup: error: ")
        assert str(path) in err

    def test_real_process_has_no_traceback(self, tmp_path: Path) -> None:
        bad = tmp_path / "not-a-model.bin"
        bad.write_bytes(b"\0" * 4096)
        proc = _cli(str(bad), "--report")
        assert proc.returncode == 2
        assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
        assert "not a GGUF file" in proc.stderr

    def test_debug_shows_the_traceback(self, tmp_path: Path) -> None:
        proc = _cli(str(tmp_path / "missing.gguf"), "--debug")
        assert proc.returncode != 0 and "Traceback" in proc.stderr


def _no_ipc_lock_and_tiny_memlock() -> None:
    """In the child before exec: RLIMIT_MEMLOCK of one page, CAP_IPC_LOCK dropped if we can.

    Root has CAP_IPC_LOCK, which ignores the limit; dropping it from the bounding set makes
    the exec'd interpreter start without it. Unprivileged users never had it.
    """
    import ctypes
    import resource

    resource.setrlimit(resource.RLIMIT_MEMLOCK, (4096, 4096))
    libc = ctypes.CDLL(None, use_errno=True)
    pr_capbset_drop, cap_ipc_lock = 24, 14
    libc.prctl(pr_capbset_drop, cap_ipc_lock, 0, 0, 0)


class TestLock:
    """--lock holds pages until SIGTERM, and names RLIMIT_MEMLOCK when refused."""

    def test_refused_names_the_limit(self, model: Path) -> None:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tools.warmup", str(model), "--lock", "--force"],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            preexec_fn=_no_ipc_lock_and_tiny_memlock,
        )
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        if proc.returncode in (0, -signal.SIGKILL) and "locked" in out:
            pytest.skip("this process keeps CAP_IPC_LOCK: mlock ignores RLIMIT_MEMLOCK")
        assert proc.returncode == 1, err
        assert err.count("\n") == 1 and "Traceback" not in err
        assert "RLIMIT_MEMLOCK is 4096 bytes" in err
        assert f"mlock of {-(-model.stat().st_size // PAGE_BYTES) * PAGE_BYTES} bytes" in err

    def test_lock_holds_until_sigterm(self, model: Path, table: ExpertTable) -> None:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tools.warmup", str(model), "--lock", "--layers", "2",
             "--experts", "0"],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            if not line.startswith("locked"):
                proc.wait(timeout=30)
                err = proc.stderr.read() if proc.stderr else ""
                if "RLIMIT_MEMLOCK" in err:
                    pytest.skip(f"mlock not permitted here: {err.strip()}")
                pytest.fail(f"unexpected output {line!r} {err!r}")
            status = Path(f"/proc/{proc.pid}/status").read_text()
            locked_kib = int(next(x for x in status.splitlines()
                                  if x.startswith("VmLck:")).split()[1])
            assert locked_kib * 1024 >= table.expert_bytes(2)
            assert evict(model, expert_ranges(table, [(2, 0)])) == 0
            proc.send_signal(signal.SIGTERM)
            out, _ = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert proc.returncode == 0
        assert "released (SIGTERM)" in out


class TestStartUp:
    """The command's lean start: BLAS threads and the early read of a plain warm-up."""

    @pytest.mark.parametrize(("argv", "expected"), [
        (["m.gguf"], ("m.gguf", False, None)),
        (["m.gguf", "--threads", "4", "--force", "--debug"], ("m.gguf", True, 4)),
        (["--threads=4", "m.gguf"], ("m.gguf", False, 4)),
        (["m.gguf", "--threads", "0"], None),
        (["m.gguf", "--threads"], None),
        (["m.gguf", "--report"], None),
        (["m.gguf", "--layers", "1"], None),
        (["m.gguf", "other.gguf"], None),
        (["--help"], None),
        ([], None),
    ])
    def test_plain_warm_target(self, argv: list[str],
                                expected: tuple[str, bool, int | None] | None) -> None:
        from moestream.tools.warmup.early import plain_warm_target

        assert plain_warm_target(argv) == expected

    def test_early_read_loads_the_start(self, cold_model: Path) -> None:
        from moestream.tools.warmup.early import start_early

        early = start_early([str(cold_model), "--force"])
        assert early is not None
        early.join(timeout_s=30)
        assert_all_resident(Residency.of_file(cold_model))  # smaller than the early cap

    @pytest.mark.parametrize("stop_at_once", [True, False])
    def test_stop_hands_over_a_read_start(self, cold_model: Path, stop_at_once: bool) -> None:
        """Whenever it is stopped, the head start has read the whole start it reports."""
        from moestream.tools.warmup.early import EarlyRead

        size = cold_model.stat().st_size
        fd = os.open(cold_model, os.O_RDONLY)
        early = EarlyRead(fd, size, threads=3, piece_bytes=3 * PAGE_BYTES)
        if not stop_at_once:
            early.join(timeout_s=30)
        read = early.stop()
        assert 0 <= read <= size
        assert read == size or stop_at_once
        res = Residency.of_file(cold_model)
        assert_loaded(res.resident_bytes([ByteRange(0, read)]), read, res.n_pages * PAGE_BYTES)

    def test_engine_reads_only_past_the_head_start(self, cold_model: Path,
                                                   table: ExpertTable) -> None:
        from moestream.tools.warmup.cli import _past_early
        from moestream.tools.warmup.early import start_early

        early = start_early([str(cold_model), "--force"])
        assert early is not None
        early.stop()
        ranges = [ByteRange(0, 100), ByteRange(4000, 200), ByteRange(5000, 10)]
        assert _past_early(table.files, ranges, early, 4096) == [
            ByteRange(4096, 104), ByteRange(5000, 10)]
        assert _past_early(table.files, ranges, early, 0) == ranges

    def test_plain_warm_up_reports_its_head_start(
        self, cold_model: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        from moestream.tools.warmup import main as lean_main

        assert lean_main([str(cold_model), "--force"]) == 0
        out = capsys.readouterr().out
        assert "file 100.0%" in out and "during start-up" in out
        assert_all_resident(Residency.of_file(cold_model))

    def test_no_early_read_for_other_modes_or_files(self, cold_model: Path,
                                                    tmp_path: Path) -> None:
        from moestream.tools.warmup.early import start_early

        plain = tmp_path / "plain.bin"
        plain.write_bytes(b"not a gguf" * 100)
        assert start_early([str(cold_model), "--evict"]) is None
        assert start_early([str(plain), "--force"]) is None
        assert start_early([str(tmp_path / "missing.gguf")]) is None
        assert Residency.of_file(cold_model).resident_page_count <= 16

    def test_command_runs_with_one_blas_thread(self) -> None:
        done = subprocess.run(
            [sys.executable, "-c", "import os, moestream.tools.warmup as w; "
             "w.single_threaded_blas(); "
             "import numpy; print(os.environ['OPENBLAS_NUM_THREADS'])"],
            cwd=REPO, capture_output=True, text=True, check=True, timeout=60)
        assert done.stdout.strip() == "1"
