"""Values and plain-text building blocks shared by the analysis reports.

``tools.analyze`` (summary, comparison and what-if tables) and ``tools.analyze.device_report`` (the
per-device table) render their figures with these: one value type, one ratio rule, one
aligned-table layout and one byte-size format, so that the sections of a report read alike.
"""

from __future__ import annotations

import math

from moestream.pipeline.foundation.sizes import size_text

__all__ = ["GB", "MB", "Value", "ratio", "size_text", "text_table"]

Value = float | int | str | bool | None
"""One figure of a report: a number, a label or a flag; None when its source was absent."""

MB = 1e6
GB = 1e9


def ratio(num: float, den: float) -> float | None:
    """``num / den``, or None when ``den`` is not positive or ``num`` is not finite."""
    return num / den if den > 0 and math.isfinite(num) else None


def text_table(rows: list[list[str]]) -> str:
    """Rows as an aligned table: the first row a header underlined with dashes, the first
    column left-aligned and the others right-aligned."""
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    lines = []
    for i, row in enumerate(rows):
        cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:],
                                                                           strict=True)]
        lines.append("  ".join(cells).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines) + "\n"
