"""The run log's schema as the reader checks it: versions, events, each event's fields.

A log is read if its first non-blank line is a moestream event of a known schema
(``first_object``); each later line's fields are counted against ``FIELDS`` (unknown) and
``REQUIRED`` (missing), never refused. docs/LOG_SCHEMA.md is the schema in words.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from moestream.pipeline.foundation.errors import TraceError
from moestream.pipeline.foundation.inputs import JSONDepthError, load_json_bounded
from moestream.pipeline.foundation.timesplit import PARTS

__all__ = ["ENVELOPE", "FIELDS", "KNOWN_EVENTS", "LAYER_COLUMNS", "PREFETCH_COLUMNS",
           "REQUIRED", "ROW_COLUMNS", "SCHEMA_VERSION", "SCHEMA_VERSIONS", "TIME_COLUMNS",
           "TIME_FIELDS", "TOKEN_COLUMNS", "first_object", "out_of_range"]

SCHEMA_VERSION = 2
"""The newest log schema this reader understands."""

SCHEMA_VERSIONS = frozenset({1, 2})
"""Every log schema this reader understands: 2 is 1 with the token event's ``time``."""

KNOWN_EVENTS = frozenset(
    {"run_start", "token", "layer", "controller_decision", "mode_switch", "run_end",
     "warmup_start", "warmup_done", "warmup_stopped", "host_tier"}
)
"""Event types of schema 1."""

ENVELOPE = frozenset({"event", "schema", "ts", "level"})

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

PREFETCH_COLUMNS = ("predicted", "correct", "wasted_bytes")

TIME_FIELDS = tuple(f"{part}_ms" for part in PARTS)
TIME_COLUMNS = tuple(f"time_{name}" for name in TIME_FIELDS)
"""Columns of the token event's ``time`` parts (schema 2), present when any token had one."""

ROW_COLUMNS = (*TOKEN_COLUMNS, *(f"prefetch_{name}" for name in PREFETCH_COLUMNS),
               *TIME_COLUMNS)
"""A token line's numbers, in the order the reader keeps them."""

FIELDS: dict[str, frozenset[str]] = {
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
REQUIRED: dict[str, frozenset[str]] = {
    "run_start": frozenset({"config", "model", "machine", "budget_bytes", "policy"}),
    "token": frozenset(TOKEN_COLUMNS) | {"mode", "experts"},
    "layer": FIELDS["layer"] - {"read_ms"},
    "controller_decision": frozenset({"mode", "readings", "reason"}),
    "mode_switch": FIELDS["mode_switch"] - {"took_ms"},
    "warmup_start": FIELDS["warmup_start"],
    "warmup_done": FIELDS["warmup_done"],
    "warmup_stopped": FIELDS["warmup_stopped"],
    "host_tier": FIELDS["host_tier"],
    "run_end": frozenset(
        {
            "tokens", "elapsed_s", "tokens_per_s", "hits", "misses", "hit_rate",
            "file_bytes", "cache_bytes", "storage_bytes", "verified", "mismatches",
            "peak_device_bytes", "budget_bytes", "exit",
        }
    ),
}
LAYER_COLUMNS = ("token", "layer", "hits", "misses", "read_ms", "stall_ms")


_LONG_NUMBER = re.compile(rb"\d{19}")  # a line without 19 digits in a row holds no int64 edge
_INT64_BOUND = 2**63


def out_of_range(raw: bytes, obj: object) -> bool:
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


def first_object(path: Path, line: bytes) -> dict[str, Any]:
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
