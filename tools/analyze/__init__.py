"""``python -m tools.analyze``: summaries, comparisons, plots and what-if replays of run logs."""

from tools.analyze.cli import main

__all__ = ["main"]
