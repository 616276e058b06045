"""Verification: the bytes compute consumed equal the model file's bytes.

Device kernels digest each expert's three matrices into a per-token results array
(``DigestRows``); once per token the host reads them back and ``Verifier`` compares them
with the file's own digests: those ``tools.make_model`` records in the metadata, or, for any
other file, digests of a plain buffered read, a path independent of the pipeline's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from gpu.policy import ExpertKey
from pipeline.digest import digest_bytes
from pipeline.table import ExpertTable

__all__ = ["DigestRows", "Verifier"]

Digest = tuple[ExpertKey, int, int]
"""(expert key, matrix 0/1/2 for gate/up/down, digest)."""


class DigestRows:
    """Rows of digest sums for one token, allocated on first use (most tokens need none).

    Args:
        kernels: the backend's kernels (``new_results``, ``read_results``).
        capacity: most experts digested per token.
    """

    def __init__(self, kernels: Any, capacity: int) -> None:
        self._kernels = kernels
        self._capacity = capacity
        self._results: Any = None
        self.keys: list[ExpertKey] = []

    def reserve(self, key: ExpertKey) -> tuple[Any, int]:
        """The results array and the first of three rows for ``key``'s digests."""
        if self._results is None:
            self._results = self._kernels.new_results(self._capacity * 3)
        if len(self.keys) >= self._capacity:
            raise RuntimeError(f"more than {self._capacity} digests in one token")
        self.keys.append(key)
        return self._results, (len(self.keys) - 1) * 3

    def take(self, synchronize: Callable[[], None]) -> list[Digest]:
        """Read back this token's digests (after ``synchronize``) and start afresh."""
        if not self.keys:
            return []
        synchronize()
        values = self._kernels.read_results(self._results, len(self.keys) * 3)
        out = [(key, m, values[i * 3 + m]) for i, key in enumerate(self.keys) for m in range(3)]
        self.keys = []
        self._results = None
        return out


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
