"""Verification of files that record no digests: the digest manifest, and runs that use it.

The manifest (``pipeline.foundation.manifest``) holds the same per-matrix digests the device
computes,
computed once from the file (``moestream.stages.manifest_build``); runs verify against it and never
re-read an expert to verify; a manifest from before the file changed is never used.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from moestream.pipeline.cli.run import RunSummary, run
from moestream.pipeline.foundation.config import Budget, ComputeSpec
from moestream.pipeline.foundation.digest import GOLDEN, RunningDigest, digest_bytes
from moestream.pipeline.foundation.errors import ModelChangedError, ReadError
from moestream.pipeline.foundation.manifest import (
    DigestManifest,
    ManifestKey,
    load_manifest,
    manifest_path,
)
from moestream.pipeline.foundation.table import ExpertTable, open_table
from moestream.pipeline.makers.modelgen import spec_for, write_model
from moestream.pipeline.proxy.config import RunConfig
from moestream.pipeline.run import main
from moestream.pipeline.streaming.verify import Digests, Verifier
from moestream.stages.manifest_build import ManifestBuilder
from moestream.stages.reader import ModelReader
from moestream.tools import warmup
from tests.conftest import BACKENDS
from tests.gguf_files import write_plain_moe

MASK = (1 << 64) - 1


def _reference(data: bytes) -> int:
    """The digest as pipeline.digest first defined it, word by word."""
    padded = data + bytes(-len(data) % 4)
    words = np.frombuffer(padded, dtype="<u4").astype(object)
    s1 = sum(words) if len(words) else 0
    s2 = sum(int(w) * (i + 1) for i, w in enumerate(words))
    return (int(s2) + int(s1) * GOLDEN) & MASK


class TestRunningDigest:
    """Fed in pieces of any size, the digest is the one of the whole range."""

    @settings(max_examples=200, deadline=None)
    @given(data=st.binary(max_size=3000), cuts=st.lists(st.integers(0, 3000), max_size=8))
    def test_pieces_equal_whole(self, data: bytes, cuts: list[int]) -> None:
        running = RunningDigest()
        at = 0
        for cut in sorted(c for c in cuts if c <= len(data)):
            running.update(data[at:cut])
            at = cut
        running.update(data[at:])
        assert running.value() == digest_bytes(data) == _reference(data)

    def test_blocks_past_a_million_words(self) -> None:
        data = np.random.default_rng(3).integers(0, 256, (1 << 22) * 2 + 7, dtype=np.uint8)
        running = RunningDigest()
        for start in range(0, data.size, 3_000_001):  # odd pieces straddle numpy blocks
            running.update(data[start : start + 3_000_001])
        words = np.concatenate([data, np.zeros(1, np.uint8)]).view("<u4").astype(np.uint64)
        s1 = int(words.sum(dtype=np.uint64))
        s2 = int((words * np.arange(1, words.size + 1, dtype=np.uint64)).sum(dtype=np.uint64))
        assert running.value() == (s2 + s1 * GOLDEN) & MASK


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This test's own user cache."""
    path = tmp_path / "cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(path))
    return path


@pytest.fixture(scope="module")
def plain_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``tools.make_model --no-digests``: the tiny preset's shape, no moestream metadata."""
    path = tmp_path_factory.mktemp("plain") / "tiny-plain.gguf"
    return write_model(spec_for("tiny", layers=4, experts=16), path, record_digests=False)


@pytest.fixture(scope="module")
def writer_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A file made by gguf's writer directly, slices at odd offsets."""
    path = tmp_path_factory.mktemp("writer") / "writer.gguf"
    return write_plain_moe(path, hidden=256, ffn=256, experts=16)


@pytest.fixture(params=["no-digests", "gguf-writer"])
def plain(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    """A fresh copy (its own path: its own manifest) of each kind of file without digests."""
    source = request.getfixturevalue("plain_source" if request.param == "no-digests"
                                     else "writer_source")
    return Path(shutil.copy(source, tmp_path / source.name))


def _build(table: ExpertTable, manifest: DigestManifest, **kw: Any) -> Any:
    async def go() -> Any:
        async with ManifestBuilder(table, manifest, **kw) as builder:
            return await builder.build()

    return asyncio.run(go())


class TestManifestFile:
    """Stored with its key; a key that no longer matches the file is ignored, logged once."""

    def test_round_trip(self, plain: Path, cache: Path) -> None:
        table = open_table(plain)
        manifest = load_manifest(table)
        assert manifest.known_count == 0 and not manifest.dirty
        _build(table, manifest)
        path = manifest_path(plain)
        assert path.parent == cache / "moestream" / "digests"
        manifest.save(path)
        again = load_manifest(table)
        assert again.complete and again.key == manifest.key
        assert np.array_equal(again.digests, manifest.digests)
        assert not list(path.parent.glob(".*.tmp"))  # written atomically, nothing left over

    def test_damaged_is_ignored(self, plain: Path, cache: Path) -> None:
        table = open_table(plain)
        manifest = load_manifest(table)
        _build(table, manifest)
        path = manifest_path(plain)
        manifest.save(path)
        data = bytearray(path.read_bytes())
        data[-5] ^= 0x01
        path.write_bytes(bytes(data))
        with capture_logs() as logs:
            assert load_manifest(table).known_count == 0
        assert [e["event"] for e in logs] == ["digest_manifest_unreadable"]
        assert "checksum" in logs[0]["reason"]

    @pytest.mark.parametrize("change", ["rewrite-hidden", "replace", "touch"])
    def test_stale_key_is_ignored_once(self, plain: Path, tmp_path: Path, cache: Path,
                                       change: str) -> None:
        table = open_table(plain)
        manifest = load_manifest(table)
        _build(table, manifest)
        manifest.save(manifest_path(plain))
        before = os.stat(plain)
        if change == "rewrite-hidden":  # new bytes in place, size and times put back
            with plain.open("r+b") as f:
                r = table.slices((table.moe_layers[0], 0)).gate
                f.seek(r.offset)
                f.write(bytes(b ^ 0xFF for b in f.read(64)))
                f.seek(r.offset)
                f.write(bytes(64))
            os.utime(plain, ns=(before.st_atime_ns, before.st_mtime_ns))
        elif change == "replace":
            other = Path(shutil.copy(plain, tmp_path / "other.gguf"))
            os.replace(other, plain)
        else:
            os.utime(plain, ns=(before.st_atime_ns, before.st_mtime_ns + 1))
        with capture_logs() as logs:
            stale = load_manifest(open_table(plain))
        assert stale.known_count == 0
        assert [e["event"] for e in logs] == ["digest_manifest_stale"]
        assert logs[0]["changed"]

    def test_named_by_path(self, tmp_path: Path, cache: Path) -> None:
        a, b = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf"
        assert manifest_path(a) != manifest_path(b)
        assert manifest_path(a).name.startswith("m.gguf-")


class TestBuilder:
    """Host digests of every expert, equal to what make_model records and the device sums."""

    @pytest.mark.parametrize("direct", [True, False])
    @pytest.mark.parametrize("fused", [False, True])
    def test_matches_recorded_digests(self, tmp_path: Path, direct: bool, fused: bool) -> None:
        path = write_model(spec_for("ds4-flash-q2", layers=2, experts=3, fused_gate_up=fused),
                           tmp_path / "q2.gguf")
        table = open_table(path)
        assert table.digests is not None
        manifest = DigestManifest.empty(table)
        result = _build(table, manifest, direct=direct, piece_bytes=1 << 20, job_bytes=1)
        assert manifest.complete and result.experts == 2 * 3
        assert np.array_equal(manifest.digests, table.digests)
        assert result.bytes_read >= table.routed_bytes

    def test_resumes_what_is_missing(self, plain: Path) -> None:
        table = open_table(plain)
        whole = DigestManifest.empty(table)
        _build(table, whole)
        partial = DigestManifest.empty(table)
        keys = partial.missing()
        for key in keys[::2]:
            values = whole.get(key)
            assert values is not None
            partial.set(key, values)
        result = _build(table, partial)
        assert result.experts == len(keys[1::2]) and partial.complete
        assert np.array_equal(partial.digests, whole.digests)

    async def test_paused_reads_nothing_and_waited_for_come_first(self, plain: Path) -> None:
        table = open_table(plain)
        manifest = DigestManifest.empty(table)
        last = (table.moe_layers[-1], table.n_experts - 1)
        async with ManifestBuilder(table, manifest, threads=1, job_bytes=1) as builder:
            builder.pause()
            build = asyncio.ensure_future(builder.build())
            await asyncio.sleep(0.05)
            assert manifest.known_count == 0 and builder.bytes_read == 0
            ensure = asyncio.ensure_future(builder.ensure([last]))
            await asyncio.sleep(0)
            builder.resume()
            await asyncio.wait_for(ensure, 10)
            assert manifest.get(last) is not None and manifest.known_count < manifest.total
            await asyncio.wait_for(build, 30)
        assert manifest.complete

    async def test_changed_file_stops_it(self, plain: Path) -> None:
        table = open_table(plain)
        manifest = DigestManifest.empty(table)
        os.utime(plain, ns=(0, 10**18))
        # caught when the builder opens the file against the table's identity
        with pytest.raises(ModelChangedError, match="modified"):
            async with ManifestBuilder(table, manifest) as builder:
                await builder.build()
        assert manifest.known_count == 0


class TestVerifierWaits:
    """An expert checked before its digest is known is counted only once compared."""

    def test_waits_then_compares(self, plain: Path) -> None:
        table = open_table(plain)
        truth = DigestManifest.empty(table)
        _build(table, truth)
        manifest = DigestManifest.empty(table, truth.key)
        verifier = Verifier(table, manifest)
        good, bad = (table.moe_layers[0], 1), (table.moe_layers[1], 2)
        good_values, bad_values = truth.get(good), truth.get(bad)
        assert good_values is not None and bad_values is not None
        wrong = (bad_values[0], bad_values[1] ^ 1, bad_values[2])
        digests = Digests([good, good, bad], np.array([good_values, good_values, wrong],
                                                      dtype=np.uint64))
        verifier.check(digests)
        assert (verifier.verified, verifier.mismatches, verifier.unverified) == (0, 0, 3)
        assert sorted(verifier.waiting_keys) == sorted([good, bad])
        manifest.set(good, good_values)
        verifier.check(Digests.none())
        assert (verifier.verified, verifier.mismatches, verifier.unverified) == (2, 0, 1)
        manifest.set(bad, bad_values)
        verifier.resolve()
        assert (verifier.verified, verifier.mismatches, verifier.unverified) == (2, 1, 0)
        assert verifier.first_mismatch == f"layer {bad[0]} expert {bad[1]} up"


def _cli(capsys: pytest.CaptureFixture[str], model: Path, *extra: str) -> tuple[int, Any, str]:
    code = main(["-m", str(model), "-n", "6", "--backend", "host", "--cache-budget", "12",
                 "--compute", "digest", "--staging-slots", "4", "--json", *extra])
    out, err = capsys.readouterr()
    return code, json.loads(out) if out.strip() else None, err


class _ReadCounter:
    """Counts what the run's readers read, and fails any verification re-read."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.bytes = 0
        read_into = ModelReader.read_into

        def counted(reader: ModelReader, dst: Any, offset: int, *, direct: bool) -> int:
            got = read_into(reader, dst, offset, direct=direct)
            self.bytes += got
            return got

        def no_reread(reader: ModelReader, offset: int, nbytes: int) -> bytes:
            raise AssertionError("an expert was re-read to verify it")

        monkeypatch.setattr(ModelReader, "read_into", counted)
        monkeypatch.setattr(ModelReader, "read_range", no_reread)


class TestRuns:
    """Runs on files without digests verify everything, at no re-read once the manifest is
    there; damaged bytes and rewritten files are caught."""

    @pytest.mark.parametrize("mode", ["direct", "resident"])
    def test_first_run_computes_second_loads(self, plain: Path, cache: Path, mode: str,
                                             capsys: pytest.CaptureFixture[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
        code, first, _ = _cli(capsys, plain, "--mode", mode)
        assert code == 0 and first["digests"] == "manifest-built"
        assert first["mismatches"] == 0 and first["unverified"] == 0
        assert first["verified"] >= first["misses"] > 0
        assert first["manifest_bytes"] >= open_table(plain).routed_bytes
        assert load_manifest(open_table(plain)).complete  # saved for the next run
        reads = _ReadCounter(monkeypatch)
        code, second, _ = _cli(capsys, plain, "--mode", mode)
        assert code == 0 and second["digests"] == "manifest"
        assert second["manifest_bytes"] == 0 and second["mismatches"] == 0
        assert second["verified"] == first["verified"] and second["unverified"] == 0
        if mode == "direct":
            # storage: what the streamer read (aligned covers of the misses), nothing more
            assert reads.bytes >= second["file_bytes"]
            assert second["storage_bytes"] <= reads.bytes + (1 << 20)

    def test_rewritten_file_is_not_checked_against_its_old_manifest(
            self, plain: Path, tmp_path: Path, cache: Path,
            capsys: pytest.CaptureFixture[str]) -> None:
        code, first, _ = _cli(capsys, plain, "--mode", "direct")
        assert code == 0 and first["mismatches"] == 0
        old = load_manifest(open_table(plain))
        assert old.complete
        table = open_table(plain)
        before = os.stat(plain)
        with plain.open("r+b") as f:  # every expert's bytes change, in place, times kept
            for s in table.iter_slices():
                for r in s.ranges:
                    f.seek(r.offset)
                    f.write(bytes(b ^ 0x5A for b in f.read(r.nbytes)))
        os.utime(plain, ns=(before.st_atime_ns, before.st_mtime_ns))
        code, second, err = _cli(capsys, plain, "--mode", "direct")
        assert "digest_manifest_stale" in err
        assert code == 0 and second["digests"] == "manifest-built"
        assert second["mismatches"] == 0 and second["verified"] > 0
        new = load_manifest(open_table(plain))
        assert new.complete and not np.array_equal(new.digests, old.digests)

    @pytest.mark.parametrize("backend", BACKENDS)
    @pytest.mark.parametrize("mode", ["direct", "resident"])
    @pytest.mark.parametrize("manifest", ["none", "stored"])
    def test_corrupt_exits_3(self, plain: Path, cache: Path, backend: str, mode: str,
                             manifest: str, capsys: pytest.CaptureFixture[str]) -> None:
        if manifest == "stored":
            assert warmup.main([str(plain), "--digests"]) == 0
            capsys.readouterr()
        code, summary, err = _cli(capsys, plain, "--mode", mode, "--inject", "corrupt@3",
                                  "--backend", backend)
        errors = [line for line in err.splitlines() if line.startswith("moestream: error:")]
        assert code == 3 and len(errors) == 1 and "differ from the file" in errors[0]
        assert summary["mismatches"] >= 1 and summary["unverified"] == 0
        assert summary["digests"] == ("manifest" if manifest == "stored" else "manifest-built")

    def test_corrupt_with_recorded_digests(self, tiny_model: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
        code, summary, _ = _cli(capsys, tiny_model, "--mode", "direct", "--inject",
                                "corrupt@1", "--compute", "fixed:0")
        assert code == 3 and summary["mismatches"] == 1 and summary["digests"] == "file"

    def test_failed_manifest_is_no_pass(self, plain: Path, cache: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
        def failing(*args: Any) -> Any:
            raise ReadError("injected: the manifest's read failed")

        monkeypatch.setattr(ManifestBuilder, "_digest_job", failing)
        cfg = RunConfig(model=plain, tokens=3, backend="host", mode="direct",
                        budget=Budget(experts=12), compute=ComputeSpec("digest"))
        summary = RunSummary()
        with pytest.raises(ReadError, match="injected"):
            asyncio.run(run(cfg, summary=summary))
        assert summary.verified == 0 and summary.unverified > 0
        assert not manifest_path(plain).exists()


class TestWarmupDigests:
    """``tools.warmup MODEL --digests`` computes and stores the manifest a run then loads."""

    def test_writes_then_run_loads(self, plain: Path, cache: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
        assert warmup.main([str(plain), "--digests", "--threads", "2"]) == 0
        out, _ = capsys.readouterr()
        path = manifest_path(plain)
        assert out.startswith("digests: 48 experts") and str(path) in out
        assert load_manifest(open_table(plain)).complete
        assert warmup.main([str(plain), "--digests"]) == 0
        assert "up to date" in capsys.readouterr()[0]
        code, summary, _ = _cli(capsys, plain, "--mode", "direct")
        assert code == 0 and summary["digests"] == "manifest"
        assert summary["manifest_bytes"] == 0 and summary["mismatches"] == 0

    def test_key_in_the_file(self, plain: Path, cache: Path,
                             capsys: pytest.CaptureFixture[str]) -> None:
        assert warmup.main([str(plain), "--digests"]) == 0
        stored = DigestManifest.from_bytes(manifest_path(plain).read_bytes())
        st = os.stat(plain)
        assert stored.key == ManifestKey.of(open_table(plain))
        assert (stored.key.size, stored.key.mtime_ns, stored.key.inode, stored.key.device) == (
            st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev)
        assert stored.key.path == str(plain.resolve())

    def test_recorded_digests_need_none(self, tiny_model: Path, cache: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
        assert warmup.main([str(tiny_model), "--digests"]) == 0
        assert "no manifest needed" in capsys.readouterr()[0]
        assert not (cache / "moestream" / "digests").exists()

    def test_selection_refused(self, plain: Path, capsys: pytest.CaptureFixture[str]) -> None:
        assert warmup.main([str(plain), "--digests", "--layers", "1"]) == 2
        assert "takes no selection" in capsys.readouterr()[1]
