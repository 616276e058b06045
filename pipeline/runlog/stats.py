"""Streaming sums over a log's token lines: what the summary and the time split need.

The summary of a run (``moestream.tools.analyze.cli.summarize``), its time split
(``moestream.tools.analyze.time_report``) and the reader's consistency checks need sums, counts and
per-mode totals, not every token's values. ``TokenStats`` folds each block of token rows
(``moestream.pipeline.runlog.read`` reads them ``BLOCK_ROWS`` at a time) into these accumulators, so
that what they hold does not grow with the log. Within a block the sums are numpy's (pairwise,
as over a whole column); blocks are added in order, so a log of more than one block may differ
from a sum over the whole column in the last bits of a float.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from moestream.pipeline.foundation.timesplit import PARTS
from moestream.pipeline.runlog.values import FloatArray

__all__ = ["ModeSplit", "TokenStats", "bandwidth_limits"]


def bandwidth_limits(raw: Mapping[str, Any]) -> dict[str, float]:
    """The positive ``read_bytes_per_s`` and ``copy_bytes_per_s`` of ``run_start.limits``."""
    out: dict[str, float] = {}
    for key in ("read_bytes_per_s", "copy_bytes_per_s"):
        value = raw.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
            out[key] = float(value)
    return out


class ModeSplit:
    """Sums over the tokens of one mode whose time split and wall time are finite.

    Attributes:
        rows: how many such tokens.
        wall_ms: their summed wall time.
        parts_ms: their summed time of each part, in ``PARTS`` order.
    """

    __slots__ = ("parts_ms", "rows", "wall_ms")

    def __init__(self) -> None:
        self.rows = 0
        self.wall_ms = 0.0
        self.parts_ms = [0.0] * len(PARTS)


class TokenStats:
    """Sums, counts and per-mode totals of a log's token rows, block by block.

    Args:
        names: the columns of a row block, in order; must include ``token``, ``wall_ms``,
            ``hits``, ``misses``, ``file_bytes`` and, for the time split, the
            ``time_<part>_ms`` columns in ``PARTS`` order.
        time_columns: the names of the time split's columns.

    Attributes:
        tokens: token rows folded in.
        totals: column -> sum over every row, NaN ignored.
        split: ``ModeSplit`` over every row whose time split and wall time are finite.
        split_resident: how many of those were decoded in ``resident`` mode.
        split_file_bytes: their summed file (miss) bytes, NaN ignored; likewise
            ``split_hits`` and ``split_misses``.
        floor_ms: their summed max(compute, miss bytes / the limiting bandwidth).
        compute_ms: their summed compute part; ``io_ms``: their miss bytes over bandwidth.
        by_mode: mode code -> ``ModeSplit`` of that mode's rows.
        gap_row: the first row whose token index is not its row number; None if none.
        differs: rows whose hits + misses differ from the expert ids listed.
        differs_token: the token index of the first such row.
    """

    __slots__ = ("_col", "by_mode", "compute_ms", "differs", "differs_token", "floor_ms",
                 "gap_row", "io_ms", "split", "split_file_bytes", "split_hits",
                 "split_misses", "split_resident", "time_columns", "tokens", "totals")

    def __init__(self, names: tuple[str, ...], time_columns: tuple[str, ...]) -> None:
        self._col = {name: i for i, name in enumerate(names)}
        self.time_columns = time_columns
        self.tokens = 0
        self.totals = dict.fromkeys(names, 0.0)
        self.split = ModeSplit()
        self.split_resident = 0
        self.split_file_bytes = self.split_hits = self.split_misses = 0.0
        self.floor_ms = self.compute_ms = self.io_ms = 0.0
        self.by_mode: dict[int, ModeSplit] = {}
        self.gap_row: int | None = None
        self.differs = 0
        self.differs_token: int | None = None

    def add_block(self, columns: FloatArray, codes: npt.NDArray[np.int8],
                  used: npt.NDArray[np.int32], limits: Mapping[str, float],
                  resident_code: int) -> None:
        """Fold in one block of rows.

        Args:
            columns: ``(len(names), rows)`` float64, one contiguous row per column.
            codes: the rows' mode codes (-1 where absent).
            used: the rows' count of expert ids listed.
            limits: ``bandwidth_limits`` of the run's header (empty without one).
            resident_code: the code of ``resident`` mode; -2 when no row had it yet.
        """
        rows = columns.shape[1]
        if not rows:
            return
        col = self._col
        for name, i in col.items():
            self.totals[name] += float(np.nansum(columns[i]))
        index = columns[col["token"]]
        if self.gap_row is None:
            expected = np.arange(self.tokens, self.tokens + rows, dtype=np.float64)
            if not np.array_equal(index, expected):
                self.gap_row = self.tokens + int(np.argmax(index != expected))
        counted = columns[col["hits"]] + columns[col["misses"]]
        differs = np.flatnonzero(~np.isnan(counted) & (counted != used))
        if differs.size:
            if not self.differs:
                self.differs_token = int(index[differs[0]])
            self.differs += int(differs.size)
        self.tokens += rows
        self._add_split(columns, codes, limits, resident_code)

    def _add_split(self, columns: FloatArray, codes: npt.NDArray[np.int8],
                   limits: Mapping[str, float], resident_code: int) -> None:
        col = self._col
        if self.time_columns[0] not in col:
            return
        split = [columns[col[name]] for name in self.time_columns]
        wall = columns[col["wall_ms"]]
        keep = np.isfinite(wall)
        for part in split:
            keep &= np.isfinite(part)
        if not keep.any():
            return
        self._fold(self.split, keep, split, wall)
        resident = codes == resident_code
        self.split_resident += int((keep & resident).sum())
        miss_bytes = columns[col["file_bytes"]][keep]
        self.split_file_bytes += float(np.nansum(miss_bytes))
        self.split_hits += float(np.nansum(columns[col["hits"]][keep]))
        self.split_misses += float(np.nansum(columns[col["misses"]][keep]))
        read, copy = limits.get("read_bytes_per_s"), limits.get("copy_bytes_per_s")
        # a direct miss is read, then copied: the slower of the two limits it
        direct = read if copy is None or read is None else min(read, copy)
        bandwidth = np.where(resident[keep], copy or np.inf, direct or np.inf)
        io_ms = np.nan_to_num(miss_bytes) / bandwidth * 1000.0
        compute = split[0][keep]
        self.floor_ms += float(np.maximum(compute, io_ms).sum())
        self.compute_ms += float(compute.sum())
        self.io_ms += float(io_ms.sum())
        for code in np.unique(codes[keep]).tolist():
            in_mode = keep & (codes == code)
            self._fold(self.by_mode.setdefault(int(code), ModeSplit()), in_mode, split, wall)

    @staticmethod
    def _fold(into: ModeSplit, keep: npt.NDArray[np.bool_], split: list[FloatArray],
              wall: FloatArray) -> None:
        into.rows += int(keep.sum())
        into.wall_ms += float(wall[keep].sum())
        for i, part in enumerate(split):
            into.parts_ms[i] += float(part[keep].sum())
