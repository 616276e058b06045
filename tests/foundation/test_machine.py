"""``moestream.pipeline.foundation.machine``: the readings the controller and the token log take."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import threading
from pathlib import Path

import psutil

from moestream.pipeline.foundation.machine import process_read_bytes
from moestream.stages.residency import evict


def _proc_read_bytes() -> int:
    """``/proc/self/io``'s count (psutil's reading of it): the process's threads' reads, and
    those of the children it has reaped."""
    return int(psutil.Process().io_counters().read_bytes)


def test_storage_reads_counted_as_the_kernel_counts_them(tmp_path: Path) -> None:
    """An O_DIRECT read, and a buffered one by a thread that has ended since, show in this
    process's read bytes at once, as much as in ``/proc/self/io``'s (the same per-task
    counter, which ``getrusage`` reports in 512-byte units)."""
    path = tmp_path / "data"
    path.write_bytes(os.urandom(1 << 20))
    evict(path)
    before, proc = process_read_bytes(), _proc_read_bytes()
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        buf = mmap.mmap(-1, 1 << 20)
        assert os.preadv(fd, [buf], 0) == 1 << 20
    finally:
        os.close(fd)
    after = process_read_bytes()
    assert after - before == _proc_read_bytes() - proc >= 1 << 20
    evict(path)
    before, proc = after, _proc_read_bytes()
    reader = threading.Thread(target=path.read_bytes)
    reader.start()
    reader.join()
    assert process_read_bytes() - before == _proc_read_bytes() - proc >= 1 << 20


def test_a_child_process_reads_are_its_own(tmp_path: Path) -> None:
    """A child's storage reads are not this process's (``/proc/self/io`` adds a reaped
    child's to its parent's: a token's figure would take them)."""
    path = tmp_path / "data"
    path.write_bytes(os.urandom(4 << 20))
    evict(path)
    before, proc = process_read_bytes(), _proc_read_bytes()
    subprocess.run([sys.executable, "-c", f"open({str(path)!r}, 'rb').read()"], check=True)
    assert _proc_read_bytes() - proc >= 4 << 20
    assert process_read_bytes() - before < 1 << 20
