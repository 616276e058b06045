"""What-if cache simulations: replay a run's expert accesses under other budgets and policies.

The question a run log cannot answer by itself is "what would a different budget or policy
have bought?". Replaying the logged accesses through the same ``CacheIndex`` the live cache
uses answers it without a GPU or a model file, and exactly: at the run's own budget and
policy the replay reproduces the logged hit count token by token, which this module checks
and reports. Belady's rule (evict the key used again farthest in the future) is the ceiling:
it runs through the same ``CacheIndex`` as an ``EvictionPolicy`` that knows the future, so
its admission and per-layer protection rules are the live cache's own, and for experts of
one size it is the best any policy under those rules can do.

Budgets are bytes (``20GiB``, ``11GB``) or a count of experts (``2522``, as ds4's
``--ssd-streaming-cache-experts``), converted to bytes at the largest expert size.

A replay is pure Python through ``CacheIndex``, about 8 us per layer visit for LRU and 10 for
Belady on the 2-core development machine (40-45 s for 100,000 tokens x 43 layers), and one
replay cannot be split: the cache state is sequential. Different budgets and policies are
independent, so long traces replay in worker processes, one per core.
"""

from __future__ import annotations

import heapq
import logging
import multiprocessing
import os
import sys
from collections.abc import Collection, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import numpy.typing as npt
import structlog

from gpu.policy import CacheIndex, EvictionPolicy, ExpertKey, make_policy
from pipeline.config import parse_budget as parse_run_budget
from pipeline.errors import TraceError, UsageError
from tools.logread import RunLog

__all__ = [
    "POLICIES",
    "AccessTrace",
    "BeladyPolicy",
    "ReplayResult",
    "WhatIfReport",
    "default_budgets",
    "next_use_positions",
    "parse_budget",
    "replay",
    "smallest_budget",
    "what_if",
]

log = structlog.get_logger(__name__)

POLICIES = ("lru", "freq", "belady")
"""Policies the simulator replays: the two live ones and the Belady ceiling."""

NEVER = np.iinfo(np.int64).max
"""Next-use position of an access whose key is never used again."""

_CHUNK_TOKENS = 1024  # tokens converted to Python lists at a time: bounds memory at 100k tokens


@dataclass(frozen=True, slots=True)
class AccessTrace:
    """The expert accesses of a run, as the cache saw them.

    Attributes:
        moe_layers: model layer index per MoE layer position.
        expert_bytes: bytes of one expert per MoE layer position.
        experts: ``(tokens, layers, width)`` expert ids in lookup order, -1 padded.
        logged_hits: per-token hits as the log recorded them (NaN where absent).
    """

    moe_layers: tuple[int, ...]
    expert_bytes: tuple[int, ...]
    experts: npt.NDArray[np.int32]
    logged_hits: npt.NDArray[np.float64]

    @classmethod
    def from_log(cls, run: RunLog) -> AccessTrace:
        """Take the accesses of a run log.

        Raises:
            TraceError: the log has no ``run_start`` (no expert sizes) or no expert lists.
        """
        header = run.header
        if header is None or not header.moe_layers:
            raise TraceError(f"{run.path}: no run_start with moe_layers: nothing to replay")
        if len(header.expert_bytes) != len(header.moe_layers):
            raise TraceError(f"{run.path}: expert_bytes and moe_layers differ in length")
        experts = run.tokens.experts
        if experts.shape[0] and not (experts >= 0).any():
            raise TraceError(f"{run.path}: token lines carry no expert lists")
        return cls(header.moe_layers, header.expert_bytes, experts, run.tokens["hits"])

    @property
    def tokens(self) -> int:
        """Tokens in the trace."""
        return int(self.experts.shape[0])

    @property
    def accesses(self) -> int:
        """Expert uses in the trace (hits + misses of any replay)."""
        return int((self.experts >= 0).sum())

    @property
    def padded(self) -> bool:
        """True if some layer used fewer experts than the array's width."""
        return bool((self.experts < 0).any())

    @property
    def max_expert_bytes(self) -> int:
        """Bytes of the largest expert: the unit of a budget given in experts."""
        return max(self.expert_bytes)

    def working_set_bytes(self) -> int:
        """Bytes of all distinct experts used: a budget at which only first uses miss."""
        total = 0
        for pos, size in enumerate(self.expert_bytes):
            ids = self.experts[:, pos, :]
            total += int(np.unique(ids[ids >= 0]).size) * size
        return total

    def layer_bytes(self) -> int:
        """Bytes of the largest single layer's experts: below this, layers evict themselves."""
        width = self.experts.shape[2] if self.experts.ndim == 3 else 0
        return max((width * size for size in self.expert_bytes), default=0)


def next_use_positions(experts: npt.NDArray[np.int32]) -> npt.NDArray[np.int64]:
    """For every access, the position of the next access to the same (layer, expert).

    Positions count layer visits: token ``t`` at MoE layer position ``l`` is
    ``t * layers + l``. A key lives in one layer only, so its next use is the next token
    whose list for that layer contains it.

    Args:
        experts: ``(tokens, layers, width)`` expert ids, -1 padded.

    Returns:
        int64 array of the same shape; ``NEVER`` where the key is not used again or the
        slot is padding.
    """
    tokens, layers, width = experts.shape
    result = np.full(experts.shape, NEVER, dtype=np.int64)
    token_of = np.repeat(np.arange(tokens, dtype=np.int64), width)
    for pos in range(layers):
        ids = experts[:, pos, :].reshape(-1).astype(np.int64)
        valid = ids >= 0
        flat = np.flatnonzero(valid)
        # Sort the layer's accesses by (expert, token); a key's next use follows it.
        order = flat[np.lexsort((token_of[flat], ids[flat]))]
        same = ids[order[1:]] == ids[order[:-1]]
        nxt = np.full(order.shape, NEVER, dtype=np.int64)
        nxt[:-1][same] = token_of[order[1:]][same] * layers + pos
        column = result[:, pos, :].reshape(-1)
        column[order] = nxt
        result[:, pos, :] = column.reshape(tokens, width)
    return result


class BeladyPolicy:
    """Evicts the unprotected key whose next use is farthest away (Belady's MIN).

    It knows the future through ``upcoming``: before each ``CacheIndex.access_layer`` the
    replay sets it to the next-use position of each key of that layer, and ``touch`` and
    ``insert`` file the key under it. Keys sit in a max-heap with lazy deletion; a key's
    older entries go stale when it is used again or removed, and the heap is rebuilt when
    stale entries outnumber live ones (they would otherwise sink and pile up, because a
    key's next use only moves later).
    """

    __slots__ = ("_heap", "_next", "_seq", "_stamp", "upcoming")

    def __init__(self) -> None:
        self.upcoming: dict[ExpertKey, int] = {}
        self._heap: list[tuple[int, int, ExpertKey]] = []
        self._stamp: dict[ExpertKey, int] = {}
        self._next: dict[ExpertKey, int] = {}
        self._seq = 0

    def _file(self, key: ExpertKey) -> None:
        self._seq += 1
        nxt = self.upcoming[key]
        self._stamp[key] = self._seq
        self._next[key] = nxt
        heapq.heappush(self._heap, (-nxt, self._seq, key))
        if len(self._heap) > 4 * len(self._stamp) + 1024:
            self._heap = [(-self._next[k], s, k) for k, s in self._stamp.items()]
            heapq.heapify(self._heap)

    def insert(self, key: ExpertKey) -> None:
        """A key was admitted at the current access."""
        self._file(key)

    def touch(self, key: ExpertKey) -> None:
        """A held key was used at the current access."""
        self._file(key)

    def remove(self, key: ExpertKey) -> None:
        """A key left the cache."""
        del self._stamp[key]
        del self._next[key]

    def victim(self, protected: Collection[ExpertKey]) -> ExpertKey | None:
        """The held key used again farthest in the future, never one in ``protected``."""
        skipped: list[tuple[int, int, ExpertKey]] = []
        found: ExpertKey | None = None
        heap = self._heap
        while heap:
            _, seq, key = heap[0]
            if self._stamp.get(key) != seq:
                heapq.heappop(heap)
                continue
            if key in protected:
                skipped.append(heapq.heappop(heap))
                continue
            found = key
            break
        for entry in skipped:
            heapq.heappush(heap, entry)
        return found

    def advance_token(self) -> None:
        """Belady needs no notion of time beyond positions."""


@dataclass(frozen=True, slots=True)
class ReplayResult:
    """Outcome of one replay.

    Attributes:
        policy: ``lru``, ``freq`` or ``belady``.
        capacity_bytes: the CacheIndex capacity replayed.
        hits: total hits.
        misses: total misses.
        evictions: total evictions.
        token_hits: hits per token.
    """

    policy: str
    capacity_bytes: int
    hits: int
    misses: int
    evictions: int
    token_hits: npt.NDArray[np.int32]

    @property
    def hit_rate(self) -> float:
        """hits / (hits + misses); 0.0 for an empty trace."""
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


def _make(policy: str) -> EvictionPolicy:
    if policy == "belady":
        return BeladyPolicy()
    try:
        return make_policy(policy)
    except ValueError as exc:
        raise UsageError(f"{exc}; the simulator also knows 'belady'") from exc


def replay(
    trace: AccessTrace,
    policy: str,
    capacity_bytes: int,
    next_use: npt.NDArray[np.int64] | None = None,
) -> ReplayResult:
    """Replay every token's accesses through a ``CacheIndex``, as the live cache does.

    Per token, each MoE layer in order is one ``access_layer`` call with keys
    ``(moe_layers[l], expert)`` and sizes ``expert_bytes[l]``; ``advance_token`` follows.

    Args:
        trace: the accesses.
        policy: ``lru``, ``freq`` or ``belady``.
        capacity_bytes: the index capacity.
        next_use: ``next_use_positions(trace.experts)``, to share it between Belady
            replays; computed when needed and not given.

    Raises:
        TraceError: an expert list repeats an id (the live cache would have refused it).
        UsageError: unknown policy or negative capacity.
    """
    if capacity_bytes < 0:
        raise UsageError(f"budget must be >= 0 bytes, got {capacity_bytes}")
    engine = _make(policy)
    belady = engine if isinstance(engine, BeladyPolicy) else None
    if belady is not None and next_use is None:
        next_use = next_use_positions(trace.experts)
    index = CacheIndex(capacity_bytes, engine)
    n_ids = int(trace.experts.max(initial=-1)) + 1
    key_rows = [[(layer, e) for e in range(n_ids)] for layer in trace.moe_layers]
    width = trace.experts.shape[2]
    size_rows = [(size,) * width for size in trace.expert_bytes]
    padded = trace.padded
    token_hits = np.zeros(trace.tokens, dtype=np.int32)
    hits = misses = evictions = 0
    token = 0
    log.debug("replay_start", policy=policy, capacity_bytes=capacity_bytes, tokens=trace.tokens)
    try:
        for start in range(0, trace.tokens, _CHUNK_TOKENS):
            block = trace.experts[start : start + _CHUNK_TOKENS].tolist()
            nxt_block = (
                next_use[start : start + _CHUNK_TOKENS].tolist() if next_use is not None else None
            )
            for offset, layers in enumerate(block):
                token = start + offset
                before = hits
                for pos, ids in enumerate(layers):
                    if padded:
                        ids = [e for e in ids if e >= 0]
                    row = key_rows[pos]
                    keys = [row[e] for e in ids]
                    if belady is not None and nxt_block is not None:
                        belady.upcoming = dict(zip(keys, nxt_block[offset][pos], strict=False))
                    sizes = size_rows[pos]
                    outcome = index.access_layer(keys, sizes[: len(keys)] if padded else sizes)
                    hits += len(outcome.hits)
                    misses += len(outcome.misses)
                    evictions += len(outcome.evicted)
                token_hits[token] = hits - before
                index.advance_token()
    except ValueError as exc:
        raise TraceError(f"token {token}: expert list the cache cannot take ({exc})") from exc
    log.debug("replay_done", policy=policy, capacity_bytes=capacity_bytes, hits=hits)
    return ReplayResult(policy, capacity_bytes, hits, misses, evictions, token_hits)


def parse_budget(text: str, expert_bytes: int) -> int:
    """A budget in bytes from ``20GiB``, ``11GB``, ``512MiB`` or ``2522`` (experts).

    The run's own parser (``pipeline.config.parse_budget``), resolved the way the run
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
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise UsageError(f"unknown policy {unknown[0]!r} (expected one of {', '.join(POLICIES)})")
    if not 0 < target <= 1:
        raise UsageError(f"--target must be in (0, 1], got {target}")
    if not budgets:
        raise UsageError("no budgets to replay")
    if jobs is not None and jobs < 1:
        raise UsageError(f"--jobs must be >= 1, got {jobs}")
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
