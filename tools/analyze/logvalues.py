"""Tolerant conversions of decoded JSON values, shared by the run-log reader's modules.

A log line's fields may be absent or of the wrong type (older or newer writers, a hand-edited
file); the reader keeps what has the right type and turns the rest into ``None`` or NaN
instead of failing. Used by ``tools.analyze.logread``, ``tools.analyze.logrecords`` and
``tools.analyze.logdevices``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = [
    "FloatArray",
    "float_columns",
    "float_or_none",
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
    """``value`` as a float if it is an int or float (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def str_or_none(value: object) -> str | None:
    """``value`` if it is a string, else None."""
    return value if isinstance(value, str) else None


def int_tuple(value: object) -> tuple[int, ...]:
    """``value`` as a tuple if it is a list of ints, else empty."""
    if not isinstance(value, list) or not all(int_or_none(x) is not None for x in value):
        return ()
    return tuple(value)


def mapping(value: object) -> Mapping[str, Any]:
    """``value`` if it is a JSON object, else an empty mapping."""
    return value if isinstance(value, dict) else {}


def float_columns(rows: list[tuple[Any, ...]], names: tuple[str, ...]) -> dict[str, FloatArray]:
    """Turn rows of JSON scalars into float64 columns; non-numbers become NaN."""
    if not rows:
        return {name: np.zeros(0, dtype=np.float64) for name in names}
    try:
        table = np.array(rows, dtype=np.float64)
    except (ValueError, TypeError):
        # Some value was a string, object or null: clean row by row (rare, slower).
        table = np.array(
            [[math.nan if (f := float_or_none(v)) is None else f for v in row] for row in rows],
            dtype=np.float64,
        )
    return {name: table[:, col].copy() for col, name in enumerate(names)}
