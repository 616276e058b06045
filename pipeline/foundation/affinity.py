"""Pinning the decode loop's thread to one CPU, and keeping the helper threads off that pin.

Why: on small experts warm misses are bound by the loop thread's host work (10-20 misses a
layer), and on the H200's host that work ran 1.4-1.7 x slower when the thread was free to
move between CPUs: ``bench.profile --backend cupy`` on the fine-grained shape took 542-581
us a layer unpinned against 364-473 under ``taskset -c``, and ``bench.pipeline``'s warm
misses read 0.79 and 0.86 x pinned H2D unpinned against 0.90 and 0.91 pinned
(``bench/results/pin-h200/``). The device's reads of host memory slow the host's Python
too (``bench.dmaload``: 1.7 x), which a warm core's caches soften.

Linux gives each thread its own CPU mask and a new thread inherits its creator's, so the
pools the pinned loop thread starts would share its one CPU: every pool of the run takes
``widen_thread`` as its initializer, which gives a new thread back the mask the loop
thread had before it was pinned.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from pipeline.foundation.errors import UsageError

__all__ = ["PinSpec", "parse_pin", "pinned", "resolve_cpu", "widen_thread"]

PinSpec = int | str | None
"""A CPU index, ``"auto"`` (the highest CPU the thread may use), or None (no pin)."""

_wide: set[int] | None = None  # the mask the pinned thread had; helper threads get it back


def parse_pin(text: str) -> PinSpec:
    """``--pin-cpu``'s text: an index, ``auto`` or ``off``.

    Raises:
        UsageError: anything else.
    """
    if text in ("auto", "off"):
        return None if text == "off" else "auto"
    if not text.isdigit():
        raise UsageError(f"--pin-cpu must be a CPU index, auto or off, got {text!r}")
    return int(text)


def _supported() -> bool:
    return hasattr(os, "sched_setaffinity") and hasattr(os, "sched_getaffinity")


def resolve_cpu(spec: PinSpec) -> int | None:
    """The CPU ``spec`` names for the calling thread, or None for no pin.

    ``"auto"`` pins only where the thread may use more than one CPU and the platform can
    pin (the highest such CPU: CPU 0 takes most interrupts); an explicit index must be one
    the thread may use.

    Raises:
        UsageError: an index the thread may not use, or pinning is not supported here.
    """
    if spec is None:
        return None
    if not _supported():
        if spec == "auto":
            return None
        raise UsageError("--pin-cpu: this platform cannot pin a thread to a CPU")
    allowed = os.sched_getaffinity(0)
    if spec == "auto":
        return max(allowed) if len(allowed) > 1 else None
    if not isinstance(spec, int) or spec not in allowed:
        raise UsageError(f"--pin-cpu {spec}: not a CPU this process may use "
                         f"({_ranges(sorted(allowed))})")
    return spec


@contextlib.contextmanager
def pinned(spec: PinSpec) -> Iterator[int | None]:
    """Pin the calling thread to ``spec``'s CPU for the block, then give it its mask back.

    Threads started meanwhile by pools that run ``widen_thread`` get the old mask.
    Yields the CPU (None: not pinned).
    """
    global _wide
    cpu = resolve_cpu(spec)
    if cpu is None:
        yield None
        return
    before = os.sched_getaffinity(0)
    outer = _wide
    _wide = before if outer is None else outer
    os.sched_setaffinity(0, {cpu})
    try:
        yield cpu
    finally:
        os.sched_setaffinity(0, before)
        _wide = outer


def widen_thread() -> None:
    """A pool thread's initializer: off the decode loop's CPU, while a pin holds."""
    if _wide is not None:
        os.sched_setaffinity(0, _wide)


def _ranges(cpus: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    parts: list[str] = []
    for cpu in cpus:
        if parts and cpus[cpus.index(cpu) - 1] == cpu - 1:
            parts[-1] = f"{parts[-1].split('-')[0]}-{cpu}"
        else:
            parts.append(str(cpu))
    return ",".join(parts)
