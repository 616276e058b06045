"""Where a token's wall time goes, measured on the decode thread where it waits.

Decode runs on one thread (the event loop's). A token's wall time is the intervals that
thread spent waiting, plus the Python it ran; each wait is charged, where it happens, to
what it waited on:

- ``compute``: the layer's experts being computed. On the host backend kernels run inline,
  so it is the time spent in them; on a GPU it is the end-of-layer synchronize, less the
  part where the compute stream sat waiting on an upload event (that part is ``upload``).
- ``read``: a miss the decoder waited for was being read from the model file (O_DIRECT, or
  buffered for the host tier and not yet registered windows), or queued for a reader thread.
- ``upload``: a miss was being copied to the device (the host backend's memcpy, a resident
  copy from the page-cache mapping, or the compute stream waiting on its upload event).
- ``slot``: a miss waited for a staging slot (none free, or the free one still read by its
  last upload). Device buffers never hold decode up here: the cache recycles them with an
  event the upload waits on, on the device, which shows in ``upload``.
- ``switch``: the controller at the token boundary (a sample, a mode switch).
- ``host``: the rest, Python on the loop (routing, planning, launching, logging) and the hop
  from a worker's notice to the decoder's wake-up: the wall time less all of the above, so
  the parts sum to the wall time by construction.

Work that overlaps a wait is hidden behind it and not charged: device compute of the hits
while the decoder waits for a read is ``read`` time, because the read is what the token
waited for. A wait for one expert is split by what that expert's load was doing meanwhile
(``LoadPhases``): the load that ended the wait is the one on the token's critical path.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Literal

__all__ = ["BOUND_OF_PART", "PARTS", "LaunchTimes", "LoadPhases", "Part", "TimeSplit"]

Part = Literal["compute", "read", "upload", "slot", "switch", "host"]

PARTS: tuple[Part, ...] = ("compute", "read", "upload", "slot", "switch", "host")
"""The parts of a token's wall time, in the order reports list them; ``host`` is the rest."""

BOUND_OF_PART: dict[Part, str] = {
    "compute": "compute", "read": "storage", "upload": "copy", "slot": "staging",
    "switch": "controller", "host": "host",
}
"""What bounds a run whose largest part is this one (``storage-bound``, ``copy-bound``...)."""


@dataclass(slots=True)
class TimeSplit:
    """Milliseconds of the decode thread's waits, by what was waited on (``host`` is not
    kept: it is whatever of a wall time the others do not explain, ``record``)."""

    compute_ms: float = 0.0
    read_ms: float = 0.0
    upload_ms: float = 0.0
    slot_ms: float = 0.0
    switch_ms: float = 0.0

    def charge(self, part: Part, seconds: float) -> None:
        """Add ``seconds`` of waiting to ``part`` (``host`` adds nothing: it is derived)."""
        ms = seconds * 1000.0
        if part == "compute":
            self.compute_ms += ms
        elif part == "read":
            self.read_ms += ms
        elif part == "upload":
            self.upload_ms += ms
        elif part == "slot":
            self.slot_ms += ms
        elif part == "switch":
            self.switch_ms += ms

    def add(self, other: TimeSplit) -> None:
        self.compute_ms += other.compute_ms
        self.read_ms += other.read_ms
        self.upload_ms += other.upload_ms
        self.slot_ms += other.slot_ms
        self.switch_ms += other.switch_ms

    @property
    def measured_ms(self) -> float:
        """The waits' total (everything but ``host``)."""
        return self.compute_ms + self.read_ms + self.upload_ms + self.slot_ms + self.switch_ms

    def parts(self, wall_ms: float) -> dict[Part, float]:
        """Every part in ms, ``host`` being the rest of ``wall_ms`` (never below 0)."""
        return {"compute": self.compute_ms, "read": self.read_ms, "upload": self.upload_ms,
                "slot": self.slot_ms, "switch": self.switch_ms,
                "host": max(0.0, wall_ms - self.measured_ms)}

    def record(self, wall_ms: float) -> dict[str, float]:
        """The token event's ``time`` object: each part in ms (3 decimals), ``host_ms`` the
        rest of ``wall_ms`` rounded the same way, so the six add up to ``wall_ms``."""
        out = {
            "compute_ms": round(self.compute_ms, 3),
            "read_ms": round(self.read_ms, 3),
            "upload_ms": round(self.upload_ms, 3),
            "slot_ms": round(self.slot_ms, 3),
            "switch_ms": round(self.switch_ms, 3),
        }
        out["host_ms"] = round(max(0.0, round(wall_ms, 3) - sum(out.values())), 3)
        return out


@dataclass(slots=True)
class LaunchTimes:
    """One layer's launch, as the loads that wait behind it saw it.

    ``planned``: when the layer's lookup made its misses (``time.perf_counter`` seconds).
    ``slot_waits``: (start, end) of each wait of the launcher for a free staging slot; a
    miss not yet launched waits behind it, so those intervals are ``slot`` time for every
    later miss of the layer, and the launcher's other time is ``host``.
    """

    planned: float
    slot_waits: list[tuple[float, float]] = field(default_factory=list)


class LoadPhases:
    """What one expert's load did over time: a ``host``/``slot`` prefix until its launch,
    then the phases its launcher and reader thread mark as they end.

    Marks are appended in time order by one thread at a time (the launcher, then the worker
    that finishes the load) and read by the loop only after the load's arrival was
    delivered there (``call_soon_threadsafe``), so they need no lock.

    Args:
        launch: the layer launch this load waited behind before its own start.
    """

    __slots__ = ("_launch", "_marks", "start")

    def __init__(self, launch: LaunchTimes) -> None:
        self._launch = launch
        self.start: float | None = None
        self._marks: list[tuple[float, Part]] = []

    def begin(self, at: float | None = None) -> None:
        """The load's own work starts (its slot taken, or its job handed to a worker)."""
        self.start = time.perf_counter() if at is None else at

    def mark(self, part: Part, at: float | None = None) -> None:
        """The phase that ends now (or ``at``) was ``part``; it began where the last ended."""
        self._marks.append((time.perf_counter() if at is None else at, part))

    def charge(self, split: TimeSplit, waited_from: float, waited_to: float) -> float:
        """Charge a wait for this load, ``[waited_from, waited_to)``, by what it was doing;
        returns the ms charged to a part other than ``host`` (which ``split`` derives)."""
        # (start, end, part) from the layer's planning on, covering every later moment
        segments: list[tuple[float, float, Part]] = []
        cursor = self._launch.planned
        own = math.inf if self.start is None else self.start
        for a, b in self._launch.slot_waits:
            a, b = max(a, cursor), min(b, own)
            if b > a:
                segments += [(cursor, a, "host"), (a, b, "slot")]
                cursor = b
        if self.start is not None:
            segments.append((cursor, own, "host"))
            cursor = own
            for end, part in self._marks:
                if end > cursor:
                    segments.append((cursor, end, part))
                    cursor = end
        segments.append((cursor, math.inf, "host"))  # not started yet, or delivered: the hops
        charged_s = 0.0
        for a, b, part in segments:
            lo, hi = max(a, waited_from), min(b, waited_to)
            if hi > lo:
                split.charge(part, hi - lo)
                if part != "host":
                    charged_s += hi - lo
        return charged_s * 1000.0
