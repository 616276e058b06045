"""Read a moestream run log (docs/LOG_SCHEMA.md) into numpy columns, tolerantly.

Logs are read after the fact, often from runs that were killed, so the reader accepts what a
real file looks like (blank lines, a cut-off last line, fields and events from newer
writers) and counts every line it could not use instead of failing or hiding it. Only a file
that is not a moestream log at all is refused, with a ``TraceError`` that names the path,
and so is an expert id no int32 holds (naming the line). A line holding an integer no int64
holds (a 4000-digit ``wall_ms``) is skipped and counted (``out_of_range``), never turned
into a float that overflows. Lines are read with a length cap
(``MAX_LINE_BYTES``): a longer one is skipped a piece at a time, never held whole, so a file
without newlines costs no more memory than one line.

Token lines are turned into numbers 4096 at a time, folded into running sums
(``moestream.pipeline.runlog.stats``) and, where asked, kept as numpy columns for intervals and
plots; where asked, the expert ids of every token become one ``(tokens, layers, top_k)``
array that the what-if simulator replays. What that array may take follows the log's size,
never a value in it (``_ExpertBuffer``): a token listing more experts in a layer than the
model has keeps its numbers but not its lists (a counted problem), and a log whose few wide
lists would pad every token past 64 bytes a byte of log is refused in one line. Plain
``json`` parsing dominates the cost; reading is synchronous because there is nothing to
overlap it with (a single sequential file read, CPU-bound parsing), so ``aiofiles`` would
only add overhead.

This module is the reading pass and the schema it checks lines against; the records it fills
are in ``pipeline.runlog.records`` (re-exported here, as the types ``read_log`` returns) and the
per-device fields are read by ``moestream.pipeline.runlog.devices``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, Any

import numpy as np
import numpy.typing as npt
import structlog

from moestream.pipeline.foundation.errors import TraceError, printable
from moestream.pipeline.foundation.inputs import JSONDepthError, load_json_bounded, open_input
from moestream.pipeline.foundation.timesplit import PARTS
from moestream.pipeline.runlog.devices import TokenDeviceRows, dropped_entries_problem, sum_problems
from moestream.pipeline.runlog.records import (
    ControllerDecision,
    LineCounts,
    ModeSwitch,
    RunEnd,
    RunHeader,
    RunLog,
    TokenColumns,
)
from moestream.pipeline.runlog.stats import TokenStats, bandwidth_limits
from moestream.pipeline.runlog.values import (
    FloatArray,
    FloatRows,
    float_table,
    int_or_none,
    mapping,
    str_or_none,
)

__all__ = ["KNOWN_EVENTS", "MAX_LAYER_EXPERTS", "MAX_LINE_BYTES", "MAX_MOE_LAYERS",
           "SCHEMA_VERSION", "SCHEMA_VERSIONS", "TIME_COLUMNS", "TOKEN_COLUMNS", "log_lines",
           "read_log"]

log = structlog.get_logger(__name__)

SCHEMA_VERSION = 2
"""The newest log schema this reader understands."""

SCHEMA_VERSIONS = frozenset({1, 2})
"""Every log schema this reader understands: 2 is 1 with the token event's ``time``."""

KNOWN_EVENTS = frozenset(
    {"run_start", "token", "layer", "controller_decision", "mode_switch", "run_end",
     "warmup_start", "warmup_done", "warmup_stopped", "host_tier"}
)
"""Event types of schema 1."""

_ENVELOPE = frozenset({"event", "schema", "ts", "level"})

TOKEN_COLUMNS: tuple[str, ...] = (
    "token",
    "wall_ms",
    "read_ms",
    "stage_ms",
    "upload_ms",
    "install_ms",
    "stall_ms",
    "compute_ms",
    "hits",
    "misses",
    "evictions",
    "file_bytes",
    "cache_bytes",
    "storage_bytes",
    "ram_available_bytes",
    "cache_live_bytes",
    "cache_parked_bytes",
)
"""Required numeric fields of a ``token`` line, one float64 column each (NaN when absent)."""

_PREFETCH_COLUMNS = ("predicted", "correct", "wasted_bytes")

_TIME_FIELDS = tuple(f"{part}_ms" for part in PARTS)
TIME_COLUMNS = tuple(f"time_{name}" for name in _TIME_FIELDS)
"""Columns of the token event's ``time`` parts (schema 2), present when any token had one."""

_ROW_COLUMNS = (*TOKEN_COLUMNS, *(f"prefetch_{name}" for name in _PREFETCH_COLUMNS),
                *TIME_COLUMNS)
_NO_PREFETCH = (math.nan,) * len(_PREFETCH_COLUMNS)
_NO_TIME = (math.nan,) * len(_TIME_FIELDS)
_WALL = _ROW_COLUMNS.index("wall_ms")
_CHECKED = tuple(_ROW_COLUMNS.index(name) for name in ("token", "hits", "misses", "file_bytes"))
_BLOCK_ROWS = 4096

_FIELDS: dict[str, frozenset[str]] = {
    "run_start": frozenset(
        {"config", "model", "machine", "budget_bytes", "policy", "compute", "backend",
         "devices", "limits"}
    ),
    "token": frozenset(TOKEN_COLUMNS) | {"mode", "experts", "prefetch", "devices", "time",
                                         "cpu_ms", "process_cpu_ms"},
    "layer": frozenset({"token", "layer", "hits", "misses", "read_ms", "stall_ms"}),
    "controller_decision": frozenset({"mode", "readings", "reason", "token"}),
    "mode_switch": frozenset({"from", "to", "reason", "readings", "token", "took_ms"}),
    "warmup_start": frozenset({"bytes", "token"}),
    "warmup_done": frozenset({"bytes", "seconds", "token"}),
    "warmup_stopped": frozenset({"token"}),
    "host_tier": frozenset({"bytes", "target_bytes", "experts", "token"}),
    "run_end": frozenset(
        {
            "tokens", "elapsed_s", "tokens_per_s", "hits", "misses", "hit_rate",
            "file_bytes", "cache_bytes", "storage_bytes", "verified", "mismatches",
            "peak_device_bytes", "budget_bytes", "exit",
            # optional, informative
            "evictions", "allocations", "frees", "stall_ms", "compute_ms", "mode", "modes",
            "switches", "backend", "device", "model", "hit_rate_final", "final_budget_bytes",
            "devices", "unverified", "digests", "manifest_bytes", "experts",
        }
    ),
}
_REQUIRED: dict[str, frozenset[str]] = {
    "run_start": frozenset({"config", "model", "machine", "budget_bytes", "policy"}),
    "token": frozenset(TOKEN_COLUMNS) | {"mode", "experts"},
    "layer": _FIELDS["layer"] - {"read_ms"},
    "controller_decision": frozenset({"mode", "readings", "reason"}),
    "mode_switch": _FIELDS["mode_switch"] - {"took_ms"},
    "warmup_start": _FIELDS["warmup_start"],
    "warmup_done": _FIELDS["warmup_done"],
    "warmup_stopped": _FIELDS["warmup_stopped"],
    "host_tier": _FIELDS["host_tier"],
    "run_end": frozenset(
        {
            "tokens", "elapsed_s", "tokens_per_s", "hits", "misses", "hit_rate",
            "file_bytes", "cache_bytes", "storage_bytes", "verified", "mismatches",
            "peak_device_bytes", "budget_bytes", "exit",
        }
    ),
}
_LAYER_COLUMNS = ("token", "layer", "hits", "misses", "read_ms", "stall_ms")

_MAX_PROBLEMS = 20

MAX_LINE_BYTES = 1 << 20
"""The longest log line read (a token line of 43 MoE layers x top-6 is about 2 KB)."""


def log_lines(handle: IO[bytes]) -> Iterator[bytes | None]:
    """The lines of a log, each at most ``MAX_LINE_BYTES``; ``None`` for a longer line,
    which is skipped a piece at a time and never held whole."""
    while line := handle.readline(MAX_LINE_BYTES + 1):
        if len(line) <= MAX_LINE_BYTES or line.endswith(b"\n"):
            yield line
            continue
        while line and not line.endswith(b"\n"):
            line = handle.readline(MAX_LINE_BYTES)
        yield None


_INT32_MAX = 2**31 - 1

MAX_LAYER_EXPERTS = 4096
"""The most expert ids one layer's list may hold: the model's expert count when the header
gives one (at most this), else this (the largest models route among a few hundred). A token
listing more in a layer has its lists left out, counted as a problem: one line cannot widen
every token's row of the what-if array."""

MAX_MOE_LAYERS = 4096
"""The most MoE layers a header may list (models have tens): a row of the expert array per
token is ``layers x width x 4`` bytes, whatever the token's line holds."""

_BLOCK_BYTES = 16 << 20  # one block of expert ids, at most (a block has at least one row)
_HELD_FLOOR_BYTES = 256 << 20  # the expert ids kept for a replay, at most, or ...
_HELD_PER_LOG_BYTE = 64  # ... this many bytes a byte of log, when that is more

_FITS, _RAGGED, _TOO_WIDE = 0, 1, 2  # what ``_ExpertBuffer.append`` made of a token


class _ExpertBuffer:
    """The tokens' expert ids as ``(tokens, layers, width)`` int32, -1 padded, in blocks.

    Per token, 4 bytes per (layer, slot) while ``keep`` (the what-if replay needs every
    token's ids), else only the 4-byte count of ids used; the block being filled is reused.
    Ids at or above ``n_experts`` are counted block by block for the consistency check.

    Memory follows the log, not the values in it: a block holds at most ``_BLOCK_BYTES``; a
    list longer than the model's expert count (``MAX_LAYER_EXPERTS`` at most) is left out;
    and the ids kept for a replay may take ``_HELD_PER_LOG_BYTE`` bytes a byte of log read
    (``_HELD_FLOOR_BYTES`` at least), past which the log is refused (``TraceError``: a few
    wide lists among many narrow ones would pad every token to their width).
    """

    __slots__ = ("_block", "_block_rows", "_blocks", "_held", "_in_block", "_keep", "_layers",
                 "_limit", "_most_rows", "_n_experts", "_outside", "_path", "_used", "_width",
                 "log_bytes")

    def __init__(self, layers: int, width: int, *, keep: bool, n_experts: int | None,
                 path: Path) -> None:
        if layers > MAX_MOE_LAYERS:
            raise TraceError(f"{path}: run_start lists {layers} MoE layers, more than the "
                             f"{MAX_MOE_LAYERS} a log may have")
        # kept blocks are many: large ones; the one reused block small (it is fixed cost)
        self._most_rows = 4096 if keep else 256
        self._layers = max(layers, 0)
        self._limit = (n_experts if n_experts is not None and 0 < n_experts < MAX_LAYER_EXPERTS
                       else MAX_LAYER_EXPERTS)
        self._width = min(max(width, 1), self._limit)
        self._keep = keep
        self._n_experts = n_experts
        self._path = path
        self._blocks: list[npt.NDArray[np.int32]] = []
        self._used: list[npt.NDArray[np.int32]] = []
        self._outside = 0
        self._held = 0
        self.log_bytes = 0
        """Bytes of the log read so far (the reader sets it): what the kept ids may take."""
        self._block_rows = 1
        self._block = self._new_block()
        self._in_block = 0

    @property
    def limit(self) -> int:
        """The most ids a layer's list may hold."""
        return self._limit

    def _new_block(self) -> npt.NDArray[np.int32]:
        row_bytes = max(self._layers * self._width * 4, 1)
        self._block_rows = max(1, min(self._most_rows, _BLOCK_BYTES // row_bytes))
        return np.full((self._block_rows, self._layers, self._width), -1, np.int32)

    def _row(self, width: int) -> int:
        """The row the next token goes in, in a block at least ``width`` wide."""
        if width > self._width:
            self._flush()  # the rows so far keep their width (``result`` pads them)
            self._width = width
            self._block = self._new_block()
        elif self._in_block == self._block_rows:
            self._flush()
        row = self._in_block
        self._in_block += 1
        return row

    def append(self, experts: Any) -> int:
        """Store one token's lists: ``_FITS``; ``_RAGGED`` when they are not one list of
        expert ids per layer (stored padded); ``_TOO_WIDE`` when a list holds more than
        ``limit`` ids (none stored). Lists of another length than top-k are well formed: a
        prefill token lists every expert its prompt routed to, and a layer fetched twice
        in a token lists each expert once.

        Raises:
            OverflowError: an id no int32 holds (never wrapped).
        """
        try:  # the common case: a rectangular matrix, one row of ids per layer
            ids = np.asarray(experts)
            rectangular = (ids.ndim == 2 and ids.shape[0] == self._layers
                           and ids.dtype.kind in "iu")
        except (ValueError, TypeError):
            rectangular = False
        if rectangular:
            if ids.shape[1] > self._limit:
                self._row(0)
                return _TOO_WIDE
            if ids.size and not -_INT32_MAX - 1 <= int(ids.min()) <= int(ids.max()) <= _INT32_MAX:
                raise OverflowError("an expert id outside int32")
            row = self._row(ids.shape[1])
            self._block[row, :, : ids.shape[1]] = ids  # never broadcast a short list
            return _FITS
        if not isinstance(experts, list):
            self._row(0)
            return _RAGGED
        well_formed = len(experts) == self._layers
        lists: list[list[int]] = []
        for ids in experts[: self._layers]:
            if not isinstance(ids, list):
                well_formed = False
                lists.append([])
                continue
            clean = [e for e in ids if isinstance(e, int) and not isinstance(e, bool)]
            well_formed = well_formed and len(clean) == len(ids)
            lists.append(clean)
        width = max(map(len, lists), default=0)
        if width > self._limit:
            self._row(0)
            return _TOO_WIDE
        row = self._row(width)
        for pos, clean in enumerate(lists):
            if clean:
                self._block[row, pos, : len(clean)] = clean  # OverflowError outside int32
        return _FITS if well_formed else _RAGGED

    def _allowed_bytes(self) -> int:
        return max(_HELD_FLOOR_BYTES, _HELD_PER_LOG_BYTE * self.log_bytes)

    def _refuse(self, nbytes: int) -> TraceError:
        return TraceError(
            f"{self._path}: its expert lists would take {nbytes} bytes to replay, more than "
            f"{self._allowed_bytes()} for a log of {self.log_bytes} bytes (a layer lists "
            f"{self._width} experts: every token is padded to the widest list)")

    def _flush(self) -> None:
        if not self._in_block:
            return
        block = self._block[: self._in_block]
        self._used.append((block >= 0).sum(axis=(1, 2), dtype=np.int32))
        if self._n_experts is not None:
            self._outside += int((block >= self._n_experts).sum())
        if self._keep:
            kept = block.copy() if self._in_block < self._block_rows else block
            self._held += kept.nbytes
            if self._held > self._allowed_bytes():
                raise self._refuse(self._held)
            self._blocks.append(kept)
            self._block = self._new_block()
        else:
            self._block.fill(-1)
        self._in_block = 0

    def take_used(self) -> npt.NDArray[np.int32]:
        """The ids used per token since the last call (the buffer forgets them)."""
        self._flush()
        used = np.concatenate(self._used) if self._used else np.zeros(0, np.int32)
        self._used = []
        return used

    def result(self) -> tuple[npt.NDArray[np.int32], int]:
        """The ids (no tokens unless ``keep``) and how many ids were at or above
        ``n_experts``.

        Raises:
            TraceError: padded to the widest list, the ids would take more than the log
                allows.
        """
        self._flush()
        rows = sum(b.shape[0] for b in self._blocks)
        padded = rows * self._layers * self._width * 4
        if padded > self._allowed_bytes():
            raise self._refuse(padded)
        blocks = [np.pad(b, ((0, 0), (0, 0), (0, self._width - b.shape[2])), constant_values=-1)
                  if b.shape[2] < self._width else b for b in self._blocks]
        experts = (np.concatenate(blocks) if blocks
                   else np.full((0, self._layers, self._width), -1, np.int32))
        self._blocks = []
        return experts, self._outside


_LONG_NUMBER = re.compile(rb"\d{19}")  # a line without 19 digits in a row holds no int64 edge
_INT64_BOUND = 2**63


def _out_of_range(raw: bytes, obj: object) -> bool:
    """True when the decoded line holds an integer no int64 holds (a 4000-digit
    ``wall_ms``): no float or numpy column takes it. Only a line with 19 digits in a row is
    walked, so the common line costs one regular-expression search."""
    if _LONG_NUMBER.search(raw) is None:
        return False
    stack = [obj]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
        elif isinstance(value, int) and not -_INT64_BOUND <= value < _INT64_BOUND:
            return True
    return False


def _first_object(path: Path, line: bytes) -> dict[str, Any]:
    """Decode and check the first non-blank line: is this file a moestream log at all?"""
    try:
        obj = load_json_bounded(line, f"{path}:1")
    except JSONDepthError as exc:
        raise TraceError(f"{path}: not a moestream log ({exc})") from None
    except ValueError:
        raise TraceError(f"{path}: not a moestream log (first line is not JSON)") from None
    if not isinstance(obj, dict):
        raise TraceError(f"{path}: not a moestream log (first line is not a JSON object)")
    event = obj.get("event")
    if event not in KNOWN_EVENTS:
        raise TraceError(f"{path}: not a moestream log (first event is {event!r})")
    if "schema" not in obj:
        raise TraceError(f"{path}: not a moestream log (first line has no 'schema' field)")
    if obj["schema"] not in SCHEMA_VERSIONS or isinstance(obj["schema"], bool):
        raise TraceError(
            f"{path}: log schema {obj['schema']!r} is not supported"
            f" (this reader knows schemas {', '.join(map(str, sorted(SCHEMA_VERSIONS)))})"
        )
    return obj


class _Reader:
    """One pass over a file; collects columns and counts, then builds a ``RunLog``."""

    def __init__(self, path: Path, *, keep_experts: bool, keep_columns: bool) -> None:
        self.path = path
        self.schema = SCHEMA_VERSION
        self._required = _REQUIRED
        self.counts = LineCounts()
        self.header: RunHeader | None = None
        self.end: RunEnd | None = None
        self.decisions: list[ControllerDecision] = []
        self.switches: list[ModeSwitch] = []
        # per token: the numbers of the block being read (never the decoded line), folded
        # into self.stats per block; kept as float64 columns only with keep_columns, else
        # only wall_ms (the latency percentiles) and the mode code, 9 bytes a token
        self.tokens = 0
        self._rows: list[tuple[Any, ...]] = []
        self._unfolded: list[tuple[FloatArray, int, npt.NDArray[np.int32]]] = []
        self.stats = TokenStats(_ROW_COLUMNS, TIME_COLUMNS)
        self._keep_columns = keep_columns
        self._kept: list[FloatArray] = []  # (rows, columns) blocks, with keep_columns
        self._walls: list[FloatArray] = []
        self._checked: list[FloatArray | int] = []  # per block: its device-check columns
        self._block_devices = False
        self.mode_codes = bytearray()  # index into mode_names, 255 where absent
        self.mode_names: list[str] = []
        self.prefetch_seen = False
        self.time_seen = False
        self.layer_rows = FloatRows(_LAYER_COLUMNS)
        self.device_rows = TokenDeviceRows()
        self.problems: list[str] = []
        self.ragged_tokens = 0
        self.wide_tokens = 0  # tokens whose lists were left out: longer than the model's
        self.log_bytes = 0  # read so far: what the kept expert ids may take
        self._keep_experts = keep_experts
        self._experts: _ExpertBuffer | None = None

    def set_schema(self, schema: int) -> None:
        """The file's schema (its first line's): schema 2 requires the token's ``time``."""
        self.schema = schema
        self._required = _REQUIRED if schema < 2 else {
            **_REQUIRED, "token": _REQUIRED["token"] | {"time"}}

    def _problem(self, text: str) -> None:
        if len(self.problems) < _MAX_PROBLEMS:
            self.problems.append(text)

    def _fields(self, event: str, obj: dict[str, Any]) -> None:
        known = _FIELDS[event]
        keys = obj.keys()
        for name in keys - known - _ENVELOPE:
            self.counts.unknown_fields[printable(f"{event}.{name}")] += 1
        for name in self._required[event] - keys:
            self.counts.missing_fields[f"{event}.{name}"] += 1

    def _expert_buffer(self) -> _ExpertBuffer:
        if self._experts is None:
            layers = len(self.header.moe_layers) if self.header else 0
            width = (self.header.top_k or 1) if self.header else 1
            n_experts = self.header.n_experts if self.header else None
            self._experts = _ExpertBuffer(layers, width, keep=self._keep_experts,
                                          n_experts=n_experts, path=self.path)
        return self._experts

    def _mode_code(self, mode: object) -> int:
        if not isinstance(mode, str):
            return 255
        mode = printable(mode)  # reaches the report's rows and verdicts
        if mode not in self.mode_names:
            if len(self.mode_names) == 127:  # int8 codes: more modes than any run has
                return 255
            self.mode_names.append(mode)
        return self.mode_names.index(mode)

    def add(self, obj: dict[str, Any], event: str) -> None:
        self._fields(event, obj)
        if event == "token":
            self._token(obj)
        elif event == "layer":
            self.layer_rows.append(tuple(obj.get(name, math.nan) for name in _LAYER_COLUMNS))
        elif event == "run_start":
            self.header = RunHeader.from_event(obj)
            self._check_header(self.header)
            self._fold_held()
            self._check_device_list(event, obj, self.header.devices)
        elif event == "controller_decision":
            self.decisions.append(
                ControllerDecision(
                    mode=str_or_none(obj.get("mode")),
                    reason=str_or_none(obj.get("reason")),
                    readings=mapping(obj.get("readings")),
                    after_tokens=self.tokens,
                    token=int_or_none(obj.get("token")),
                )
            )
        elif event == "mode_switch":
            self.switches.append(
                ModeSwitch(
                    from_mode=str_or_none(obj.get("from")),
                    to_mode=str_or_none(obj.get("to")),
                    reason=str_or_none(obj.get("reason")),
                    readings=mapping(obj.get("readings")),
                    token=int_or_none(obj.get("token")),
                    after_tokens=self.tokens,
                )
            )
        elif event == "run_end":
            self.end = RunEnd.from_event(obj)
            self._check_device_list(event, obj, self.end.devices)

    def _check_device_list(self, event: str, obj: Mapping[str, Any], kept: tuple[Any, ...]) -> None:
        problem = dropped_entries_problem(event, obj, kept)
        if problem is not None:
            self._problem(problem)

    def _check_header(self, header: RunHeader) -> None:
        if len(header.expert_bytes) != len(header.moe_layers):
            self._problem(
                f"run_start: {len(header.expert_bytes)} expert_bytes for"
                f" {len(header.moe_layers)} moe_layers"
            )

    def _token(self, obj: dict[str, Any]) -> None:
        self.tokens += 1
        row = tuple(obj.get(name, math.nan) for name in TOKEN_COLUMNS)
        self.mode_codes.append(self._mode_code(obj.get("mode")))
        experts = obj.get("experts")
        buffer = self._expert_buffer()
        buffer.log_bytes = self.log_bytes
        try:
            fits = buffer.append(experts)
        except OverflowError:  # the columns are int32: refuse rather than wrap or widen
            raise TraceError(f"{self.path}:{self.counts.lines}: token {obj.get('token')!r} has "
                             "an expert id outside int32") from None
        if fits == _TOO_WIDE:
            self.wide_tokens += 1
            if self.wide_tokens == 1:
                log.warning("expert_list_too_wide", path=str(self.path),
                            line=self.counts.lines, token=obj.get("token"),
                            most_experts=buffer.limit,
                            action="this token's expert lists are left out")
        elif fits == _RAGGED and experts is not None:
            self.ragged_tokens += 1
            if self.ragged_tokens == 1:
                self._problem(
                    f"token {obj.get('token')}: experts is not {self._shape_text()} lists"
                )
        prefetch = obj.get("prefetch")
        if isinstance(prefetch, dict):
            self.prefetch_seen = True
            row += tuple(prefetch.get(name, math.nan) for name in _PREFETCH_COLUMNS)
        else:
            row += _NO_PREFETCH
        split = obj.get("time")
        if isinstance(split, dict):
            self.time_seen = True
            row += tuple(split.get(name, math.nan) for name in _TIME_FIELDS)
        else:
            row += _NO_TIME
        self._rows.append(row)
        devices = obj.get("devices")
        if devices is not None:
            self._block_devices = True
            self.device_rows.add(self.tokens - 1, devices)
        if len(self._rows) == _BLOCK_ROWS:
            self._end_block()

    def _end_block(self) -> None:
        """Turn the block's rows into numbers: kept (columns, or only what the reports need
        per token) and folded into ``stats`` once the header is known."""
        if not self._rows:
            return
        table = float_table(self._rows)  # (rows, columns)
        self._rows = []
        start = self.tokens - table.shape[0]
        used = self._experts.take_used() if self._experts is not None else np.zeros(
            table.shape[0], np.int32)
        if self._keep_columns:
            self._kept.append(table)
        else:
            self._walls.append(table[:, _WALL].copy())
            # the devices' sums are checked per token: their tokens' columns, when any
            self._checked.append(table[:, _CHECKED].copy() if self._block_devices
                                 else table.shape[0])
        self._block_devices = False
        self._unfolded.append((np.ascontiguousarray(table.T), start, used))
        if self.header is not None:
            self._fold_held()

    def _fold_held(self) -> None:
        """Fold the blocks read so far into ``stats`` (held until the header, whose
        bandwidth limits the time split's device limit needs, is known)."""
        limits = bandwidth_limits(self.header.limits) if self.header is not None else {}
        resident = self.mode_names.index("resident") if "resident" in self.mode_names else -2
        codes = np.frombuffer(self.mode_codes, dtype=np.int8)
        for columns, start, used in self._unfolded:
            self.stats.add_block(columns, codes[start: start + columns.shape[1]], used, limits,
                                 resident)
        self._unfolded = []

    def _shape_text(self) -> str:
        if self.header is None:
            return "the expected"
        return f"{len(self.header.moe_layers)} x top-{self.header.top_k}"

    def _device_columns(self, tokens: int) -> dict[int, dict[str, FloatArray]]:
        columns, problems = self.device_rows.columns(tokens)
        for problem in problems:
            self._problem(problem)
        return columns

    def _values(self) -> tuple[dict[str, FloatArray], dict[str, FloatArray]]:
        """The kept columns (all, or ``wall_ms`` only), and those the devices' sums are
        checked against (empty when no token listed devices)."""
        present = [name for name in _ROW_COLUMNS if self.prefetch_seen
                   or not name.startswith("prefetch_")]
        present = [name for name in present if self.time_seen or name not in TIME_COLUMNS]
        if self._keep_columns:
            # one row per column (views below), filled a block at a time while the blocks
            # are let go: the numbers are held once, not twice
            rows = np.empty((len(_ROW_COLUMNS), self.tokens))
            self._kept.reverse()
            start = 0
            while self._kept:
                block = self._kept.pop()
                rows[:, start: start + block.shape[0]] = block.T
                start += block.shape[0]
            values = {name: rows[_ROW_COLUMNS.index(name)] for name in present}
            return values, values
        wall = np.empty(self.tokens)  # filled while the blocks are let go: held once
        self._walls.reverse()
        start = 0
        while self._walls:
            part = self._walls.pop()
            wall[start: start + part.shape[0]] = part
            start += part.shape[0]
        checked: dict[str, FloatArray] = {}
        if any(not isinstance(block, int) for block in self._checked):
            blocks = [np.full((block, len(_CHECKED)), math.nan) if isinstance(block, int)
                      else block for block in self._checked]
            rows = np.ascontiguousarray(np.concatenate(blocks).T)
            checked = {_ROW_COLUMNS[i]: rows[k] for k, i in enumerate(_CHECKED)}
        self._checked = []
        return {"wall_ms": wall}, checked

    def build(self) -> RunLog:
        self._end_block()
        self._fold_held()
        values, checked = self._values()
        totals = {name: self.stats.totals[name] for name in _ROW_COLUMNS
                  if (self.prefetch_seen or not name.startswith("prefetch_"))
                  and (self.time_seen or name not in TIME_COLUMNS)}
        codes = np.frombuffer(bytes(self.mode_codes), dtype=np.int8)  # 255 reads as -1
        if self._experts is not None:
            experts, outside = self._experts.result()
        else:
            layers = len(self.header.moe_layers) if self.header else 0
            experts, outside = np.full((0, layers, 1), -1, np.int32), 0
        tokens = TokenColumns(
            values=values,
            mode_codes=codes,
            mode_names=tuple(self.mode_names),
            experts=experts,
            devices=self._device_columns(len(codes)),
            totals=totals,
            stats=self.stats,
        )
        self._check_tokens(tokens, checked, outside)
        return RunLog(
            path=self.path,
            header=self.header,
            tokens=tokens,
            layers=self.layer_rows.columns(),
            decisions=tuple(self.decisions),
            switches=tuple(self.switches),
            end=self.end,
            counts=self.counts,
            problems=tuple(self.problems),
            schema=self.schema,
        )

    def _check_tokens(self, tokens: TokenColumns, checked: Mapping[str, FloatArray],
                      outside: int) -> None:
        """Cross-check the token rows against the expert lists and the header
        (``outside``: ids >= n_experts), and the devices' sums against ``checked``, the
        token columns they add up to."""
        if not len(tokens):
            return
        stats = self.stats
        if stats.gap_row is not None:
            self._problem(f"token indices are not consecutive from row {stats.gap_row}")
        if stats.differs:
            self._problem(
                f"{stats.differs} tokens have hits + misses != experts used"
                f" (first: token {stats.differs_token})"
            )
        if outside:
            self._problem(f"{outside} expert ids >= n_experts")
        if self.ragged_tokens:
            self._problem(f"{self.ragged_tokens} tokens with experts of an unexpected shape")
        if self.wide_tokens:
            limit = self._experts.limit if self._experts is not None else MAX_LAYER_EXPERTS
            self._problem(f"{self.wide_tokens} tokens list more than {limit} experts in a "
                          "layer, more than the model has: their expert lists were left out")
        if tokens.devices:
            # per token, the devices' hits, misses and file bytes add up to the token's
            for problem in sum_problems(tokens.devices, checked):
                self._problem(problem)


def read_log(path: str | Path, *, experts: bool = True, columns: bool = True) -> RunLog:
    """Read one run log.

    What is held per token line: with ``columns``, its numbers as float64 columns (about 30
    values, 8 bytes each), else only ``wall_ms`` and the mode code (9 bytes); with
    ``experts``, its expert ids (4 bytes per MoE layer and top-k slot: 1 KB at 43 layers x
    top-6, what the what-if replay needs); never the decoded line. The sums the summary,
    the time split and the checks need are kept as the log is read (``tokens.stats``,
    ``tokens.totals``) either way.

    Args:
        path: the JSON-lines file written by a moestream run.
        experts: keep every token's expert ids (``tokens.experts``); without, that array
            has no rows.
        columns: keep every token's numbers (``tokens.values``: the CSV, plots and the
            replay need them); without, ``tokens.values`` holds only ``wall_ms``.

    Returns:
        The run's header, token columns, controller events, summary line and line counts.

    Raises:
        TraceError: the file cannot be read, or its first non-blank line is not a
            moestream event of a known schema.
    """
    path = Path(path)
    try:
        handle = open_input(path)  # a FIFO or a device is refused, never waited on
    except OSError as exc:
        raise TraceError(f"{path}: cannot read ({exc.strerror or exc})") from exc
    with handle:
        reader = _Reader(path, keep_experts=experts, keep_columns=columns)
        counts = reader.counts
        pending_bad = 0  # unparsable lines not yet known to be the last one
        started = False
        try:
            for raw in log_lines(handle):
                counts.lines += 1
                reader.log_bytes += MAX_LINE_BYTES if raw is None else len(raw)
                if raw is None:  # longer than any line a run writes
                    if not started:
                        raise TraceError(f"{path}: not a moestream log (line {counts.lines} is "
                                         f"longer than {MAX_LINE_BYTES} bytes)")
                    counts.malformed += pending_bad
                    pending_bad = 1
                    continue
                if not raw.strip():
                    counts.blank += 1
                    continue
                if not started:
                    obj = _first_object(path, raw)
                    if _out_of_range(raw, obj):
                        raise TraceError(f"{path}: not a moestream log (line {counts.lines} "
                                         "holds an integer no int64 holds)")
                    reader.set_schema(obj["schema"])
                    started = True
                else:
                    try:
                        obj = load_json_bounded(raw, f"{path}:{counts.lines}")
                    except ValueError:  # not JSON, or nested deeper than any event
                        counts.malformed += pending_bad
                        pending_bad = 1
                        continue
                    counts.malformed += pending_bad
                    pending_bad = 0
                    if not isinstance(obj, dict):
                        counts.malformed += 1
                        continue
                    if _out_of_range(raw, obj):  # no column takes it: the line is bad
                        counts.out_of_range += 1
                        continue
                    if obj.get("schema", reader.schema) != reader.schema:
                        counts.other_schema += 1
                        continue
                event = obj.get("event")
                if event not in KNOWN_EVENTS:
                    counts.unknown_events[printable(str(event))] += 1
                    continue
                if event == "run_start" and reader.header is not None:
                    counts.after_second_run += 1
                    for rest in log_lines(handle):
                        counts.lines += 1
                        if rest is None or rest.strip():
                            counts.after_second_run += 1
                        else:
                            counts.blank += 1
                    break
                reader.add(obj, event)
                counts.used += 1
        except OSError as exc:
            raise TraceError(f"{path}: cannot read ({exc.strerror or exc})") from exc
    counts.truncated = pending_bad
    if not started:
        raise TraceError(f"{path}: not a moestream log (no events: the file is empty)")
    result = reader.build()
    if counts.skipped or counts.unknown_fields or counts.missing_fields:
        log.warning(
            "log_lines_not_understood",
            path=str(path),
            skipped=counts.skipped,
            truncated=counts.truncated,
            malformed=counts.malformed,
            out_of_range=counts.out_of_range,
            unknown_events=dict(counts.unknown_events),
            unknown_fields=sum(counts.unknown_fields.values()),
            missing_fields=sum(counts.missing_fields.values()),
        )
    if result.problems:
        log.warning("log_inconsistent", path=str(path), problems=list(result.problems))
    return result
