"""What the streamer's loads are made of: a layer in flight (``LayerLoad``), one expert's
job from read to delivery (``LoadJob``), a registered miss's copies (``MappedCopies``), the
stages' busy times, and the I/O modes.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, Protocol

from moestream.gpu.backend import Stream
from moestream.gpu.cache.store import Entry, LayerPlan
from moestream.pipeline.foundation.timesplit import LaunchTimes, LoadPhases
from moestream.pipeline.streaming.arrivals import Arrivals
from moestream.stages.layout import ExpertLayout
from moestream.stages.staging import StagingSlot

__all__ = ["IOMode", "JobMode", "LayerLoad", "LoadJob", "MappedCopies", "StageTimes", "WarmGate"]


class WarmGate(Protocol):
    """Something that reads in the background and yields to decode (a ``WarmEngine``)."""

    def pause(self) -> None: ...

    def resume(self) -> None: ...


IOMode = Literal["direct", "resident"]
"""The streamer's I/O mode: O_DIRECT reads through staging, or copies from the mapping."""
JobMode = Literal["direct", "resident", "tier"]
"""How one expert is read: O_DIRECT, from the mapping, or buffered with pages kept."""


@dataclass(slots=True)
class StageTimes:
    """Busy milliseconds per stage, summed over workers (may exceed wall time)."""

    read_ms: float = 0.0
    stage_ms: float = 0.0
    upload_ms: float = 0.0
    install_ms: float = 0.0

    def add(self, other: StageTimes) -> None:
        self.read_ms += other.read_ms
        self.stage_ms += other.stage_ms
        self.upload_ms += other.upload_ms
        self.install_ms += other.install_ms


@dataclass(slots=True)
class LayerLoad:
    """A layer in flight: its plan, and a queue yielding misses as their uploads are queued.

    ``phases``: what each miss's load did over time, by key, so that a wait for one is
    charged to its read, upload or slot (``pipeline.foundation.timesplit``); ``launch``: the launch
    they waited behind.
    """

    plan: LayerPlan
    arrived: Arrivals[tuple[Entry, BaseException | None]] | None = None
    launcher: asyncio.Task[None] | None = None
    pending: int = 0
    launched: int = 0
    delivered: int = 0
    gate: WarmGate | None = None
    prefetch: bool = False
    launch: LaunchTimes | None = None
    phases: dict[tuple[int, int], LoadPhases] = field(default_factory=dict)


class MappedCopies(NamedTuple):
    """A registered miss's copies, computed once per expert and mapping, for the path the
    streamer takes: for the gather (which reads across windows) its launch rows, one per
    range (``gather_rows``); for the copy engines (device offset, mapping address,
    bytes), one per window piece (a copy may not span two registrations); and for the
    copy engines the (device offset, bytes) ranges its install digest reads."""

    rows: list[int]
    copies: list[tuple[int, int, int]]
    ranges: list[tuple[int, int]]


@dataclass(slots=True, eq=False)
class LoadJob:
    """One expert being loaded; ``remaining`` chunks count down on worker threads.

    ``reuse_wait_s``: the longest any chunk waited for the slot's last upload to finish.
    """

    entry: Entry
    layout: ExpertLayout
    stream: Stream
    load: LayerLoad
    mode: JobMode
    phases: LoadPhases
    slot: StagingSlot | None = None
    remaining: int = 0
    reuse_wait_s: float = 0.0
    error: BaseException | None = None
    digest_row: int = -1
    digest_results: Any = None
    lock: threading.Lock = field(default_factory=threading.Lock)

