"""The house's numbers: layers, cycles, module and function sizes (``python tests/house.py``).

Every folder is one layer; a module imports its own folder or the folders of lower layers,
never above (every import counts, those inside functions and under ``TYPE_CHECKING``
included: they are how cycles hide). From the bottom up::

    pipeline/foundation    errors, files, the expert table, config, digests, traces
    pipeline/makers        model files written: the embedded tiny model, GGUF and
                           safetensors checkpoints, quantized forms (the foundation only)
    pipeline/runlog        the per-token run log: its writer and its reader
    gpu                    device backends: host, CUDA, kernels
    gpu/cache              the device cache's bookkeeping: entries, pool, policy, placement
    stages                 I/O stages: read, staging, upload, install, residency, warming
    pipeline/streaming     the streaming session: streamer, leases, controller, verification
    moestream              the public API an engine imports
    moestream/transformers the transformers integration (the public API and foundation only)
    pipeline/proxy         the proxy engine: decode loop, synthetic routing, its calibration
    pipeline/cli           the command lines' plumbing and ``pipeline.run``'s engines
    tools/analyze          the run-log analysis command
    tools/warmup           the warm-up command
    pipeline, tools        entry points (``python -m pipeline.run``, ``tools.make_model``)
    bench                  benchmarks: not shipped

The card's folders ship inside the one import package ``moestream`` (symlinks
``moestream/pipeline -> ../pipeline`` and so on), so every import names ``moestream.``;
an import of a bare ``pipeline``, ``stages``, ``gpu`` or ``tools`` is a finding too.
Sizes: a module over 400 lines is listed, one over 500 is a finding; a function over 60
lines is a finding. Run as a script it prints every number and exits 1 on a finding; the
tests (``tests/test_house.py``) assert the same.

One miss: :func:`miss_path` opens the embedded tiny model through ``moestream.open_sync``
(host backend, direct I/O), fetches one expert to start every thread, then profiles every
thread while a second, cold expert is fetched and used: the product files and functions that
ran, to follow a miss by. Comprehensions and lambdas are not counted; a dataclass's generated
``__init__`` is (an object the miss makes), under its class's file. Whether the caller
blocks depends on when the read lands, so the profile is the union of ``MISS_RUNS`` misses,
each in a session of its own: every path a cold miss may take. Printed, not a finding: the
aim was 8 files and 40 functions. :func:`least_files` prints how far moving code can go
toward it: the fewest modules that hold the classes the miss ran in, kept whole.
"""

from __future__ import annotations

import ast
import os
import sys
import tempfile
import threading
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CARD = ("pipeline", "stages", "gpu", "tools")
FOLDERS = (*CARD, "moestream", "bench")
LAYERS: tuple[tuple[str, ...], ...] = (
    ("pipeline/foundation",),
    ("pipeline/makers",),
    ("pipeline/runlog",),
    ("gpu",),
    ("gpu/cache",),
    ("stages",),
    ("pipeline/streaming",),
    ("moestream",),
    ("moestream/transformers",),
    ("pipeline/proxy",),
    ("pipeline/cli",),
    ("tools/analyze",),
    ("tools/warmup",),
    ("pipeline", "tools"),
    ("bench",),
)
"""Each layer's folders, from the bottom up."""
API_ONLY = {
    "moestream/transformers": ("moestream", "pipeline/foundation"),
    "pipeline/cli": ("moestream", "moestream/transformers", "pipeline/proxy",
                     "pipeline/foundation"),
}
"""Folders that may import only these folders (and their own): the transformers integration
is an engine on the public API; the command lines drive the two engines (the proxy engine
and the transformers integration) on the public API too."""
FACES = {"moestream": "moestream", "moestream/transformers": "moestream.transformers"}
"""Folders an API-only folder imports by their package's names only (folder -> package)."""
MODULE_LINES = 400
MODULE_LINES_MAX = 500
FUNCTION_LINES = 60


def folder_rank(folder: str) -> int:
    """The layer of ``folder`` (-1 when it has none)."""
    for rank, folders in enumerate(LAYERS):
        if folder in folders:
            return rank
    return -1


def module_name(path: Path) -> str:
    """The import name of a file of the tree: ``pipeline/x.py`` is ``moestream.pipeline.x``."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    if parts[0] in CARD:
        parts.insert(0, "moestream")
    return ".".join(parts)


def shipped_modules() -> dict[str, Path]:
    """Import name -> file, for every module of the tree (each file once: no symlink)."""
    modules: dict[str, Path] = {}
    for top in FOLDERS:
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = path.relative_to(ROOT).parts
            if parts[0] == "moestream" and parts[1] in CARD:  # the symlinks: seen as themselves
                continue
            if parts[:2] == ("bench", "results"):  # scripts kept with their results, as run
                continue
            modules[module_name(path)] = path
    return modules


def folder_of(path: Path) -> str:
    """The folder a module file lives in, relative to the root (``pipeline/streaming``)."""
    return path.parent.relative_to(ROOT).as_posix()


def imports_of(source: str, module: str, is_package: bool = False) -> set[str]:
    """Every name of ours that ``source`` imports, anywhere in the file."""
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
        found.update(n for n in names if n.split(".")[0] in FOLDERS)
    return found


def import_graph(modules: Mapping[str, Path]) -> tuple[dict[str, set[str]], list[str]]:
    """Module -> the modules of ours it imports; and the bare card imports found."""
    graph: dict[str, set[str]] = {}
    bare: list[str] = []
    for name, path in modules.items():
        targets = imports_of(path.read_text(), name, path.name == "__init__.py")
        bare += [f"{name} imports {t}" for t in sorted(targets) if t.split(".")[0] in CARD]
        resolved = set()
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                resolved.add(target)
        graph[name] = resolved
    return graph, bare


def layer_violations(graph: Mapping[str, Iterable[str]], folders: Mapping[str, str]) -> list[str]:
    """Each import that reaches a higher layer, or outside what an API-only folder may use:
    of ``moestream`` and of ``moestream.transformers``, the package's names
    (``from moestream import X``), never one of its private modules (``moestream._session``,
    ``moestream.transformers._hub``), which is where the public face ends."""
    found = []
    for source, targets in graph.items():
        here = folders[source]
        for target in targets:
            there = folders[target]
            if there == here:
                continue
            allowed = API_ONLY.get(here)
            private = there in FACES and target != FACES[there]
            if folder_rank(there) > folder_rank(here) or (
                    allowed and (there not in allowed or private)):
                found.append(f"{source} ({here}) imports {target} ({there})")
    return sorted(found)


def cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def successors(node: str) -> Iterator[str]:
        return iter(sorted(graph.get(node, ())))

    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, successors(root))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, it = work[-1]
            for nxt in it:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, successors(nxt)))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while (member := stack.pop()) != node:
                        on_stack.discard(member)
                        component.append(member)
                    on_stack.discard(node)
                    if component:
                        found.append(sorted([*component, node]))
    return found


@dataclass(frozen=True)
class Size:
    """A module's or function's length in lines, where it is."""

    where: str
    lines: int


def module_sizes(modules: Mapping[str, Path]) -> list[Size]:
    """Every product module (not bench) over ``MODULE_LINES``, longest first."""
    sizes = [Size(str(p.relative_to(ROOT)), len(p.read_text().splitlines()))
             for p in modules.values() if p.relative_to(ROOT).parts[0] != "bench"]
    return sorted((s for s in sizes if s.lines > MODULE_LINES), key=lambda s: -s.lines)


def function_sizes(modules: Mapping[str, Path], limit: int = FUNCTION_LINES) -> list[Size]:
    """Every function of the tree (bench included) over ``limit`` lines, longest first."""
    sizes = []
    for path in modules.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > limit:
                    sizes.append(Size(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}", lines))
    return sorted(sizes, key=lambda s: -s.lines)


@dataclass(frozen=True)
class MissPath:
    """The product code one cold miss ran: file -> its functions; and the threads it ran on."""

    functions: dict[str, list[str]]
    threads: int

    @property
    def n_functions(self) -> int:
        return sum(len(f) for f in self.functions.values())


def least_files(miss: MissPath) -> tuple[int, dict[str, int]]:
    """The fewest modules that could hold what ``miss`` ran without changing the code: each
    class or top-level function it ran in kept whole, in its own layer's folder, no module
    over ``MODULE_LINES_MAX`` lines. Returns (at least that many files, the lines of those
    definitions by folder): a lower bound (each folder's lines over the cap, rounded up),
    for the distance between the aim and what moving code alone can reach."""
    lines: dict[str, int] = {}
    for path, names in miss.functions.items():
        outer = {name.split(".")[0] for name in names}
        tree = ast.parse((ROOT / path).read_text())
        for node in tree.body:
            if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) \
                    and node.name in outer:
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                folder = str(Path(path).parent)
                lines[folder] = lines.get(folder, 0) + (node.end_lineno or first) - first + 1
    return sum(-(-n // MODULE_LINES_MAX) for n in lines.values()), lines


_ANONYMOUS = ("<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>", "<lambda>")
MISS_RUNS = 5


def _product_function(frame: FrameType, product: tuple[str, ...]) -> tuple[str, str] | None:
    """(file, qualified name) of the product function ``frame`` runs, or None: a dataclass's
    generated ``__init__`` (code compiled from a string) counts under its class's file."""
    code = frame.f_code
    if code.co_filename == "<string>":
        if code.co_name != "__init__" or "self" not in frame.f_locals:
            return None
        cls = type(frame.f_locals["self"])
        path = os.path.realpath(getattr(sys.modules.get(cls.__module__), "__file__", "") or "")
        name = f"{cls.__qualname__}.__init__"
    else:
        path = os.path.realpath(code.co_filename)
        name = code.co_qualname
    if not path.startswith(product) or name.endswith(_ANONYMOUS):
        return None
    return str(Path(path).relative_to(ROOT)), name


def miss_path(runs: int = MISS_RUNS) -> MissPath:
    """Profile cold misses through ``open_sync(...).fetch(...)`` (see the module docstring)."""
    from moestream.pipeline.makers.modelgen import ensure_default_model

    product = tuple(str(ROOT / top) + os.sep for top in (*CARD, "moestream"))
    seen: dict[tuple[str, str], set[str]] = {}
    with tempfile.TemporaryDirectory() as cache:
        previous = os.environ.get("XDG_CACHE_HOME")
        os.environ["XDG_CACHE_HOME"] = cache
        try:
            model = ensure_default_model()
            for _ in range(runs):
                _profile_one_miss(model, product, seen)
        finally:
            if previous is None:
                os.environ.pop("XDG_CACHE_HOME", None)
            else:
                os.environ["XDG_CACHE_HOME"] = previous
    functions: dict[str, list[str]] = {}
    for path, name in sorted(seen):
        functions.setdefault(path, []).append(name)
    return MissPath(functions, len({t for names in seen.values() for t in names}))


def _profile_one_miss(model: Path, product: tuple[str, ...],
                      seen: dict[tuple[str, str], set[str]]) -> None:
    """One session: a first fetch starts every thread, the second (cold) one is profiled."""
    import moestream

    tracing = False

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if tracing and event == "call":
            found = _product_function(frame, product)
            if found is not None:
                seen.setdefault(found, set()).add(threading.current_thread().name)

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        with moestream.open_sync(model, backend="host", mode="direct", verify=False) as ms:
            layer = ms.model.moe_layers[0]
            with ms.fetch(layer, [0]) as lease:
                for handle in lease:
                    handle.wait()
            ms.end_token()
            tracing = True
            with ms.fetch(layer, [1]) as lease:
                for handle in lease:
                    handle.wait()
            tracing = False
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type,unused-ignore]


@dataclass(frozen=True)
class Report:
    """Everything the house test checks."""

    unplaced: list[str]
    bare: list[str]
    violations: list[str]
    cycles: list[list[str]]
    long_modules: list[Size]
    long_functions: list[Size]

    @property
    def too_long_modules(self) -> list[Size]:
        return [s for s in self.long_modules if s.lines > MODULE_LINES_MAX]

    @property
    def findings(self) -> int:
        return (len(self.unplaced) + len(self.bare) + len(self.violations) + len(self.cycles)
                + len(self.too_long_modules) + len(self.long_functions))


def report() -> Report:
    """The house as it stands."""
    modules = shipped_modules()
    folders = {name: folder_of(path) for name, path in modules.items()}
    graph, bare = import_graph(modules)
    return Report(
        unplaced=sorted(f"{n} ({f})" for n, f in folders.items() if folder_rank(f) < 0),
        bare=bare,
        violations=layer_violations(graph, folders),
        cycles=cycles(graph),
        long_modules=module_sizes(modules),
        long_functions=function_sizes(modules),
    )


def main() -> int:
    found = report()
    sections: list[tuple[str, list[str]]] = [
        ("modules in no layer", found.unplaced),
        ("bare card imports (not through moestream.)", found.bare),
        ("imports reaching up", found.violations),
        ("import cycles", [" <-> ".join(c) for c in found.cycles]),
        (f"modules over {MODULE_LINES} lines (over {MODULE_LINES_MAX}: a finding)",
         [f"{s.lines:5d}  {s.where}" for s in found.long_modules]),
        (f"functions over {FUNCTION_LINES} lines",
         [f"{s.lines:5d}  {s.where}" for s in found.long_functions]),
    ]
    for title, lines in sections:
        print(f"{title}: {len(lines)}")
        for line in lines:
            print(f"    {line}")
    miss = miss_path()
    print(f"one cold miss (open_sync(...).fetch(...), {MISS_RUNS} runs): "
          f"{len(miss.functions)} files, "
          f"{miss.n_functions} functions, {miss.threads} threads (aim: 8 files, 40 functions)")
    for path, names in miss.functions.items():
        print(f"    {path}: {len(names)}  {', '.join(names)}")
    floor, lines = least_files(miss)
    print(f"  the classes and functions it ran in: {sum(lines.values())} lines; kept whole, "
          f"at most {MODULE_LINES_MAX} lines a module, they need at least {floor} files")
    for folder, n in sorted(lines.items(), key=lambda item: folder_rank(item[0])):
        files = -(-n // MODULE_LINES_MAX)
        print(f"    {folder}: {n} lines, at least {files} file{'s' * (files > 1)}")
    print(f"findings: {found.findings}")
    return 1 if found.findings else 0


if __name__ == "__main__":
    sys.exit(main())
