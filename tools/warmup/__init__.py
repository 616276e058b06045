"""``python -m tools.warmup``: preload, report, evict or lock a model's pages.

This package imports nothing heavy: ``main`` sets up the process (``single_threaded_blas``)
and, for a plain warm-up, starts the reads (``moestream.tools.warmup.early``) before
``moestream.tools.warmup.cli`` brings in numpy and the pipeline.
"""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from moestream.tools.warmup.early import start_early

if TYPE_CHECKING:
    from moestream.tools.warmup.ram_guard import MemoryProbe

__all__ = ["command", "main", "single_threaded_blas"]

_BLAS_THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS",)


def single_threaded_blas() -> bool:
    """Ask numpy's OpenBLAS for one thread, when numpy is not imported yet; returns whether
    it was asked.

    Why: OpenBLAS starts a thread per CPU when numpy is imported, and each spins for a while
    (about 0.08 s of CPU on the dev VM) before it sleeps; a 16-CPU machine paid more than a
    second of CPU for threads the command never uses (it does no floating-point linear
    algebra; the digest's integer ``np.dot`` does not go through BLAS). A value the user set
    is kept.
    """
    if "numpy" in sys.modules:
        return False
    for name in _BLAS_THREAD_VARIABLES:
        os.environ.setdefault(name, "1")
    return True


def main(argv: Sequence[str] | None = None, *, memory: MemoryProbe | None = None) -> int:
    """The ``moestream-warmup`` command (``moestream.tools.warmup.cli.main``), started lean.

    Args:
        argv: arguments (``sys.argv[1:]`` when None).
        memory: where the RAM guard reads available memory (psutil when None).
    """
    args = list(sys.argv[1:] if argv is None else argv)
    single_threaded_blas()
    # a given probe fakes RAM: leave the guard's decision to the command
    early = start_early(args) if memory is None else None
    from moestream.tools.warmup.cli import (
        main as cli_main,  # after the BLAS setting: it imports numpy
    )

    return cli_main(args, memory=memory, early=early)


def command() -> int:
    """``main`` as a process runs it (``python -m tools.warmup``, ``moestream-warmup``).

    Once the command is done, ``gc.freeze`` moves every object out of the collector's reach
    before the interpreter shuts down: its final collection otherwise walks all the objects
    that numpy, gguf and the table made, 50-130 ms on the dev VM (10-20 ms frozen), time in
    which the command is not done to anyone who waits for it (it is timed against
    ``vmtouch -t``). Nothing is skipped: files, threads and atexit handlers end as before.
    """
    code = main()
    gc.freeze()
    return code
