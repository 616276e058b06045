"""The house (``tests/house.py``): every folder one layer, no cycle, modules and functions
that fit in a head, and a wheel that ships only ``moestream``."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from tests import house

REPORT = house.report()


class TestTheTree:
    """The tree as it stands keeps every rule."""

    def test_every_module_has_a_layer(self) -> None:
        assert REPORT.unplaced == []

    def test_every_import_goes_through_moestream(self) -> None:
        assert REPORT.bare == []

    def test_no_import_reaches_up(self) -> None:
        assert REPORT.violations == []

    def test_no_import_cycles(self) -> None:
        assert REPORT.cycles == []

    def test_no_module_over_500_lines(self) -> None:
        assert REPORT.too_long_modules == []

    def test_no_function_over_60_lines(self) -> None:
        assert REPORT.long_functions == []

    def test_only_benchs_own_tests_import_bench(self) -> None:
        """A test of the product imports the product (and the tests' own helpers); what a
        benchmark and a test both need lives in the product (a model maker, say)."""
        tests = house.ROOT / "tests"
        found = [str(path.relative_to(tests)) for path in sorted(tests.rglob("*.py"))
                 if not path.is_relative_to(tests / "bench")
                 and any(name == "bench" or name.startswith("bench.") for name in
                         house.imports_of(path.read_text(), "tests"))]
        assert found == []

    def test_the_wheel_ships_one_package(self) -> None:
        config = tomllib.loads((house.ROOT / "pyproject.toml").read_text())
        assert config["tool"]["setuptools"]["packages"]["find"]["include"] == ["moestream*"]
        for card in house.CARD:  # each card folder is in it through its symlink
            link = house.ROOT / "moestream" / card
            assert link.is_symlink() and link.resolve() == house.ROOT / card


class TestOneMiss:
    """The profile of one cold miss sees the miss's path (printed by ``tests/house.py``)."""

    def test_the_profile_sees_the_read_the_upload_and_the_lease(self) -> None:
        miss = house.miss_path()
        assert "ModelReader.read_into" in miss.functions["stages/reader.py"]
        assert "Uploader.upload" in miss.functions["stages/upload.py"]
        assert any(path.startswith("moestream/_") for path in miss.functions)
        assert miss.threads >= 2  # the caller's and the session's loop at least

    def test_least_files_counts_whole_definitions_by_folder(
            self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """A decorated class counts from its decorator to its end, once however many of its
        methods ran; a folder's lines are rounded up to whole modules, folders apart."""
        (tmp_path / "a").mkdir()
        (tmp_path / "b").mkdir()
        body = "\n".join(f"    def m{i}(self) -> None:\n        pass" for i in range(300))
        (tmp_path / "a/one.py").write_text(f"import x\n\n@dataclass\nclass Big:\n{body}\n")
        (tmp_path / "a/two.py").write_text("def f() -> None:\n    pass\n\n\ndef g() -> None:"
                                           "\n    pass\n")
        (tmp_path / "b/three.py").write_text("def h() -> None:\n    pass\n")
        monkeypatch.setattr(house, "ROOT", tmp_path)
        miss = house.MissPath({"a/one.py": ["Big.m0", "Big.m7", "Big.__init__"],
                               "a/two.py": ["f"], "b/three.py": ["h"]}, threads=1)
        floor, lines = house.least_files(miss)
        assert lines == {"a": 2 + 600 + 2, "b": 2}  # g never ran
        assert floor == 2 + 1


def _folders(*names: str) -> dict[str, str]:
    """Module -> folder, for planted graphs: the name's path less its leaf."""
    out = {}
    for name in names:
        if name.startswith("moestream.transformers"):  # the engine's folder, under moestream/
            out[name] = "moestream/transformers"
            continue
        parts = name.removeprefix("moestream.").split(".")
        out[name] = "/".join(parts[:-1]) or "moestream"
    return out


class TestTheChecksCatch:
    """Each kind of finding, planted in a small graph, is caught."""

    @pytest.mark.parametrize(("source", "target"), [
        ("moestream.pipeline.makers.modelgen", "moestream.pipeline.streaming.session"),
        ("moestream.pipeline.streaming.session", "moestream.pipeline.proxy.decode"),
        ("moestream.pipeline.cli.run", "bench.pipeline"),
        ("moestream.gpu.cache.store", "moestream.stages.upload"),
        ("moestream.pipeline.foundation.config", "moestream.gpu.kernels"),
        ("moestream.tools.analyze.cli", "moestream.tools.warmup.select"),
        ("moestream.transformers._loader", "moestream.pipeline.streaming.session"),
    ])
    def test_upward_import(self, source: str, target: str) -> None:
        folders = _folders(source, target)
        assert house.layer_violations({source: {target}, target: set()}, folders)

    @pytest.mark.parametrize("target", [
        "moestream.pipeline.streaming.summary",  # below the API: not a client's to import
        "moestream.pipeline.runlog.write",
        "moestream.gpu.kernels",
        "moestream._run_session",  # the API's own private module: its names, not its files
        "moestream.transformers._hub",  # the engine's private module: its names, not its files
    ])
    def test_a_command_line_imports_beneath_the_api(self, target: str) -> None:
        source = "moestream.pipeline.cli.run"
        assert house.layer_violations({source: {target}, target: set()},
                                      _folders(source, target))

    @pytest.mark.parametrize("target", [
        "moestream", "moestream.pipeline.proxy.decode", "moestream.pipeline.foundation.errors",
        "moestream.transformers",
    ])
    def test_a_command_line_imports_the_api_and_its_engines(self, target: str) -> None:
        source = "moestream.pipeline.cli.run"
        assert house.layer_violations({source: {target}, target: set()},
                                      _folders(source, target)) == []

    def test_a_downward_import_is_fine(self) -> None:
        source, target = "moestream.pipeline.streaming.session", "moestream.gpu.cache.store"
        assert house.layer_violations({source: {target}}, _folders(source, target)) == []

    @pytest.mark.parametrize("ring", [
        ["moestream.gpu.backend", "moestream.gpu.cuda", "moestream.gpu.host"],
        ["moestream.tools.make_trace", "moestream.pipeline.proxy.calibrate"],
    ])
    def test_cycle(self, ring: list[str]) -> None:
        graph = {m: {ring[(i + 1) % len(ring)]} for i, m in enumerate(ring)}
        assert house.cycles(graph) == [sorted(ring)]

    def test_imports_inside_functions_count(self) -> None:
        source = "def f():\n    from moestream.pipeline.makers import modelgen\n"
        assert "moestream.pipeline.makers.modelgen" in house.imports_of(
            source, "moestream.pipeline.cli.run")

    def test_bare_card_imports_are_seen(self) -> None:
        assert house.imports_of("import pipeline.run\n", "x") == {"pipeline.run"}
