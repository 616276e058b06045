"""Verification: the bytes compute consumed equal the model file's bytes.

Device kernels digest each expert's three matrices into a per-token results array
(``DigestRows``); once per token the host reads them back and ``Verifier`` compares them
with the file's own digests: those ``tools.make_model`` records in the metadata, or, for any
other file, its digest manifest (``pipeline.foundation.manifest``): the same digests computed on the
host from a separate read of the file, once, off the decode path. Nothing is re-read to
verify.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from moestream.gpu.backend import Event, Kernels
from moestream.gpu.cache.policy import ExpertKey
from moestream.pipeline.foundation.manifest import DigestManifest
from moestream.pipeline.foundation.table import ExpertTable

__all__ = ["DigestRows", "Digests", "Verifier"]


@dataclass(frozen=True, slots=True)
class Digests:
    """Device digests of experts: ``values[i]`` holds the gate, up and down digests of
    ``keys[i]``. An array, not a tuple per matrix: a token compares hundreds of experts
    in a few numpy operations, not microseconds of Python each (verification may cost at
    most 2% of tokens/s)."""

    keys: list[ExpertKey]
    values: npt.NDArray[np.uint64]

    @classmethod
    def none(cls) -> Digests:
        return cls([], np.zeros((0, 3), dtype=np.uint64))

    @classmethod
    def join(cls, parts: Iterable[Digests]) -> Digests:
        parts = [p for p in parts if p.keys]
        if len(parts) == 1:
            return parts[0]
        if not parts:
            return cls.none()
        return cls([k for p in parts for k in p.keys], np.concatenate([p.values for p in parts]))


_NONE = Digests.none()  # shared: nothing can be written into its (0, 3) array
_NONE.values.setflags(write=False)


class _Generation:
    """One results array and the keys whose digests go into it, three rows each."""

    def __init__(self, results: Any) -> None:
        self.results = results
        self.address: int | None = None  # of row 0, once asked for
        self.keys: list[ExpertKey | None] = []  # None: a dropped row, never read
        self.done: list[Event | bool] = []
        self.taken = 0


class DigestRows:
    """Rows of digest sums, handed to loads and read back once their kernels were queued.

    A load reserves three rows when it starts and calls ``complete`` once its digest work
    is queued, or ``drop`` when it failed (its rows are never read, and never hold back the
    rows after them); ``take`` returns only completed digests, so loads still in flight
    (started ahead by prefetch) are read in a later call, never as zeros. Arrays are allocated on
    first use (most warm tokens need none) and dropped once all their rows were taken.

    Args:
        kernels: the backend's kernels (``new_results``, ``read_results``).
        capacity: experts per results array.
    """

    def __init__(self, kernels: Kernels, capacity: int) -> None:
        self._kernels = kernels
        self._capacity = capacity
        self._generations: list[_Generation] = []

    def reserve(self, key: ExpertKey) -> tuple[Any, int]:
        """The results array and the first of three rows for ``key``'s digests."""
        if not self._generations or len(self._generations[-1].keys) >= self._capacity:
            self._generations.append(_Generation(self._kernels.new_results(self._capacity * 3)))
        gen = self._generations[-1]
        gen.keys.append(key)
        gen.done.append(False)
        return gen.results, (len(gen.keys) - 1) * 3

    def address(self, results: Any, row: int) -> int:
        """The device address of ``row`` of ``results`` (a ``gather`` row's digest address),
        from the array's address asked of the kernels once: asking costs microseconds."""
        for gen in self._generations:
            if gen.results is results:
                if gen.address is None:
                    gen.address = self._kernels.results_address(results, 0)
                return gen.address + row * 16
        raise ValueError("not a results array of these rows")

    def complete(self, results: Any, row: int, event: Event | None) -> None:
        """The digest work for the rows at ``row`` is queued; ``event`` follows it."""
        for gen in self._generations:
            if gen.results is results:
                gen.done[row // 3] = event if event is not None else True
                return

    def drop(self, results: Any, row: int) -> None:
        """The load that reserved the rows at ``row`` failed: they are skipped, unread."""
        for gen in self._generations:
            if gen.results is results:
                gen.keys[row // 3] = None
                gen.done[row // 3] = True
                return

    def take(self, *, wait: bool = False) -> Digests:
        """Digests whose work was queued since the last call and has run.

        Rows are taken in the order they were reserved, up to the first whose work has not
        run yet (``wait``: waiting for each, the final take). Never waiting is what keeps a
        token's end from draining the loads started ahead (a lookahead of layers, whose
        copies are still in flight); it loses nothing: every expert a token consumed was
        reserved before those and its work ran before compute read it, so a token's own
        experts are always taken at its end.
        """
        if all(gen.taken == len(gen.keys) for gen in self._generations):
            return _NONE  # the common case once warm: nothing was loaded
        keys: list[ExpertKey] = []
        values: list[npt.NDArray[np.uint64]] = []
        for gen in self._generations:
            ready = 0
            seen: Event | None = None  # a layer gathered in one launch shares one event
            while gen.taken + ready < len(gen.keys) and gen.done[gen.taken + ready]:
                mark = gen.done[gen.taken + ready]
                if not isinstance(mark, bool) and mark is not seen:
                    if wait:
                        mark.synchronize()
                    elif not mark.done():
                        break
                    seen = mark
                ready += 1
            if not ready:
                continue
            stop = gen.taken + ready
            mixed = self._kernels.read_results(gen.results, stop * 3)[gen.taken * 3 :]
            taken = gen.keys[gen.taken : stop]
            if None in taken:  # rows of failed loads: left out
                kept = [i for i, key in enumerate(taken) if key is not None]
                taken = [taken[i] for i in kept]
                mixed = mixed.reshape(ready, 3)[kept].reshape(-1)
            keys.extend(k for k in taken if k is not None)
            values.append(mixed.reshape(len(taken), 3))
            gen.taken = stop
        last = self._generations[-1] if self._generations else None
        self._generations = [
            g for g in self._generations
            if g.taken < len(g.keys) or (g is last and len(g.keys) < self._capacity)
        ]
        if not keys:
            return _NONE
        return Digests(keys, values[0] if len(values) == 1 else np.concatenate(values))

    @property
    def pending(self) -> int:
        return sum(len(g.keys) - g.taken for g in self._generations)


class Verifier:
    """Counts verified experts and mismatches against the file's digests.

    Expected digests come from the file's metadata (``tools.make_model`` records them) or
    from its digest manifest (``moestream.pipeline.foundation.manifest``), which a run may still be
    computing in the background: an expert whose digest is not known yet waits, with the digests its
    device copy produced, until the manifest learns it (``check`` looks at what it learned
    each time). Nothing is counted verified before it was compared; ``unverified`` counts
    what still waits.

    Args:
        table: the model (recorded digests, if any).
        manifest: the file's digest manifest, for a file without recorded digests.
    """

    def __init__(self, table: ExpertTable, manifest: DigestManifest | None = None) -> None:
        self._table = table
        self._recorded = table.digests is not None
        self._manifest = manifest
        self._positions = {layer: i for i, layer in enumerate(table.moe_layers)}
        self._learned = 0  # manifest.arrivals already looked at
        self._pending: dict[ExpertKey, dict[tuple[int, int, int], int]] = {}
        self.verified = 0
        self.mismatches = 0
        self.first_mismatch = ""

    def _expected_rows(self, keys: list[ExpertKey]
                       ) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.bool_]]:
        """The file's digests of every key at once, and which of them are known."""
        pos = np.fromiter((self._positions[k[0]] for k in keys), np.intp, len(keys))
        expert = np.fromiter((k[1] for k in keys), np.intp, len(keys))
        if self._recorded:
            assert self._table.digests is not None
            return self._table.digests[pos, expert], np.ones(len(keys), dtype=bool)
        if self._manifest is None:
            return np.zeros((len(keys), 3), dtype=np.uint64), np.zeros(len(keys), dtype=bool)
        return self._manifest.digests[pos, expert], self._manifest.known[pos, expert]

    def check(self, digests: Digests) -> None:
        """An expert verifies when all three of its matrices match; one whose digests are
        not known yet waits for them. Also settles what waited, as far as now known."""
        self.resolve()
        if not digests.keys:
            return
        keys, values = digests.keys, digests.values
        expected, known = self._expected_rows(keys)
        equal = (values == expected).all(axis=1)
        self.verified += int(np.count_nonzero(equal & known))
        bad: set[ExpertKey] = set()
        for i in np.flatnonzero(known & ~equal).tolist():
            self._mismatch(keys[i], values[i], expected[i], bad)
        for i in np.flatnonzero(~known).tolist():
            waiting = self._pending.setdefault(keys[i], {})
            gate, up, down = values[i].tolist()
            waiting[gate, up, down] = waiting.get((gate, up, down), 0) + 1
        self.mismatches += len(bad)

    def resolve(self) -> None:
        """Compare what waited for digests the manifest has learned since the last call."""
        if self._manifest is None or not self._pending:
            if self._manifest is not None:
                self._learned = len(self._manifest.arrivals)
            return
        arrivals = self._manifest.arrivals
        bad: set[ExpertKey] = set()
        for key in arrivals[self._learned :]:
            waiting = self._pending.pop(key, None)
            expected = self._manifest.get(key)
            if waiting is None or expected is None:
                continue
            for values, count in waiting.items():
                self._compare(key, values, expected, count, bad)
        self._learned = len(arrivals)
        self.mismatches += len(bad)

    def _compare(self, key: ExpertKey, values: tuple[int, int, int],
                 expected: tuple[int, int, int], count: int, bad: set[ExpertKey]) -> None:
        if values == expected:
            self.verified += count
            return
        self._mismatch(key, values, expected, bad)

    def _mismatch(self, key: ExpertKey, values: Any, expected: Any, bad: set[ExpertKey]) -> None:
        if not self.first_mismatch:
            matrix = next(m for m in range(3) if values[m] != expected[m])
            self.first_mismatch = f"layer {key[0]} expert {key[1]} {_MATRICES[matrix]}"
        bad.add(key)

    @property
    def waiting_keys(self) -> list[ExpertKey]:
        """Experts checked on the device whose file digests are not known yet."""
        return list(self._pending)

    @property
    def unverified(self) -> int:
        """Expert checks still waiting for their file digests (never counted verified)."""
        return sum(sum(w.values()) for w in self._pending.values())


_MATRICES = ("gate", "up", "down")
