"""The per-device fields of a run log: ``devices`` in ``run_start``, ``token`` and ``run_end``.

A run over several devices (``--devices 0,1``) names its devices and their budget shares in
``run_start.devices``, logs each device's counters per token in ``token.devices`` and each
device's budget, peak and buffer counts in ``run_end.devices``. One-device runs and logs that
predate the field have none. This module turns those fields into typed entries and per-device
columns and finds what does not add up; ``pipeline.runlog.read`` calls it while it reads a file and
passes the problems it returns on to the ``RunLog``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from moestream.pipeline.runlog.values import FloatArray, FloatRows, int_or_none, str_or_none

__all__ = [
    "DEVICE_COLUMNS",
    "DeviceEnd",
    "DeviceStart",
    "TokenDeviceRows",
    "device_ends",
    "device_starts",
    "dropped_entries_problem",
    "sum_problems",
]

DEVICE_COLUMNS: tuple[str, ...] = (
    "hits",
    "misses",
    "file_bytes",
    "stall_ms",
    "compute_ms",
    "cache_live_bytes",
)
"""Numeric fields of one entry of a ``token`` line's ``devices`` list, one column each."""

# The tuples ``TokenDeviceRows`` collects, in this order; ``row`` is the token line's index.
_DEVICE_ROW = ("row", "device", *DEVICE_COLUMNS)
_DEVICE_SUMS = ("hits", "misses", "file_bytes")  # per token, the devices' add up to these


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
        registered_path: how its resident misses left the registered mapping (``gather``,
            ``copy_engines``, ``trial``); None in logs written before it was recorded.
    """

    device: int
    budget_bytes: int | None
    peak_device_bytes: int | None
    allocations: int | None
    frees: int | None
    registered_path: str | None = None


def _device_objects(value: object) -> list[Mapping[str, Any]]:
    """The entries of a ``devices`` list that are objects with an int ``device``."""
    if not isinstance(value, list):
        return []
    return [entry for entry in value
            if isinstance(entry, dict) and int_or_none(entry.get("device")) is not None]


def device_starts(value: object) -> tuple[DeviceStart, ...]:
    """The usable entries of a ``run_start.devices`` value, in the writer's order."""
    return tuple(
        DeviceStart(
            device=entry["device"],
            name=str_or_none(entry.get("name")),
            budget_bytes=int_or_none(entry.get("budget_bytes")),
        )
        for entry in _device_objects(value)
    )


def device_ends(value: object) -> tuple[DeviceEnd, ...]:
    """The usable entries of a ``run_end.devices`` value, in the writer's order."""
    return tuple(
        DeviceEnd(
            device=entry["device"],
            budget_bytes=int_or_none(entry.get("budget_bytes")),
            peak_device_bytes=int_or_none(entry.get("peak_device_bytes")),
            allocations=int_or_none(entry.get("allocations")),
            frees=int_or_none(entry.get("frees")),
            registered_path=str_or_none(entry.get("registered_path")),
        )
        for entry in _device_objects(value)
    )


def dropped_entries_problem(
    event: str, obj: Mapping[str, Any], kept: tuple[Any, ...]
) -> str | None:
    """The problem text when a line's ``devices`` had entries that were not kept, else None.

    Args:
        event: the line's event (``run_start`` or ``run_end``).
        obj: the decoded line.
        kept: the entries built from its ``devices`` (``device_starts``/``device_ends``).
    """
    devices = obj.get("devices")
    if devices is None:
        return None
    given = len(devices) if isinstance(devices, list) else 1
    if given != len(kept):
        return f"{event}: {given - len(kept)} devices entries are not objects with an int device"
    return None


class TokenDeviceRows:
    """The ``devices`` lists of token lines, collected as float rows (``FloatRows``: 8 bytes
    a value), scattered into per-device columns once.

    Device ids are checked in ``columns``, vectorized.
    """

    __slots__ = ("_bad", "_rows")

    def __init__(self) -> None:
        self._rows = FloatRows(_DEVICE_ROW)
        self._bad = 0

    def add(self, row: int, devices: object) -> None:
        """Keep the entries of one token line's ``devices``; ``row`` is the line's index."""
        if not isinstance(devices, list):
            self._bad += 1
            return
        nan = math.nan
        for entry in devices:
            if isinstance(entry, dict):
                get = entry.get  # spelled out: a generator here costs a third of the read
                self._rows.append(
                    (row, get("device", nan), get("hits", nan), get("misses", nan),
                     get("file_bytes", nan), get("stall_ms", nan), get("compute_ms", nan),
                     get("cache_live_bytes", nan))
                )
            else:
                self._bad += 1

    def columns(self, tokens: int) -> tuple[dict[int, dict[str, FloatArray]], list[str]]:
        """Scatter the collected entries into one column set per device.

        Args:
            tokens: the number of token lines (the length of every column).

        Returns:
            Device index -> one float64 column per name in ``DEVICE_COLUMNS`` (NaN where a
            token had no entry for the device; devices in order of first appearance), and
            the problems found (entries that are not objects or have no int device, devices
            repeated within a token).
        """
        problems: list[str] = []
        if not len(self._rows):
            if self._bad:
                problems.append(f"{self._bad} token devices entries are not objects")
            return {}, problems
        table = self._rows.columns()
        rows = table["row"].astype(np.int64)
        ids = table["device"]
        valid = np.isfinite(ids) & (ids == np.round(ids))
        bad = self._bad + int((~valid).sum())
        if bad:
            problems.append(f"{bad} token devices entries without an int device")
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
            problems.append(f"{duplicated} token devices entries repeat a device of their token")
        return out, problems


def sum_problems(
    devices: Mapping[int, Mapping[str, FloatArray]], values: Mapping[str, FloatArray]
) -> list[str]:
    """Per token, the devices' hits, misses and file bytes must add up to the token's.

    Args:
        devices: the per-device columns (``TokenColumns.devices``), not empty.
        values: the token columns (``TokenColumns.values``).

    Returns:
        One problem per field that does not add up on some token.
    """
    problems: list[str] = []
    present = np.zeros(values["token"].shape[0], dtype=bool)
    for columns in devices.values():
        present |= ~np.isnan(columns["hits"])
    for name in _DEVICE_SUMS:
        summed = np.nansum([c[name] for c in devices.values()], axis=0)
        logged = values[name]
        differs = np.flatnonzero(present & ~np.isnan(logged) & (summed != logged))
        if differs.size:
            problems.append(
                f"{differs.size} tokens have devices' {name} that do not add up to the"
                f" token's (first: token {int(values['token'][differs[0]])})"
            )
    return problems
