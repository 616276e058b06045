"""Verification: the bytes compute consumed equal the model file's bytes.

Device kernels digest each expert's three matrices into a per-token results array
(``DigestRows``); once per token the host reads them back and ``Verifier`` compares them
with the file's own digests: those ``tools.make_model`` records in the metadata, or, for any
other file, digests of a plain buffered read, a path independent of the pipeline's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from gpu.backend import Event, Kernels
from gpu.policy import ExpertKey
from pipeline.foundation.digest import digest_bytes
from pipeline.foundation.table import ExpertTable

__all__ = ["DigestRows", "Verifier"]

Digest = tuple[ExpertKey, int, int]
"""(expert key, matrix 0/1/2 for gate/up/down, digest)."""


class _Generation:
    """One results array and the keys whose digests go into it, three rows each."""

    def __init__(self, results: Any) -> None:
        self.results = results
        self.keys: list[ExpertKey] = []
        self.done: list[Event | bool] = []
        self.taken = 0


class DigestRows:
    """Rows of digest sums, handed to loads and read back once their kernels were queued.

    A load reserves three rows when it starts and calls ``complete`` once its digest work
    is queued; ``take`` returns only completed digests, so loads still in flight (started
    ahead by prefetch) are read in a later call, never as zeros. Arrays are allocated on
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

    def complete(self, results: Any, row: int, event: Event | None) -> None:
        """The digest work for the rows at ``row`` is queued; ``event`` follows it."""
        for gen in self._generations:
            if gen.results is results:
                gen.done[row // 3] = event if event is not None else True
                return

    def take(self) -> list[Digest]:
        """Digests whose work was queued since the last call, once that work has run.

        Waits only on those rows' own events, never on a whole stream: loads started
        ahead keep flowing meanwhile.
        """
        out: list[Digest] = []
        for gen in self._generations:
            ready = 0
            while gen.taken + ready < len(gen.keys) and gen.done[gen.taken + ready]:
                mark = gen.done[gen.taken + ready]
                if not isinstance(mark, bool):
                    mark.synchronize()
                ready += 1
            if not ready:
                continue
            stop = (gen.taken + ready) * 3
            values = self._kernels.read_results(gen.results, stop)
            for i in range(gen.taken, gen.taken + ready):
                out.extend((gen.keys[i], m, values[i * 3 + m]) for m in range(3))
            gen.taken += ready
        last = self._generations[-1] if self._generations else None
        self._generations = [
            g for g in self._generations
            if g.taken < len(g.keys) or (g is last and len(g.keys) < self._capacity)
        ]
        return out

    @property
    def pending(self) -> int:
        return sum(len(g.keys) - g.taken for g in self._generations)


class Verifier:
    """Counts verified experts and mismatches against the file's digests.

    Args:
        table: the model (recorded digests, byte ranges).
        read_range: buffered ``(offset, nbytes) -> bytes`` for files without digests.
    """

    def __init__(self, table: ExpertTable, read_range: Callable[[int, int], bytes]) -> None:
        self._table = table
        self._read_range = read_range
        self._expected: dict[tuple[ExpertKey, int], int] = {}
        self.verified = 0
        self.mismatches = 0
        self.first_mismatch = ""

    def expected(self, key: ExpertKey, matrix: int) -> int:
        cached = self._expected.get((key, matrix))
        if cached is not None:
            return cached
        recorded = self._table.expected_digests(key)
        if recorded is not None:
            value = recorded[matrix]
        else:
            r = self._table.slices(key).ranges[matrix]
            value = digest_bytes(self._read_range(r.offset, r.nbytes))
        self._expected[(key, matrix)] = value
        return value

    def check(self, digests: Sequence[Digest]) -> None:
        """An expert verifies when all three of its matrices match."""
        bad: set[ExpertKey] = set()
        seen = 0
        for key, matrix, value in digests:
            seen += matrix == 0
            if value != self.expected(key, matrix):
                if key not in bad and not self.first_mismatch:
                    name = ("gate", "up", "down")[matrix]
                    self.first_mismatch = f"layer {key[0]} expert {key[1]} {name}"
                bad.add(key)
        self.mismatches += len(bad)
        self.verified += seen - len(bad)
