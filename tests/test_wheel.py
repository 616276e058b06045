"""The wheel, installed (not editable) into a fresh venv, beside a user's own ``pipeline/``,
``gpu.py``, ``stages/`` and ``tools/``: neither shadows the other.

The wheel ships one import package, ``moestream``; the card's folders are inside it
(``moestream.pipeline``, ...). The fresh venv gets the dev venv's third-party packages
(numpy, gguf, ...) through a ``.pth`` path line, which adds the directory without running
its ``.pth`` files: the checkout's editable install stays out. No network is used.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
USER_MODULES = {
    "pipeline/__init__.py": 'WHOSE = "user pipeline"\n',
    "gpu.py": 'WHOSE = "user gpu"\n',
    "stages/__init__.py": 'WHOSE = "user stages"\n',
    "tools/__init__.py": 'WHOSE = "user tools"\n',
}
CHECK = """
import importlib.metadata as md, sys
import moestream
from moestream.pipeline.foundation.errors import UsageError
from moestream.pipeline.streaming.session import StreamSession
import gpu, pipeline, stages, tools
assert (pipeline.WHOSE, gpu.WHOSE, stages.WHOSE, tools.WHOSE) == (
    "user pipeline", "user gpu", "user stages", "user tools")
assert moestream.__file__.startswith(sys.argv[1]), moestream.__file__
assert issubclass(moestream.UsageError, Exception) and moestream.UsageError is UsageError
for point in md.entry_points(group="console_scripts"):
    if point.value.startswith("moestream."):
        point.load()
print("ok", sorted(p.name for p in md.entry_points(group="console_scripts")
                   if p.value.startswith("moestream.")))
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel built from this checkout (no build isolation: no network)."""
    out = tmp_path_factory.mktemp("wheel")
    shutil.rmtree(ROOT / "build", ignore_errors=True)  # no file of an earlier build
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-index",
                    "--no-build-isolation", "-w", str(out), str(ROOT)],
                   check=True, capture_output=True, timeout=300)
    shutil.rmtree(ROOT / "build", ignore_errors=True)
    (built,) = out.glob("moestream-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A fresh venv with the wheel installed: (its python, its site-packages)."""
    home = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(home)], check=True,
                   timeout=120)
    python = home / "bin" / "python"
    site = Path(subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True).stdout.strip())
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    "--target", str(site), str(wheel)], check=True, capture_output=True,
                   timeout=300)
    (site / "dev-packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python, site


def _user_project(where: Path) -> Path:
    for name, text in USER_MODULES.items():
        (where / name).parent.mkdir(parents=True, exist_ok=True)
        (where / name).write_text(text)
    return where


class TestTheWheel:
    """What the built wheel holds."""

    def test_one_import_package(self, wheel: Path) -> None:
        with zipfile.ZipFile(wheel) as zf:
            names = zf.namelist()
            top = zf.read(next(n for n in names if n.endswith("top_level.txt"))).decode()
        assert top.split() == ["moestream"]
        assert {n.split("/")[0] for n in names} == {"moestream", "moestream-0.1.0.dist-info"}
        for card in ("pipeline", "stages", "gpu", "tools"):
            assert f"moestream/{card}/__init__.py" in names
        assert not any(n.startswith("moestream/bench") or "/tests/" in n for n in names)


class TestInstalled:
    """The installed wheel beside a user's modules of the card's names."""

    def test_imports_and_entry_points(self, venv: tuple[Path, Path], tmp_path: Path) -> None:
        python, site = venv
        done = subprocess.run([str(python), "-c", CHECK, str(site)], cwd=_user_project(tmp_path),
                              capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("ok") and "moestream-run" in done.stdout

    def test_the_run_command(self, venv: tuple[Path, Path], tmp_path: Path) -> None:
        python, _ = venv
        env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
        env.pop("PYTHONPATH", None)
        done = subprocess.run(
            [str(python), "-m", "moestream.pipeline.run", "-n", "2", "--backend", "host",
             "--json"], cwd=_user_project(tmp_path / "project"), env=env,
            capture_output=True, text=True, timeout=300, check=False)
        assert done.returncode == 0, done.stderr
        assert '"tokens": 2' in done.stdout
