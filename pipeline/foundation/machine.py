"""Live readings of the machine: RAM, this process's storage reads, disk counters.

The controller, the log and the run summary all read the machine through here, so tests
can substitute readings in one place.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import psutil

__all__ = [
    "MachineReadings",
    "disk_of",
    "machine_info",
    "process_read_bytes",
    "ram_available_bytes",
    "read_machine",
]


_io_fd: tuple[int, int] | None = None  # (pid, fd of /proc/<pid>/io), kept open


def process_read_bytes() -> int:
    """Bytes this process pulled from storage (page-cache hits do not count).

    Read once per token: the file stays open and is read with one ``pread`` (opening it
    each time was 38 us a token on the dev VM, a visible share of an all-cached token).
    """
    global _io_fd
    pid = os.getpid()
    try:
        if _io_fd is None or _io_fd[0] != pid:  # first use, or a forked child
            _io_fd = (pid, os.open(f"/proc/{pid}/io", os.O_RDONLY | os.O_CLOEXEC))
        data = os.pread(_io_fd[1], 4096, 0)
        at = data.index(b"\nread_bytes:") + 12
        return int(data[at : data.index(b"\n", at)])
    except (OSError, ValueError):
        io = psutil.Process().io_counters()
        return int(getattr(io, "read_bytes", 0))


def ram_available_bytes() -> int:
    """Available RAM alone (the cheap reading, for token boundaries)."""
    return int(psutil.virtual_memory().available)


@dataclass(frozen=True, slots=True)
class MachineReadings:
    """One sample of the machine."""

    ram_available_bytes: int
    ram_total_bytes: int
    process_read_bytes: int
    disk_read_bytes: int


def read_machine(*, disks: bool = True) -> MachineReadings:
    """Sample RAM (psutil), this process's storage reads and, with ``disks``, the system's
    disk reads (0 without: summing every disk's counters costs about twice the rest)."""
    vm = psutil.virtual_memory()
    disk = psutil.disk_io_counters() if disks else None
    return MachineReadings(
        ram_available_bytes=int(vm.available),
        ram_total_bytes=int(vm.total),
        process_read_bytes=process_read_bytes(),
        disk_read_bytes=int(disk.read_bytes) if disk is not None else 0,
    )


def disk_of(path: Path) -> str | None:
    """The device the file lives on (e.g. /dev/nvme0n1p2), if psutil can tell."""
    try:
        target = os.path.realpath(path)
        best = None
        for part in psutil.disk_partitions(all=False):
            if target.startswith(part.mountpoint) and (
                best is None or len(part.mountpoint) > len(best.mountpoint)
            ):
                best = part
        return best.device if best else None
    except OSError:
        return None


def machine_info(path: Path, gpu: str | None) -> dict[str, object]:
    """The run header's description of the machine."""
    return {
        "gpu": gpu,
        "ram_total_bytes": int(psutil.virtual_memory().total),
        "cpu_count": os.cpu_count(),
        "disk": disk_of(path),
    }
