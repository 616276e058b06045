"""The live line of ``pipeline.cli.run`` on a terminal: tokens, tokens/s, hit rate, mode, bound.

A tqdm bar on stderr, like the progress bars of ``tools.warmup`` and ``tools.make_model``,
updated in place once per token (tqdm redraws at most every ``mininterval``, so an update
costs microseconds); off when stderr is not a terminal or the summary is JSON. The bound is
the largest part of the recent tokens' time split (``pipeline.foundation.timesplit``), each part an
exponential average over about ``_SMOOTH_TOKENS`` tokens, so that one slow token does not
flip it; the hit rate is the run's so far.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import IO, Any

from moestream.pipeline.foundation.timesplit import BOUND_OF_PART, PARTS, Part

__all__ = ["LiveLine"]

_SMOOTH_TOKENS = 8


class LiveLine:
    """One line, redrawn in place while a run decodes.

    Args:
        tokens: the run's token count (the bar's total).
        enabled: draw it (``pipeline.cli.run``: stderr is a terminal and the summary is not
            JSON); when False every method does nothing.
        stream: where to draw (stderr).
    """

    def __init__(self, tokens: int, *, enabled: bool, stream: IO[str] | None = None) -> None:
        self._bar: Any = None
        self._hits = 0
        self._lookups = 0
        self._parts: dict[Part, float] = dict.fromkeys(PARTS, 0.0)
        self._seen = 0
        if not enabled:
            return
        from tqdm import tqdm  # imported here, as the warm-up's: start-up time counts

        self._bar = tqdm(total=tokens, unit="tok", desc="decoding", dynamic_ncols=True,
                         file=stream or sys.stderr, leave=False)

    def update(self, hits: int, misses: int, time: Mapping[str, float], mode: str) -> None:
        """One more token decoded: its hits, misses and ``time`` (the token event's object,
        ms by part), in ``mode``."""
        if self._bar is None:
            return
        self._hits += hits
        self._lookups += hits + misses
        self._seen += 1
        weight = max(1.0 / self._seen, 1.0 / _SMOOTH_TOKENS)
        for part in PARTS:
            ms = time.get(f"{part}_ms", 0.0)
            self._parts[part] += weight * (ms - self._parts[part])
        top = max(PARTS, key=self._parts.__getitem__)
        total = sum(self._parts.values())
        share = 100.0 * self._parts[top] / total if total > 0 else 0.0
        hit_rate = self._hits / self._lookups if self._lookups else 0.0
        self._bar.set_postfix_str(
            f"hit {hit_rate:.2f}, {mode}, {BOUND_OF_PART[top]}-bound {share:.0f}%",
            refresh=False)
        self._bar.update(1)

    def close(self) -> None:
        """Erase the line (the summary follows)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> LiveLine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
