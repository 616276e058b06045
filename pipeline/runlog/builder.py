"""One run log's events, collected into columns and counts, then built into a ``RunLog``.

Token lines are turned into numbers 4096 at a time, folded into running sums
(``moestream.pipeline.runlog.stats``) and, where asked, kept as numpy columns for intervals and
plots; where asked, the expert ids of every token are kept for the what-if replay
(``moestream.pipeline.runlog.expert_ids``). The lines themselves are read, and the file
judged a log or not, by ``moestream.pipeline.runlog.read``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import structlog

from moestream.pipeline.foundation.errors import TraceError, printable
from moestream.pipeline.runlog.devices import TokenDeviceRows, dropped_entries_problem, sum_problems
from moestream.pipeline.runlog.expert_ids import (
    MAX_LAYER_EXPERTS,
    RAGGED,
    TOO_WIDE,
    ExpertBuffer,
)
from moestream.pipeline.runlog.records import (
    ControllerDecision,
    LineCounts,
    ModeSwitch,
    RunEnd,
    RunHeader,
    RunLog,
    TokenColumns,
)
from moestream.pipeline.runlog.schema import (
    ENVELOPE,
    FIELDS,
    LAYER_COLUMNS,
    PREFETCH_COLUMNS,
    REQUIRED,
    ROW_COLUMNS,
    SCHEMA_VERSION,
    TIME_COLUMNS,
    TIME_FIELDS,
    TOKEN_COLUMNS,
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

__all__ = ["RunLogBuilder"]

log = structlog.get_logger("moestream.pipeline.runlog.read")  # the reader's logger, as before

_NO_PREFETCH = (math.nan,) * len(PREFETCH_COLUMNS)
_NO_TIME = (math.nan,) * len(TIME_FIELDS)
_WALL = ROW_COLUMNS.index("wall_ms")
_CHECKED = tuple(ROW_COLUMNS.index(name) for name in ("token", "hits", "misses", "file_bytes"))
_BLOCK_ROWS = 4096
_MAX_PROBLEMS = 20


class RunLogBuilder:
    """One pass over a file; collects columns and counts, then builds a ``RunLog``."""

    def __init__(self, path: Path, *, keep_experts: bool, keep_columns: bool) -> None:
        self.path = path
        self.schema = SCHEMA_VERSION
        self._required = REQUIRED
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
        self.stats = TokenStats(ROW_COLUMNS, TIME_COLUMNS)
        self._keep_columns = keep_columns
        self._kept: list[FloatArray] = []  # (rows, columns) blocks, with keep_columns
        self._walls: list[FloatArray] = []
        self._checked: list[FloatArray | int] = []  # per block: its device-check columns
        self._block_devices = False
        self.mode_codes = bytearray()  # index into mode_names, 255 where absent
        self.mode_names: list[str] = []
        self.prefetch_seen = False
        self.time_seen = False
        self.layer_rows = FloatRows(LAYER_COLUMNS)
        self.device_rows = TokenDeviceRows()
        self.problems: list[str] = []
        self.ragged_tokens = 0
        self.wide_tokens = 0  # tokens whose lists were left out: longer than the model's
        self.log_bytes = 0  # read so far: what the kept expert ids may take
        self._keep_experts = keep_experts
        self._experts: ExpertBuffer | None = None

    def set_schema(self, schema: int) -> None:
        """The file's schema (its first line's): schema 2 requires the token's ``time``."""
        self.schema = schema
        self._required = REQUIRED if schema < 2 else {
            **REQUIRED, "token": REQUIRED["token"] | {"time"}}

    def _problem(self, text: str) -> None:
        if len(self.problems) < _MAX_PROBLEMS:
            self.problems.append(text)

    def _fields(self, event: str, obj: dict[str, Any]) -> None:
        known = FIELDS[event]
        keys = obj.keys()
        for name in keys - known - ENVELOPE:
            self.counts.unknown_fields[printable(f"{event}.{name}")] += 1
        for name in self._required[event] - keys:
            self.counts.missing_fields[f"{event}.{name}"] += 1

    def _expert_buffer(self) -> ExpertBuffer:
        if self._experts is None:
            layers = len(self.header.moe_layers) if self.header else 0
            width = (self.header.top_k or 1) if self.header else 1
            n_experts = self.header.n_experts if self.header else None
            self._experts = ExpertBuffer(layers, width, keep=self._keep_experts,
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
            self.layer_rows.append(tuple(obj.get(name, math.nan) for name in LAYER_COLUMNS))
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
        if fits == TOO_WIDE:
            self.wide_tokens += 1
            if self.wide_tokens == 1:
                log.warning("expert_list_too_wide", path=str(self.path),
                            line=self.counts.lines, token=obj.get("token"),
                            most_experts=buffer.limit,
                            action="this token's expert lists are left out")
        elif fits == RAGGED and experts is not None:
            self.ragged_tokens += 1
            if self.ragged_tokens == 1:
                self._problem(
                    f"token {obj.get('token')}: experts is not {self._shape_text()} lists"
                )
        prefetch = obj.get("prefetch")
        if isinstance(prefetch, dict):
            self.prefetch_seen = True
            row += tuple(prefetch.get(name, math.nan) for name in PREFETCH_COLUMNS)
        else:
            row += _NO_PREFETCH
        split = obj.get("time")
        if isinstance(split, dict):
            self.time_seen = True
            row += tuple(split.get(name, math.nan) for name in TIME_FIELDS)
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
        present = [name for name in ROW_COLUMNS if self.prefetch_seen
                   or not name.startswith("prefetch_")]
        present = [name for name in present if self.time_seen or name not in TIME_COLUMNS]
        if self._keep_columns:
            # one row per column (views below), filled a block at a time while the blocks
            # are let go: the numbers are held once, not twice
            rows = np.empty((len(ROW_COLUMNS), self.tokens))
            self._kept.reverse()
            start = 0
            while self._kept:
                block = self._kept.pop()
                rows[:, start: start + block.shape[0]] = block.T
                start += block.shape[0]
            values = {name: rows[ROW_COLUMNS.index(name)] for name in present}
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
            checked = {ROW_COLUMNS[i]: rows[k] for k, i in enumerate(_CHECKED)}
        self._checked = []
        return {"wall_ms": wall}, checked

    def build(self) -> RunLog:
        self._end_block()
        self._fold_held()
        values, checked = self._values()
        totals = {name: self.stats.totals[name] for name in ROW_COLUMNS
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
