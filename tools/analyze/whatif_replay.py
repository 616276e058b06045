"""Replay a run's expert accesses through the live cache's ``CacheIndex``: the simulator.

The accesses of a run log (``AccessTrace``) go through the same ``CacheIndex`` the live
cache uses, one ``access_layer`` per token and MoE layer, so a replay needs no GPU or model
file and is exact: at the run's own budget and policy it reproduces the logged hit count
token by token (``tools.analyze.whatif`` checks and reports this). Belady's rule (evict the key used
again farthest in the future) is the ceiling: it runs through the same ``CacheIndex`` as an
``EvictionPolicy`` that knows the future (``BeladyPolicy``, fed by ``next_use_positions``),
so its admission and per-layer protection rules are the live cache's own, and for experts of
one size it is the best any policy under those rules can do.

A replay is pure Python through ``CacheIndex``, about 8 us per layer visit for LRU and 10 for
Belady on the 2-core development machine (40-45 s for 100,000 tokens x 43 layers), and one
replay cannot be split: the cache state is sequential.
"""

from __future__ import annotations

import heapq
from collections.abc import Container, Iterable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import structlog

from moestream.gpu.cache.policy import CacheIndex, EvictionPolicy, ExpertKey, make_policy
from moestream.pipeline.foundation.errors import TraceError, UsageError
from moestream.pipeline.runlog.records import RunLog

__all__ = [
    "NEVER",
    "POLICIES",
    "AccessTrace",
    "BeladyPolicy",
    "ReplayResult",
    "next_use_positions",
    "replay",
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
            TraceError: the log has no ``run_start`` (no expert sizes), an expert size that
                is not positive (budgets are counted in experts), or no expert lists.
        """
        header = run.header
        if header is None or not header.moe_layers:
            raise TraceError(f"{run.path}: no run_start with moe_layers: nothing to replay")
        if len(header.expert_bytes) != len(header.moe_layers):
            raise TraceError(f"{run.path}: expert_bytes and moe_layers differ in length")
        for layer, size in zip(header.moe_layers, header.expert_bytes, strict=True):
            if size <= 0:
                raise TraceError(f"{run.path}: run_start gives layer {layer} expert_bytes "
                                 f"{size}: an expert's size must be positive")
        experts = run.tokens.experts
        if experts.shape[0] != len(run.tokens):
            raise ValueError(f"{run.path}: read without its expert ids: a replay needs "
                             "read_log(path, experts=True)")
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

    def touch_all(self, keys: Iterable[ExpertKey]) -> None:
        """Each of ``keys``, all held, was used, in order."""
        for key in keys:
            self._file(key)

    def remove(self, key: ExpertKey) -> None:
        """A key left the cache."""
        del self._stamp[key]
        del self._next[key]

    def victim(self, protected: Container[ExpertKey]) -> ExpertKey | None:
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


_DENSE_IDS = 4096  # ids below this (any model's) get a key each; above, only those used


def _key_rows(trace: AccessTrace) -> list[dict[int, ExpertKey]]:
    """Per MoE layer position, the cache key of each expert id: for every id up to the
    largest when that is a model's count, else for the ids used only, so an id of
    2**31 - 1 in a log costs one key, not two billion."""
    top = int(trace.experts.max(initial=-1)) + 1
    rows = []
    for pos, layer in enumerate(trace.moe_layers):
        ids = (range(top) if top <= _DENSE_IDS
               else [e for e in np.unique(trace.experts[:, pos, :]).tolist() if e >= 0])
        rows.append({e: (layer, e) for e in ids})
    return rows


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
    token_hits = np.zeros(trace.tokens, dtype=np.int32)
    log.debug("replay_start", policy=policy, capacity_bytes=capacity_bytes, tokens=trace.tokens)
    hits, misses, evictions = _run_tokens(trace, index, belady, next_use, token_hits)
    log.debug("replay_done", policy=policy, capacity_bytes=capacity_bytes, hits=hits)
    return ReplayResult(policy, capacity_bytes, hits, misses, evictions, token_hits)


def _run_tokens(trace: AccessTrace, index: CacheIndex, belady: BeladyPolicy | None,
                next_use: npt.NDArray[np.int64] | None,
                token_hits: npt.NDArray[np.int32]) -> tuple[int, int, int]:
    """Every token's accesses through ``index``, in order; fills ``token_hits`` and returns
    the hits, misses and evictions. This loop is the replay's cost: it walks Python lists
    (cheaper per element than numpy scalars), converted a chunk of tokens at a time so a
    long trace's lists stay small.

    Raises:
        TraceError: an expert list repeats an id.
    """
    key_rows = _key_rows(trace)
    width = trace.experts.shape[2]
    size_rows = [(size,) * width for size in trace.expert_bytes]
    padded = trace.padded
    hits = misses = evictions = 0
    token = 0
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
    return hits, misses, evictions
