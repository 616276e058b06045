"""The house: the folders tell the data flow, and the imports keep to it.

Every import of every shipped module counts, those inside functions included (they are
how cycles hide). Layers from the bottom up; a module may import its own layer or those
below, never above:

    pipeline.foundation   errors, config, the GGUF header and expert table, digests,
                          fault plans, atomic files: imports nothing of ours above it
    gpu                   backends, device cache, pool, kernels
    stages                read, staging, upload, install
    pipeline              the session, leases, controller, streamer
    moestream             the public face an engine imports
    the run               pipeline.run, its loop and its proxy engine (pipeline.loop,
                          pipeline.decode): moestream's first client, written against it
    tools                 the user commands (warm-up, analysis, model and trace makers)
    bench                 benchmarks: not shipped in the wheel

and no cycles between modules, whatever their layers.
"""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("pipeline", "stages", "gpu", "moestream", "tools", "bench")
LAYERS = (("pipeline.foundation",), ("gpu",), ("stages",), ("pipeline",), ("moestream",),
          ("pipeline.run", "pipeline.loop", "pipeline.decode"), ("tools",), ("bench",))
"""Each layer's module prefixes, from the bottom up."""


def layer_of(module: str) -> int:
    """The index in ``LAYERS`` of the layer with the longest prefix of ``module``."""
    best = -1
    best_len = -1
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    return best


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(source: str, module: str, is_package: bool = False) -> set[str]:
    """Every module of ours that ``source`` imports, anywhere in the file."""
    found: set[str] = set()
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            # ``from pkg import mod`` imports the submodule when there is one
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        found.update(n for n in names if n.split(".")[0] in PACKAGES)
    return found


def shipped_modules() -> dict[str, Path]:
    modules: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            modules[module_name(path)] = path
    return modules


def import_graph(modules: Mapping[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules of ours it imports (names that are not modules are dropped)."""
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = imports_of(path.read_text(), name, path.name == "__init__.py")
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def layer_violations(graph: Mapping[str, Iterable[str]]) -> list[str]:
    return sorted(
        f"{source} (layer {LAYERS[layer_of(source)][0]}) imports {target} "
        f"(layer {LAYERS[layer_of(target)][0]})"
        for source, targets in graph.items()
        for target in targets
        if layer_of(target) > layer_of(source)
    )


def cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def successors(node: str) -> Iterator[str]:
        return iter(sorted(graph.get(node, ())))

    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, successors(root))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, it = work[-1]
            advanced = False
            for nxt in it:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, successors(nxt)))
                    advanced = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


class TestTheTree:
    """The shipped packages keep the layering."""

    def test_every_module_has_a_layer(self) -> None:
        assert [m for m in shipped_modules() if layer_of(m) < 0] == []

    def test_no_import_reaches_up(self) -> None:
        assert layer_violations(import_graph(shipped_modules())) == []

    def test_no_import_cycles(self) -> None:
        assert cycles(import_graph(shipped_modules())) == []

    def test_the_wheel_ships_no_benchmark(self) -> None:
        config = tomllib.loads((ROOT / "pyproject.toml").read_text())
        include = config["tool"]["setuptools"]["packages"]["find"]["include"]
        assert not any(pattern.startswith("bench") for pattern in include)
        shipped = {p for p in PACKAGES if p != "bench" and (ROOT / p / "__init__.py").exists()}
        assert {pattern.split("*")[0] for pattern in include} >= shipped


class TestTheChecksCatch:
    """Each finding of the issue, planted in a small graph, is caught."""

    @pytest.mark.parametrize(("source", "target"), [
        ("pipeline.run", "tools.make_model"),        # the product imports its tools
        ("pipeline.run", "bench.pipeline"),          # ... or a benchmark
        ("pipeline.session", "moestream"),           # the implementation imports its face
        ("moestream._session", "pipeline.decode"),   # ... the face imports its client
        ("gpu.cache", "stages.faults"),              # the device layer imports a stage
        ("pipeline.foundation.config", "stages.x"),  # the foundation imports above it
        ("tools.warmup", "bench.kit"),               # a command imports a benchmark
    ])
    def test_upward_import(self, source: str, target: str) -> None:
        assert layer_violations({source: {target}, target: set()})

    @pytest.mark.parametrize("ring", [
        ["gpu.backend", "gpu.cuda", "gpu.host"],
        ["tools.analyze", "tools.plots"],
        ["tools.make_trace", "tools.calibrate"],
    ])
    def test_cycle(self, ring: list[str]) -> None:
        graph = {m: {ring[(i + 1) % len(ring)]} for i, m in enumerate(ring)}
        assert cycles(graph) == [sorted(ring)]

    def test_imports_inside_functions_count(self) -> None:
        source = "def f():\n    from tools.make_trace import synthetic_trace\n"
        assert imports_of(source, "pipeline.run") == {
            "tools.make_trace", "tools.make_trace.synthetic_trace"}

    def test_relative_imports_resolve(self) -> None:
        assert "gpu.host" in imports_of("from .host import X\n", "gpu.backend")
        assert "gpu.host" in imports_of("from . import host\n", "gpu", is_package=True)
