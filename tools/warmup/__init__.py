"""``python -m tools.warmup``: preload, report, evict or lock a model's pages."""

from tools.warmup.cli import main

__all__ = ["main"]
