"""A run's totals as the command lines print them: the summary's lines, or its JSON.

A client's concern (the library prints nothing): both engines of ``python -m pipeline.run``
end with it, the proxy run (``run.py``) and ``--engine transformers`` (``transformers.py``),
so their summaries read alike. The totals themselves are the public ``moestream.RunSummary``.
"""

from __future__ import annotations

import json

from moestream import RunSummary
from moestream.pipeline.foundation.errors import printable
from moestream.pipeline.foundation.sizes import size_text

__all__ = ["print_summary"]


def print_summary(summary: RunSummary, as_json: bool) -> None:
    """The summary on stdout: its fields as JSON, or a few lines for people."""
    if as_json:
        print(json.dumps(summary.as_dict(), indent=2))
        return
    print(
        f"model      {printable(summary.model)}"
        f"{f' ({summary.experts})' if summary.experts else ''}\n"
        f"backend    {summary.backend} ({summary.device}), mode {summary.mode}"
        f"{f', {summary.switches} switches' if summary.switches else ''}\n"
        f"decoded    {summary.tokens} tokens in {summary.elapsed_s:.2f} s: "
        f"{summary.tokens_per_s:.2f} tok/s\n"
        f"cache      hit rate {summary.hit_rate:.3f} ({summary.hits} hits, {summary.misses} "
        f"misses, {summary.evictions} evictions), budget {size_text(summary.budget_bytes)},"
        f" peak {size_text(summary.peak_device_bytes)}\n"
        f"bytes      {size_text(summary.file_bytes)} read from file, "
        f"{size_text(summary.cache_bytes)} served from cache, "
        f"{size_text(summary.storage_bytes)} from storage\n"
        f"verified: {_count(summary.verified, 'expert')}, "
        f"{_count(summary.mismatches, 'mismatch', 'mismatches')}"
        f"{f', {summary.unverified} not verified' if summary.unverified else ''}"
        f" (digests: {summary.digests})"
    )


def _count(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and ``noun``, plural unless ``n`` is one (``1 expert``, ``0 mismatches``)."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"
