"""The residency controller: direct-I/O or page-cache-resident mode, chosen from live RAM.

When RAM holds the whole model, O_DIRECT ties decode to SSD speed while RAM sits idle; when
RAM is short, O_DIRECT is right and leaves memory to other processes. The controller samples
the machine on a background task (and at token boundaries) and switches while running:

- resident when the RAM it may use covers the model plus a safety margin, direct otherwise;
- separate enter and leave thresholds and a minimum dwell time, so it never flaps, except
  that real pressure (RAM below the model itself) leaves at once, within one sample;
- entering resident maps the model for zero-copy uploads and warms the rest of it in the
  background, throttled; leaving unregisters, unmaps, then drops our pages.

"RAM it may use" is the kernel's available RAM. The model's cached pages are already inside
it, and so, measured on the H200 machine, are the pages we registered with CUDA: the kernel
still counts those file pages as reclaimable though they are pinned. Adding resident or
pinned bytes on top would count them twice and keep us resident under a balloon until the
machine runs out; so the readings log resident and pinned bytes, and the decision uses
available RAM alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import structlog

from moestream.pipeline.foundation.config import StreamConfig
from moestream.pipeline.foundation.machine import ram_available_bytes
from moestream.pipeline.foundation.table import ExpertTable
from moestream.pipeline.runlog.write import RunLog
from moestream.pipeline.streaming.decision import (
    ControllerReadings,
    MachineSampler,
    Mode,
    ModeDecider,
    Sampler,
    Thresholds,
    default_margin,
)

__all__ = [
    "ControllerReadings",
    "MachineSampler",
    "ModeController",
    "ModeDecider",
    "Sampler",
    "Thresholds",
    "default_margin",
]

_log = structlog.get_logger("moestream.controller")
_FULL_SAMPLE_S = 2.0
"""How often the background task also counts the model's resident pages (mincore)."""
_REGISTER_EVERY = 2 << 30
"""Warm-up bytes between two passes registering the windows that became resident."""
WARM_QUIET_S = 0.05
"""How long decode must load nothing before the run's warm-up reads on: a token's layers
load a few milliseconds apart, and the pieces the warm-up starts in such a gap (up to 16 x
8 MiB) would hold the disk when the next layer's misses come."""


class ModeController:
    """Chooses and switches the streamer's I/O mode while the run goes on.

    Args:
        config: ``mode``, ``sample_ms``, ``ram_limit`` and ``margin_bytes`` matter here.
        table: the model.
        streamer: whose mode is switched (``set_mode``, ``pinned_bytes``).
        runlog: where decisions and switches are logged.
        sampler: readings source (default: the machine).
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(
        self,
        config: StreamConfig,
        table: ExpertTable,
        streamer: object,
        runlog: RunLog,
        *,
        sampler: Sampler | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._cfg = config
        self._table = table
        self._streamer = streamer
        self._runlog = runlog
        self._clock = clock
        self._sampler: Sampler = sampler or MachineSampler(
            table, lambda: int(getattr(streamer, "pinned_bytes", 0)), config.ram_limit
        )
        self._decider: ModeDecider | None = None
        self._task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        self.switches = 0
        self.tokens_in_mode: dict[str, int] = {}
        self.last_ram_available = 0
        self.token = 0
        self._last_sample = float("-inf")
        self._warm_task: asyncio.Task[None] | None = None
        self._warm_engine: Any = None

    @property
    def forced(self) -> bool:
        return self._cfg.mode != "auto"

    async def start(self) -> None:
        """Choose the initial mode and start sampling (auto mode only)."""
        readings = self._sampler(True)
        self.last_ram_available = readings.ram_available_bytes
        margin = self._cfg.margin_bytes or default_margin(readings.ram_total_bytes)
        thresholds = Thresholds(margin, margin // 2, self._cfg.dwell_s)
        if self.forced:
            initial: Mode = "resident" if self._cfg.mode == "resident" else "direct"
            reason = f"forced by --mode {self._cfg.mode}"
        else:
            enough = readings.usable_bytes >= readings.model_bytes + thresholds.enter_margin_bytes
            initial = "resident" if enough else "direct"
            reason = "initial: usable RAM " + (
                ">=" if enough else "<") + " model + enter margin"
        self._decider = ModeDecider(thresholds, initial, self._clock() - thresholds.min_dwell_s)
        self._runlog.emit("controller_decision", mode=initial, reason=reason,
                          readings=asdict(readings), token=0)
        await self._apply(initial, reason, readings, initial_switch=True)
        if not self.forced:
            self._task = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        """Sample RAM every period; count resident pages (mincore) only every
        ``_FULL_SAMPLE_S``: the decision needs available RAM alone (the resident
        pages are logged, not decided on), and mincore over a 34 GB model takes ~80 ms of
        a core each time."""
        period = self._cfg.sample_ms / 1000.0
        last_full = self._clock()
        while True:
            await asyncio.sleep(period)
            now = self._clock()
            full = now - last_full >= _FULL_SAMPLE_S
            if full:
                last_full = now
            await self.sample(full=full)

    async def sample(self, *, full: bool = False) -> None:
        """Take a reading and act on it (auto mode); ``full`` runs mincore off the loop."""
        if self._decider is None or self.forced:
            return
        async with self._lock:
            if full:
                loop = asyncio.get_running_loop()
                readings = await loop.run_in_executor(None, self._sampler, True)
            else:
                readings = self._sampler(False)
            self._last_sample = self._clock()
            self.last_ram_available = readings.ram_available_bytes
            before = self._decider.mode
            mode, reason = self._decider.decide(readings, self._clock())
            if mode != before:
                await self._apply(mode, reason, readings)
            if mode == "direct":
                await self._size_tier(readings)

    async def _apply(
        self, mode: Mode, reason: str, readings: ControllerReadings, *, initial_switch: bool = False
    ) -> None:
        """Switch the streamer; resident also starts the background warm-up, direct stops it
        first (then the streamer unregisters, unmaps and drops the pages)."""
        t0 = time.perf_counter()
        if mode == "direct":
            await self._stop_warmup()
        set_mode = getattr(self._streamer, "set_mode", None)
        if set_mode is not None:
            result = set_mode(mode)
            if asyncio.iscoroutine(result):
                await result
        if mode == "resident" and self._cfg.warmup:
            await self._start_warmup()
        took_ms = (time.perf_counter() - t0) * 1000.0
        if not initial_switch:
            self.switches += 1
            _log.info("mode_switch", to=mode, reason=reason, took_ms=round(took_ms, 1))
            self._runlog.emit(
                "mode_switch", to=mode, reason=reason, readings=asdict(readings),
                token=self.token, took_ms=round(took_ms, 3),
                **{"from": "direct" if mode == "resident" else "resident"},
            )

    async def at_token(self, token: int) -> None:
        """Token boundary: count the mode; take a RAM-only reading if none, the background
        task's or a boundary's, is a sample period (``sample_ms``) old.

        A quick reading (RAM and this process's reads, not the disks' counters) costs
        ~100 us; at 50+ tokens/s one per token would be a visible share of decode. The
        background task reads every period while the loop is free; a boundary reads only
        where it did not (a loop kept busy), so a reading is never more than about a period
        old either way, and a held token (~0.5 ms of moestream's host time on the dev VM)
        seldom pays for one.
        """
        self.token = token + 1
        mode = getattr(self._streamer, "mode", "direct")
        self.tokens_in_mode[mode] = self.tokens_in_mode.get(mode, 0) + 1
        now = self._clock()
        if now - self._last_sample < self._cfg.sample_ms / 1000.0:
            return
        self._last_sample = now
        if self._lock.locked():
            return  # a switch is under way (a release takes seconds): decode goes on
        if not self.forced:
            await self.sample(full=False)
        else:
            self.last_ram_available = ram_available_bytes()

    async def _size_tier(self, readings: ControllerReadings) -> None:
        """Partial residency: in direct mode, keep as many hot experts' pages as the RAM
        above the margin allows (a host tier, shrunk as available RAM falls)."""
        set_tier = getattr(self._streamer, "set_tier_bytes", None)
        if set_tier is None or self._decider is None:
            return
        target = max(0, readings.ram_available_bytes - self._decider.thresholds.enter_margin_bytes)
        before = int(getattr(self._streamer, "tier_bytes", 0))
        got = await set_tier(target)
        if abs(got - before) > max(before, got) // 20:
            self._runlog.emit("host_tier", bytes=got, target_bytes=target,
                              experts=len(getattr(self._streamer, "tier", ())), token=self.token)

    async def _start_warmup(self) -> None:
        """Warm the model's non-resident pages in the background, after decode's reads."""
        from moestream.stages.residency import Residency, file_ranges
        from moestream.stages.warm import WarmEngine

        if self._warm_task is not None:
            return
        files = self._table.files
        loop = asyncio.get_running_loop()
        missing = await loop.run_in_executor(
            None, lambda: Residency.of_files(files).missing(file_ranges(files)))
        if not missing:
            return
        engine = WarmEngine(files, threads=8, quiet_s=WARM_QUIET_S)
        self._warm_engine = engine
        setattr(self._streamer, "warm_gate", engine)  # noqa: B010  (streamer-like object)
        self._warm_task = loop.create_task(self._warm(engine, missing))

    async def _warm(self, engine: Any, missing: list[Any]) -> None:
        """Warm the missing ranges, registering windows as they become resident.

        Registering 34 GiB took 3.6-4.9 s on the H200 and slows the copies queued meanwhile
        to a quarter; done all at the end, it fell on the first seconds of full-speed
        decode. Done every ``_REGISTER_EVERY`` bytes, it overlaps the warm-up, when decode
        waits on the disk anyway; ``warmup_done`` is logged once the last pass is done.
        """
        total = sum(r.nbytes for r in missing)
        self._runlog.emit("warmup_start", bytes=total, token=self.token)
        register = getattr(self._streamer, "register_resident", None)
        registered = getattr(self._streamer, "registered", None)
        next_at = _REGISTER_EVERY

        def progress(done: int, _total: int) -> None:
            nonlocal next_at
            if register is not None and done >= next_at:
                next_at = done + _REGISTER_EVERY
                register()

        started = time.perf_counter()
        try:
            result = await engine.warm(missing, progress=progress)
            if register is not None and registered is not None:
                # the whole file is resident now: register what is left, and count it in
                # the warm-up, done when the mapping is ready for full-speed decode
                register()
                await registered()
        except asyncio.CancelledError:
            self._runlog.emit("warmup_stopped", token=self.token)
            raise
        seconds = time.perf_counter() - started
        _log.info("warmup_done", bytes=result.bytes_read, seconds=round(seconds, 2))
        self._runlog.emit("warmup_done", bytes=result.bytes_read, seconds=round(seconds, 3),
                          token=self.token)

    async def _stop_warmup(self) -> None:
        task, self._warm_task = self._warm_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        engine, self._warm_engine = self._warm_engine, None
        if engine is not None:
            setattr(self._streamer, "warm_gate", None)  # noqa: B010
            await engine.aclose()

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self._stop_warmup()
