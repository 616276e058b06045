"""Tolerant conversions of decoded JSON values, shared by the run-log reader's modules.

A log line's fields may be absent or of the wrong type (older or newer writers, a hand-edited
file); the reader keeps what has the right type and turns the rest into ``None`` or NaN
instead of failing. Used by ``pipeline.runlog.read``, ``pipeline.runlog.records`` and
``moestream.pipeline.runlog.devices``.

A string is kept with its control characters escaped as ``repr`` would (``\\x1b``,
``\\n``): a ``mode`` or ``exit`` field holding a terminal escape or a newline reaches the
report as text, never as a command to the terminal or a line of its own.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from moestream.pipeline.foundation.errors import printable

__all__ = [
    "FloatArray",
    "FloatRows",
    "float_columns",
    "float_or_none",
    "float_table",
    "int_or_none",
    "int_tuple",
    "mapping",
    "str_or_none",
]

FloatArray = npt.NDArray[np.float64]


def int_or_none(value: object) -> int | None:
    """``value`` if it is an int (not a bool), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def float_or_none(value: object) -> float | None:
    """``value`` as a float if it is an int or float (not a bool) a float holds, else None
    (an integer of hundreds of digits too)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        return float(value)
    except OverflowError:
        return None


def str_or_none(value: object) -> str | None:
    """``value`` if it is a string (control characters escaped, ``printable``), else None."""
    return printable(value) if isinstance(value, str) else None


def int_tuple(value: object) -> tuple[int, ...]:
    """``value`` as a tuple if it is a list of ints, else empty."""
    if not isinstance(value, list) or not all(int_or_none(x) is not None for x in value):
        return ()
    return tuple(value)


def mapping(value: object) -> Mapping[str, Any]:
    """``value`` if it is a JSON object, else an empty mapping."""
    return value if isinstance(value, dict) else {}


def float_table(rows: list[tuple[Any, ...]]) -> FloatArray:
    """Rows of JSON scalars as one ``(rows, columns)`` float64 array; non-numbers (and
    numbers no float holds) become NaN."""
    try:
        return np.array(rows, dtype=np.float64)
    except (ValueError, TypeError, OverflowError):
        # Some value was a string, object, null or an integer no float holds: clean row by
        # row (rare, slower).
        return np.array(
            [[math.nan if (f := float_or_none(v)) is None else f for v in row] for row in rows],
            dtype=np.float64,
        )


def float_columns(rows: list[tuple[Any, ...]], names: tuple[str, ...]) -> dict[str, FloatArray]:
    """Turn rows of JSON scalars into float64 columns; non-numbers become NaN."""
    if not rows:
        return {name: np.zeros(0, dtype=np.float64) for name in names}
    table = float_table(rows)
    return {name: table[:, col].copy() for col, name in enumerate(names)}


class FloatRows:
    """Rows of JSON scalars collected into float64 columns as they come.

    A log has a row per token; holding each as a tuple of Python floats costs about 50
    bytes a value. Here at most ``BLOCK_ROWS`` rows are held as tuples; each full block
    becomes a float64 array (8 bytes a value), so a reader holds 8 bytes per value and row.

    Args:
        names: the column names, in row order.
    """

    __slots__ = ("_blocks", "_count", "_names", "_pending")

    BLOCK_ROWS = 4096

    def __init__(self, names: tuple[str, ...]) -> None:
        self._names = names
        self._blocks: list[FloatArray] = []
        self._pending: list[tuple[Any, ...]] = []
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def append(self, row: tuple[Any, ...]) -> None:
        """Add one row of ``len(names)`` JSON scalars."""
        self._pending.append(row)
        self._count += 1
        if len(self._pending) >= self.BLOCK_ROWS:
            self._flush()

    def _flush(self) -> None:
        if self._pending:
            self._blocks.append(float_table(self._pending))
            self._pending = []

    def columns(self) -> dict[str, FloatArray]:
        """One float64 column per name (the rows collected so far; collection may go on)."""
        self._flush()
        if not self._blocks:
            return {name: np.zeros(0, dtype=np.float64) for name in self._names}
        if len(self._blocks) > 1:
            self._blocks = [np.concatenate(self._blocks)]
        table = np.ascontiguousarray(self._blocks[0].T)  # one row per column: views below
        return {name: table[col] for col, name in enumerate(self._names)}
