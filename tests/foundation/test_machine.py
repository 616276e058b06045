"""``moestream.pipeline.foundation.machine``: the readings the controller and the token log take."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import psutil

from moestream.pipeline.foundation.machine import process_read_bytes


def test_storage_reads_counted_as_the_kernel_counts_them(tmp_path: Path) -> None:
    """An O_DIRECT read shows in this process's read bytes at once, equal to psutil's
    reading of the same counter (the per-token reading keeps its file open)."""
    path = tmp_path / "data"
    path.write_bytes(os.urandom(1 << 20))
    before = process_read_bytes()
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        buf = mmap.mmap(-1, 1 << 20)
        assert os.preadv(fd, [buf], 0) == 1 << 20
    finally:
        os.close(fd)
    after = process_read_bytes()
    assert after - before >= 1 << 20
    assert after == psutil.Process().io_counters().read_bytes
