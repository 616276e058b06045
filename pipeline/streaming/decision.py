"""The residency controller's decision: what it reads of the machine, and the mode those
readings call for, with hysteresis and a minimum dwell so it never flaps (the controller,
``streaming.controller``, samples and switches). See the controller's docstring for why
the decision uses available RAM alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

from moestream.pipeline.foundation.machine import read_machine
from moestream.pipeline.foundation.table import ExpertTable

__all__ = [
    "GIB",
    "ControllerReadings",
    "MachineSampler",
    "Mode",
    "ModeDecider",
    "Sampler",
    "Thresholds",
    "default_margin",
]

Mode = Literal["direct", "resident"]
GIB = 1 << 30


def default_margin(ram_total_bytes: int) -> int:
    """The safety margin when none is given: max(2 GiB, 5% of RAM)."""
    return max(2 * GIB, ram_total_bytes // 20)


@dataclass(frozen=True, slots=True)
class ControllerReadings:
    """What a decision is based on (logged with every decision and switch)."""

    ram_available_bytes: int
    ram_total_bytes: int
    model_bytes: int
    model_resident_bytes: int
    pinned_bytes: int
    storage_read_bytes: int
    disk_read_bytes: int

    @property
    def usable_bytes(self) -> int:
        return self.ram_available_bytes


@dataclass(frozen=True, slots=True)
class Thresholds:
    """Enter resident at ``model + enter_margin``; leave below ``model + leave_margin``."""

    enter_margin_bytes: int
    leave_margin_bytes: int
    min_dwell_s: float = 2.0

    def __post_init__(self) -> None:
        if self.leave_margin_bytes > self.enter_margin_bytes:
            raise ValueError("the leave threshold must not be above the enter threshold")


class ModeDecider:
    """Pure decision logic with hysteresis and dwell; fed readings and a clock.

    Args:
        thresholds: enter/leave margins and dwell.
        initial: the mode to start in.
        now: the time of the initial mode (seconds, any monotonic clock).
    """

    def __init__(self, thresholds: Thresholds, initial: Mode, now: float) -> None:
        self.thresholds = thresholds
        self.mode: Mode = initial
        self._since = now

    def decide(self, r: ControllerReadings, now: float) -> tuple[Mode, str]:
        """The mode to be in now and the reason, in words."""
        th = self.thresholds
        usable = r.usable_bytes
        enter_at = r.model_bytes + th.enter_margin_bytes
        leave_at = r.model_bytes + th.leave_margin_bytes
        dwelt = now - self._since >= th.min_dwell_s
        if self.mode == "direct":
            if usable >= enter_at and dwelt:
                return self._switch("resident", now), (
                    f"usable RAM {usable} >= model + enter margin {enter_at}"
                )
            return "direct", f"usable RAM {usable} < model + enter margin {enter_at}" if (
                usable < enter_at) else "dwell time not yet passed"
        if usable < r.model_bytes:
            return self._switch("direct", now), (
                f"pressure: usable RAM {usable} < model {r.model_bytes}"
            )
        if usable < leave_at and dwelt:
            return self._switch("direct", now), (
                f"usable RAM {usable} < model + leave margin {leave_at}"
            )
        return "resident", f"usable RAM {usable} >= model + leave margin {leave_at}"

    def _switch(self, mode: Mode, now: float) -> Mode:
        self.mode = mode
        self._since = now
        return mode


class Sampler(Protocol):
    """Produces readings; tests feed their own. ``full`` also counts resident pages."""

    def __call__(self, full: bool) -> ControllerReadings: ...


class MachineSampler:
    """Readings from psutil, getrusage (storage reads) and cachestat (or mincore), capped by
    ``--ram-limit``.

    Args:
        table: the model (its path and size).
        pinned_bytes: how many model bytes we hold page-locked right now.
        ram_limit: the RAM the controller may believe in, at most.

    Calling it with ``full`` also counts the model's resident bytes and reads the system's
    disk counters (run off the loop); a quick reading (the token boundaries') carries the
    last full reading's disk counter (at most 2 s old under the controller's watch): only
    decisions and switches log it, and reading it costs twice the rest.
    """

    def __init__(
        self,
        table: ExpertTable,
        pinned_bytes: Callable[[], int],
        ram_limit: int | None,
    ) -> None:
        self._table = table
        self._pinned = pinned_bytes
        self._limit = ram_limit
        self._resident = -1
        self._disk_read = -1  # the system's disk reads at the last full reading

    def __call__(self, full: bool) -> ControllerReadings:
        disks = full or self._disk_read < 0
        m = read_machine(disks=disks)
        if disks:
            self._disk_read = m.disk_read_bytes
        total, available = m.ram_total_bytes, m.ram_available_bytes
        if self._limit is not None and self._limit < total:
            available = max(0, available - (total - self._limit))
            total = self._limit
        pinned = self._pinned()
        if pinned >= self._table.file_bytes:
            self._resident = pinned  # all page-locked: resident, no need to ask mincore
        elif full or self._resident < 0:
            from moestream.stages.residency import file_ranges, resident_bytes_of

            # a count: cachestat where the kernel has it (no page map of a 40 GB file)
            files = self._table.files
            self._resident = resident_bytes_of(files, file_ranges(files))[0]
        return ControllerReadings(
            ram_available_bytes=available,
            ram_total_bytes=total,
            model_bytes=self._table.file_bytes,
            model_resident_bytes=self._resident,
            pinned_bytes=pinned,
            storage_read_bytes=m.process_read_bytes,
            disk_read_bytes=self._disk_read,
        )
