"""The per-device section of ``moestream-analyze``: one row per device of a multi-device run.

A run over several devices (``--devices 0,1``) logs per-device counters (read by
``pipeline.runlog.devices``); this module turns them into each device's hits, file bytes, stall,
budget and peak, how evenly the file bytes were spread (``device_balance``), a text table
with the run's own totals for comparison, and the ``devices`` entries of ``--json``.
One-device runs and logs that predate the fields get no section.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from moestream.pipeline.runlog.records import RunLog
from moestream.tools.analyze.report_text import Value, ratio, size_text, text_table

__all__ = ["device_balance", "device_rows", "device_table", "devices_json"]


def _device_order(run: RunLog) -> list[int]:
    """Devices as run_start lists them (home first), then any only the tokens or run_end name."""
    order: list[int] = [d.device for d in run.header.devices] if run.header else []
    ended = [d.device for d in run.end.devices] if run.end else []
    for device in [*run.tokens.devices, *ended]:
        if device not in order:
            order.append(device)
    return order


def _has_devices(run: RunLog) -> bool:
    return bool(run.tokens.devices) or (run.header is not None and len(run.header.devices) > 1)


def device_rows(run: RunLog) -> list[dict[str, Value]]:
    """Per-device figures of a run over several devices; empty for a one-device log.

    Token figures (hits, misses, file bytes, stall and compute per token) come from the
    tokens' ``devices`` lists, budget from ``run_start.devices`` and peak, allocations and
    frees from ``run_end.devices``; a figure whose source is absent is None.
    ``file_share`` is the device's part of the file bytes of all devices (what its misses,
    and prefetches, read); ``peak_within_budget`` compares the peak with the budget at the
    start (a device out-of-memory can shrink the budget later: ``final_budget_bytes``).
    """
    if not _has_devices(run):
        return []
    cols = run.tokens
    starts = {d.device: d for d in run.header.devices} if run.header else {}
    ends = {d.device: d for d in run.end.devices} if run.end else {}
    file_all = sum(cols.device_total(d, "file_bytes") for d in cols.devices)
    rows: list[dict[str, Value]] = []
    for device in _device_order(run):
        start, end = starts.get(device), ends.get(device)
        row: dict[str, Value] = {"device": device, "name": start.name if start else None}
        if device in cols.devices:
            tokens = int(np.count_nonzero(~np.isnan(cols.devices[device]["hits"])))
            hits, misses, file_b = (cols.device_total(device, k)
                                    for k in ("hits", "misses", "file_bytes"))
            row.update({
                "tokens": tokens, "hits": int(hits), "misses": int(misses),
                "hit_rate": ratio(hits, hits + misses), "file_bytes": int(file_b),
                "file_share": ratio(file_b, file_all),
                "stall_ms_per_token": ratio(cols.device_total(device, "stall_ms"), tokens),
                "compute_ms_per_token": ratio(cols.device_total(device, "compute_ms"),
                                               tokens),
            })
        else:
            row.update(dict.fromkeys(("tokens", "hits", "misses", "hit_rate", "file_bytes",
                                      "file_share", "stall_ms_per_token",
                                      "compute_ms_per_token")))
        budget = start.budget_bytes if start else None
        peak = end.peak_device_bytes if end else None
        row.update({
            "budget_bytes": budget,
            "final_budget_bytes": end.budget_bytes if end else None,
            "peak_device_bytes": peak,
            "peak_within_budget": None if budget is None or peak is None else peak <= budget,
            "allocations": end.allocations if end else None,
            "frees": end.frees if end else None,
            "registered_path": end.registered_path if end else None,
        })
        rows.append(row)
    return rows


def device_balance(rows: Sequence[dict[str, Value]]) -> float | None:
    """Largest device file bytes over the devices' mean (1.0: even); None without data."""
    read = [float(r["file_bytes"]) for r in rows if isinstance(r["file_bytes"], int)]
    if not read:
        return None
    return ratio(max(read), sum(read) / len(read))


def _cell(value: Value, digits: int, scale: float = 1.0) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, str):
        return value
    if isinstance(value, int) and scale == 1.0:
        return f"{value:,}"
    return f"{value / scale:,.{digits}f}"


def _bytes(value: Value) -> str:
    """A byte count in the binary unit it reaches ("-" when unknown)."""
    return "-" if value is None or isinstance(value, bool | str) else size_text(int(value))


def device_table(run: RunLog) -> str:
    """The per-device section of a run over several devices ("" for one device).

    One row per device and a ``run`` row with the run's own totals (token lines, run_start,
    run_end) for comparison: hits, misses and file bytes of the devices add up to it; stall
    and compute do not, since on every layer the devices wait and compute together.
    """
    rows = device_rows(run)
    if not rows:
        return ""
    balance = device_balance(rows)
    table = [["device", "name", "hits", "misses", "hit rate", "file", "file share",
              "stall ms/token", "compute ms/token", "budget", "peak", "peak <= budget"]]
    for r in rows:
        table.append([str(r["device"]), _cell(r["name"], 0), _cell(r["hits"], 0),
                      _cell(r["misses"], 0), _cell(r["hit_rate"], 4),
                      _bytes(r["file_bytes"]), _cell(r["file_share"], 3),
                      _cell(r["stall_ms_per_token"], 2), _cell(r["compute_ms_per_token"], 2),
                      _bytes(r["budget_bytes"]), _bytes(r["peak_device_bytes"]),
                      _cell(r["peak_within_budget"], 0)])
    cols, end = run.tokens, run.end
    n = len(cols)
    hits, misses = cols.total("hits"), cols.total("misses")
    budget = run.header.budget_bytes if run.header else None
    peak = end.peak_device_bytes if end else None
    table.append(["run", "-", _cell(int(hits), 0), _cell(int(misses), 0),
                  _cell(ratio(hits, hits + misses), 4),
                  _bytes(cols.total("file_bytes")), "-",
                  _cell(ratio(cols.total("stall_ms"), n), 2),
                  _cell(ratio(cols.total("compute_ms"), n), 2),
                  _bytes(budget), _bytes(peak),
                  _cell(None if budget is None or peak is None else peak <= budget, 0)])
    title = (f"devices: {len(rows)}; file bytes balance (max/mean)"
             f" {_cell(balance, 3)}\n")
    notes = ["run stall and compute ms/token: per layer the slowest device's, so not the sum"]
    for r in rows:
        final, start = r["final_budget_bytes"], r["budget_bytes"]
        if isinstance(final, int) and isinstance(start, int) and final != start:
            notes.append(f"device {r['device']}: budget {size_text(start)} at the start,"
                         f" {size_text(final)} at the end")
        if r["allocations"] is not None and r["allocations"] != r["frees"]:
            notes.append(f"device {r['device']}: {r['allocations']} allocations,"
                         f" {_cell(r['frees'], 0)} frees")
    return title + text_table(table) + "".join(f"  {note}\n" for note in notes)


def devices_json(run: RunLog) -> dict[str, Any]:
    """``devices`` and ``device_balance`` for a run's JSON entry; nothing for one device."""
    rows = device_rows(run)
    return {"devices": rows, "device_balance": device_balance(rows)} if rows else {}
