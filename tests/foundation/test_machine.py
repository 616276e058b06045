"""``moestream.pipeline.foundation.machine``: the readings the controller and the token log take."""

from __future__ import annotations

import mmap
import os
import threading
from pathlib import Path

import psutil

from moestream.pipeline.foundation.machine import process_read_bytes
from moestream.stages.residency import evict


def test_storage_reads_counted_as_the_kernel_counts_them(tmp_path: Path) -> None:
    """An O_DIRECT read, and a buffered one by a thread that has ended since, show in this
    process's read bytes at once, equal to ``/proc/self/io``'s (psutil's reading of it):
    ``getrusage``'s count is the same counter."""
    path = tmp_path / "data"
    path.write_bytes(os.urandom(1 << 20))
    evict(path)
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
    evict(path)
    reader = threading.Thread(target=path.read_bytes)
    reader.start()
    reader.join()
    later = process_read_bytes()
    assert later - after >= 1 << 20
    assert later == psutil.Process().io_counters().read_bytes
