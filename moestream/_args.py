"""The API's arguments, checked at the boundary: what an engine may pass, in its words.

Every public call checks its arguments here before anything is pinned or opened, so a
bad value fails at once with a ``UsageError`` (a ``ValueError``; ``UsageTypeError``, also
a ``TypeError``, for a value of the wrong type) that names the argument as the API spells
it, never a CLI flag.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt

from moestream.pipeline.foundation.config import Budget, parse_budget
from moestream.pipeline.foundation.errors import UsageError, UsageTypeError

__all__ = ["ExpertIds", "Index", "budget_of", "choice", "devices_of", "engine_ms", "expert_ids",
           "index", "milliseconds"]

Index: TypeAlias = int | np.integer[Any]
"""A layer or expert index: an int, or a numpy integer (normalized to int)."""
ExpertIds: TypeAlias = Sequence[int | np.integer[Any]] | npt.NDArray[np.integer[Any]]
"""A fetch's experts: a list, tuple or range of them, or a 1-D integer array."""


def index(value: object, what: str) -> int:
    """``value`` as an ``int``: an ``int`` or a numpy integer; never a bool, a float (even
    ``2.0``), a string or anything else that merely converts.

    Raises:
        UsageTypeError: ``value`` is not an integer.
    """
    kind = type(value)
    if kind is int:
        return value  # type: ignore[return-value]
    if isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
        return int(value)
    raise UsageTypeError(f"{what} must be an int, not {kind.__name__} {value!r}")


def expert_ids(experts: object, layer: int) -> list[int]:
    """``experts`` as a list of ints: a list, tuple, range or 1-D integer numpy array of
    integers. A set (no order), a generator (consumed by looking), a string or a mapping
    is refused: the order asked is the order ``gather`` hands them back.

    Raises:
        UsageTypeError: not such a sequence, or an element is not an integer.
    """
    if isinstance(experts, np.ndarray):
        if experts.ndim != 1 or experts.dtype.kind not in "iu":
            raise UsageTypeError(f"layer {layer}: experts must be a 1-D integer array, not "
                                 f"{experts.dtype} of shape {experts.shape}")
        return [int(e) for e in experts.tolist()]
    if (isinstance(experts, (str, bytes, bytearray, Mapping))
            or not isinstance(experts, Sequence)):
        raise UsageTypeError(f"layer {layer}: experts must be a list or tuple of ints, not "
                             f"{type(experts).__name__}")
    out = [e if type(e) is int else index(e, f"layer {layer}: an expert") for e in experts]
    return out


def milliseconds(value: object, what: str) -> float:
    """A duration in ms: a finite, non-negative int or float.

    Raises:
        UsageTypeError: not a number. UsageError: negative, NaN or infinite.
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer,
                                                                     np.floating)):
        raise UsageTypeError(f"{what} must be a number of milliseconds, not "
                             f"{type(value).__name__} {value!r}")
    ms = float(value)
    if not math.isfinite(ms) or ms < 0:
        raise UsageError(f"{what} must be finite and >= 0 ms, not {value!r}")
    return ms


def choice(value: object, what: str, allowed: Sequence[str]) -> str:
    """One of ``allowed`` (exactly as spelled).

    Raises:
        UsageError: another value.
    """
    if not isinstance(value, str) or value not in allowed:
        raise UsageError(f"{what} must be one of {', '.join(map(repr, allowed))}, "
                         f"not {value!r}")
    return value


def devices_of(devices: object) -> tuple[int, ...] | None:
    """None, one device index, or a sequence of distinct ones (each ``>= 0``).

    Raises:
        UsageTypeError: not an int or a sequence of ints. UsageError: empty, negative or
            repeated indices.
    """
    if devices is None:
        return None
    if isinstance(devices, (str, bytes, Mapping)) or not isinstance(
            devices, (int, np.integer, Sequence)):
        raise UsageTypeError(f"devices must be a device index or a list of them, not "
                             f"{type(devices).__name__} {devices!r}")
    if isinstance(devices, Sequence):
        chosen = tuple(index(d, "a device index") for d in devices)
    else:
        chosen = (index(devices, "devices"),)
    if not chosen:
        raise UsageError("devices must name at least one device (None: every visible one)")
    negative = [d for d in chosen if d < 0]
    if negative:
        raise UsageError(f"device indices are >= 0, not {negative[0]}")
    if len(set(chosen)) != len(chosen):
        raise UsageError(f"devices names a device twice: {list(chosen)}")
    return chosen


def budget_of(budget: object) -> Budget | None:
    """The cache budget: None (every expert), an int (that many experts, as the text
    ``"2522"``), a text (``"2522"`` or ``"2522.0"`` experts, ``"20GiB"``, ``"11GB"``) or a
    ``Budget``.

    Only what no model can take is refused here; a budget below what the model needs (its
    top-k experts for each layer in flight) is refused when the session opens, naming that
    minimum.

    Raises:
        UsageTypeError: another type (a float, a bool). UsageError: an unreadable text, a
            bare number with a fraction, zero or a negative number.
    """
    if budget is None:
        return None
    if isinstance(budget, Budget):
        parts = [n for n in (budget.experts, budget.nbytes) if n is not None]
        if len(parts) != 1:
            raise UsageError(f"a Budget gives experts or nbytes, exactly one: {budget!r}")
        value = index(parts[0], "Budget's " + ("experts" if budget.experts is not None
                                               else "nbytes"))
        if value < 1:
            raise _not_positive(budget)
        return budget
    if isinstance(budget, (float, np.floating)):
        raise UsageTypeError(f"budget {budget!r}: give experts as an int, or a size as text "
                             "with its unit (\"20GiB\")")
    if not isinstance(budget, str):
        experts = index(budget, "budget")
        if experts < 1:
            raise _not_positive(experts)
        return parse_budget(str(experts))
    if budget.strip().startswith("-"):
        raise _not_positive(budget)
    parsed = parse_budget(budget)
    if (parsed.experts if parsed.experts is not None else parsed.nbytes or 0) < 1:
        raise _not_positive(budget)
    return parsed


def _not_positive(budget: object) -> UsageError:
    """The refusal of a budget no model can take; the model's own minimum is not known yet
    (the session names it when it opens)."""
    shown = str(budget) if isinstance(budget, Budget) else repr(budget)
    return UsageError(f"budget {shown[:40]}: give a positive number of experts or a size "
                      "with a unit (\"20GiB\"); a model takes at least its top-k experts for "
                      "each layer in flight")


def engine_ms(compute_ms: object, devices: int) -> float | list[float] | None:
    """``end_token``'s ``compute_ms``, checked: a number, or one per device (``devices``
    of them)."""
    if compute_ms is None:
        return None
    if isinstance(compute_ms, Sequence) and not isinstance(compute_ms, (str, bytes)):
        figures = [milliseconds(ms, "compute_ms (per device)") for ms in compute_ms]
        if len(figures) != devices:
            raise UsageError(f"compute_ms gives {len(figures)} figures for {devices} devices: "
                             "give one per device (devices order), or one number")
        return figures if len(figures) > 1 else figures[0]
    if not isinstance(compute_ms, (int, float)):
        raise UsageTypeError(f"compute_ms must be a number of milliseconds or one per "
                             f"device, not {type(compute_ms).__name__}")
    return milliseconds(compute_ms, "compute_ms")
