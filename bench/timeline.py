"""Where a generate's wall time goes on the GPU: a torch profiler trace (CUDA activity
included, CuPy's copies and kernels too: CUPTI sees the whole process) reduced to the
device's busy times a token.

``bench.experts_profile --timeline`` calls :func:`profiled_timeline`. The question it answers
is the miss path's: do the uploads overlap the model's kernels, or do the two take turns
(the device idle while the host waits to learn which experts to load)? The summary gives,
per token: the kernels' busy time (their union over all streams), the host-to-device
copies' busy time and bytes, how much of the two overlapped, the time the device did
neither, and the host's time inside synchronizing CUDA calls.
"""

from __future__ import annotations

import gzip
import json
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

__all__ = ["busy", "overlap", "profiled_timeline", "summarize"]

_SYNCS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize",
          "cudaMemcpy", "cudaMemcpyAsync")
"""Host calls that may wait for the device (``cudaMemcpyAsync`` does for a device-to-host
copy into pageable memory: ``.tolist()``/``.item()``)."""


def busy(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of ``(start, end)`` intervals, as disjoint sorted intervals."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            if end > merged[-1][1]:
                merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


def overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """The total length of the intersection of two disjoint sorted interval lists."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        low, high = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if high > low:
            total += high - low
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in intervals)


def summarize(trace: dict[str, Any], tokens: int) -> dict[str, float]:
    """Per-token milliseconds (and copied megabytes) of a chrome trace's device activity
    between its first and last device event; ``tokens`` divides."""
    kernels, copies, host_waits = [], [], 0.0
    copied = 0
    for event in trace.get("traceEvents", []):
        if event.get("ph") != "X":
            continue
        category, start, length = event.get("cat", ""), event.get("ts"), event.get("dur", 0)
        if start is None:
            continue
        span = (float(start), float(start) + float(length))
        if category == "kernel":
            kernels.append(span)
        elif category == "gpu_memcpy" and "HtoD" in event.get("name", ""):
            copies.append(span)
            copied += int(event.get("args", {}).get("bytes", 0))
        elif category == "cuda_runtime" and event.get("name") in _SYNCS:
            host_waits += float(length)
    kernel_busy, copy_busy = busy(kernels), busy(copies)
    every = busy(kernel_busy + copy_busy)
    window = (every[-1][1] - every[0][0]) if every else 0.0
    per = 1000.0 * max(1, tokens)  # microseconds to ms a token
    return {
        "device_window_ms": window / per,
        "kernels_ms": _length(kernel_busy) / per,
        "h2d_ms": _length(copy_busy) / per,
        "h2d_mb": copied / 1e6 / max(1, tokens),
        "overlap_ms": overlap(kernel_busy, copy_busy) / per,
        "idle_ms": (window - _length(every)) / per,
        "host_sync_calls_ms": host_waits / per,
    }


def profiled_timeline(run: Callable[[], Any], tokens: int, keep: Path | None = None
                      ) -> dict[str, float]:
    """Run ``run`` (one generate of ``tokens`` tokens) under the torch profiler with CUDA
    activity and summarize its trace (:func:`summarize`); ``keep``: also write the trace
    there, gzipped."""
    import torch

    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profile:
        run()
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "trace.json"
        profile.export_chrome_trace(str(path))
        with path.open() as f:
            trace = json.load(f)
        if keep is not None:
            with path.open("rb") as src, gzip.open(keep, "wb") as dst:
                shutil.copyfileobj(src, dst)
    return summarize(trace, tokens)
