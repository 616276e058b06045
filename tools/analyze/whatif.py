"""What-if cache simulations: replay a run's expert accesses under other budgets and policies.

The question a run log cannot answer by itself is "what would a different budget or policy
have bought?". ``what_if`` replays the logged accesses (``tools.analyze.whatif_replay``) for every
budget and policy asked for, checks that the replay at the run's own budget and policy
reproduces the logged hits, and bisects for the smallest budget reaching a target hit rate.

Budgets are bytes (``20GiB``, ``11GB``) or a count of experts (``2522``, as ds4's
``--ssd-streaming-cache-experts``), converted to bytes at the largest expert size.

One replay cannot be split (the cache state is sequential), but different budgets and
policies are independent, so long traces replay in worker processes, one per core.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import numpy.typing as npt
import structlog

from moestream.pipeline.foundation.config import parse_budget as parse_run_budget
from moestream.pipeline.foundation.errors import UsageError
from moestream.tools.analyze.whatif_replay import (
    POLICIES,
    AccessTrace,
    ReplayResult,
    next_use_positions,
    replay,
)

__all__ = [
    "WhatIfReport",
    "default_budgets",
    "parse_budget",
    "smallest_budget",
    "what_if",
]

log = structlog.get_logger(__name__)


def parse_budget(text: str, expert_bytes: int) -> int:
    """A budget in bytes from ``20GiB``, ``11GB``, ``512MiB`` or ``2522`` (experts).

    The run's own parser (``pipeline.foundation.config.parse_budget``), resolved the way the run
    resolves it: a count of experts times the largest expert's size.

    Raises:
        UsageError: the text is not a size or a count.
    """
    return parse_run_budget(text).resolve(expert_bytes)


def default_budgets(trace: AccessTrace, run_budget: int | None, points: int = 8) -> list[int]:
    """Budgets to try when none are given: a geometric range up to the working set.

    From one layer's experts (or 1/64 of the working set, whichever is larger) to the
    whole working set, rounded to whole experts, plus the run's own budget.
    """
    unit = trace.max_expert_bytes
    top = max(trace.working_set_bytes(), unit)
    low = min(max(trace.layer_bytes(), top // 64, unit), top)
    grid = np.geomspace(low, top, num=points)
    budgets = {max(1, round(float(b) / unit)) * unit for b in grid}
    if run_budget is not None:
        budgets.add(run_budget)
    return sorted(budgets)


def smallest_budget(
    trace: AccessTrace,
    policy: str,
    target: float,
    results: Iterable[ReplayResult],
    next_use: npt.NDArray[np.int64] | None = None,
    tolerance: float = 0.02,
) -> ReplayResult | None:
    """The smallest budget at which ``policy`` reaches ``target`` hit rate.

    Starts from the replays already made (``results``) and bisects between the largest
    budget below the target and the smallest at or above it, in whole experts, until the
    bracket is within ``tolerance`` of the answer. Assumes the hit rate grows with the
    budget, which holds for LRU and Belady with experts of one size.

    Returns:
        The replay at the smallest budget found, or None if no replay reached the target.
    """
    done = sorted((r for r in results if r.policy == policy), key=lambda r: r.capacity_bytes)
    above = [r for r in done if r.hit_rate >= target]
    if not above:
        return None
    best = above[0]
    below = [r for r in done if r.capacity_bytes < best.capacity_bytes]
    unit = trace.max_expert_bytes
    lo = below[-1].capacity_bytes // unit if below else 0
    hi = best.capacity_bytes // unit
    while hi - lo > max(1, int(hi * tolerance)):
        mid = (lo + hi) // 2
        trial = replay(trace, policy, mid * unit, next_use)
        if trial.hit_rate >= target:
            best, hi = trial, mid
        else:
            lo = mid
    return best


@dataclass(frozen=True, slots=True)
class WhatIfReport:
    """Hit rates per policy per budget, the exactness check and the target budgets.

    Attributes:
        budgets: the budgets replayed, bytes, ascending.
        policies: the policies replayed.
        results: one replay per (policy, budget).
        target: the hit rate asked for.
        smallest: per policy, the replay at the smallest budget reaching ``target``, or
            None when even the largest budget fell short.
        exact: the replay at the run's own budget and policy, when both are known.
        logged_hits: the log's total hits, for comparison with ``exact``.
        first_divergence: first token where ``exact`` and the log disagree, if any.
        expert_unit_bytes: bytes of one expert, the unit of counts in the report.
    """

    budgets: tuple[int, ...]
    policies: tuple[str, ...]
    results: tuple[ReplayResult, ...]
    target: float
    smallest: dict[str, ReplayResult | None]
    exact: ReplayResult | None
    logged_hits: int | None
    first_divergence: int | None
    expert_unit_bytes: int

    def rate(self, policy: str, budget: int) -> float:
        """Hit rate of ``policy`` at ``budget`` (one of ``budgets``)."""
        for result in self.results:
            if result.policy == policy and result.capacity_bytes == budget:
                return result.hit_rate
        raise KeyError((policy, budget))


class _Replayer:
    """Runs replays of one trace, here or in worker processes.

    Replays are independent and CPU-bound (pure Python through ``CacheIndex``), so the
    only way to use more than one core is more processes. Workers are spawned, not forked
    (the parent may hold threads), and get the trace once through their initializer.
    """

    def __init__(self, trace: AccessTrace, jobs: int) -> None:
        self.trace = trace
        self._next_use: npt.NDArray[np.int64] | None = None
        self._pool: ProcessPoolExecutor | None = None
        if jobs > 1:
            self._pool = ProcessPoolExecutor(
                max_workers=jobs, mp_context=multiprocessing.get_context("spawn"),
                initializer=_worker_init, initargs=(trace,))

    def __enter__(self) -> _Replayer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the worker processes, if any."""
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
            self._pool = None

    def _future(self, policy: str) -> npt.NDArray[np.int64] | None:
        if policy != "belady":
            return None
        if self._next_use is None:
            self._next_use = next_use_positions(self.trace.experts)
        return self._next_use

    def replay(self, policy: str, budget: int) -> ReplayResult:
        """One replay, in this process."""
        return replay(self.trace, policy, budget, self._future(policy))

    def smallest_one(self, policy: str, target: float,
                     results: Sequence[ReplayResult]) -> ReplayResult | None:
        """``smallest_budget`` for one policy, in this process."""
        return smallest_budget(self.trace, policy, target, results, self._future(policy))

    def replays(self, tasks: Sequence[tuple[str, int]]) -> list[ReplayResult]:
        """Replay every (policy, budget), in parallel when there are workers."""
        if self._pool is None or len(tasks) < 2:
            return [self.replay(policy, budget) for policy, budget in tasks]
        policies, budgets = zip(*tasks, strict=True)
        return self._gather(self._pool.map(_worker_replay, policies, budgets))

    def smallest(self, policies: Sequence[str], target: float,
                 results: Sequence[ReplayResult]) -> list[ReplayResult | None]:
        """``smallest_budget`` per policy, the policies' bisections in parallel."""
        if self._pool is None or len(policies) < 2:
            return [self.smallest_one(policy, target, results) for policy in policies]
        n = len(policies)
        return self._gather(self._pool.map(_worker_smallest, policies, [target] * n,
                                           [results] * n))

    @staticmethod
    def _gather(outcomes: Iterable[_T]) -> list[_T]:
        try:
            return list(outcomes)
        except BrokenProcessPool as exc:
            raise UsageError(
                "a what-if worker process died (out of memory?): try --jobs 1") from exc


_T = TypeVar("_T")

_WORKER: list[_Replayer] = []
"""Inside a worker process only: that worker's replayer (set by ``_worker_init``)."""


def _worker_init(trace: AccessTrace) -> None:
    # A spawned worker starts with structlog's defaults (print to stdout): keep its events
    # off the parent's report.
    structlog.configure(
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    _WORKER[:] = [_Replayer(trace, jobs=1)]


def _worker_replay(policy: str, budget: int) -> ReplayResult:
    return _WORKER[0].replay(policy, budget)


def _worker_smallest(policy: str, target: float,
                     results: Sequence[ReplayResult]) -> ReplayResult | None:
    return _WORKER[0].smallest_one(policy, target, results)


def _auto_jobs(trace: AccessTrace, tasks: int) -> int:
    """Worker processes worth starting: none for small traces (a spawn costs ~1 s)."""
    if trace.tokens * len(trace.moe_layers) < 50_000:
        return 1
    return max(1, min(os.cpu_count() or 1, tasks))


def what_if(
    trace: AccessTrace,
    budgets: Sequence[int],
    policies: Sequence[str] = POLICIES,
    target: float = 0.8,
    run_budget: int | None = None,
    run_policy: str | None = None,
    jobs: int | None = None,
) -> WhatIfReport:
    """Replay ``trace`` for every policy and budget, check exactness, find target budgets.

    Args:
        trace: the accesses.
        budgets: capacities in bytes.
        policies: names among ``POLICIES``.
        target: the hit rate whose smallest budget is sought, in (0, 1].
        run_budget: the run's budget, for the exactness check.
        run_policy: the run's policy, for the exactness check.
        jobs: worker processes; None picks from the trace size and the CPU count.

    Raises:
        UsageError: unknown policy, target outside (0, 1], no budgets, or jobs < 1.
    """
    _check(policies, target, budgets, jobs)
    ordered = sorted(set(budgets))
    tasks = [(policy, budget) for policy in policies for budget in ordered]
    check = run_budget is not None and run_policy in ("lru", "freq")
    if check and (run_policy, run_budget) not in tasks:
        tasks.append((str(run_policy), int(run_budget or 0)))
    workers = _auto_jobs(trace, len(tasks)) if jobs is None else jobs
    log.info("what_if_start", tokens=trace.tokens, replays=len(tasks), jobs=workers)
    with _Replayer(trace, workers) as replayer:
        done = replayer.replays(tasks)
        results = [r for r in done if r.policy in policies and r.capacity_bytes in ordered]
        for result in results:
            log.info("what_if_replay", policy=result.policy, budget_bytes=result.capacity_bytes,
                     hit_rate=round(result.hit_rate, 4))
        smallest = dict(zip(policies, replayer.smallest(policies, target, results),
                            strict=True))
    exact = None
    divergence = None
    logged = trace.logged_hits
    logged_total = int(np.nansum(logged)) if logged.size and not np.isnan(logged).all() else None
    if check:
        exact = next(r for r in done if r.policy == run_policy and r.capacity_bytes == run_budget)
        if logged_total is not None:
            differs = np.flatnonzero(~np.isnan(logged) & (exact.token_hits != logged))
            divergence = int(differs[0]) if differs.size else None
    return WhatIfReport(
        budgets=tuple(ordered),
        policies=tuple(policies),
        results=tuple(results),
        target=target,
        smallest=smallest,
        exact=exact,
        logged_hits=logged_total,
        first_divergence=divergence,
        expert_unit_bytes=trace.max_expert_bytes,
    )


def _check(policies: Sequence[str], target: float, budgets: Sequence[int],
           jobs: int | None) -> None:
    """``what_if``'s arguments, refused with the option they came from."""
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise UsageError(f"unknown policy {unknown[0]!r} (expected one of {', '.join(POLICIES)})")
    if not 0 < target <= 1:
        raise UsageError(f"--target must be in (0, 1], got {target}")
    if not budgets:
        raise UsageError("no budgets to replay")
    if jobs is not None and jobs < 1:
        raise UsageError(f"--jobs must be >= 1, got {jobs}")
