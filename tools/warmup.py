"""Warm, inspect, drop or pin a model file's pages in the page cache, like vmtouch for GGUF.

Why: resident mode is only as good as the page cache behind it. Before a run (or on a
machine where RAM >= model) an operator wants the file, or just the non-routed tensors and
the hottest experts of a past run, loaded as fast as the disk allows; wants to see what is
resident per part of the model; and wants to drop or pin it for experiments. Everything the
kernel is asked goes through ``pipeline.residency`` and ``pipeline.warm``, the engine the
controller uses too.

    python -m tools.warmup MODEL                   # preload the whole file
    python -m tools.warmup MODEL --report --per-expert
    python -m tools.warmup MODEL --non-routed --hot run.jsonl --max-bytes 20GiB
    python -m tools.warmup MODEL --evict --layers 3-5
    python -m tools.warmup MODEL --lock            # hold until Ctrl-C / SIGTERM
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import signal
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, Protocol

import numpy as np

from pipeline.config import parse_size
from pipeline.errors import MoestreamError, TraceError, UsageError
from pipeline.logs import configure_console
from pipeline.residency import (
    PageLock,
    Residency,
    coalesce,
    evict,
    lock_pages,
)
from pipeline.table import ByteRange, ExpertTable, open_table
from pipeline.warm import WarmEngine

__all__ = [
    "HotLog",
    "MemoryProbe",
    "PsutilMemory",
    "Selection",
    "build_selection",
    "check_ram",
    "format_report",
    "header_range",
    "main",
    "non_routed_ranges",
    "parse_index_list",
    "read_hot_log",
    "residency_report",
]

PROG = "moestream-warmup"
MARGIN_BYTES = 2 << 30
MARGIN_FRACTION = 0.05

def parse_index_list(text: str) -> list[int]:
    """Indices in ``text`` such as ``0,3-5`` -> ``[0, 3, 4, 5]`` (sorted, unique).

    Raises:
        UsageError: not a list of indices and ranges.
    """
    out: set[int] = set()
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if match is None:
            raise UsageError(f"not an index list: {text!r} (example: 0,3-5)")
        lo = int(match.group(1))
        hi = int(match.group(2)) if match.group(2) is not None else lo
        if hi < lo:
            raise UsageError(f"empty range {part.strip()!r} in {text!r}")
        out.update(range(lo, hi + 1))
    return sorted(out)


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


def _size(nbytes: float) -> str:
    """``nbytes`` in the largest binary unit that keeps it >= 1."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{int(nbytes)} B"


def _pct(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "100.0%"


class MemoryProbe(Protocol):
    """Where the RAM guard reads memory figures (injectable for tests)."""

    def available_bytes(self) -> int: ...

    def total_bytes(self) -> int: ...


class PsutilMemory:
    """The machine's memory as ``pipeline.machine`` reads it (psutil)."""

    def available_bytes(self) -> int:
        from pipeline.machine import read_machine  # psutil: only when the guard runs

        return read_machine().ram_available_bytes

    def total_bytes(self) -> int:
        from pipeline.machine import read_machine

        return read_machine().ram_total_bytes


def check_ram(need_bytes: int, memory: MemoryProbe, what: str) -> None:
    """Refuse to load ``need_bytes`` more than available RAM minus a margin.

    The margin is 2 GiB or 5% of RAM, whichever is larger.

    Raises:
        UsageError: with both figures.
    """
    available = memory.available_bytes()
    margin = max(MARGIN_BYTES, int(MARGIN_FRACTION * memory.total_bytes()))
    room = available - margin
    if need_bytes > room:
        raise UsageError(
            f"refusing to {what} {_gib(need_bytes)} not yet resident: only {_gib(max(room, 0))} "
            f"may be used ({_gib(available)} available minus a {_gib(margin)} margin); "
            "use --force to do it anyway"
        )


# --- the run log's expert use ------------------------------------------------------------------


@dataclass
class HotLog:
    """Expert use counted from a moestream run log."""

    counts: Counter[tuple[int, int]] = field(default_factory=Counter)
    tokens: int = 0
    skipped_lines: int = 0

    def hottest(self) -> list[tuple[int, int]]:
        """Used experts, most used first (ties by layer, then expert)."""
        return sorted(self.counts, key=lambda key: (-self.counts[key], key))


def _check_starts_a_run(path: Path) -> None:
    """Refuse early, with one line, a file whose first event is not ``run_start``."""
    try:
        with path.open("rb") as f:
            first = next((line for line in f if line.strip()), b"")
    except OSError as exc:
        raise TraceError(f"{path}: cannot read ({exc.strerror})") from None
    try:
        event = json.loads(first)
    except ValueError:
        event = None
    if not isinstance(event, dict) or event.get("event") != "run_start":
        raise TraceError(f"{path}: not a moestream run log (it does not start with a "
                         "run_start event)")


def read_hot_log(path: Path, table: ExpertTable) -> HotLog:
    """Count how often each (layer, expert) was used in a run log of ``table``'s model.

    The log is read by ``tools.logread`` (JSON only, tolerant of bad lines, which are
    counted): the ``run_start`` event's ``model.moe_layers`` orders the ``experts`` lists of
    the ``token`` events.

    Raises:
        TraceError: the file cannot be read, is not a moestream run log, or does not fit the
            model (a layer that is not a MoE layer of it, an expert id out of range).
    """
    from tools.logread import read_log  # only --hot needs it; keep start-up short

    _check_starts_a_run(path)
    run = read_log(path)
    if run.header is None or not run.header.moe_layers:
        raise TraceError(f"{path}: not a moestream run log (no run_start event with "
                         "model.moe_layers)")
    moe_layers = list(run.header.moe_layers)
    unknown = sorted(set(moe_layers) - set(table.layers))
    if unknown:
        raise TraceError(f"{path}: log layers {unknown} are not MoE layers of {table.path} "
                         f"(it has {_compact(table.moe_layers)})")
    experts = run.tokens.experts  # (tokens, layers, width), -1 where nothing was logged
    hot = HotLog(tokens=int(experts.shape[0]), skipped_lines=run.counts.skipped)
    if experts.size == 0:
        return hot
    if experts.shape[1] != len(moe_layers):
        raise TraceError(f"{path}: token experts have {experts.shape[1]} layers, run_start "
                         f"lists {len(moe_layers)} MoE layers")
    for pos, layer in enumerate(moe_layers):
        ids = experts[:, pos, :]
        ids = ids[ids >= 0]
        n_experts = table.layers[layer].n_experts
        if ids.size and int(ids.max()) >= n_experts:
            raise TraceError(f"{path}: expert {int(ids.max())} of layer {layer} outside "
                             f"0..{n_experts - 1} ({table.path})")
        for expert, count in enumerate(np.bincount(ids, minlength=n_experts)):
            if count:
                hot.counts[(layer, expert)] = int(count)
    return hot


# --- selection ---------------------------------------------------------------------------------


@dataclass
class Selection:
    """What to act on: named parts in warm order (most wanted first).

    Attributes:
        parts: ``(name, ranges)``; ranges of one part are in the order to warm them.
        whole_file: True when nothing was selected, so the whole file is meant.
        hot_experts: experts taken from ``--hot``, hottest first.
    """

    parts: list[tuple[str, list[ByteRange]]]
    whole_file: bool = False
    hot_experts: list[tuple[int, int]] = field(default_factory=list)

    @property
    def ranges(self) -> list[ByteRange]:
        """Every range of every part, in warm order."""
        return [r for _, ranges in self.parts for r in ranges]

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in coalesce(self.ranges))


def header_range(table: ExpertTable) -> ByteRange:
    """The GGUF header, KV metadata and tensor infos: everything before the first tensor."""
    first = min(
        [t.offset for t in table.non_routed]
        + [min(layer.gate_offset, layer.down_offset) for layer in table.layers.values()]
    )
    return ByteRange(0, first)


def non_routed_ranges(table: ExpertTable) -> list[ByteRange]:
    """The header and every tensor that is not a routed expert, merged."""
    return coalesce([header_range(table), *table.non_routed])


def build_selection(
    table: ExpertTable,
    *,
    layers: Sequence[int] | None = None,
    experts: Sequence[int] | None = None,
    non_routed: bool = False,
    hot: HotLog | None = None,
    max_hot_bytes: int | None = None,
) -> Selection:
    """The byte ranges the options select, in warm order: non-routed, hot, then the grid.

    ``layers``/``experts`` select a grid (all MoE layers or all experts where one is None);
    ``hot`` adds used experts hottest first, at most ``max_hot_bytes`` of them. With nothing
    selected the whole file is meant.

    Raises:
        UsageError: a layer that is not a MoE layer, or an expert out of range.
    """
    parts: list[tuple[str, list[ByteRange]]] = []
    if non_routed:
        parts.append(("non-routed", non_routed_ranges(table)))
    taken: set[tuple[int, int]] = set()
    hot_keys: list[tuple[int, int]] = []
    if hot is not None:
        budget = max_hot_bytes if max_hot_bytes is not None else table.file_bytes
        used = 0
        for key in hot.hottest():
            size = table.expert_bytes(key[0])
            if used + size > budget:
                break
            used += size
            hot_keys.append(key)
        taken.update(hot_keys)
        parts.append(("hot", [r for key in hot_keys for r in table.slices(key).ranges]))
    if layers is not None or experts is not None:
        grid_layers = list(table.layers) if layers is None else list(layers)
        unknown = [x for x in grid_layers if x not in table.layers]
        if unknown:
            raise UsageError(f"layers {unknown} are not MoE layers (the model has "
                             f"{_compact(table.moe_layers)})")
        for index in grid_layers:
            n = table.layers[index].n_experts
            ids = list(range(n)) if experts is None else list(experts)
            bad = [e for e in ids if e >= n]
            if bad:
                raise UsageError(f"experts {bad} out of range: layer {index} has {n} experts")
            ranges = [r for e in ids if (index, e) not in taken
                      for r in table.slices((index, e)).ranges]
            parts.append((f"layer {index}", coalesce(ranges)))
    if not parts:
        return Selection([("file", [ByteRange(0, table.file_bytes)])], whole_file=True)
    return Selection(parts, hot_experts=hot_keys)


def _compact(values: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``0-2,5``."""
    runs: list[list[int]] = []
    for v in sorted(values):
        if runs and runs[-1][1] == v - 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


# --- report ------------------------------------------------------------------------------------


def residency_report(
    table: ExpertTable,
    residency: Residency,
    *,
    selection: Selection | None = None,
    per_expert: bool = False,
) -> dict[str, Any]:
    """Resident bytes of the file, its non-routed part, each MoE layer (and each expert).

    With a selection that is not the whole file, layers outside ``selection`` are left out
    and its total is added under ``"selection"``.
    """
    shown = set(table.layers)
    if selection is not None and not selection.whole_file:
        named = {name for name, _ in selection.parts}
        grid = {int(n.split()[1]) for n in named if n.startswith("layer ")}
        shown = grid | {key[0] for key in selection.hot_experts}
    nr = non_routed_ranges(table)
    parts: list[dict[str, Any]] = [{
        "part": "non-routed",
        "bytes": sum(r.nbytes for r in nr),
        "resident_bytes": residency.resident_bytes(nr),
    }]
    for index, layer in table.layers.items():
        if index not in shown:
            continue
        ranges = [r for e in range(layer.n_experts) for r in layer.slices(e).ranges]
        each = residency.resident_bytes_each(ranges).reshape(layer.n_experts, 3).sum(axis=1)
        row: dict[str, Any] = {
            "part": f"layer {index}",
            "layer": index,
            "experts": layer.n_experts,
            "bytes": layer.n_experts * layer.expert_bytes,
            "resident_bytes": int(each.sum()),
            "experts_fully_resident": int((each == layer.expert_bytes).sum()),
        }
        if per_expert:
            row["expert_resident_bytes"] = [int(x) for x in each]
        parts.append(row)
    report: dict[str, Any] = {
        "path": str(table.path),
        "file_bytes": table.file_bytes,
        "resident_bytes": residency.file_resident_bytes,
        "expert_bytes": {str(i): layer.expert_bytes for i, layer in table.layers.items()},
        "parts": parts,
    }
    if selection is not None and not selection.whole_file:
        report["selection"] = {
            "bytes": selection.nbytes,
            "resident_bytes": residency.resident_bytes(selection.ranges),
        }
    return report


def _glyphs(each: Sequence[int], full: int) -> str:
    return "".join("#" if b >= full else ("+" if b else ".") for b in each)


def _row(name: str, resident: int, total: int) -> str:
    return f"  {name:<28} {_size(resident):>12} of {_size(total):>12}  {_pct(resident, total):>6}"


def format_report(report: dict[str, Any]) -> str:
    """The report as text: one line per part, a glyph per expert with ``--per-expert``."""
    lines = [
        f"{report['path']}: {_size(report['resident_bytes'])} of {_size(report['file_bytes'])} "
        f"resident ({_pct(report['resident_bytes'], report['file_bytes'])})"
    ]
    for part in report["parts"]:
        name = part["part"]
        if "experts" in part:
            name += f" ({part['experts_fully_resident']}/{part['experts']} experts)"
        lines.append(_row(name, part["resident_bytes"], part["bytes"]))
        if "expert_resident_bytes" in part:
            full = report["expert_bytes"][str(part["layer"])]
            glyphs = _glyphs(part["expert_resident_bytes"], full)
            for start in range(0, len(glyphs), 64):
                lines.append(f"    {start:>4}: {glyphs[start:start + 64]}")
    if "selection" in report:
        sel = report["selection"]
        lines.append(_row("selection", sel["resident_bytes"], sel["bytes"]))
    if any("expert_resident_bytes" in p for p in report["parts"]):
        lines.append("  (# resident, + partly, . not)")
    return "\n".join(lines)


# --- actions -----------------------------------------------------------------------------------


def _warm(path: Path, ranges: list[ByteRange], threads: int | None) -> tuple[int, float]:
    """Load ``ranges`` with a progress bar; returns bytes read and seconds."""
    from tqdm import tqdm  # imported here: start-up time counts against every warm-up

    total = sum(r.nbytes for r in ranges)
    bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1000, file=sys.stderr,
               desc="warming", dynamic_ncols=True, disable=None)

    def progress(done: int, _total: int) -> None:
        bar.update(done - bar.n)

    async def run() -> tuple[int, float]:
        async with WarmEngine(path, threads=threads) as engine:
            result = await engine.warm(ranges, progress=progress)
        return result.bytes_read, result.seconds

    try:
        return asyncio.run(run())
    finally:
        bar.close()


def _hold(lock: PageLock, out: Any) -> None:
    """Keep ``lock`` until SIGINT or SIGTERM."""
    signals = {signal.SIGINT, signal.SIGTERM}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        print(f"locked {_size(lock.locked_bytes)} of {lock.name} in RAM; "
              "Ctrl-C or SIGTERM releases it", file=out, flush=True)
        received = signal.sigwait(signals)
        print(f"released ({signal.Signals(received).name})", file=out, flush=True)
    finally:
        lock.unlock()
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


class _Parser(argparse.ArgumentParser):
    """Argument errors become UsageErrors: one line, exit 2."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description="Preload, report, evict or lock a model file's pages in the page cache.",
    )
    parser.add_argument("model", type=Path, metavar="MODEL", help="GGUF model file")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--report", action="store_true", help="show what is resident, per part")
    mode.add_argument("--evict", action="store_true", help="drop the selection's pages")
    mode.add_argument("--lock", action="store_true",
                      help="mlock the selection and hold it until SIGINT/SIGTERM")
    parser.add_argument("--per-expert", action="store_true", help="with --report: per expert")
    parser.add_argument("--json", action="store_true", help="with --report: JSON output")
    parser.add_argument("--layers", type=parse_index_list, metavar="LIST",
                        help="MoE layers to select, e.g. 0,3-5 (all experts unless --experts)")
    parser.add_argument("--experts", type=parse_index_list, metavar="LIST",
                        help="experts to select in each selected (or every) MoE layer")
    parser.add_argument("--non-routed", action="store_true",
                        help="select the header and every tensor that is not a routed expert")
    parser.add_argument("--hot", type=Path, metavar="LOG",
                        help="select the experts a moestream run log used, most used first")
    parser.add_argument("--max-bytes", type=parse_size, metavar="SIZE",
                        help="with --hot: at most this many bytes of hot experts (20GiB, 11GB)")
    parser.add_argument("--threads", type=int, metavar="N", help="reader threads for warming")
    parser.add_argument("--force", action="store_true",
                        help="warm or lock even beyond available RAM minus the margin")
    parser.add_argument("--debug", action="store_true", help="log events and tracebacks")
    return parser


def _run(args: argparse.Namespace, memory: MemoryProbe) -> int:
    if (args.per_expert or args.json) and not args.report:
        raise UsageError("--per-expert and --json go with --report")
    if args.max_bytes is not None and args.hot is None:
        raise UsageError("--max-bytes goes with --hot")
    if args.threads is not None and args.threads < 1:
        raise UsageError(f"--threads must be >= 1, not {args.threads}")
    table = open_table(args.model)
    hot = read_hot_log(args.hot, table) if args.hot is not None else None
    if hot is not None and hot.skipped_lines:
        print(f"{args.hot}: skipped {hot.skipped_lines} lines that carried no usable data",
              file=sys.stderr)
    selection = build_selection(table, layers=args.layers, experts=args.experts,
                                non_routed=args.non_routed, hot=hot,
                                max_hot_bytes=args.max_bytes)
    path = table.path

    if args.report:
        started = time.perf_counter()
        report = residency_report(table, Residency.of_file(path), selection=selection,
                                  per_expert=args.per_expert)
        report["seconds"] = round(time.perf_counter() - started, 4)
        print(json.dumps(report) if args.json else format_report(report))
        return 0

    union = coalesce(selection.ranges)
    if args.evict:
        before = Residency.of_file(path).resident_bytes(union)
        left = evict(path, union)
        after = Residency.of_file(path).resident_bytes(union)
        print(f"evicted {_size(left)} of {path}: selection resident {_size(before)} -> "
              f"{_size(after)} of {_size(selection.nbytes)}")
        return 0

    missing = Residency.of_file(path).missing(selection.ranges)
    need = sum(r.nbytes for r in coalesce(missing))
    if not args.force:
        check_ram(need, memory, "lock" if args.lock else "warm")
    if args.lock:
        with lock_pages(path, union) as lock:
            _hold(lock, sys.stdout)
        return 0

    read_bytes, seconds = _warm(path, missing, args.threads) if missing else (0, 0.0)
    residency = Residency.of_file(path)
    resident = residency.resident_bytes(union)
    rate = f" ({read_bytes / seconds / 1e9:.2f} GB/s)" if seconds > 0 else ""
    file_pct = _pct(residency.file_resident_bytes, table.file_bytes)
    print(f"resident: {_size(resident)} of {_size(selection.nbytes)} selected "
          f"({_pct(resident, selection.nbytes)}); file {file_pct}; "
          f"read {_size(read_bytes)} in {seconds:.2f} s{rate}")
    return 0


def main(argv: Sequence[str] | None = None, *, memory: MemoryProbe | None = None) -> int:
    """Command line entry point; returns the exit code.

    Args:
        argv: arguments (``sys.argv[1:]`` when None).
        memory: where the RAM guard reads available memory (psutil when None).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    configure_console(debug=debug)
    try:
        return _run(_parser().parse_args(argv), memory or PsutilMemory())
    except MoestreamError as exc:
        if debug:
            raise
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
