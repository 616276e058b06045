"""A run's rates from its log's token events: what every bench that runs the pipeline reports.

A window of token events (a round's measured tokens, say) gives tokens/s, delivered GB/s,
the hit rate, where the wall went, and the median and longest token beside the mean: a
round of a few hundred ms moves with one slow token.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["token_events", "window_rate"]

GB = 1e9


def token_events(log: Path) -> list[dict[str, Any]]:
    """The ``token`` events of a JSON-lines run log, in order."""
    with log.open() as f:
        return [e for e in map(json.loads, f) if e.get("event") == "token"]


def window_rate(events: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Tokens/s, delivered GB/s and hit rate over a window of token events, and the
    median and longest token (a round of a few hundred ms moves with one slow token)."""
    walls = [e["wall_ms"] for e in events]
    wall_s = sum(walls) / 1000.0
    file_bytes = sum(e["file_bytes"] for e in events)
    hits = sum(e["hits"] for e in events)
    misses = sum(e["misses"] for e in events)
    return {
        "tokens": len(events),
        "tokens_per_s": len(events) / wall_s if wall_s else 0.0,
        "delivered_gbps": file_bytes / wall_s / GB if wall_s else 0.0,
        "hit_rate": hits / (hits + misses) if hits + misses else 0.0,
        "stall_ms_per_token": sum(e["stall_ms"] for e in events) / max(1, len(events)),
        "compute_ms_per_token": sum(e["compute_ms"] for e in events) / max(1, len(events)),
        "wall_ms_per_token": wall_s * 1000.0 / max(1, len(events)),
        "wall_ms_median": float(np.median(walls)) if walls else 0.0,
        "wall_ms_max": max(walls, default=0.0),
        "stall_ms_max": max((e["stall_ms"] for e in events), default=0.0),
        # the loop thread's CPU against its wall: near 1, it computes; well below, it waits
        # outside moestream's measured waits (a full launch queue, the GIL)
        "cpu_ms_per_token": sum(e.get("cpu_ms", 0.0) for e in events) / max(1, len(events)),
        "process_cpu_ms_per_token": sum(e.get("process_cpu_ms", 0.0) for e in events)
        / max(1, len(events)),
        # where the wall went (the token's ``time`` parts): ``host_ms`` against the waits
        # for the device (``compute_ms``, ``upload_ms``) says which side bounds a round
        "time_ms_per_token": {part: sum(e["time"][part] for e in events) / len(events)
                              for part in (events[0]["time"] if events else {})},
    }
