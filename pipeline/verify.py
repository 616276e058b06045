"""Verification: the bytes compute consumed equal the model file's bytes.

Device kernels digest each expert's three matrices into a per-token results array
(``DigestRows``); once per token the host reads them back and ``Verifier`` compares them
with the file's own digests: those ``tools.make_model`` records in the metadata, or, for any
other file, its digest manifest (``pipeline.foundation.manifest``): the same digests computed on the
host from a separate read of the file, once, off the decode path. Nothing is re-read to
verify.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gpu.backend import Event, Kernels
from gpu.policy import ExpertKey
from pipeline.foundation.manifest import DigestManifest
from pipeline.foundation.table import ExpertTable

__all__ = ["DigestRows", "Verifier"]

Digest = tuple[ExpertKey, int, int]
"""(expert key, matrix 0/1/2 for gate/up/down, digest)."""


class _Generation:
    """One results array and the keys whose digests go into it, three rows each."""

    def __init__(self, results: Any) -> None:
        self.results = results
        self.address: int | None = None  # of row 0, once asked for
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

    def take(self, *, wait: bool = False) -> list[Digest]:
        """Digests whose work was queued since the last call and has run.

        Rows are taken in the order they were reserved, up to the first whose work has not
        run yet (``wait``: waiting for each, the final take). Never waiting is what keeps a
        token's end from draining the loads started ahead (a lookahead of layers, whose
        copies are still in flight); it loses nothing: every expert a token consumed was
        reserved before those and its work ran before compute read it, so a token's own
        experts are always taken at its end.
        """
        out: list[Digest] = []
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

    Expected digests come from the file's metadata (``tools.make_model`` records them) or
    from its digest manifest (``pipeline.foundation.manifest``), which a run may still be
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
        self._learned = 0  # manifest.arrivals already looked at
        self._pending: dict[ExpertKey, dict[tuple[int, int, int], int]] = {}
        self.verified = 0
        self.mismatches = 0
        self.first_mismatch = ""

    def expected(self, key: ExpertKey) -> tuple[int, int, int] | None:
        """The file's digests of ``key``'s gate, up and down matrices; None while unknown."""
        if self._recorded:
            return self._table.expected_digests(key)
        return self._manifest.get(key) if self._manifest is not None else None

    def check(self, digests: Sequence[Digest]) -> None:
        """An expert verifies when all three of its matrices match; one whose digests are
        not known yet waits for them. Also settles what waited, as far as now known."""
        self.resolve()
        bad: set[ExpertKey] = set()
        for key, values in _experts(digests):
            expected = self.expected(key)
            if expected is None:
                waiting = self._pending.setdefault(key, {})
                waiting[values] = waiting.get(values, 0) + 1
            else:
                self._compare(key, values, expected, 1, bad)
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


def _experts(digests: Sequence[Digest]) -> list[tuple[ExpertKey, tuple[int, int, int]]]:
    """Per-matrix digests (three in a row per expert, as ``DigestRows.take`` gives them)
    grouped into one (gate, up, down) triple per expert."""
    out = []
    for i in range(0, len(digests) - 2, 3):
        (key, m0, v0), (k1, m1, v1), (k2, m2, v2) = digests[i : i + 3]
        if not (key == k1 == k2 and (m0, m1, m2) == (0, 1, 2)):
            raise ValueError(f"digests out of order at {i}: {digests[i : i + 3]}")
        out.append((key, (v0, v1, v2)))
    if len(digests) % 3:
        raise ValueError(f"{len(digests)} matrix digests do not make whole experts")
    return out
