"""The RAM guard: refuse to load more of a file into RAM than the machine can spare.

``check_ram`` compares the bytes an action would add to the page cache with available RAM
minus a margin. The warm-up CLI (``tools.warmup``, unless ``--force``) and the benchmarks'
``bench.kit.make_resident`` ask it before they warm or lock a file.
"""

from __future__ import annotations

from typing import Protocol

from moestream.pipeline.foundation.errors import UsageError

__all__ = ["MARGIN_BYTES", "MARGIN_FRACTION", "MemoryProbe", "PsutilMemory", "check_ram"]

MARGIN_BYTES = 2 << 30
"""The smallest margin kept free, bytes."""
MARGIN_FRACTION = 0.05
"""The margin as a share of total RAM, when that is larger than ``MARGIN_BYTES``."""


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


class MemoryProbe(Protocol):
    """Where the RAM guard reads memory figures (injectable for tests)."""

    def available_bytes(self) -> int: ...

    def total_bytes(self) -> int: ...


class PsutilMemory:
    """The machine's memory as ``moestream.pipeline.foundation.machine`` reads it (psutil)."""

    def available_bytes(self) -> int:
        from moestream.pipeline.foundation.machine import (
            ram_available_bytes,  # psutil: only when the guard runs
        )

        return ram_available_bytes()

    def total_bytes(self) -> int:
        from moestream.pipeline.foundation.machine import read_machine

        return read_machine(disks=False).ram_total_bytes


def check_ram(need_bytes: int, memory: MemoryProbe, what: str) -> None:
    """Refuse to load ``need_bytes`` more than available RAM minus a margin.

    The margin is 2 GiB or 5% of RAM, whichever is larger.

    Raises:
        UsageError: with both figures.
    """
    available = memory.available_bytes()
    margin = max(MARGIN_BYTES, int(MARGIN_FRACTION * memory.total_bytes()))
    room = available - margin
    if need_bytes > room:
        raise UsageError(
            f"refusing to {what} {_gib(need_bytes)} not yet resident: only {_gib(max(room, 0))} "
            f"may be used ({_gib(available)} available minus a {_gib(margin)} margin); "
            "use --force to do it anyway"
        )
