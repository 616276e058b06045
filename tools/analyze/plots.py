"""``--plot`` of ``tools.analyze``: a run (or several) drawn over time as PNG files.

Split out of ``tools.analyze`` so that module keeps to summaries, tables, CSV and what-if;
everything that touches matplotlib is here. The plots draw the same per-interval rows as
``--csv`` (``moestream.tools.analyze.intervals``) plus per-token latency and I/O mode from the
run log. matplotlib is imported only when a plot is drawn.

``summary.png``, written first, is the page to read: per run, the share of token time each
part took (one bar), the time split per token over the run (stacked), tokens/s against the
device limit, and hit rate with storage GB/s, mode switches marked. Points are spaced from
the run's length (about 100, at least 20, one per token for short runs) unless ``--interval``
says otherwise.
"""

from __future__ import annotations

import itertools
import math
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moestream.pipeline.foundation.outputs import atomic_output, check_output_dir
from moestream.pipeline.runlog.read import TIME_COLUMNS
from moestream.pipeline.runlog.records import RunLog
from moestream.tools.analyze.intervals import STAGE_COLUMNS, interval_rows
from moestream.tools.analyze.report_text import Value
from moestream.tools.analyze.time_report import PART_LABELS, TimeReport, time_report

__all__ = ["PLOT_FILES", "plot_interval", "write_plots"]

_GB = 1e9
_POINTS = 100
_LEAST_POINTS = 20

PLOT_FILES = ("summary.png", "time_breakdown.png", "hit_rate.png", "latency.png",
              "bytes_per_token.png", "mode_timeline.png", "stages.png")
"""The files ``write_plots`` writes, in its order (``tools.analyze`` checks them first)."""

PART_COLORS = {"compute": "#2ca02c", "read": "#d62728", "upload": "#ff7f0e",
               "slot": "#9467bd", "switch": "#7f7f7f", "host": "#9ecae1"}
"""One color per part of the time split, the same in every plot."""

_MODE_COLORS = {"direct": "#1f77b4", "resident": "#2ca02c"}

FloatArray = np.ndarray[Any, np.dtype[np.float64]]


def plot_interval(tokens: int) -> int:
    """Tokens per plot point for a run of ``tokens``: a round number (1, 2, 5, 10, ...)
    giving about 100 points, never fewer than 20 (one per token up to 100 tokens)."""
    raw = tokens / _POINTS
    if raw <= 1:
        return 1
    decade = 10 ** math.floor(math.log10(raw))
    step = next(m * decade for m in (5, 2, 1) if m * decade <= raw)
    return max(1, min(int(step), tokens // _LEAST_POINTS))


@dataclass(slots=True)
class _Series:
    """One run's interval rows as columns, with the interval used."""

    run: RunLog
    interval: int
    rows: list[dict[str, Value]]
    split: TimeReport | None

    @property
    def x(self) -> FloatArray:
        return np.array([r["ctx_tokens"] for r in self.rows], dtype=np.float64)

    def col(self, name: str) -> FloatArray:
        return np.array([math.nan if r[name] is None else r[name] for r in self.rows],
                        dtype=np.float64)


def write_plots(runs: Sequence[RunLog], directory: Path, interval: int | None = None
                ) -> list[Path]:
    """Draw the run(s) over time into PNG files in ``directory``; returns their paths.

    Files, in order: ``summary.png`` (the page to read, one column per run),
    ``time_breakdown.png`` (ms per token by part, stacked: the parts add up to the wall
    time), ``hit_rate.png`` (hit rate and storage GB/s, mode switches marked),
    ``latency.png`` (token latency and its interval median), ``bytes_per_token.png``
    (device cache / page cache / storage, stacked), ``mode_timeline.png`` (mode in force,
    available RAM, switches) and ``stages.png`` (busy ms per token by stage against wall
    time; stages overlap, so they are lines). ``interval``: tokens per point, or None to
    choose from each run's length (``plot_interval``).
    """
    # matplotlib is heavy (about a second to import) and optional: import only when asked.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    check_output_dir(directory, what="--plot", create=True)
    series = []
    for run in runs:
        step = interval or plot_interval(len(run.tokens))
        series.append(_Series(run, step, interval_rows(run, step), time_report(run)))
    written: list[Path] = []
    figures = (_summary_figure, _split_figure, _hits_figure, _latency_figure, _bytes_figure,
               _mode_figure, _stages_figure)
    for name, draw in zip(PLOT_FILES, figures, strict=True):
        fig = draw(plt, series)  # drawn, saved and closed one at a time
        path = directory / name
        try:  # atomic: a link is followed, a FIFO or device refused, never replaced
            with atomic_output(path, what="--plot") as out:
                fig.savefig(out, format="png", dpi=100)
        finally:
            plt.close(fig)
        written.append(path)
    return written


def _split_figure(plt: Any, series: Sequence[_Series]) -> Any:
    """``time_breakdown.png``: ms per token by part, stacked, one row per run."""
    fig, axes = plt.subplots(len(series), 1, figsize=(10, 3.6 * len(series)), squeeze=False)
    for s, row in zip(series, axes, strict=True):
        _draw_split(row[0], s)
        row[0].set_title(f"{s.run.name}: where each token's time goes "
                         f"(mean per {_tokens(s.interval)})")
        row[0].set_xlabel("token")
    fig.tight_layout()
    return fig


def _hits_figure(plt: Any, series: Sequence[_Series]) -> Any:
    """``hit_rate.png``: hit rate and storage GB/s, mode switches marked, one row per run."""
    fig, axes = plt.subplots(len(series), 1, figsize=(10, 3.4 * len(series)), squeeze=False)
    for s, row in zip(series, axes, strict=True):
        _draw_hits_and_storage(row[0], s)
        row[0].set_title(f"{s.run.name}: hit rate and storage reads per {_tokens(s.interval)}")
        row[0].set_xlabel("token")
    fig.tight_layout()
    return fig


def _latency_figure(plt: Any, series: Sequence[_Series]) -> Any:
    """``latency.png``: every token's latency and its interval median, the runs together."""
    fig, ax = plt.subplots(figsize=(10, 4))
    for i, s in enumerate(series):
        wall = s.run.tokens["wall_ms"]
        ax.plot(np.arange(1, wall.size + 1), wall, ".", ms=2, alpha=0.3, color=f"C{i}")
        ax.plot(s.x, s.col("latency_p50_ms"), color=f"C{i}",
                label=f"{s.run.name} p50 per {_tokens(s.interval)}")
    ax.set(xlabel="token", ylabel="token latency, ms", title="token latency")
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper right")
    fig.tight_layout()
    return fig


def _bytes_figure(plt: Any, series: Sequence[_Series]) -> Any:
    """``bytes_per_token.png``: device cache / page cache / storage MB per token, stacked."""
    fig, axes = plt.subplots(len(series), 1, figsize=(10, 3.2 * len(series)), squeeze=False)
    for s, row in zip(series, axes, strict=True):
        ax = row[0]
        storage = s.col("storage_mb_per_token")
        page = np.maximum(s.col("file_mb_per_token") - storage, 0.0)
        ax.stackplot(s.x, np.nan_to_num(s.col("cache_mb_per_token")), np.nan_to_num(page),
                     np.nan_to_num(storage), labels=["device cache", "page cache", "storage"],
                     colors=["C2", "C1", "C3"])
        ax.set(xlabel="token", ylabel="MB per token", title=f"{s.run.name}: bytes by source")
        ax.legend(loc="upper right")
    fig.tight_layout()
    return fig


def _mode_figure(plt: Any, series: Sequence[_Series]) -> Any:
    """``mode_timeline.png``: the mode in force, available RAM and the switches."""
    fig, axes = plt.subplots(len(series), 1, figsize=(10, 2.8 * len(series)), squeeze=False)
    for s, row in zip(series, axes, strict=True):
        ax = row[0]
        _shade_modes(ax, s.run)
        ram = s.run.tokens["ram_available_bytes"] / _GB
        ax.plot(np.arange(ram.size), ram, color="k", lw=1, label="RAM available")
        handles, labels = ax.get_legend_handles_labels()
        unique = dict(zip(labels, handles, strict=True))
        ax.legend(unique.values(), unique.keys(), loc="upper right")
        ax.set(xlabel="token", ylabel="RAM available, GB", title=f"{s.run.name}: I/O mode")
    fig.tight_layout()
    return fig


def _stages_figure(plt: Any, series: Sequence[_Series]) -> Any:
    """``stages.png``: busy ms per token by stage against wall time (stages overlap: lines)."""
    fig, axes = plt.subplots(len(series), 1, figsize=(10, 3.2 * len(series)), squeeze=False)
    for s, row in zip(series, axes, strict=True):
        ax = row[0]
        for j, stage in enumerate(STAGE_COLUMNS):
            ax.plot(s.x, s.col(stage), color=f"C{j}", label=stage.removesuffix("_ms"))
        with np.errstate(divide="ignore"):
            ax.plot(s.x, 1000.0 / s.col("gen_tps"), "k--", lw=1, label="wall")
        ax.set(xlabel="token", ylabel="ms per token",
               title=f"{s.run.name}: stages, busy time summed over workers (they overlap)")
        ax.legend(loc="upper right", ncol=4)
    fig.tight_layout()
    return fig


def _tokens(n: int) -> str:
    return "token" if n == 1 else f"{n} tokens"


def _summary_figure(plt: Any, series: Sequence[_Series]) -> Any:
    """One column per run: the share bar, the split over time, tokens/s, hits and storage."""
    fig, axes = plt.subplots(
        4, len(series), figsize=(9 * len(series), 12), squeeze=False,
        gridspec_kw={"height_ratios": [0.55, 2.2, 1.3, 1.5]},
    )
    for column, s in enumerate(series):
        bar, split, rate, hits = (axes[r][column] for r in range(4))
        verdict = s.split.verdict if s.split is not None else (
            "no time breakdown in this log (schema 1: tokens carry no time)")
        _draw_shares(bar, s)
        bar.set_title(f"{s.run.name}: {_headline(s)}\n" + textwrap.fill(verdict, 105),
                      loc="left", fontsize=10)
        _draw_split(split, s)
        split.set_title(f"where each token's time goes (ms, mean per {_tokens(s.interval)};"
                        " the parts add up to the wall time)", loc="left", fontsize=10)
        _draw_rate(rate, s)
        _draw_hits_and_storage(hits, s)
        hits.set_xlabel("token")
    fig.tight_layout()
    return fig


def _headline(s: _Series) -> str:
    """Tokens, tokens/s, hit rate and the modes of a run, in a few words."""
    cols = s.run.tokens
    wall = float(np.nansum(cols["wall_ms"]))
    hits, misses = float(np.nansum(cols["hits"])), float(np.nansum(cols["misses"]))
    words = [f"{len(cols)} tokens"]
    if wall > 0:
        words.append(f"{len(cols) * 1000.0 / wall:.2f} tok/s")
    if hits + misses:
        words.append(f"hit rate {hits / (hits + misses):.2f}")
    modes = "/".join(cols.mode_names)
    if modes:
        switches = len(s.run.switches)
        words.append(f"{modes} mode" + (f", {switches} switch{'es' if switches > 1 else ''}"
                                         if switches else ""))
    return ", ".join(words)


def _draw_shares(ax: Any, s: _Series) -> None:
    """One horizontal bar: each part's share of the run's token time, labelled."""
    ax.set_xlim(0, 100)
    ax.set_yticks([])
    ax.set_xlabel("share of token time, %")
    if s.split is None:
        ax.text(50, 0, "no time breakdown (schema 1 log)", ha="center", va="center")
        return
    left = 0.0
    for part, share in s.split.shares.items():
        width = 100.0 * share
        ax.barh(0, width, left=left, color=PART_COLORS[part], edgecolor="white", height=0.8)
        if width >= 6:
            ax.text(left + width / 2, 0, f"{part}\n{width:.0f}%", ha="center", va="center",
                    fontsize=9)
        left += width


def _draw_split(ax: Any, s: _Series) -> None:
    """Stacked ms per token by part, with switches marked; the legend gives each share."""
    if s.split is None:
        with np.errstate(divide="ignore"):
            ax.plot(s.x, 1000.0 / s.col("gen_tps"), color="k", lw=1, label="wall")
        ax.text(0.5, 0.5, "no time breakdown in this log (schema 1)", transform=ax.transAxes,
                ha="center", va="center")
    else:
        shares = s.split.shares
        parts = [c.removeprefix("time_").removesuffix("_ms") for c in TIME_COLUMNS]
        stack = [np.nan_to_num(s.col(c)) for c in TIME_COLUMNS]
        ax.stackplot(s.x, *stack, colors=[PART_COLORS[p] for p in parts],
                     labels=[f"{PART_LABELS[p]} {100 * shares[p]:.0f}%" for p in parts])
        top = float(np.max(np.sum(stack, axis=0))) if s.x.size else 0.0
        if top > 0:
            ax.set_ylim(0, 1.35 * top)  # room for the legend above the peaks
    _mark_switches(ax, s.run)
    ax.set_ylabel("ms per token")
    ax.set_xlim(0, max(len(s.run.tokens), 1))
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper left", fontsize=8, ncol=3, framealpha=0.85)


def _draw_rate(ax: Any, s: _Series) -> None:
    """Tokens/s per interval, and the device limit when the log holds the bandwidths."""
    ax.plot(s.x, s.col("gen_tps"), color="k", lw=1.2, label="measured tok/s")
    low = s.split.lower_bound if s.split is not None else None
    if low is not None and math.isfinite(low.tokens_per_s):
        ax.axhline(low.tokens_per_s, color="C3", ls="--", lw=1,
                   label=f"device limit at this hit rate {low.tokens_per_s:.1f} tok/s")
    _mark_switches(ax, s.run)
    ax.set_ylabel("tokens/s")
    ax.set_xlim(0, max(len(s.run.tokens), 1))
    ax.set_ylim(bottom=0)
    ax.legend(loc="lower right", fontsize=8)


def _draw_hits_and_storage(ax: Any, s: _Series) -> None:
    """Hit rate (left axis) and storage GB/s (right axis) over the modes in force."""
    _shade_modes(ax, s.run)
    ax.plot(s.x, s.col("hit_rate"), color="k", lw=1.2, label="hit rate")
    ax.set_ylim(0, 1.02)
    ax.set_ylabel("hit rate")
    ax.set_xlim(0, max(len(s.run.tokens), 1))
    right = ax.twinx()
    right.plot(s.x, s.col("storage_gbps"), color="C3", lw=1.2, label="storage GB/s")
    right.set_ylabel("storage GB/s", color="C3")
    right.set_ylim(bottom=0)
    handles, labels = ax.get_legend_handles_labels()
    more, more_labels = right.get_legend_handles_labels()
    unique = dict(zip([*labels, *more_labels], [*handles, *more], strict=True))
    ax.legend(unique.values(), unique.keys(), loc="lower right", fontsize=8)


def _shade_modes(ax: Any, run: RunLog) -> None:
    """Shade the tokens decoded in each mode and mark the switches."""
    codes = run.tokens.mode_codes
    edges = np.flatnonzero(np.diff(codes)) + 1
    bounds = [0, *edges.tolist(), codes.size]
    for a, b in itertools.pairwise(bounds):
        code = int(codes[a]) if b > a else -1
        name = run.tokens.mode_names[code] if code >= 0 else "unknown"
        ax.axvspan(a, b, color=_MODE_COLORS.get(name, "C7"), alpha=0.12, lw=0,
                   label=f"{name} mode")
    _mark_switches(ax, run)


def _mark_switches(ax: Any, run: RunLog) -> None:
    for switch in run.switches:
        if switch.token is not None:
            ax.axvline(switch.token, color="k", lw=0.8, ls=":")
            ax.annotate(f"to {switch.to_mode}", (switch.token, 0.03),
                        xycoords=("data", "axes fraction"), fontsize=7, rotation=90,
                        va="bottom", ha="right")
