"""``--plot`` of ``tools.analyze``: a run (or several) drawn over time as PNG files.

Split out of ``tools.analyze`` so that module keeps to summaries, tables, CSV and what-if;
everything that touches matplotlib is here. The plots draw the same per-interval rows as
``--csv`` (``tools.analyze.interval_rows``) plus per-token latency and I/O mode from the
run log. matplotlib is imported only when a plot is drawn.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.foundation.outputs import atomic_output, check_output_dir
from tools.analyze.cli import STAGE_COLUMNS, interval_rows
from tools.analyze.logrecords import RunLog

__all__ = ["PLOT_FILES", "write_plots"]

_GB = 1e9

PLOT_FILES = ("latency.png", "hit_rate.png", "bytes_per_token.png", "mode_timeline.png",
              "stages.png")
"""The files ``write_plots`` writes, in its order (``tools.analyze`` checks them first)."""


def write_plots(runs: Sequence[RunLog], directory: Path, interval: int) -> list[Path]:
    """Draw the run(s) over time into PNG files in ``directory``; returns their paths.

    Files: ``latency.png`` (token latency and its interval median), ``hit_rate.png``,
    ``bytes_per_token.png`` (device cache / page cache / storage, stacked),
    ``mode_timeline.png`` (mode in force, available RAM, switches) and ``stages.png``
    (mean ms per token by stage against wall time; stages overlap, so they are lines).
    Several runs share the line plots and get one panel each in the stacked ones.
    """
    # matplotlib is heavy (about a second to import) and optional: import only when asked.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    check_output_dir(directory, what="--plot", create=True)
    rows = [interval_rows(run, interval) for run in runs]
    x = [np.array([r["ctx_tokens"] for r in rs], dtype=np.float64) for rs in rows]

    def col(i: int, name: str) -> np.ndarray[Any, np.dtype[np.float64]]:
        return np.array([np.nan if r[name] is None else r[name] for r in rows[i]],
                        dtype=np.float64)

    written: list[Path] = []

    def save(fig: Any, name: str) -> None:
        assert name in PLOT_FILES
        path = directory / name
        fig.tight_layout()
        try:  # atomic: a link is followed, a FIFO or device refused, never replaced
            with atomic_output(path, what="--plot") as out:
                fig.savefig(out, format="png", dpi=100)
        finally:
            plt.close(fig)
        written.append(path)

    fig, ax = plt.subplots(figsize=(10, 4))
    for i, run in enumerate(runs):
        wall = run.tokens["wall_ms"]
        ax.plot(np.arange(wall.size), wall, ",", alpha=0.3, color=f"C{i}")
        ax.plot(x[i], col(i, "latency_p50_ms"), color=f"C{i}", label=f"{run.name} p50")
    ax.set(xlabel="token", ylabel="token latency, ms", title="token latency")
    ax.legend(loc="upper right")
    save(fig, "latency.png")

    fig, ax = plt.subplots(figsize=(10, 4))
    for i, run in enumerate(runs):
        ax.plot(x[i], col(i, "hit_rate"), color=f"C{i}", label=run.name)
    ax.set(xlabel="token", ylabel="hit rate", ylim=(0, 1.02),
           title=f"cache hit rate per {interval} tokens")
    ax.legend(loc="lower right")
    save(fig, "hit_rate.png")

    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 3.2 * len(runs)), squeeze=False)
    for i, run in enumerate(runs):
        storage = col(i, "storage_mb_per_token")
        page = np.maximum(col(i, "file_mb_per_token") - storage, 0.0)
        ax = axes[i][0]
        ax.stackplot(x[i], np.nan_to_num(col(i, "cache_mb_per_token")), np.nan_to_num(page),
                     np.nan_to_num(storage), labels=["device cache", "page cache", "storage"],
                     colors=["C2", "C1", "C3"])
        ax.set(xlabel="token", ylabel="MB per token", title=f"{run.name}: bytes by source")
        ax.legend(loc="upper right")
    save(fig, "bytes_per_token.png")

    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 2.8 * len(runs)), squeeze=False)
    for i, run in enumerate(runs):
        ax = axes[i][0]
        codes = run.tokens.mode_codes
        edges = np.flatnonzero(np.diff(codes)) + 1
        bounds = [0, *edges.tolist(), codes.size]
        for a, b in itertools.pairwise(bounds):
            code = int(codes[a]) if b > a else -1
            name = run.tokens.mode_names[code] if code >= 0 else "unknown"
            color = {"direct": "C0", "resident": "C2"}.get(name, "C7")
            ax.axvspan(a, b, color=color, alpha=0.25, lw=0, label=name)
        for switch in run.switches:
            if switch.token is not None:
                ax.axvline(switch.token, color="k", lw=0.8)
        ram = run.tokens["ram_available_bytes"] / _GB
        ax.plot(np.arange(ram.size), ram, color="k", lw=1, label="RAM available")
        handles, labels = ax.get_legend_handles_labels()
        unique = dict(zip(labels, handles, strict=True))
        ax.legend(unique.values(), unique.keys(), loc="upper right")
        ax.set(xlabel="token", ylabel="RAM available, GB", title=f"{run.name}: I/O mode")
    save(fig, "mode_timeline.png")

    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 3.2 * len(runs)), squeeze=False)
    for i, run in enumerate(runs):
        ax = axes[i][0]
        for j, stage in enumerate(STAGE_COLUMNS):
            ax.plot(x[i], col(i, stage), color=f"C{j}", label=stage.removesuffix("_ms"))
        gen = col(i, "gen_tps")
        with np.errstate(divide="ignore"):
            ax.plot(x[i], 1000.0 / gen, "k--", lw=1, label="wall")
        ax.set(xlabel="token", ylabel="ms per token", title=f"{run.name}: stages")
        ax.legend(loc="upper right", ncol=4)
    save(fig, "stages.png")
    return written
