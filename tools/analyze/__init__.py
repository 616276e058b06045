"""``python -m tools.analyze``: summaries, comparisons, plots and what-if replays of run logs."""

from moestream.tools.analyze.cli import main

__all__ = ["main"]
