"""The fault matrix: every injectable fault at its stage, one small run each, observed.

Each case decodes a few tokens of a small model on the host backend with one fault plan
(``moestream.pipeline.foundation.faults``) and records, besides the exit status, the
invariants the faults must not break, observed when the run closes its parts:

- every installed expert came from complete, correct bytes: verification (digest compute,
  every consumed expert) found no mismatch, every entry left in the cache is ready (its
  upload completed), and the expert whose load failed is not in the cache; bytes damaged
  on purpose (``corrupt``) are found: at least one mismatch, exit 3 as the CLI gives;
- the accounting is exact: device allocations equal frees after close, the peak of live +
  parked bytes stayed within the budget;
- every staging slot was back in the ring when it closed.

``tests/test_faults.py`` runs every case; ``python -m bench.faultmatrix`` prints them as
the table in ``docs/RELIABILITY.md`` (on the GPU too, with ``--backend cupy``).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from moestream.gpu.cache.store import DeviceCache
from moestream.pipeline.cli.run import RunSummary, run
from moestream.pipeline.foundation.config import Budget, ComputeSpec
from moestream.pipeline.foundation.errors import MoestreamError, VerificationError
from moestream.pipeline.foundation.faults import STAGES, parse_faults
from moestream.pipeline.proxy.config import RunConfig
from moestream.stages.reader import ModelReader
from moestream.stages.staging import StagingRing

__all__ = ["CASES", "CaseResult", "FaultCase", "Observed", "case_config", "observe", "run_case"]


@dataclass(frozen=True, slots=True)
class FaultCase:
    """One fault plan, the I/O mode it runs in, and whether the run must survive it."""

    spec: str
    mode: str
    survives: bool
    outcome: str

    @property
    def kind(self) -> str:
        return self.spec.split("@")[0].split("=")[0]

    @property
    def stage(self) -> str:
        return STAGES[self.kind]

    @property
    def id(self) -> str:
        return f"{self.spec}-{self.mode}"

    @property
    def corrupts(self) -> bool:
        """The fault damages bytes on purpose: verification must find it."""
        return self.kind == "corrupt"


CASES: tuple[FaultCase, ...] = (
    FaultCase("read_eio@300", "direct", True, "retried once, then read"),
    FaultCase("read_eio@300+", "direct", False, "retries exhausted: ReadError, token stopped"),
    FaultCase("short@300", "direct", True, "retried once, then read"),
    FaultCase("short@300+", "direct", False, "retries exhausted: ReadError, token stopped"),
    FaultCase("odirect_einval@300", "direct", True, "buffered reads from then on, logged once"),
    FaultCase("slow_ms=300@100", "direct", True, "one 300 ms latency spike; run completes"),
    FaultCase("slow_ms=5@1+", "direct", True, "every read 5 ms late; run completes"),
    FaultCase("truncate@300", "direct", False, "ModelChangedError, token stopped"),
    FaultCase("replace@300", "direct", False, "ModelChangedError, token stopped"),
    FaultCase("staging_oom@3", "direct", True, "ring keeps 2 of 4 slots, logged"),
    FaultCase("staging_oom@3", "resident", True, "ring keeps 2 of 4 slots, logged"),
    FaultCase("staging_oom@1", "direct", False, "no slot: DeviceMemoryError at start"),
    FaultCase("upload@20", "direct", False, "UploadError after a partial copy, token stopped"),
    FaultCase("upload@20", "resident", False, "UploadError after a partial copy, token stopped"),
    FaultCase("corrupt@5", "direct", False, "a flipped device byte: mismatch, exit 3"),
    FaultCase("corrupt@5", "resident", False, "a flipped device byte: mismatch, exit 3"),
    FaultCase("device_oom@5", "direct", True, "budget shrinks to the bytes held, logged"),
    FaultCase("device_oom@5", "resident", True, "budget shrinks to the bytes held, logged"),
    FaultCase("device_oom@5+", "direct", True, "budget shrinks once; buffers reused after"),
    FaultCase("device_oom@1", "direct", False, "nothing held to shrink to: DeviceMemoryError"),
)
"""The matrix: every kind at its stage; transient ones also persistent; both I/O modes where
the stage runs in both (reads happen only in direct mode)."""


@dataclass(slots=True)
class Observed:
    """What the run's parts looked like when they were closed."""

    n_slots: int = -1
    requested_slots: int = -1
    slots_free_at_close: int = -1
    entries_at_close: list[tuple[int, int]] = field(default_factory=list)
    unready_at_close: int = 0
    device_bytes_at_close: int = 0
    budget_at_close: int = 0
    allocations: int = 0
    frees_after_close: int = 0
    budget_shrinks: int = 0
    read_retries: int = 0


@contextmanager
def observe() -> Iterator[Observed]:
    """Record the ring, cache and reader state at ``close`` (patched on the classes for the
    duration of the block, then restored)."""
    seen = Observed()
    ring_close, cache_close, reader_close = StagingRing.close, DeviceCache.close, ModelReader.close

    def on_ring_close(ring: StagingRing) -> None:
        if seen.n_slots < 0:
            seen.n_slots, seen.slots_free_at_close = ring.n_slots, ring.n_free
            seen.requested_slots = ring.requested_slots
        ring_close(ring)

    def on_cache_close(cache: DeviceCache) -> None:
        entries = cache.entries()
        seen.entries_at_close = [e.key for e in entries]
        seen.unready_at_close = sum(not e.ready for e in entries)
        seen.device_bytes_at_close = cache.device_bytes
        seen.budget_at_close = cache.budget_bytes
        seen.budget_shrinks = cache.counters.budget_shrinks
        cache_close(cache)
        seen.allocations, seen.frees_after_close = cache.pool.allocations, cache.pool.frees

    def on_reader_close(reader: ModelReader) -> None:
        seen.read_retries = max(seen.read_retries, reader.retries)
        reader_close(reader)

    StagingRing.close = on_ring_close  # type: ignore[method-assign, assignment]
    DeviceCache.close = on_cache_close  # type: ignore[method-assign, assignment]
    ModelReader.close = on_reader_close  # type: ignore[method-assign, assignment]
    try:
        yield seen
    finally:
        StagingRing.close = ring_close  # type: ignore[method-assign]
        DeviceCache.close = cache_close  # type: ignore[method-assign]
        ModelReader.close = reader_close  # type: ignore[method-assign]


_FAILED = re.compile(r"layer (\d+) expert (\d+):")


@dataclass(slots=True)
class CaseResult:
    """One case's exit status, totals and observed invariants."""

    case: FaultCase
    exit_code: int
    error: str
    fired: dict[str, int]
    summary: dict[str, Any]
    observed: Observed
    failed_key: tuple[int, int] | None
    seconds: float

    def problems(self) -> list[str]:
        """Broken expectations, in words (empty: the case passed)."""
        s, o = self.summary, self.observed
        out = []
        if (self.exit_code == 0) != self.case.survives:
            out.append(f"exit {self.exit_code} ({self.error or 'ok'}), expected "
                       f"{'success' if self.case.survives else 'a stop'}")
        if not self.fired:
            out.append("the fault never fired")
        if s["mismatches"] and not self.case.corrupts:
            out.append(f"{s['mismatches']} verification mismatches")
        if self.case.corrupts and (not s["mismatches"]
                                   or self.exit_code != VerificationError.exit_code):
            out.append(f"damaged bytes not found: {s['mismatches']} mismatches, "
                       f"exit {self.exit_code}")
        if self.case.survives and not s["verified"]:
            out.append("nothing was verified")
        if o.allocations != o.frees_after_close:
            out.append(f"allocations {o.allocations} != frees {o.frees_after_close}")
        if s["peak_device_bytes"] > s["budget_bytes"]:
            out.append(f"peak {s['peak_device_bytes']} > budget {s['budget_bytes']}")
        if o.device_bytes_at_close > o.budget_at_close:
            out.append(f"held {o.device_bytes_at_close} > budget {o.budget_at_close} at close")
        if o.n_slots >= 0 and o.slots_free_at_close != o.n_slots:
            out.append(f"{o.n_slots - o.slots_free_at_close} staging slots not returned")
        if o.unready_at_close:
            out.append(f"{o.unready_at_close} cache entries never completed their upload")
        if self.failed_key is not None and self.failed_key in o.entries_at_close:
            out.append(f"failed expert {self.failed_key} is in the cache")
        return out

    def row(self) -> dict[str, Any]:
        """A flat, JSON-ready record."""
        return {
            "spec": self.case.spec, "stage": self.case.stage, "mode": self.case.mode,
            "outcome": self.case.outcome, "exit_code": self.exit_code, "error": self.error,
            "fired": self.fired, "tokens": self.summary["tokens"],
            "verified": self.summary["verified"], "mismatches": self.summary["mismatches"],
            "observed": asdict(self.observed), "problems": self.problems(),
            "seconds": round(self.seconds, 3),
        }


def case_config(case: FaultCase, model: Path, tokens: int = 6,
                backend: str = "host") -> RunConfig:
    """The run a case makes: digest compute (every consumed expert verified), a budget of
    12 of the model's experts per cache, four staging slots, four readers."""
    return RunConfig(model=model, tokens=tokens, budget=Budget(experts=12),
                     mode=case.mode,  # type: ignore[arg-type]
                     compute=ComputeSpec("digest"), backend=backend, faults=case.spec,
                     queue_depth=4, staging_slots=4, chunk_bytes=64 << 10)


def run_case(case: FaultCase, model: Path, tokens: int = 6, backend: str = "host") -> CaseResult:
    """Run one case in this process (its own event loop) and observe it."""
    plan = parse_faults(case.spec)
    summary = RunSummary()
    exit_code, error = 0, ""
    failed: tuple[int, int] | None = None
    t0 = time.perf_counter()
    with observe() as seen:
        try:
            asyncio.run(run(case_config(case, model, tokens, backend), faults=plan,
                            summary=summary))
        except MoestreamError as exc:
            exit_code, error = exc.exit_code, str(exc)
            m = _FAILED.match(error)
            failed = (int(m.group(1)), int(m.group(2))) if m else None
    if exit_code == 0 and summary.mismatches:  # as the CLI: the run ends with exit 3
        exit_code = VerificationError.exit_code
        error = f"experts that differ from the file: {summary.mismatches}"
    return CaseResult(case, exit_code, error, dict(plan.fired), summary.as_dict(), seen,
                      failed, time.perf_counter() - t0)
