"""The host tier of partial residency: in direct mode, the experts missed most often are
read through the page cache and their pages kept, up to a byte share the controller sets
from the RAM it sees; the rest stays O_DIRECT."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from moestream.pipeline.foundation.table import ByteRange, ExpertKey, ExpertTable

__all__ = ["HostTier"]


class HostTier:
    """Which experts the tier holds, chosen from the miss counts.

    Args:
        table: the model (expert sizes and ranges).
        drop_ranges: drops the pages of byte ranges (blocking; run on a worker).
    """

    def __init__(self, table: ExpertTable,
                 drop_ranges: Callable[[Sequence[ByteRange]], None]) -> None:
        self._table = table
        self._drop_ranges = drop_ranges
        self.keys: frozenset[ExpertKey] = frozenset()
        self.nbytes = 0
        self.miss_counts: dict[ExpertKey, int] = {}

    def missed(self, keys: Sequence[ExpertKey]) -> None:
        """Count a miss of each of ``keys`` (a layer's at once)."""
        counts = self.miss_counts
        for key in keys:
            counts[key] = counts.get(key, 0) + 1

    async def resize(self, nbytes: int) -> int:
        """Hold the experts missed most often, up to ``nbytes`` of file bytes; experts that
        leave have their pages dropped. Returns the tier's bytes."""
        ranked = sorted(self.miss_counts, key=self.miss_counts.__getitem__, reverse=True)
        chosen: list[ExpertKey] = []
        total = 0
        for key in ranked:
            size = self._table.expert_bytes(key[0])  # per layer: no per-key objects
            if total + size > nbytes:
                break
            chosen.append(key)
            total += size
        new = frozenset(chosen)
        left = self.keys - new
        self.keys, self.nbytes = new, total
        if left:
            ranges = [r for key in left for r in self._table.slices(key).ranges]
            await asyncio.get_running_loop().run_in_executor(None, self._drop_ranges, ranges)
        return total
