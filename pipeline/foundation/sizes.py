"""Byte counts as people read them.

One function for every message and summary, so that a small model's sizes never all print
as ``0.00 GiB`` and a large one's are not a 12-digit count.
"""

from __future__ import annotations

__all__ = ["size_text"]


def size_text(nbytes: int) -> str:
    """A byte count in the largest binary unit it reaches (``1.50 GiB``, ``47.00 KiB``,
    ``12 B``), thousands grouped (``1,536.00 GiB``) as the analysis tables print counts."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:,.2f} {unit}"
    return f"{nbytes} B"
