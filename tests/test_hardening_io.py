"""Wrong bytes verified as right (issue 27): the digest manifest and every input under the
input/output rules, and bounded parsing.

The manifest is written atomically without following a link at its path, and read as an
input: only a regular file, at most what the model's expert count can fill; a bad one is
ignored with one warning and computed again, never a hang nor a traceback. Every input JSON
goes through one bounded loader; every size is parsed exactly and capped.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import MutableMapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from moestream.pipeline.foundation.config import MAX_SIZE_BYTES, Budget, parse_budget, parse_size
from moestream.pipeline.foundation.errors import OutputError, TraceError, UsageError
from moestream.pipeline.foundation.inputs import (
    InputTooLargeError,
    JSONDepthError,
    NotRegularFileError,
    json_depth,
    load_json_bounded,
    read_input,
)
from moestream.pipeline.foundation.manifest import (
    _MAGIC,
    DigestManifest,
    load_manifest,
    manifest_max_bytes,
    manifest_path,
)
from moestream.pipeline.foundation.outputs import write_atomic
from moestream.pipeline.foundation.table import open_table
from moestream.pipeline.foundation.trace import load_trace
from moestream.pipeline.makers.modelgen import spec_for, write_model
from moestream.pipeline.runlog.read import read_log

REPO = Path(__file__).resolve().parents[1]
DEEP = 3000
"""Nesting that makes ``json.loads`` raise ``RecursionError`` (about 1000 levels do)."""


def _deep(levels: int = DEEP) -> str:
    return "[" * levels + "]" * levels


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _cli(module: str, *argv: str, cache: Path | None = None,
         timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """``python -m MODULE ARGV`` with its own user cache; a hang fails by ``timeout``."""
    env = dict(os.environ)
    if cache is not None:
        env["XDG_CACHE_HOME"] = str(cache)
    return subprocess.run([sys.executable, "-m", module, *argv], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)


def _refused(done: subprocess.CompletedProcess[str], match: str) -> None:
    """Exit 2, no traceback, the last stderr line says ``match``."""
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    assert match in done.stderr.strip().splitlines()[-1], done.stderr[-2000:]


@pytest.fixture(scope="module")
def plain_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model that records no digests: its runs use a digest manifest."""
    path = tmp_path_factory.mktemp("plain") / "plain.gguf"
    return write_model(spec_for("tiny", layers=4, experts=16), path, record_digests=False)


@pytest.fixture
def plain(plain_source: Path, tmp_path: Path) -> Path:
    """A fresh copy: its own path, so its own manifest."""
    return Path(shutil.copy(plain_source, tmp_path / plain_source.name))


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This test's own user cache."""
    path = tmp_path / "cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(path))
    return path


def _at_manifest_path(model: Path) -> Path:
    path = manifest_path(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def _one_warning(logs: Sequence[MutableMapping[str, Any]], event: str) -> MutableMapping[str, Any]:
    warnings = [e for e in logs if e.get("log_level") == "warning"]
    assert [e["event"] for e in warnings] == [event], warnings
    return warnings[0]


class TestManifestSave:
    """The manifest is written atomically and never through a link at its path."""

    def test_link_to_the_model_is_replaced_not_written_through(self, plain: Path,
                                                               cache: Path) -> None:
        path = _at_manifest_path(plain)
        path.symlink_to(plain)
        before = _sha(plain)
        table = open_table(plain)
        manifest = DigestManifest.empty(table)
        manifest.save(path)
        assert _sha(plain) == before  # the model is untouched
        assert not path.is_symlink() and path.is_file()
        assert DigestManifest.from_bytes(path.read_bytes()).key == manifest.key

    def test_dangling_link_is_replaced(self, plain: Path, cache: Path, tmp_path: Path) -> None:
        path = _at_manifest_path(plain)
        elsewhere = tmp_path / "elsewhere" / "victim"
        path.symlink_to(elsewhere)
        DigestManifest.empty(open_table(plain)).save(path)
        assert not path.is_symlink() and path.is_file()
        assert not elsewhere.exists() and not elsewhere.parent.exists()

    def test_fifo_is_replaced(self, plain: Path, cache: Path) -> None:
        path = _at_manifest_path(plain)
        os.mkfifo(path)
        DigestManifest.empty(open_table(plain)).save(path)
        assert path.is_file()

    def test_directory_is_refused(self, plain: Path, cache: Path) -> None:
        path = _at_manifest_path(plain)
        path.mkdir()
        with pytest.raises(OutputError, match="is a directory"):
            DigestManifest.empty(open_table(plain)).save(path)

    def test_user_outputs_still_follow_links(self, tmp_path: Path) -> None:
        target = tmp_path / "target.csv"
        target.write_text("old")
        link = tmp_path / "link.csv"
        link.symlink_to(target)
        write_atomic(link, "new")
        assert link.is_symlink() and target.read_text() == "new"

    def test_warmup_digests_through_a_link_keeps_the_model(self, plain: Path,
                                                           tmp_path: Path) -> None:
        cache = tmp_path / "cli-cache"
        env_path = manifest_path(plain, cache / "moestream")
        env_path.parent.mkdir(parents=True)
        env_path.symlink_to(plain)
        before = _sha(plain)
        done = _cli("moestream.tools.warmup", str(plain), "--digests", cache=cache)
        assert done.returncode == 0, done.stderr[-2000:]
        assert _sha(plain) == before
        assert env_path.is_file() and not env_path.is_symlink()


class TestManifestRead:
    """Only a regular file of a plausible size is read; anything else: one warning, then the
    digests are computed again."""

    def test_fifo_is_not_waited_on(self, plain: Path, cache: Path) -> None:
        os.mkfifo(_at_manifest_path(plain))
        with capture_logs() as logs:
            manifest = load_manifest(open_table(plain))
        assert manifest.known_count == 0
        assert "FIFO" in _one_warning(logs, "digest_manifest_unreadable")["reason"]

    def test_link_to_dev_zero_is_not_streamed(self, plain: Path, cache: Path) -> None:
        _at_manifest_path(plain).symlink_to("/dev/zero")
        with capture_logs() as logs:
            assert load_manifest(open_table(plain)).known_count == 0
        assert "character device" in _one_warning(logs, "digest_manifest_unreadable")["reason"]

    def test_huge_sparse_file_is_not_read(self, plain: Path, cache: Path) -> None:
        path = _at_manifest_path(plain)
        with path.open("wb") as f:
            f.write(_MAGIC)
            f.truncate(64 << 30)  # sparse: costs no disk
        table = open_table(plain)
        with capture_logs() as logs:
            assert load_manifest(table).known_count == 0
        reason = _one_warning(logs, "digest_manifest_unreadable")["reason"]
        assert str(manifest_max_bytes(table)) in reason

    def test_cap_fits_a_real_manifest(self, plain: Path, cache: Path) -> None:
        table = open_table(plain)
        data = DigestManifest.empty(table).to_bytes()
        assert len(data) <= manifest_max_bytes(table) < len(data) + (2 << 20)

    def test_deep_header_is_damage_not_a_traceback(self, plain: Path, cache: Path) -> None:
        header = ('{"format": 1, "key": ' + _deep() + "}").encode()
        _at_manifest_path(plain).write_bytes(_MAGIC + len(header).to_bytes(4, "little")
                                             + header)
        with capture_logs() as logs:
            assert load_manifest(open_table(plain)).known_count == 0
        assert "nested" in _one_warning(logs, "digest_manifest_unreadable")["reason"]

    def test_header_number_out_of_range(self, plain: Path, cache: Path) -> None:
        header = b'{"format": 1, "key": {}, "moe_layers": [1e400], "n_experts": 1, "crc32": 0}'
        _at_manifest_path(plain).write_bytes(_MAGIC + len(header).to_bytes(4, "little")
                                             + header)
        with capture_logs() as logs:
            assert load_manifest(open_table(plain)).known_count == 0
        _one_warning(logs, "digest_manifest_unreadable")

    @pytest.mark.parametrize("command", ["run", "warmup"])
    def test_commands_with_a_fifo_there_finish(self, plain: Path, tmp_path: Path,
                                               command: str) -> None:
        cache = tmp_path / "cli-cache"
        path = manifest_path(plain, cache / "moestream")
        path.parent.mkdir(parents=True)
        os.mkfifo(path)
        if command == "run":
            done = _cli("pipeline.run", "-m", str(plain), "-n", "4", "--backend", "host",
                        "--compute", "digest", cache=cache, timeout=120)
        else:
            done = _cli("moestream.tools.warmup", str(plain), "--digests", cache=cache, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        assert "Traceback" not in done.stderr
        warned = [line for line in done.stderr.splitlines() if "digest_manifest" in line
                  and "warn" in line.lower()]
        assert len(warned) == 1 and "FIFO" in warned[0], done.stderr[-2000:]
        assert path.is_file()  # replaced by the manifest computed
        assert load_manifest(open_table(plain), path).complete


class TestReadInput:
    """``read_input``: a regular file up to a size, refused otherwise, without blocking."""

    def test_refusals(self, tmp_path: Path) -> None:
        fifo = tmp_path / "fifo"
        os.mkfifo(fifo)
        with pytest.raises(NotRegularFileError, match="FIFO"):
            read_input(fifo, 100)
        big = tmp_path / "big"
        big.write_bytes(bytes(101))
        with pytest.raises(InputTooLargeError, match="101 bytes"):
            read_input(big, 100)
        assert read_input(big, 101) == bytes(101)


class TestBoundedJSON:
    """One loader for input JSON: depth checked before the parser recurses."""

    @settings(max_examples=200, deadline=None)
    @given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                        lambda inner: st.lists(inner, max_size=3)
                        | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                        max_leaves=30))
    def test_depth_of_any_document(self, value: Any) -> None:
        def depth(v: Any) -> int:
            if isinstance(v, list):
                return 1 + max((depth(x) for x in v), default=0)
            if isinstance(v, dict):
                return 1 + max((depth(x) for x in v.values()), default=0)
            return 0

        text = json.dumps(value)
        assert json_depth(text) == json_depth(text.encode()) == depth(value)
        assert load_json_bounded(text, "doc", max_depth=max(depth(value), 1)) == value

    def test_brackets_in_strings_do_not_count(self) -> None:
        text = json.dumps(["[[[{{{", '\\"[[[', {"k]]]": "\"{{{"}])
        assert json_depth(text) == 2

    def test_too_deep_is_a_value_error_not_a_recursion_error(self) -> None:
        with pytest.raises(JSONDepthError, match="doc: JSON nested 3000 levels deep"):
            load_json_bounded(_deep(), "doc")
        with pytest.raises(ValueError, match="nested"):
            load_json_bounded("[" * DEEP + '"unterminated', "doc")

    def test_unterminated_strings_scan_in_linear_time(self) -> None:
        assert json_depth('"' + '\\"' * 500_000) == 0  # quadratic would take hours

    @pytest.mark.parametrize("line", [1, 2])
    def test_trace_line_too_deep(self, tmp_path: Path, line: int) -> None:
        from moestream.pipeline.foundation.trace import TRACE_FORMAT, TRACE_VERSION

        path = tmp_path / "deep.jsonl"
        header = {"format": TRACE_FORMAT, "version": TRACE_VERSION, "n_layers": 43,
                  "n_experts": 256, "top_k": 8, "preset": "x"}  # rows of up to 22 K chars
        lines = [json.dumps(header), _deep()] if line == 2 else [_deep()]
        path.write_text("\n".join(lines) + "\n")
        with pytest.raises(TraceError, match=f"deep.jsonl:{line}: JSON nested"):
            load_trace(path)

    def test_log_line_too_deep_is_malformed(self, tmp_path: Path) -> None:
        path = tmp_path / "run.jsonl"
        start = {"event": "run_start", "schema": 2, "config": {}, "model": {"moe_layers": []},
                 "machine": {}, "budget_bytes": 1, "policy": "lru"}
        path.write_text(json.dumps(start) + "\n" + _deep() + "\n" + json.dumps(start) + "\n")
        assert read_log(path).counts.malformed == 1

    def test_analyze_first_line_too_deep(self, tmp_path: Path) -> None:
        path = tmp_path / "deep.jsonl"
        path.write_text(_deep() + "\n")
        _refused(_cli("moestream.tools.analyze", str(path)), "nested")

    def test_run_trace_too_deep(self, tiny_model: Path, tmp_path: Path) -> None:
        path = tmp_path / "deep.jsonl"
        path.write_text(_deep() + "\n")
        _refused(_cli("pipeline.run", "-m", str(tiny_model), "-n", "2", "--trace", str(path)),
                 "nested")

    def test_warmup_hot_too_deep(self, tiny_model: Path, tmp_path: Path) -> None:
        path = tmp_path / "deep.jsonl"
        path.write_text(_deep() + "\n")
        _refused(_cli("moestream.tools.warmup", str(tiny_model), "--hot", str(path)), "nested")


HUGE = "1" + "0" * 400


class TestSizes:
    """Sizes are parsed exactly in integers and capped: never an OverflowError."""

    @pytest.mark.parametrize(("text", "nbytes"), [
        ("512", 512), ("11GB", 11 * 10**9), ("20GiB", 20 * 2**30), ("1.5G", 3 * 2**29),
        ("0.5", 0), ("1.9999", 1), ("4EiB".replace("EiB", "") + "611686018427387904",
                                      MAX_SIZE_BYTES),
        ("0" * 500 + "7k", 7 * 1024), ("1." + "5" * 5000 + "k", 1592),
    ])
    def test_exact(self, text: str, nbytes: int) -> None:
        assert parse_size(text) == nbytes

    @pytest.mark.parametrize("text", [HUGE, HUGE + "GB", str(MAX_SIZE_BYTES + 1), "1" + "0" * 25])
    def test_over_the_cap(self, text: str) -> None:
        with pytest.raises(UsageError, match="larger than"):
            parse_size(text)

    def test_budget_in_experts_capped(self) -> None:
        with pytest.raises(UsageError, match="experts a budget may hold"):
            parse_budget(HUGE)
        assert Budget(experts=2**32).resolve(2**40) == MAX_SIZE_BYTES

    @pytest.mark.parametrize("budget", [HUGE, HUGE + "GB", 10**400])
    def test_api_budget(self, budget: str | int) -> None:
        import moestream

        with pytest.raises(UsageError, match=r"experts a budget may hold|larger than"):
            moestream.open_sync(budget=budget, backend="host")

    @pytest.mark.parametrize("option", ["--cache-budget", "--chunk", "--ram-limit", "--margin",
                                        "--limits"])
    def test_run_options(self, tiny_model: Path, option: str) -> None:
        value = f"read={HUGE}GB/s" if option == "--limits" else HUGE
        done = _cli("pipeline.run", "-m", str(tiny_model), "-n", "2", option, value)
        _refused(done, "experts a budget may hold" if option == "--cache-budget"
                 else "larger than")

    def test_warmup_max_bytes(self, tiny_model: Path, tmp_path: Path) -> None:
        log = tmp_path / "run.jsonl"
        log.write_text("{}\n")
        _refused(_cli("tools.warmup", str(tiny_model), "--hot", str(log), "--max-bytes", HUGE),
                 "larger than")


LONG_TOKENS = 9000
"""Tokens of ``long_log``: past two of ``FloatRows``' 4096-row blocks."""


@pytest.fixture(scope="module")
def long_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A synthetic run log of 43 MoE layers x top-6, about 2 KB a token line."""
    from tests.synthetic_logs import SyntheticRun, write_synthetic_log

    path = tmp_path_factory.mktemp("long") / "run.jsonl"
    write_synthetic_log(path, SyntheticRun(tokens=LONG_TOKENS, budget_experts=600))
    return path


class TestAnalyzeMemory:
    """``tools.analyze`` holds numbers per token, never the lines; expert ids only for the
    what-if replay."""

    TOKENS = LONG_TOKENS

    def test_summary_without_expert_ids_is_the_same(self, long_log: Path) -> None:
        from moestream.tools.analyze.cli import summarize

        whole, lean = read_log(long_log), read_log(long_log, experts=False)
        assert whole.tokens.experts.shape[0] == self.TOKENS
        assert lean.tokens.experts.shape[0] == 0
        assert summarize(whole) == summarize(lean)
        assert whole.problems == lean.problems == ()
        for name in whole.tokens.values:
            assert np.array_equal(whole.tokens[name], lean.tokens[name], equal_nan=True)

    def test_held_per_token(self, long_log: Path) -> None:
        import tracemalloc

        tracemalloc.start()
        try:
            run = read_log(long_log, experts=False)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert len(run.tokens) == self.TOKENS
        # about 30 float64 values a token, twice while the columns are built; the lines
        # (2 KB each here), tuples of Python floats (about 1.2 KB) and the expert ids (1 KB)
        # are not held: 4.5 KB a token before
        assert peak / self.TOKENS < 1000, peak

    def test_summary_holds_a_few_bytes_per_token(self, long_log: Path,
                                                 tmp_path: Path) -> None:
        """Without columns (the CLI without --csv, --plot, --what-if) a token adds its
        wall_ms and mode code (9 bytes) to what is held; the rest is one block's fixed cost."""
        import tracemalloc

        lines = long_log.read_bytes().splitlines(keepends=True)
        half = tmp_path / "half.jsonl"
        half.write_bytes(b"".join(lines[: 1 + self.TOKENS // 2]))  # run_start, then tokens
        peaks = []
        for path in (half, long_log):
            tracemalloc.start()
            try:
                run = read_log(path, experts=False, columns=False)
                _, peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
            peaks.append(peak)
            assert set(run.tokens.values) == {"wall_ms"}
        # the columns: 230 bytes a token (twice while built); sums only: about 9
        assert (peaks[1] - peaks[0]) / (self.TOKENS - self.TOKENS // 2) < 64, peaks

    def test_replay_refuses_a_log_read_without_ids(self, long_log: Path) -> None:
        from moestream.tools.analyze.whatif_replay import AccessTrace

        with pytest.raises(ValueError, match="experts=True"):
            AccessTrace.from_log(read_log(long_log, experts=False))
