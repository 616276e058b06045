"""Per-interval rows of a run log: the CSV of ``tools.analyze --csv`` and the points of its
plots (``moestream.tools.analyze.plots``), in ds4-bench's column names where ds4 has one."""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from moestream.pipeline.foundation.errors import UsageError
from moestream.pipeline.foundation.outputs import write_atomic
from moestream.pipeline.runlog.read import TIME_COLUMNS
from moestream.pipeline.runlog.records import RunLog
from moestream.tools.analyze.report_text import GB, MB, Value

__all__ = ["CSV_COLUMNS", "STAGE_COLUMNS", "interval_rows", "write_csv"]

STAGE_COLUMNS = ("read_ms", "stage_ms", "upload_ms", "install_ms", "stall_ms", "compute_ms")

CSV_COLUMNS = (
    "ctx_tokens", "gen_tokens", "gen_tps", "latency_p50_ms", "latency_p95_ms", "hit_rate",
    "hits", "misses", "evictions", "file_mb_per_token", "cache_mb_per_token",
    "storage_mb_per_token", "storage_gbps", *STAGE_COLUMNS, "stall_share", *TIME_COLUMNS,
    "mode", "ram_available_gb", "cache_live_gb", "run",
)
"""Columns of ``--csv``, in order (docs/LOG_SCHEMA.md, "Derived CSV columns")."""


def _mode_label(codes: np.ndarray[Any, Any], names: tuple[str, ...]) -> str:
    seen: list[str] = []
    for code in codes.tolist():
        name = names[code] if code >= 0 else "?"
        if not seen or seen[-1] != name:
            seen.append(name)
    return "/".join(seen)


def interval_rows(run: RunLog, interval: int) -> list[dict[str, Value]]:
    """Per-interval rows of ``CSV_COLUMNS`` (the last interval may be shorter)."""
    if interval < 1:
        raise UsageError(f"--interval must be >= 1, got {interval}")
    cols = run.tokens
    n = len(cols)
    if n == 0:
        return []
    starts = np.arange(0, n, interval)
    counts = np.diff(np.append(starts, n)).astype(np.float64)

    def sums(name: str) -> np.ndarray[Any, np.dtype[np.float64]]:
        return np.add.reduceat(np.nan_to_num(cols[name]), starts)

    wall = sums("wall_ms")
    hits, misses, evictions = sums("hits"), sums("misses"), sums("evictions")
    with np.errstate(divide="ignore", invalid="ignore"):
        derived = {
            "gen_tps": counts * 1000.0 / wall,
            "hit_rate": hits / (hits + misses),
            "file_mb_per_token": sums("file_bytes") / MB / counts,
            "cache_mb_per_token": sums("cache_bytes") / MB / counts,
            "storage_mb_per_token": sums("storage_bytes") / MB / counts,
            "storage_gbps": sums("storage_bytes") / GB / (wall / 1000.0),
            "stall_share": sums("stall_ms") / wall,
            **{stage: sums(stage) / counts for stage in STAGE_COLUMNS},
            # the time split (schema 2); NaN, an empty cell, for older logs
            **{part: sums(part) / counts if part in cols else np.full(starts.size, np.nan)
               for part in TIME_COLUMNS},
        }
    ends = np.append(starts[1:], n)
    rows: list[dict[str, Value]] = []
    for i, (start, end) in enumerate(zip(starts.tolist(), ends.tolist(), strict=True)):
        lat = cols["wall_ms"][start:end]
        lat = lat[np.isfinite(lat)]
        p50, p95 = np.percentile(lat, [50, 95]).tolist() if lat.size else (math.nan, math.nan)
        last = end - 1
        row: dict[str, Value] = {
            "ctx_tokens": end,
            "gen_tokens": end - start,
            "latency_p50_ms": p50,
            "latency_p95_ms": p95,
            "hits": int(hits[i]),
            "misses": int(misses[i]),
            "evictions": int(evictions[i]),
            "mode": _mode_label(cols.mode_codes[start:end], cols.mode_names),
            "ram_available_gb": float(cols["ram_available_bytes"][last]) / GB,
            "cache_live_gb": float(cols["cache_live_bytes"][last]) / GB,
            "run": run.name,
        }
        for key, array in derived.items():
            row[key] = float(array[i])
        rows.append(row)
    return [{key: row[key] for key in CSV_COLUMNS} for row in rows]


def _csv_cell(value: Value) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def write_csv(path: Path, runs: Sequence[RunLog], interval: int) -> int:
    """Write the interval rows of every run to one CSV file; returns the number of rows."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    count = 0
    for run in runs:
        for row in interval_rows(run, interval):
            writer.writerow([_csv_cell(row[c]) for c in CSV_COLUMNS])
            count += 1
    write_atomic(path, buffer.getvalue(), what="--csv", make_parents=True)
    return count
