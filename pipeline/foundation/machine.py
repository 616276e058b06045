"""Live readings of the machine: RAM, this process's storage reads, disk counters.

The controller, the log and the run summary all read the machine through here, so tests
can substitute readings in one place.
"""

from __future__ import annotations

import os
import resource
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


def process_read_bytes() -> int:
    """Bytes this process pulled from storage (page-cache hits do not count).

    Read once per token, from ``getrusage``: Linux's ``ru_inblock`` counts this process's
    threads' reads (alive and gone) in 512-byte units, the per-task counter behind
    ``/proc/self/io``'s ``read_bytes``, which also adds the reads of every child the process
    has reaped (a token's figure would take a child's whole life of reads). In a decoding
    process ``/proc/self/io`` took 35 us a token on the dev VM (one ``pread`` of a file kept
    open) against 12 for ``getrusage``: a held token's end is ~0.4 ms of host time there.
    """
    return resource.getrusage(resource.RUSAGE_SELF).ru_inblock * 512


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
