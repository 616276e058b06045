"""The records a run log is read into: header, token columns, controller events, run end.

``pipeline.runlog.read.read_log`` builds one ``RunLog`` per file from these types; each keeps what
the log's lines said with the right type and ``None`` (or NaN in a column) for the rest.
Per-device entries (``DeviceStart``, ``DeviceEnd``) come from ``moestream.pipeline.runlog.devices``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from moestream.pipeline.foundation.errors import printable
from moestream.pipeline.runlog.devices import DeviceEnd, DeviceStart, device_ends, device_starts
from moestream.pipeline.runlog.stats import TokenStats
from moestream.pipeline.runlog.values import (
    FloatArray,
    float_or_none,
    int_or_none,
    int_tuple,
    mapping,
    str_or_none,
)

__all__ = [
    "ControllerDecision",
    "LineCounts",
    "ModeSwitch",
    "RunEnd",
    "RunHeader",
    "RunLog",
    "TokenColumns",
]


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
        limits: ``run_start.limits``, the bandwidths the run was told or measured
            (``read_bytes_per_s``, ``copy_bytes_per_s``); empty when it knew none.
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
    limits: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_event(cls, obj: Mapping[str, Any]) -> RunHeader:
        """Build from a decoded ``run_start`` line, keeping what has the right type."""
        model = mapping(obj.get("model"))
        return cls(
            model_path=str_or_none(model.get("path")),
            model_file_bytes=int_or_none(model.get("file_bytes")),
            moe_layers=int_tuple(model.get("moe_layers")),
            n_experts=int_or_none(model.get("n_experts")),
            top_k=int_or_none(model.get("top_k")),
            expert_bytes=int_tuple(model.get("expert_bytes")),
            non_routed_bytes=int_or_none(model.get("non_routed_bytes")),
            budget_bytes=int_or_none(obj.get("budget_bytes")),
            policy=str_or_none(obj.get("policy")),
            config=mapping(obj.get("config")),
            machine=mapping(obj.get("machine")),
            ts=str_or_none(obj.get("ts")),
            devices=device_starts(obj.get("devices")),
            limits=mapping(obj.get("limits")),
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
            tokens=int_or_none(obj.get("tokens")),
            elapsed_s=float_or_none(obj.get("elapsed_s")),
            tokens_per_s=float_or_none(obj.get("tokens_per_s")),
            hits=int_or_none(obj.get("hits")),
            misses=int_or_none(obj.get("misses")),
            hit_rate=float_or_none(obj.get("hit_rate")),
            file_bytes=int_or_none(obj.get("file_bytes")),
            cache_bytes=int_or_none(obj.get("cache_bytes")),
            storage_bytes=int_or_none(obj.get("storage_bytes")),
            verified=int_or_none(verified),
            mismatches=int_or_none(obj.get("mismatches")),
            peak_device_bytes=int_or_none(obj.get("peak_device_bytes")),
            budget_bytes=int_or_none(obj.get("budget_bytes")),
            exit=str_or_none(obj.get("exit")),
            devices=device_ends(obj.get("devices")),
        )


@dataclass(frozen=True, slots=True)
class TokenColumns:
    """Per-token values as arrays, one row per ``token`` line in file order.

    Attributes:
        values: one float64 column per name in ``TOKEN_COLUMNS`` and, when any token had
            a ``prefetch`` object, ``prefetch_predicted``, ``prefetch_correct`` and
            ``prefetch_wasted_bytes``, and, when any token had a ``time`` object (schema 2),
            one ``time_<part>_ms`` column per part (``pipeline.runlog.read.TIME_COLUMNS``); NaN
            where a line lacked the field.
        mode_codes: index into ``mode_names`` per token; -1 where ``mode`` was absent.
        mode_names: the distinct modes, in order of first appearance.
        experts: ``(tokens, layers, width)`` expert ids, -1 padded (width is ``top_k``
            unless some list was longer; absent or short lists leave -1).
        devices: device index -> one float64 column per name in ``DEVICE_COLUMNS``, one row
            per token like ``values``, from the tokens' ``devices`` lists (runs over several
            devices); NaN where a token had no entry for that device. Devices in order of
            first appearance (the home device first); empty for one-device and older logs.
        totals: column name -> its sum over every token, NaN ignored, summed as the log
            was read: for every column of ``values`` and, when ``values`` holds only
            ``wall_ms`` (``read_log(columns=False)``), for those it would hold.
        stats: the reader's streaming sums (``moestream.pipeline.runlog.stats``): the time split
            and the checks; None only for columns built by hand.
    """

    values: Mapping[str, FloatArray]
    mode_codes: npt.NDArray[np.int8]
    mode_names: tuple[str, ...]
    experts: npt.NDArray[np.int32]
    devices: Mapping[int, Mapping[str, FloatArray]]
    totals: Mapping[str, float] = field(default_factory=dict)
    stats: TokenStats | None = None

    def __len__(self) -> int:
        return int(self.mode_codes.shape[0])

    def __getitem__(self, name: str) -> FloatArray:
        return self.values[name]

    def __contains__(self, name: object) -> bool:
        return name in self.values or name in self.totals

    def total(self, name: str) -> float:
        """Sum of a column, ignoring NaN (0.0 for an empty or all-NaN column): over the
        column when it is held, else from ``totals`` (summed block by block as the log was
        read, which may differ in the last bit)."""
        if name not in self.values:
            return self.totals[name]
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
        out_of_range: lines holding an integer no int64 holds (``moestream.pipeline.runlog.read``).
        other_schema: lines with a ``schema`` other than the file's (its first line's).
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
    out_of_range: int = 0
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
            + self.out_of_range
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
            "out_of_range": self.out_of_range,
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
        schema: the file's schema version (its first line's).
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
    schema: int = 1

    @property
    def name(self) -> str:
        """The file name, for tables and CSV rows (control characters escaped, as in the
        one-line errors)."""
        return printable(self.path.name)
