"""Read a moestream run log (docs/LOG_SCHEMA.md) into numpy columns, tolerantly.

Logs are read after the fact, often from runs that were killed, so the reader accepts what a
real file looks like (blank lines, a cut-off last line, fields and events from newer
writers) and counts every line it could not use instead of failing or hiding it. Only a file
that is not a moestream log at all is refused, with a ``TraceError`` that names the path.

Per-token values become numpy columns so that summaries, intervals and plots over 100,000
tokens are vector operations; the expert ids of every token become one ``(tokens, layers,
top_k)`` array that the what-if simulator replays. Plain ``json`` parsing dominates the cost;
reading is synchronous because there is nothing to overlap it with (a single sequential
file read, CPU-bound parsing), so ``aiofiles`` would only add overhead.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import structlog

from pipeline.errors import TraceError

__all__ = [
    "DEVICE_COLUMNS",
    "KNOWN_EVENTS",
    "SCHEMA_VERSION",
    "TOKEN_COLUMNS",
    "ControllerDecision",
    "DeviceEnd",
    "DeviceStart",
    "LineCounts",
    "ModeSwitch",
    "RunEnd",
    "RunHeader",
    "RunLog",
    "TokenColumns",
    "read_log",
]

log = structlog.get_logger(__name__)

SCHEMA_VERSION = 1
"""The log schema this reader understands."""

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

DEVICE_COLUMNS: tuple[str, ...] = (
    "hits",
    "misses",
    "file_bytes",
    "stall_ms",
    "compute_ms",
    "cache_live_bytes",
)
"""Numeric fields of one entry of a ``token`` line's ``devices`` list, one column each."""

# The tuples ``_Reader._devices`` collects, in this order; ``row`` is the token line's index.
_DEVICE_ROW = ("row", "device", *DEVICE_COLUMNS)
_DEVICE_SUMS = ("hits", "misses", "file_bytes")  # per token, the devices' add up to these

_FIELDS: dict[str, frozenset[str]] = {
    "run_start": frozenset(
        {"config", "model", "machine", "budget_bytes", "policy", "compute", "backend",
         "devices"}
    ),
    "token": frozenset(TOKEN_COLUMNS) | {"mode", "experts", "prefetch", "devices"},
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
            "devices",
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

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


def _int_or_none(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _float_or_none(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _str_or_none(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _int_tuple(value: object) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(_int_or_none(x) is not None for x in value):
        return ()
    return tuple(value)


def _mapping(value: object) -> Mapping[str, Any]:
    return value if isinstance(value, dict) else {}


def _device_objects(value: object) -> list[Mapping[str, Any]]:
    """The entries of a ``devices`` list that are objects with an int ``device``."""
    if not isinstance(value, list):
        return []
    return [entry for entry in value
            if isinstance(entry, dict) and _int_or_none(entry.get("device")) is not None]


@dataclass(frozen=True, slots=True)
class DeviceStart:
    """One entry of ``run_start.devices``: one device of the run.

    Attributes:
        device: the device index (as ``--devices`` named it).
        name: the backend's name for it (``host:1``, ``NVIDIA H200``), if logged.
        budget_bytes: this device's share of the expert-cache budget.
    """

    device: int
    name: str | None
    budget_bytes: int | None


@dataclass(frozen=True, slots=True)
class DeviceEnd:
    """One entry of ``run_end.devices``; ``None`` fields were absent or of the wrong type.

    Attributes:
        device: the device index.
        budget_bytes: this device's budget at the end (smaller than at the start after a
            device out-of-memory shrink).
        peak_device_bytes: highest cache entries + parked bytes seen on this device.
        allocations: device buffer allocations.
        frees: device buffer frees.
    """

    device: int
    budget_bytes: int | None
    peak_device_bytes: int | None
    allocations: int | None
    frees: int | None


@dataclass(frozen=True, slots=True)
class RunHeader:
    """What ``run_start`` says about the run, the model and the machine.

    Attributes:
        model_path: the model file as given to the run.
        model_file_bytes: size of the model file.
        moe_layers: model layer index of each MoE layer, in decode order.
        n_experts: routed experts per MoE layer.
        top_k: experts chosen per layer and token.
        expert_bytes: bytes of one expert per MoE layer, in ``moe_layers`` order.
        non_routed_bytes: bytes of the weights that are not routed experts.
        budget_bytes: the device expert-cache budget (the CacheIndex capacity).
        policy: the eviction policy name (``lru`` or ``freq``).
        config: the run's options, free-form.
        machine: the ``machine`` object, free-form.
        ts: when the run started (ISO 8601 string), if logged.
        devices: the run's devices (``run_start.devices``) in the writer's order, the home
            device first; one on a one-device run, empty in logs that predate the field.
    """

    model_path: str | None
    model_file_bytes: int | None
    moe_layers: tuple[int, ...]
    n_experts: int | None
    top_k: int | None
    expert_bytes: tuple[int, ...]
    non_routed_bytes: int | None
    budget_bytes: int | None
    policy: str | None
    config: Mapping[str, Any]
    machine: Mapping[str, Any]
    ts: str | None
    devices: tuple[DeviceStart, ...] = ()

    @classmethod
    def from_event(cls, obj: Mapping[str, Any]) -> RunHeader:
        """Build from a decoded ``run_start`` line, keeping what has the right type."""
        model = _mapping(obj.get("model"))
        return cls(
            model_path=_str_or_none(model.get("path")),
            model_file_bytes=_int_or_none(model.get("file_bytes")),
            moe_layers=_int_tuple(model.get("moe_layers")),
            n_experts=_int_or_none(model.get("n_experts")),
            top_k=_int_or_none(model.get("top_k")),
            expert_bytes=_int_tuple(model.get("expert_bytes")),
            non_routed_bytes=_int_or_none(model.get("non_routed_bytes")),
            budget_bytes=_int_or_none(obj.get("budget_bytes")),
            policy=_str_or_none(obj.get("policy")),
            config=_mapping(obj.get("config")),
            machine=_mapping(obj.get("machine")),
            ts=_str_or_none(obj.get("ts")),
            devices=tuple(
                DeviceStart(
                    device=entry["device"],
                    name=_str_or_none(entry.get("name")),
                    budget_bytes=_int_or_none(entry.get("budget_bytes")),
                )
                for entry in _device_objects(obj.get("devices"))
            ),
        )


@dataclass(frozen=True, slots=True)
class ControllerDecision:
    """One ``controller_decision`` line.

    Attributes:
        mode: the mode decided.
        reason: why.
        readings: what the controller saw.
        after_tokens: token lines read before this decision (its place in the run).
        token: the logged ``token`` field, if any.
    """

    mode: str | None
    reason: str | None
    readings: Mapping[str, Any]
    after_tokens: int
    token: int | None


@dataclass(frozen=True, slots=True)
class ModeSwitch:
    """One ``mode_switch`` line: the mode in force changed before ``token``."""

    from_mode: str | None
    to_mode: str | None
    reason: str | None
    readings: Mapping[str, Any]
    token: int | None
    after_tokens: int


@dataclass(frozen=True, slots=True)
class RunEnd:
    """The ``run_end`` line; ``None`` fields were absent or of the wrong type.

    ``devices`` holds the per-device entries, one per device of the run (empty in logs
    that predate the field).
    """

    tokens: int | None
    elapsed_s: float | None
    tokens_per_s: float | None
    hits: int | None
    misses: int | None
    hit_rate: float | None
    file_bytes: int | None
    cache_bytes: int | None
    storage_bytes: int | None
    verified: int | None
    mismatches: int | None
    peak_device_bytes: int | None
    budget_bytes: int | None
    exit: str | None
    devices: tuple[DeviceEnd, ...] = ()

    @classmethod
    def from_event(cls, obj: Mapping[str, Any]) -> RunEnd:
        """Build from a decoded ``run_end`` line."""
        verified = obj.get("verified")
        if isinstance(verified, bool):  # tolerate a writer that logs a flag, not a count
            verified = int(verified)
        return cls(
            tokens=_int_or_none(obj.get("tokens")),
            elapsed_s=_float_or_none(obj.get("elapsed_s")),
            tokens_per_s=_float_or_none(obj.get("tokens_per_s")),
            hits=_int_or_none(obj.get("hits")),
            misses=_int_or_none(obj.get("misses")),
            hit_rate=_float_or_none(obj.get("hit_rate")),
            file_bytes=_int_or_none(obj.get("file_bytes")),
            cache_bytes=_int_or_none(obj.get("cache_bytes")),
            storage_bytes=_int_or_none(obj.get("storage_bytes")),
            verified=_int_or_none(verified),
            mismatches=_int_or_none(obj.get("mismatches")),
            peak_device_bytes=_int_or_none(obj.get("peak_device_bytes")),
            budget_bytes=_int_or_none(obj.get("budget_bytes")),
            exit=_str_or_none(obj.get("exit")),
            devices=tuple(
                DeviceEnd(
                    device=entry["device"],
                    budget_bytes=_int_or_none(entry.get("budget_bytes")),
                    peak_device_bytes=_int_or_none(entry.get("peak_device_bytes")),
                    allocations=_int_or_none(entry.get("allocations")),
                    frees=_int_or_none(entry.get("frees")),
                )
                for entry in _device_objects(obj.get("devices"))
            ),
        )


@dataclass(frozen=True, slots=True)
class TokenColumns:
    """Per-token values as arrays, one row per ``token`` line in file order.

    Attributes:
        values: one float64 column per name in ``TOKEN_COLUMNS`` and, when any token had
            a ``prefetch`` object, ``prefetch_predicted``, ``prefetch_correct`` and
            ``prefetch_wasted_bytes``; NaN where a line lacked the field.
        mode_codes: index into ``mode_names`` per token; -1 where ``mode`` was absent.
        mode_names: the distinct modes, in order of first appearance.
        experts: ``(tokens, layers, width)`` expert ids, -1 padded (width is ``top_k``
            unless some list was longer; absent or short lists leave -1).
        devices: device index -> one float64 column per name in ``DEVICE_COLUMNS``, one row
            per token like ``values``, from the tokens' ``devices`` lists (runs over several
            devices); NaN where a token had no entry for that device. Devices in order of
            first appearance (the home device first); empty for one-device and older logs.
    """

    values: Mapping[str, FloatArray]
    mode_codes: npt.NDArray[np.int8]
    mode_names: tuple[str, ...]
    experts: npt.NDArray[np.int32]
    devices: Mapping[int, Mapping[str, FloatArray]]

    def __len__(self) -> int:
        return int(self.mode_codes.shape[0])

    def __getitem__(self, name: str) -> FloatArray:
        return self.values[name]

    def __contains__(self, name: object) -> bool:
        return name in self.values

    def total(self, name: str) -> float:
        """Sum of a column, ignoring NaN (0.0 for an empty or all-NaN column)."""
        column = self.values[name]
        return float(np.nansum(column)) if column.size else 0.0

    def device_total(self, device: int, name: str) -> float:
        """Sum of one device's column, ignoring NaN (0.0 for an empty or all-NaN column)."""
        column = self.devices[device][name]
        return float(np.nansum(column)) if column.size else 0.0

    def mode_mask(self, mode: str) -> npt.NDArray[np.bool_]:
        """True for the tokens decoded in ``mode``."""
        if mode not in self.mode_names:
            return np.zeros(len(self), dtype=bool)
        mask: npt.NDArray[np.bool_] = self.mode_codes == self.mode_names.index(mode)
        return mask


@dataclass(slots=True)
class LineCounts:
    """What happened to each line of the file.

    Attributes:
        lines: lines in the file, blank ones included.
        used: lines turned into data.
        blank: empty or whitespace-only lines.
        truncated: 1 if the last line was cut short.
        malformed: unparsable lines before the last, and lines that are not objects.
        other_schema: lines with a ``schema`` other than ``SCHEMA_VERSION``.
        after_second_run: lines from a second ``run_start`` on (not read).
        unknown_events: count per unknown event name.
        unknown_fields: count per ``event.field`` not in the schema.
        missing_fields: count per ``event.field`` required but absent.
    """

    lines: int = 0
    used: int = 0
    blank: int = 0
    truncated: int = 0
    malformed: int = 0
    other_schema: int = 0
    after_second_run: int = 0
    unknown_events: Counter[str] = field(default_factory=Counter)
    unknown_fields: Counter[str] = field(default_factory=Counter)
    missing_fields: Counter[str] = field(default_factory=Counter)

    @property
    def skipped(self) -> int:
        """Non-blank lines that carried no usable data."""
        return (
            self.truncated
            + self.malformed
            + self.other_schema
            + self.after_second_run
            + sum(self.unknown_events.values())
        )

    def as_dict(self) -> dict[str, Any]:
        """Plain-JSON form for reports."""
        return {
            "lines": self.lines,
            "used": self.used,
            "skipped": self.skipped,
            "blank": self.blank,
            "truncated": self.truncated,
            "malformed": self.malformed,
            "other_schema": self.other_schema,
            "after_second_run": self.after_second_run,
            "unknown_events": dict(self.unknown_events),
            "unknown_fields": dict(self.unknown_fields),
            "missing_fields": dict(self.missing_fields),
        }


@dataclass(frozen=True, slots=True)
class RunLog:
    """Everything read from one log file.

    Attributes:
        path: the file.
        header: the ``run_start`` line; None when the file starts with another event.
        tokens: per-token columns and expert ids.
        layers: per-layer columns from debug ``layer`` lines (``token``, ``layer``,
            ``hits``, ``misses``, ``read_ms``, ``stall_ms``); empty arrays when absent.
        decisions: controller decisions in file order.
        switches: mode switches in file order.
        end: the ``run_end`` line, None for a run that was killed.
        counts: what happened to every line.
        problems: consistency findings (first few), e.g. ``hits + misses`` that disagree
            with the expert lists.
    """

    path: Path
    header: RunHeader | None
    tokens: TokenColumns
    layers: Mapping[str, FloatArray]
    decisions: tuple[ControllerDecision, ...]
    switches: tuple[ModeSwitch, ...]
    end: RunEnd | None
    counts: LineCounts
    problems: tuple[str, ...]

    @property
    def name(self) -> str:
        """The file name, for tables and CSV rows."""
        return self.path.name


class _ExpertBuffer:
    """Growable ``(tokens, layers, width)`` int32 array of expert ids, -1 padded."""

    __slots__ = ("_array", "_count", "_layers", "_width")

    def __init__(self, layers: int, width: int, capacity: int) -> None:
        self._layers = max(layers, 0)
        self._width = max(width, 1)
        self._array = np.full((max(capacity, 16), self._layers, self._width), -1, np.int32)
        self._count = 0

    def append(self, experts: Any) -> bool:
        """Store one token's lists; False when their shape did not match (padded)."""
        if self._count == self._array.shape[0]:
            grown = np.full(
                (self._array.shape[0] * 2, self._layers, self._width), -1, np.int32
            )
            grown[: self._count] = self._array
            self._array = grown
        row = self._count
        self._count += 1
        try:
            self._array[row] = experts  # the common case: a full, rectangular top-k matrix
            return True
        except (ValueError, TypeError):
            self._array[row] = -1
        if not isinstance(experts, list):
            return False
        for pos, ids in enumerate(experts[: self._layers]):
            if not isinstance(ids, list):
                continue
            clean = [e for e in ids if isinstance(e, int) and not isinstance(e, bool)]
            if len(clean) > self._width:
                self._widen(len(clean))
            self._array[row, pos, : len(clean)] = clean
        return False

    def _widen(self, width: int) -> None:
        grown = np.full((self._array.shape[0], self._layers, width), -1, np.int32)
        grown[:, :, : self._width] = self._array
        self._array = grown
        self._width = width

    def result(self) -> npt.NDArray[np.int32]:
        return self._array[: self._count].copy()


def _first_object(path: Path, line: bytes) -> dict[str, Any]:
    """Decode and check the first non-blank line: is this file a moestream log at all?"""
    try:
        obj = json.loads(line)
    except ValueError:
        raise TraceError(f"{path}: not a moestream log (first line is not JSON)") from None
    if not isinstance(obj, dict):
        raise TraceError(f"{path}: not a moestream log (first line is not a JSON object)")
    event = obj.get("event")
    if event not in KNOWN_EVENTS:
        raise TraceError(f"{path}: not a moestream log (first event is {event!r})")
    if "schema" not in obj:
        raise TraceError(f"{path}: not a moestream log (first line has no 'schema' field)")
    if obj["schema"] != SCHEMA_VERSION:
        raise TraceError(
            f"{path}: log schema {obj['schema']!r} is not supported"
            f" (this reader knows schema {SCHEMA_VERSION})"
        )
    return obj


class _Reader:
    """One pass over a file; collects columns and counts, then builds a ``RunLog``."""

    def __init__(self, path: Path, size_hint: int) -> None:
        self.path = path
        self.counts = LineCounts()
        self.header: RunHeader | None = None
        self.end: RunEnd | None = None
        self.decisions: list[ControllerDecision] = []
        self.switches: list[ModeSwitch] = []
        self.token_rows: list[tuple[Any, ...]] = []
        self.modes: list[object] = []
        self.prefetch_rows: list[tuple[Any, ...]] = []
        self.prefetch_seen = False
        self.layer_rows: list[tuple[Any, ...]] = []
        self.device_rows: list[tuple[Any, ...]] = []
        self.bad_device_entries = 0
        self.problems: list[str] = []
        self.ragged_tokens = 0
        self._size_hint = size_hint
        self._experts: _ExpertBuffer | None = None

    def _problem(self, text: str) -> None:
        if len(self.problems) < _MAX_PROBLEMS:
            self.problems.append(text)

    def _fields(self, event: str, obj: dict[str, Any]) -> None:
        known = _FIELDS[event]
        keys = obj.keys()
        for name in keys - known - _ENVELOPE:
            self.counts.unknown_fields[f"{event}.{name}"] += 1
        for name in _REQUIRED[event] - keys:
            self.counts.missing_fields[f"{event}.{name}"] += 1

    def _expert_buffer(self) -> _ExpertBuffer:
        if self._experts is None:
            layers = len(self.header.moe_layers) if self.header else 0
            width = (self.header.top_k or 1) if self.header else 1
            # A token line is about 2 KB at 43 layers x top-6; start near the final size.
            self._experts = _ExpertBuffer(layers, width, self._size_hint // 2048 + 16)
        return self._experts

    def add(self, obj: dict[str, Any], event: str) -> None:
        self._fields(event, obj)
        if event == "token":
            self._token(obj)
        elif event == "layer":
            self.layer_rows.append(tuple(obj.get(name, math.nan) for name in _LAYER_COLUMNS))
        elif event == "run_start":
            self.header = RunHeader.from_event(obj)
            self._check_header(self.header)
            self._check_device_list(event, obj, self.header.devices)
        elif event == "controller_decision":
            self.decisions.append(
                ControllerDecision(
                    mode=_str_or_none(obj.get("mode")),
                    reason=_str_or_none(obj.get("reason")),
                    readings=_mapping(obj.get("readings")),
                    after_tokens=len(self.token_rows),
                    token=_int_or_none(obj.get("token")),
                )
            )
        elif event == "mode_switch":
            self.switches.append(
                ModeSwitch(
                    from_mode=_str_or_none(obj.get("from")),
                    to_mode=_str_or_none(obj.get("to")),
                    reason=_str_or_none(obj.get("reason")),
                    readings=_mapping(obj.get("readings")),
                    token=_int_or_none(obj.get("token")),
                    after_tokens=len(self.token_rows),
                )
            )
        elif event == "run_end":
            self.end = RunEnd.from_event(obj)
            self._check_device_list(event, obj, self.end.devices)

    def _check_device_list(self, event: str, obj: Mapping[str, Any], kept: tuple[Any, ...]) -> None:
        devices = obj.get("devices")
        if devices is None:
            return
        given = len(devices) if isinstance(devices, list) else 1
        if given != len(kept):
            self._problem(
                f"{event}: {given - len(kept)} devices entries are not objects with an int device"
            )

    def _check_header(self, header: RunHeader) -> None:
        if len(header.expert_bytes) != len(header.moe_layers):
            self._problem(
                f"run_start: {len(header.expert_bytes)} expert_bytes for"
                f" {len(header.moe_layers)} moe_layers"
            )

    def _token(self, obj: dict[str, Any]) -> None:
        self.token_rows.append(tuple(obj.get(name, math.nan) for name in TOKEN_COLUMNS))
        self.modes.append(obj.get("mode"))
        experts = obj.get("experts")
        if not self._expert_buffer().append(experts) and experts is not None:
            self.ragged_tokens += 1
            if self.ragged_tokens == 1:
                self._problem(
                    f"token {obj.get('token')}: experts is not {self._shape_text()} lists"
                )
        prefetch = obj.get("prefetch")
        if isinstance(prefetch, dict):
            self.prefetch_seen = True
            row = tuple(prefetch.get(name, math.nan) for name in _PREFETCH_COLUMNS)
        else:
            row = (math.nan, math.nan, math.nan)
        self.prefetch_rows.append(row)
        devices = obj.get("devices")
        if devices is not None:
            self._devices(devices)

    def _shape_text(self) -> str:
        if self.header is None:
            return "the expected"
        return f"{len(self.header.moe_layers)} x top-{self.header.top_k}"

    def _devices(self, devices: object) -> None:
        # Like ``prefetch``: keep raw tuples now, turn them into columns once in ``build``;
        # device ids are checked there, vectorized.
        if not isinstance(devices, list):
            self.bad_device_entries += 1
            return
        row = len(self.token_rows) - 1
        nan = math.nan
        for entry in devices:
            if isinstance(entry, dict):
                get = entry.get  # spelled out: a generator here costs a third of the read
                self.device_rows.append(
                    (row, get("device", nan), get("hits", nan), get("misses", nan),
                     get("file_bytes", nan), get("stall_ms", nan), get("compute_ms", nan),
                     get("cache_live_bytes", nan))
                )
            else:
                self.bad_device_entries += 1

    def _device_columns(self, tokens: int) -> dict[int, dict[str, FloatArray]]:
        """Scatter the collected entries into one column set per device."""
        if not self.device_rows:
            if self.bad_device_entries:
                self._problem(f"{self.bad_device_entries} token devices entries are not objects")
            return {}
        table = _float_columns(self.device_rows, _DEVICE_ROW)
        rows = table["row"].astype(np.int64)
        ids = table["device"]
        valid = np.isfinite(ids) & (ids == np.round(ids))
        bad = self.bad_device_entries + int((~valid).sum())
        if bad:
            self._problem(f"{bad} token devices entries without an int device")
        seen, first = np.unique(ids[valid], return_index=True)
        out: dict[int, dict[str, FloatArray]] = {}
        duplicated = 0
        for device in seen[np.argsort(first)].tolist():
            mask = ids == device
            picked = rows[mask]
            duplicated += picked.size - np.unique(picked).size
            columns: dict[str, FloatArray] = {}
            for name in DEVICE_COLUMNS:
                column = np.full(tokens, math.nan, dtype=np.float64)
                column[picked] = table[name][mask]  # a repeated entry: the last one counts
                columns[name] = column
            out[int(device)] = columns
        if duplicated:
            self._problem(f"{duplicated} token devices entries repeat a device of their token")
        return out

    def build(self) -> RunLog:
        values = _float_columns(self.token_rows, TOKEN_COLUMNS)
        if self.prefetch_seen:
            prefetch = _float_columns(self.prefetch_rows, _PREFETCH_COLUMNS)
            for name in _PREFETCH_COLUMNS:
                values[f"prefetch_{name}"] = prefetch[name]
        names: list[str] = []
        codes = np.full(len(self.modes), -1, dtype=np.int8)
        for row, mode in enumerate(self.modes):
            if isinstance(mode, str):
                if mode not in names:
                    names.append(mode)
                codes[row] = names.index(mode)
        experts = (
            self._experts.result()
            if self._experts is not None
            else np.full((0, len(self.header.moe_layers) if self.header else 0, 1), -1, np.int32)
        )
        tokens = TokenColumns(
            values=values,
            mode_codes=codes,
            mode_names=tuple(names),
            experts=experts,
            devices=self._device_columns(len(self.modes)),
        )
        self._check_tokens(tokens)
        return RunLog(
            path=self.path,
            header=self.header,
            tokens=tokens,
            layers=_float_columns(self.layer_rows, _LAYER_COLUMNS),
            decisions=tuple(self.decisions),
            switches=tuple(self.switches),
            end=self.end,
            counts=self.counts,
            problems=tuple(self.problems),
        )

    def _check_tokens(self, tokens: TokenColumns) -> None:
        """Cross-check the columns against the expert lists and the header."""
        if not len(tokens):
            return
        index = tokens["token"]
        expected = np.arange(index.shape[0], dtype=np.float64)
        if not np.array_equal(index, expected):
            first = int(np.argmax(index != expected))
            self._problem(f"token indices are not consecutive from row {first}")
        used = (tokens.experts >= 0).sum(axis=(1, 2))
        counted = tokens["hits"] + tokens["misses"]
        differs = np.flatnonzero(~np.isnan(counted) & (counted != used))
        if differs.size:
            self._problem(
                f"{differs.size} tokens have hits + misses != experts used"
                f" (first: token {int(index[differs[0]])})"
            )
        if self.header and self.header.n_experts is not None:
            outside = tokens.experts >= self.header.n_experts
            if outside.any():
                self._problem(f"{int(outside.sum())} expert ids >= n_experts")
        if self.ragged_tokens:
            self._problem(f"{self.ragged_tokens} tokens with experts of an unexpected shape")
        if tokens.devices:
            self._check_devices(tokens)

    def _check_devices(self, tokens: TokenColumns) -> None:
        """Per token, the devices' hits, misses and file bytes add up to the token's."""
        present = np.zeros(len(tokens), dtype=bool)
        for columns in tokens.devices.values():
            present |= ~np.isnan(columns["hits"])
        for name in _DEVICE_SUMS:
            summed = np.nansum([c[name] for c in tokens.devices.values()], axis=0)
            logged = tokens[name]
            differs = np.flatnonzero(present & ~np.isnan(logged) & (summed != logged))
            if differs.size:
                self._problem(
                    f"{differs.size} tokens have devices' {name} that do not add up to the"
                    f" token's (first: token {int(tokens['token'][differs[0]])})"
                )


def _float_columns(rows: list[tuple[Any, ...]], names: tuple[str, ...]) -> dict[str, FloatArray]:
    """Turn rows of JSON scalars into float64 columns; non-numbers become NaN."""
    if not rows:
        return {name: np.zeros(0, dtype=np.float64) for name in names}
    try:
        table = np.array(rows, dtype=np.float64)
    except (ValueError, TypeError):
        # Some value was a string, object or null: clean row by row (rare, slower).
        table = np.array(
            [[math.nan if (f := _float_or_none(v)) is None else f for v in row] for row in rows],
            dtype=np.float64,
        )
    return {name: table[:, col].copy() for col, name in enumerate(names)}


def read_log(path: str | Path) -> RunLog:
    """Read one run log.

    Args:
        path: the JSON-lines file written by a moestream run.

    Returns:
        The run's header, token columns, controller events, summary line and line counts.

    Raises:
        TraceError: the file cannot be read, or its first non-blank line is not a
            moestream event of a known schema.
    """
    path = Path(path)
    try:
        handle = path.open("rb")
    except OSError as exc:
        raise TraceError(f"{path}: cannot read ({exc.strerror or exc})") from exc
    with handle:
        try:
            size = path.stat().st_size
        except OSError:
            size = 0
        reader = _Reader(path, size)
        counts = reader.counts
        pending_bad = 0  # unparsable lines not yet known to be the last one
        started = False
        try:
            for raw in handle:
                counts.lines += 1
                if not raw.strip():
                    counts.blank += 1
                    continue
                if not started:
                    obj = _first_object(path, raw)
                    started = True
                else:
                    try:
                        obj = json.loads(raw)
                    except ValueError:
                        counts.malformed += pending_bad
                        pending_bad = 1
                        continue
                    counts.malformed += pending_bad
                    pending_bad = 0
                    if not isinstance(obj, dict):
                        counts.malformed += 1
                        continue
                    if obj.get("schema", SCHEMA_VERSION) != SCHEMA_VERSION:
                        counts.other_schema += 1
                        continue
                event = obj.get("event")
                if event not in KNOWN_EVENTS:
                    counts.unknown_events[str(event)] += 1
                    continue
                if event == "run_start" and reader.header is not None:
                    counts.after_second_run += 1
                    for rest in handle:
                        counts.lines += 1
                        if rest.strip():
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
            unknown_events=dict(counts.unknown_events),
            unknown_fields=sum(counts.unknown_fields.values()),
            missing_fields=sum(counts.missing_fields.values()),
        )
    if result.problems:
        log.warning("log_inconsistent", path=str(path), problems=list(result.problems))
    return result
