"""How a warm-up streams a file (its threads, its pieces), in a module that imports nothing:
the warm-up command's head start reads like the engine before its imports."""

from __future__ import annotations

import os

__all__ = ["STREAM_PIECE_BYTES", "default_threads"]

STREAM_PIECE_BYTES = 32 << 20
"""Bytes a reader thread takes at a time when it streams a long stretch of a file."""


def default_threads() -> int:
    """Reader threads for a warm-up: mostly waiting on the disk, so more than the CPUs.

    16 kept a virtio disk at its ceiling on a 2-core machine; more CPUs get up to 32.
    """
    return min(32, max(16, 2 * (os.cpu_count() or 2)))
