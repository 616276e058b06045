"""Host-to-device copy bandwidth of one device alone and of several at once.

What a second device adds to loading: each device gets a pinned host buffer allocated under
it, a device buffer and a stream; copies run on each device alone, then on every device at
once (one thread per device, started together by a barrier). CuPy only in practice; on the
host backend the "copies" are memcpy and measure nothing.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from moestream.gpu.backend import Backend, DeviceBuffer, HostBuffer, Stream

__all__ = ["H2D_TARGET", "DeviceCopier", "h2d_figures"]

GB = 1e9
H2D_TARGET = 1.8  # the aim: two devices loading at once >= 1.8x one device
_BARRIER_TIMEOUT_S = 60.0


@dataclass(slots=True)
class _CopyLane:
    """One device's buffers and stream. ``host`` must stay alive until ``stream`` has
    synchronized after the last copy queued from it."""

    backend: Backend
    host: HostBuffer
    device: DeviceBuffer
    stream: Stream


class DeviceCopier:
    """Pinned host buffers copied to their devices, alone or all at once.

    Args:
        backends: one per device (CuPy).
        nbytes: bytes of each host buffer and device buffer.
    """

    def __init__(self, backends: Sequence[Backend], nbytes: int) -> None:
        self.nbytes = nbytes
        self._lanes: list[_CopyLane] = []
        try:
            for b in backends:
                with b.activate():
                    host = b.alloc_host(nbytes)  # pinned for this device's context
                    host.array[:] = 1
                    lane = _CopyLane(b, host, b.alloc_device(nbytes), b.new_stream())
                self._lanes.append(lane)
                self._copy(lane, 1)  # first copy: context and mapping set-up, not timed
        except BaseException:
            self.close()
            raise

    @property
    def devices(self) -> list[int]:
        return [lane.backend.device for lane in self._lanes]

    def _copy(self, lane: _CopyLane, copies: int) -> tuple[float, float]:
        """Queue ``copies`` copies on the lane's stream and wait for them: (start, end)."""
        start = time.perf_counter()
        with lane.backend.activate():
            for _ in range(copies):
                lane.backend.copy_h2d(lane.device, 0, lane.host.array, lane.stream)
        lane.stream.synchronize()
        return start, time.perf_counter()

    def alone_gbps(self, index: int, copies: int) -> float:
        """GB/s of ``copies`` copies to device ``index`` (of this copier's) with the others
        idle."""
        start, end = self._copy(self._lanes[index], copies)
        return copies * self.nbytes / (end - start) / GB

    def together_gbps(self, copies: int) -> tuple[float, list[float]]:
        """Every device copying at once, one thread each, released together by a barrier:
        (aggregate GB/s over the first start to the last finish, each device's own GB/s)."""
        barrier = threading.Barrier(len(self._lanes), timeout=_BARRIER_TIMEOUT_S)
        spans: list[tuple[float, float] | None] = [None] * len(self._lanes)
        errors: list[BaseException] = []

        def worker(i: int) -> None:
            try:
                barrier.wait()
                spans[i] = self._copy(self._lanes[i], copies)
            except BaseException as exc:  # re-raised below, in the calling thread
                barrier.abort()
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(i,), name=f"h2d-{i}")
                   for i in range(len(self._lanes))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        done = [s for s in spans if s is not None]
        wall = max(e for _, e in done) - min(s for s, _ in done)
        per_device = [copies * self.nbytes / (e - s) / GB for s, e in done]
        return len(done) * copies * self.nbytes / wall / GB, per_device

    def close(self) -> None:
        for lane in self._lanes:
            lane.stream.synchronize()
            lane.device.close()
            lane.host.close()
        self._lanes = []

    def __enter__(self) -> DeviceCopier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def h2d_figures(backends: Sequence[Backend], nbytes: int, copies: int,
                rounds: int) -> dict[str, Any]:
    """Each device alone, then all together, ``rounds`` times; every measurement and the
    medians, with aggregate over the best single device."""
    alone: dict[int, list[float]] = {b.device: [] for b in backends}
    together: list[float] = []
    together_each: dict[int, list[float]] = {b.device: [] for b in backends}
    with DeviceCopier(backends, nbytes) as copier:
        for _ in range(rounds):
            for i, device in enumerate(copier.devices):
                alone[device].append(copier.alone_gbps(i, copies))
            aggregate, each = copier.together_gbps(copies)
            together.append(aggregate)
            for device, gbps in zip(copier.devices, each, strict=True):
                together_each[device].append(gbps)
    single = {d: round(statistics.median(v), 2) for d, v in alone.items()}
    best = max(single.values())
    aggregate_gbps = round(statistics.median(together), 2)
    ratio = round(aggregate_gbps / best, 3) if best > 0 else None
    return {
        "bytes_per_copy": nbytes, "copies": copies, "rounds": rounds,
        "alone_gbps": {str(d): [round(x, 2) for x in v] for d, v in alone.items()},
        "together_gbps": [round(x, 2) for x in together],
        "together_device_gbps": {str(d): [round(x, 2) for x in v]
                                 for d, v in together_each.items()},
        "single_gbps": {str(d): g for d, g in single.items()},
        "best_single_gbps": best,
        "aggregate_gbps": aggregate_gbps,
        "aggregate_over_best_single": ratio,
        "target": H2D_TARGET,
        "meets_target": ratio is not None and ratio >= H2D_TARGET,
    }
