"""The device's own timeline of a run's host -> device copies (CUDA, bench-only).

A warm-miss round that runs slow is either the transfer (the device copies its layers
slower) or the host (the device copies at full rate and then waits for the next layer's
launch). The wall time cannot tell them apart: the decode thread spins while it waits.
``copy_timeline`` records a timing event on the stream before and after every gather launch
and every batched copy of this process (not the copy engines' in-place digest launches),
and ``CopyTimeline.summary`` reads them once the run is over: the device's copy rate while
copying, and the share of the span it copied. Each call gains two event records (a few
microseconds of host time a layer).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any
from unittest import mock

import numpy as np
import numpy.typing as npt

from moestream.gpu.backend import Stream


class CopyTimeline:
    """The (start event, end event, bytes) of every copy call, in the order queued."""

    def __init__(self) -> None:
        import cupy

        self._cp = cupy
        self.origin = cupy.cuda.Event()
        self.origin.record()  # the legacy stream: a shared zero for every stream's events
        self.calls: list[tuple[Any, Any, int]] = []

    def around(self, stream: Stream, nbytes: int, queue: Callable[[], None]) -> None:
        """Queue ``queue()`` on ``stream`` between two timing events."""
        raw = stream.raw  # type: ignore[attr-defined]
        start, end = self._cp.cuda.Event(), self._cp.cuda.Event()
        start.record(raw)
        queue()
        end.record(raw)
        self.calls.append((start, end, nbytes))

    def summary(self, last: float = 1.0) -> dict[str, float]:
        """Over the ``last`` share of the calls (a run's measured tokens, when each token
        makes as many calls): ``copy_device_gbps``, bytes over the time some copy ran (the
        union of the calls' intervals, streams overlapping); ``copy_busy_share``, that time
        over the span from the first copy's start to the last one's end."""
        calls = self.calls[len(self.calls) - round(len(self.calls) * last):]
        if not calls:
            return {}
        for _, end, _ in calls:
            end.synchronize()
        elapsed = self._cp.cuda.get_elapsed_time
        busy, span = busy_and_span([(elapsed(self.origin, s), elapsed(self.origin, e))
                                    for s, e, _ in calls])
        total = sum(n for _, _, n in calls)
        return {"copy_device_gbps": round(total / busy / 1e6, 2) if busy else 0.0,
                "copy_busy_share": round(busy / span, 3) if span else 0.0}


def busy_and_span(intervals: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """The length of the union of ``intervals`` (begin, end) and the span from the first
    begin to the last end."""
    if not intervals:
        return 0.0, 0.0
    ordered = sorted(intervals)
    busy, reach = 0.0, ordered[0][0]
    for begin, end in ordered:
        if end > reach:
            busy += end - max(begin, reach)
            reach = end
    return busy, reach - ordered[0][0]


@contextlib.contextmanager
def copy_timeline() -> Iterator[CopyTimeline]:
    """Time every ``CudaKernels.gather`` and ``CupyBackend.copy_h2d_batch`` call made
    inside the block (any thread, any instance)."""
    from moestream.gpu.cuda import CupyBackend
    from moestream.gpu.kernels import CudaKernels

    timeline = CopyTimeline()
    gather, batch = CudaKernels.gather, CupyBackend.copy_h2d_batch

    def timed_gather(self: CudaKernels, copies: npt.NDArray[np.uint64], stream: Stream) -> None:
        moved = copies[:, 0] != copies[:, 1]  # in place: a digest launch, no transfer
        if not moved.any():
            gather(self, copies, stream)
            return
        timeline.around(stream, int(copies[moved, 2].sum()),
                        lambda: gather(self, copies, stream))

    def timed_batch(self: CupyBackend, copies: npt.NDArray[np.uint64], stream: Stream) -> None:
        timeline.around(stream, int(copies[2].sum()), lambda: batch(self, copies, stream))

    with mock.patch.object(CudaKernels, "gather", timed_gather), \
            mock.patch.object(CupyBackend, "copy_h2d_batch", timed_batch):
        yield timeline
