"""The cache moestream trusts only when it is the user's own (``pipeline.foundation.cachedir``),
and what it reads from it: the default model, identified by its content, and digest
manifests, read only as the user's own files.

The tests run as root: "another user" is a file or directory chowned to :data:`OTHER_UID`,
"others could write it" a chmod.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator, MutableMapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

import moestream
from moestream.pipeline.foundation.cachedir import (
    UntrustedPathError,
    configured_cache_dir,
    forget_fallbacks,
    open_private,
    read_private,
    trusted_cache_dir,
)
from moestream.pipeline.foundation.inputs import InputTooLargeError, NotRegularFileError
from moestream.pipeline.foundation.manifest import (
    DigestManifest,
    load_manifest,
    manifest_path,
    user_cache_dir,
)
from moestream.pipeline.foundation.table import open_table
from moestream.pipeline.makers.modelgen import ensure_default_model, spec_for, write_model
from moestream.pipeline.run import main as run_main

OTHER_UID = 12345
"""A user that is not this process's."""

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _warnings(logs: Sequence[MutableMapping[str, Any]]) -> list[MutableMapping[str, Any]]:
    return [e for e in logs if e.get("log_level") == "warning"]


def _one_warning(logs: Sequence[MutableMapping[str, Any]], event: str) -> MutableMapping[str, Any]:
    warnings = _warnings(logs)
    assert [e["event"] for e in warnings] == [event], warnings
    return warnings[0]


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture(autouse=True)
def _private_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Fallbacks go to this test's own temporary directory, and none is remembered from
    another test."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    forget_fallbacks()
    yield tmp
    forget_fallbacks()


@pytest.fixture
def xdg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This test's ``XDG_CACHE_HOME`` (not made: each test makes it as it needs)."""
    path = tmp_path / "xdg"
    monkeypatch.setenv("XDG_CACHE_HOME", str(path))
    return path


def _shared(xdg: Path) -> Path:
    """``xdg`` as a 1777 directory, with a ``moestream`` folder another user owns and anyone
    can write: what an attacker prepares."""
    xdg.mkdir()
    os.chmod(xdg, 0o1777)
    planted = xdg / "moestream"
    planted.mkdir()
    os.chmod(planted, 0o777)
    os.chown(planted, OTHER_UID, OTHER_UID)
    return planted


class TestTrustedDir:
    """The configured directory is used only when it and everything above it are safe;
    otherwise one warning and a private fallback."""

    def test_missing_directories_are_made_private(self, xdg: Path) -> None:
        with capture_logs() as logs:
            path = trusted_cache_dir("digests")
        assert path == xdg / "moestream" / "digests" and not _warnings(logs)
        assert _mode(xdg) == _mode(xdg / "moestream") == _mode(path) == 0o700

    def test_own_directory_of_the_default_mode_is_used(self, xdg: Path) -> None:
        (xdg / "moestream").mkdir(parents=True, mode=0o755)
        os.chmod(xdg / "moestream", 0o755)
        with capture_logs() as logs:
            assert trusted_cache_dir() == user_cache_dir() == xdg / "moestream"
        assert not _warnings(logs)

    def test_sticky_world_writable_parent_is_fine(self, xdg: Path) -> None:
        xdg.mkdir()
        os.chmod(xdg, 0o1777)
        with capture_logs() as logs:
            assert trusted_cache_dir() == xdg / "moestream"
        assert not _warnings(logs) and _mode(xdg / "moestream") == 0o700

    @pytest.mark.parametrize(("where", "mode", "owner", "why"), [
        ("xdg", 0o775, 0, "without the sticky bit"),
        ("xdg", 0o777, 0, "without the sticky bit"),
        ("xdg", 0o755, OTHER_UID, f"uid {OTHER_UID}"),
        ("moestream", 0o770, 0, "writable by group or others"),
        ("moestream", 0o1777, 0, "writable by group or others"),
        ("moestream", 0o700, OTHER_UID, f"owned by uid {OTHER_UID}"),
    ], ids=["group-writable-home", "world-writable-home", "home-of-another",
            "group-writable", "sticky-is-not-enough", "another-owner"])
    def test_untrusted_falls_back(self, xdg: Path, _private_tmp: Path, where: str, mode: int,
                                  owner: int, why: str) -> None:
        (xdg / "moestream").mkdir(parents=True)
        bad = xdg if where == "xdg" else xdg / "moestream"
        os.chmod(bad, mode)
        os.chown(bad, owner, owner)
        with capture_logs() as logs:
            path = trusted_cache_dir()
        warning = _one_warning(logs, "cache_dir_untrusted")
        assert warning["path"] == str(bad) and why in warning["reason"]
        assert path == _private_tmp / f"moestream-{os.geteuid()}"
        assert _mode(path) == 0o700 and os.stat(path).st_uid == os.geteuid()

    def test_link_to_someone_elses_directory(self, xdg: Path, tmp_path: Path) -> None:
        theirs = tmp_path / "theirs"
        theirs.mkdir()
        os.chown(theirs, OTHER_UID, OTHER_UID)
        xdg.mkdir()
        (xdg / "moestream").symlink_to(theirs)
        with capture_logs() as logs:
            path = trusted_cache_dir()
        assert str(theirs) in _one_warning(logs, "cache_dir_untrusted")["path"]
        assert not path.is_relative_to(theirs)

    def test_untrusted_digests_folder_alone(self, xdg: Path, _private_tmp: Path) -> None:
        digests = xdg / "moestream" / "digests"
        digests.mkdir(parents=True)
        os.chown(digests, OTHER_UID, OTHER_UID)
        with capture_logs() as logs:
            assert trusted_cache_dir() == xdg / "moestream"
            path = trusted_cache_dir("digests")
        assert _one_warning(logs, "cache_dir_untrusted")["path"] == str(digests)
        assert path.is_relative_to(_private_tmp) and path.name == "digests"

    def test_warned_once_per_process(self, xdg: Path) -> None:
        _shared(xdg)
        with capture_logs() as logs:
            first, second = trusted_cache_dir(), trusted_cache_dir()
        assert first == second
        _one_warning(logs, "cache_dir_untrusted")

    def test_fallback_taken_by_another_user(self, xdg: Path, _private_tmp: Path) -> None:
        _shared(xdg)
        taken = _private_tmp / f"moestream-{os.geteuid()}"
        taken.mkdir()
        os.chown(taken, OTHER_UID, OTHER_UID)
        with capture_logs() as logs:
            path = trusted_cache_dir()
        assert [e["event"] for e in _warnings(logs)] == ["cache_dir_untrusted"] * 2
        assert path.parent == _private_tmp and path != taken
        assert path.name.startswith("moestream-") and _mode(path) == 0o700

    def test_unusable_directory_falls_back(self, xdg: Path, _private_tmp: Path) -> None:
        xdg.write_text("not a directory")
        with capture_logs() as logs:
            path = trusted_cache_dir("digests")
        _one_warning(logs, "cache_dir_untrusted")
        assert path.is_relative_to(_private_tmp)

    def test_configured_is_only_the_path(self, xdg: Path) -> None:
        assert configured_cache_dir() == xdg / "moestream" and not xdg.exists()


class TestOpenPrivate:
    """A file of the cache is read only when it is the user's own regular file, writable by
    nobody else, and never through a link."""

    def test_own_file_is_read(self, tmp_path: Path) -> None:
        path = tmp_path / "f"
        path.write_bytes(b"ours")
        os.chmod(path, 0o644)
        assert read_private(path, 4) == b"ours"

    @pytest.mark.parametrize(("mode", "owner", "why"), [
        (0o644, OTHER_UID, f"owned by uid {OTHER_UID}"),
        (0o664, 0, "writable by group or others"),
        (0o606, 0, "writable by group or others"),
    ], ids=["another-owner", "group-writable", "world-writable"])
    def test_refused(self, tmp_path: Path, mode: int, owner: int, why: str) -> None:
        path = tmp_path / "f"
        path.write_bytes(b"theirs")
        os.chmod(path, mode)
        os.chown(path, owner, owner)
        with pytest.raises(UntrustedPathError, match=why):
            open_private(path)

    def test_link_is_not_followed(self, tmp_path: Path) -> None:
        target = tmp_path / "target"
        target.write_bytes(b"ours")
        (tmp_path / "link").symlink_to(target)
        with pytest.raises(NotRegularFileError, match="symbolic link"):
            open_private(tmp_path / "link")

    def test_fifo_is_not_waited_on(self, tmp_path: Path) -> None:
        os.mkfifo(tmp_path / "fifo")
        with pytest.raises(NotRegularFileError, match="FIFO"):
            open_private(tmp_path / "fifo")

    def test_bounded(self, tmp_path: Path) -> None:
        (tmp_path / "f").write_bytes(b"12345")
        with pytest.raises(InputTooLargeError):
            read_private(tmp_path / "f", 4)


@pytest.fixture(scope="module")
def genuine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model as this user makes it (in a cache of the module's)."""
    cache = tmp_path_factory.mktemp("genuine")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("XDG_CACHE_HOME", str(cache))
        forget_fallbacks()
        return ensure_default_model()


@pytest.fixture(scope="module")
def impostor(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A valid tiny model of another seed: the same preset, the same size, other bytes, and
    its own expert digests (a run of it verifies, 0 mismatches)."""
    path = tmp_path_factory.mktemp("impostor") / "tiny.gguf"
    return write_model(spec_for("tiny", seed=1), path)


def _plant(model: Path, directory: Path, name: str, *, record: str | None,
           owner: int = 0) -> Path:
    """``model`` copied to ``directory/name``, with a digest record of ``record`` (None:
    none), both owned by ``owner``."""
    path = directory / name
    shutil.copyfile(model, path)
    os.chown(path, owner, owner)
    if record is not None:
        sidecar = directory / f"{name}.sha256"
        sidecar.write_text(record + "\n")
        os.chown(sidecar, owner, owner)
    return path


class TestDefaultModel:
    """The default model is served only when its bytes are the ones this user made; anything
    else at its name is made again, after one warning."""

    def test_made_once_then_reused(self, xdg: Path, genuine: Path) -> None:
        with capture_logs() as logs:
            path = ensure_default_model()
            stamp = os.stat(path).st_mtime_ns
            assert ensure_default_model() == path and os.stat(path).st_mtime_ns == stamp
        assert not _warnings(logs) and path.parent == xdg / "moestream"
        assert path.name == genuine.name and _sha(path) == _sha(genuine)
        record = path.with_name(path.name + ".sha256")
        assert record.read_text().strip() == _sha(path)
        assert _mode(path) == _mode(record) == 0o600

    def test_impostor_of_another_user_is_not_served(self, xdg: Path, genuine: Path,
                                                    impostor: Path) -> None:
        cache = trusted_cache_dir()
        path = _plant(impostor, cache, genuine.name, record=_sha(impostor), owner=OTHER_UID)
        with capture_logs() as logs:
            assert ensure_default_model() == path
        warning = _one_warning(logs, "make_model.default_unverified")
        assert f"owned by uid {OTHER_UID}" in warning["reason"]
        assert _sha(path) == _sha(genuine) and os.stat(path).st_uid == os.geteuid()

    @pytest.mark.parametrize(("record", "why"), [
        ("stale", "differs from the record"),
        (None, "no record of its digest"),
    ])
    def test_own_file_of_other_bytes_is_made_again(self, xdg: Path, genuine: Path,
                                                   impostor: Path, record: str | None,
                                                   why: str) -> None:
        path = _plant(impostor, trusted_cache_dir(), genuine.name,
                      record=_sha(genuine) if record else None)
        with capture_logs() as logs:
            assert ensure_default_model() == path
        assert why in _one_warning(logs, "make_model.default_unverified")["reason"]
        assert _sha(path) == _sha(genuine)

    def test_record_of_another_user_is_not_trusted(self, xdg: Path, genuine: Path,
                                                   impostor: Path) -> None:
        cache = trusted_cache_dir()
        path = _plant(impostor, cache, genuine.name, record=_sha(impostor))
        os.chown(path.with_name(path.name + ".sha256"), OTHER_UID, OTHER_UID)
        with capture_logs() as logs:
            ensure_default_model()
        assert f"uid {OTHER_UID}" in _one_warning(logs, "make_model.default_unverified")[
            "reason"]
        assert _sha(path) == _sha(genuine)

    def test_link_is_not_followed(self, xdg: Path, genuine: Path, impostor: Path,
                                  tmp_path: Path) -> None:
        elsewhere = tmp_path / "elsewhere.gguf"
        shutil.copyfile(impostor, elsewhere)
        cache = trusted_cache_dir()
        path = cache / genuine.name
        path.symlink_to(elsewhere)
        path.with_name(path.name + ".sha256").write_text(_sha(impostor) + "\n")
        with capture_logs() as logs:
            assert ensure_default_model() == path
        assert "symbolic link" in _one_warning(logs, "make_model.default_unverified")[
            "reason"]
        assert not path.is_symlink() and _sha(path) == _sha(genuine)
        assert _sha(elsewhere) == _sha(impostor)  # what the link named is untouched

    def test_fifo_is_not_waited_on(self, xdg: Path, genuine: Path) -> None:
        path = trusted_cache_dir() / genuine.name
        os.mkfifo(path)
        with capture_logs() as logs:
            assert ensure_default_model() == path
        assert "FIFO" in _one_warning(logs, "make_model.default_unverified")["reason"]
        assert _sha(path) == _sha(genuine)

    def test_planted_in_a_shared_cache_is_never_served(self, xdg: Path, genuine: Path,
                                                       impostor: Path) -> None:
        """The attack as found: ``XDG_CACHE_HOME`` on a 1777 directory, the impostor planted
        there by another user; ``open_sync()`` once served it, "verified"."""
        planted = _plant(impostor, _shared(xdg), genuine.name, record=_sha(impostor),
                         owner=OTHER_UID)
        with capture_logs() as logs, moestream.open_sync(backend="host") as ms:
            served = Path(ms.model.path)
            with ms.fetch(ms.model.moe_layers[0], [0, 1]) as lease:
                assert len(lease.gather()) == 2
            ms.end_token()
            assert ms.counters().mismatches == 0
        assert "cache_dir_untrusted" in [e["event"] for e in _warnings(logs)]
        assert not served.is_relative_to(xdg) and _sha(served) == _sha(genuine)
        assert _sha(planted) == _sha(impostor)  # theirs, left alone


def _plain_model(directory: Path) -> Path:
    """A model that records no digests: its runs verify against a manifest."""
    return write_model(spec_for("tiny", layers=4, experts=16), directory / "plain.gguf",
                       record_digests=False)


@pytest.fixture(scope="module")
def plain_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _plain_model(tmp_path_factory.mktemp("plain"))


@pytest.fixture
def plain(plain_source: Path, tmp_path: Path) -> Path:
    """A fresh copy: its own path, so its own manifest."""
    return Path(shutil.copy(plain_source, tmp_path / plain_source.name))


def _wrong_manifest(model: Path, path: Path | None = None) -> Path:
    """A complete manifest keyed to ``model``'s real identity whose digests are all wrong;
    saved at ``path`` (default: the model's manifest path)."""
    table = open_table(model)
    manifest = DigestManifest.empty(table)
    for key in manifest.missing():
        manifest.set(key, (1, 2, 3))
    path = path or manifest_path(model)
    manifest.save(path)
    return path


def _run(capsys: pytest.CaptureFixture[str], model: Path) -> tuple[int, Any]:
    code = run_main(["-m", str(model), "-n", "6", "--backend", "host", "--cache-budget", "12",
                     "--compute", "digest", "--staging-slots", "4", "--json"])
    out, _ = capsys.readouterr()
    return code, json.loads(out) if out.strip() else None


class TestManifest:
    """A manifest is trusted only as the user's own file; another one is ignored like a stale
    one, and the model verifies against digests computed again."""

    @pytest.mark.parametrize(("mode", "owner", "why"), [
        (0o600, OTHER_UID, f"owned by uid {OTHER_UID}"),
        (0o664, 0, "writable by group or others"),
    ], ids=["another-owner", "group-writable"])
    def test_ignored_with_one_warning(self, plain: Path, xdg: Path, mode: int, owner: int,
                                      why: str) -> None:
        path = _wrong_manifest(plain)
        os.chmod(path, mode)
        os.chown(path, owner, owner)
        with capture_logs() as logs:
            assert load_manifest(open_table(plain)).known_count == 0
        assert why in _one_warning(logs, "digest_manifest_untrusted")["reason"]

    def test_planted_manifest_does_not_fail_a_healthy_model(
            self, plain: Path, xdg: Path, capsys: pytest.CaptureFixture[str]) -> None:
        path = _wrong_manifest(plain)
        code, summary = _run(capsys, plain)  # the user's own wrong manifest is believed...
        assert code == 3 and summary["mismatches"] > 0
        _wrong_manifest(plain)
        os.chown(path, OTHER_UID, OTHER_UID)  # ...another user's never is
        code, summary = _run(capsys, plain)
        assert code == 0 and summary["mismatches"] == 0 and summary["verified"] > 0
        assert summary["digests"] == "manifest-built"
        assert os.stat(path).st_uid == os.geteuid()  # replaced by the one computed

    def test_link_is_not_followed(self, plain: Path, xdg: Path, tmp_path: Path) -> None:
        table = open_table(plain)
        good = DigestManifest.empty(table)
        good.save(tmp_path / "elsewhere.digests")
        manifest_path(plain).symlink_to(tmp_path / "elsewhere.digests")
        with capture_logs() as logs:
            assert load_manifest(table).known_count == 0
        assert "symbolic link" in _one_warning(logs, "digest_manifest_unreadable")["reason"]

    def test_planted_in_a_shared_cache_is_never_read(self, plain: Path, xdg: Path,
                                                     _private_tmp: Path) -> None:
        digests = _shared(xdg) / "digests"
        digests.mkdir()
        planted = _wrong_manifest(plain, digests / manifest_path(plain, xdg).name)
        with capture_logs() as logs:
            path = manifest_path(plain)
            manifest = load_manifest(open_table(plain), path)
        _one_warning(logs, "cache_dir_untrusted")
        assert path.is_relative_to(_private_tmp) and path != planted
        assert manifest.known_count == 0
