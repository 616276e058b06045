"""Where a run's time went, and what bounds it: the analysis of the token events' ``time``.

Schema 2 logs split every token's wall time into what the decode thread waited on
(``foundation.timesplit``): compute, reads, uploads, a staging slot, the controller, and host
work for the rest. Summed over the run and divided by the tokens they give milliseconds per
token that add up to the wall time per token, and shares of it. The largest part names the
bound, with the figure that would move it:

- ``storage``: waiting on reads; the miss bytes per token and the rate they came at;
- ``copy``: waiting on uploads; the same bytes and rate;
- ``compute``: the device (or host kernels) busy;
- ``staging``: waiting for a staging slot; more slots;
- ``controller``: controller pauses at token boundaries;
- ``host``: Python on the decode thread.

When ``run_start.limits`` holds the bandwidths the run was told (``--limits``), the report
adds the device limit at the run's hit rate: per token, the larger of its compute and its
miss bytes over the limiting bandwidth (reads in direct mode, copies in resident mode),
beside the measured rate. Logs of schema 1 have no split: their report says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from moestream.pipeline.foundation.timesplit import BOUND_OF_PART, PARTS, Part
from moestream.pipeline.runlog.read import TIME_COLUMNS
from moestream.pipeline.runlog.records import RunLog, TokenColumns
from moestream.pipeline.runlog.stats import ModeSplit, TokenStats, bandwidth_limits
from moestream.tools.analyze.report_text import GB, MB, text_table

__all__ = ["PART_LABELS", "LowerBound", "TimeReport", "time_report"]

_PARTS = PARTS  # the order of TIME_COLUMNS

PART_LABELS = {
    "compute": "compute (device busy)",
    "read": "waiting on reads",
    "upload": "waiting on uploads",
    "slot": "waiting for a staging slot",
    "switch": "controller pauses",
    "host": "host work (Python, hand-offs)",
}
"""What each part of the split means, for tables and plot legends."""


@dataclass(frozen=True, slots=True)
class LowerBound:
    """The device limit at the run's hit rate: what the run could reach with no host
    overhead and I/O at the told bandwidths, overlapped with compute.

    Attributes:
        ms_per_token: mean over tokens of max(compute, miss bytes / limiting bandwidth).
        tokens_per_s: its inverse.
        compute_ms_per_token: the compute part, measured.
        io_ms_per_token: miss bytes over the limiting bandwidth, per token.
        limits: the bandwidths used, bytes/s, as the log gave them.
    """

    ms_per_token: float
    tokens_per_s: float
    compute_ms_per_token: float
    io_ms_per_token: float
    limits: dict[str, float]


@dataclass(frozen=True, slots=True)
class TimeReport:
    """A run's time split and its bound.

    Attributes:
        tokens: tokens whose ``time`` was logged.
        wall_ms_per_token: their mean wall time.
        parts_ms_per_token: part name -> mean ms per token (they add up to the wall time).
        bound: ``storage``, ``copy``, ``compute``, ``staging``, ``controller`` or ``host``.
        verdict: one line: the bound, its share, the figure that would move it.
        measured_tokens_per_s: tokens over their summed wall time.
        lower_bound: the device limit, when the log holds the bandwidths it needs.
        bound_by_mode: on a run that switched modes, each mode's own bound.
    """

    tokens: int
    wall_ms_per_token: float
    parts_ms_per_token: dict[str, float]
    bound: str
    verdict: str
    measured_tokens_per_s: float
    lower_bound: LowerBound | None
    bound_by_mode: dict[str, str] = field(default_factory=dict)

    @property
    def shares(self) -> dict[str, float]:
        """Each part's share of the wall time."""
        wall = self.wall_ms_per_token
        return {k: (v / wall if wall > 0 else 0.0) for k, v in self.parts_ms_per_token.items()}

    def as_json(self) -> dict[str, Any]:
        """The keys ``moestream.tools.analyze --json`` adds to a run's entry."""
        low = self.lower_bound
        return {
            "wall_ms_per_token": self.wall_ms_per_token,
            "time_breakdown_ms_per_token": self.parts_ms_per_token,
            "time_breakdown_shares": self.shares,
            "bound": self.bound,
            "bound_by_mode": self.bound_by_mode,
            "verdict": self.verdict,
            "lower_bound": None if low is None else {
                "tokens_per_s": low.tokens_per_s, "ms_per_token": low.ms_per_token,
                "compute_ms_per_token": low.compute_ms_per_token,
                "io_ms_per_token": low.io_ms_per_token, "limits": low.limits,
                "measured_tokens_per_s": self.measured_tokens_per_s,
            },
        }

    def table(self) -> str:
        """The split as a table (ms per token, share), then the verdict."""
        rows = [["where the time goes", "ms/token", "share"]]
        shares = self.shares
        for part in _PARTS:
            rows.append([PART_LABELS[part], f"{self.parts_ms_per_token[part]:,.2f}",
                         f"{100.0 * shares[part]:.1f}%"])
        rows.append(["wall", f"{self.wall_ms_per_token:,.2f}", "100.0%"])
        return text_table(rows) + self.verdict + "\n"


def _lower_bound(run: RunLog, stats: TokenStats) -> LowerBound | None:
    """max(compute, miss bytes / bandwidth) per token, with direct tokens limited by reads
    (and copies, if slower) and resident tokens by copies; None when a limit is missing."""
    limits = bandwidth_limits(run.header.limits if run.header is not None else {})
    n = stats.split.rows
    resident = stats.split_resident
    if (("read_bytes_per_s" not in limits and resident < n)
            or ("copy_bytes_per_s" not in limits and resident > 0)):
        return None
    total = stats.floor_ms
    return LowerBound(ms_per_token=total / n, tokens_per_s=n * 1000.0 / total if total else
                      float("inf"), compute_ms_per_token=stats.compute_ms / n,
                      io_ms_per_token=stats.io_ms / n, limits=limits)


def time_report(run: RunLog) -> TimeReport | None:
    """The run's time split and bound; None when no token logged its ``time`` (schema 1).

    Computed from the sums the reader kept (``TokenColumns.stats``), not per-token columns.
    """
    cols = run.tokens
    stats = cols.stats
    if stats is None or TIME_COLUMNS[0] not in cols or not len(cols):
        return None
    n = stats.split.rows
    if n == 0:
        return None
    parts, wall_per_token, top = _mean_split(stats.split, _wall_ms(cols, stats.split, None))
    measured = 1000.0 / wall_per_token if wall_per_token > 0 else float("inf")
    low = _lower_bound(run, stats)
    verdict = _verdict(run, stats, top, parts, wall_per_token, measured, low)
    by_mode: dict[str, str] = {}
    if len(cols.mode_names) > 1:  # a run that switched: each mode has its own bound
        for code, mode in enumerate(cols.mode_names):
            in_mode = stats.by_mode.get(code)
            if in_mode is not None and in_mode.rows:
                mode_parts, mode_wall, mode_top = _mean_split(
                    in_mode, _wall_ms(cols, in_mode, cols.mode_mask(mode)))
                by_mode[mode] = BOUND_OF_PART[mode_top]
                share = 100.0 * mode_parts[mode_top] / mode_wall if mode_wall > 0 else 0.0
                verdict += (f"{'; by mode: ' if len(by_mode) == 1 else ', '}{mode} "
                            f"{by_mode[mode]}-bound ({share:.0f}%)")
    return TimeReport(n, wall_per_token, parts, BOUND_OF_PART[top], verdict, measured, low,
                      by_mode)


def _wall_ms(cols: TokenColumns, split: ModeSplit, mask: npt.NDArray[np.bool_] | None
             ) -> float:
    """The summed wall time of ``split``'s rows: over the held ``wall_ms`` column when they
    are all the tokens (of ``mask``), as numpy sums a column; else the reader's sum."""
    wall = cols.values.get("wall_ms")
    if wall is None:
        return split.wall_ms
    picked = wall if mask is None else wall[mask]
    return float(picked.sum()) if picked.shape[0] == split.rows else split.wall_ms


def _mean_split(split: ModeSplit, wall_ms: float) -> tuple[dict[str, float], float, Part]:
    """Mean ms per token of each part over ``split``'s rows, the mean wall time (of
    ``wall_ms``, their summed wall time), the largest part."""
    n = max(split.rows, 1)
    parts: dict[str, float] = {p: split.parts_ms[i] / n for i, p in enumerate(_PARTS)}
    return parts, wall_ms / n, max(_PARTS, key=parts.__getitem__)


def _verdict(run: RunLog, stats: TokenStats, top: Part, parts: dict[str, float],
             wall: float, measured: float, low: LowerBound | None) -> str:
    """One line: the bound, its share of the token time, and what would move it."""
    n = stats.split.rows
    share = 100.0 * parts[top] / wall if wall > 0 else 0.0
    miss_mb = stats.split_file_bytes / MB / n
    hits, misses = stats.split_hits, stats.split_misses
    hit_rate = hits / (hits + misses) if hits + misses else float("nan")
    # the rate misses were delivered at while decode ran: file bytes over wall time
    rate = miss_mb * MB / GB / (wall / 1000.0) if wall > 0 else 0.0
    head = f"{BOUND_OF_PART[top]}-bound: {share:.0f}% of token time"
    if top == "read":
        text = (f"{head} waiting on reads ({miss_mb:,.1f} MB/token of misses at hit rate "
                f"{hit_rate:.2f}, read at {rate:.2f} GB/s)")
    elif top == "upload":
        text = (f"{head} waiting on uploads ({miss_mb:,.1f} MB/token of misses at hit rate "
                f"{hit_rate:.2f}, copied at {rate:.2f} GB/s)")
    elif top == "compute":
        other = max((p for p in _PARTS if p != "compute"), key=parts.__getitem__)
        text = (f"{head} computing ({parts['compute']:,.2f} ms/token); next: "
                f"{PART_LABELS[other]} {parts[other]:,.2f} ms/token")
    elif top == "slot":
        text = f"{head} waiting for a staging slot: more --staging-slots would move it"
    elif top == "switch":
        text = f"{head} in controller pauses ({len(run.switches)} mode switches)"
    else:
        text = (f"{head} in host work ({parts['host']:,.2f} ms/token of Python and hand-offs "
                f"on the decode thread, {misses / n:,.1f} misses/token to launch)")
    if low is None:
        if top in ("read", "upload"):
            text += "; no bandwidth limits in the log (--limits) for the device limit"
        return text
    return (f"{text}; at this hit rate the device limit is {low.tokens_per_s:,.1f} tok/s "
            f"(max of compute {low.compute_ms_per_token:,.2f} and I/O "
            f"{low.io_ms_per_token:,.2f} ms/token), measured {measured:,.1f} tok/s")
