"""Start loading the model while the warm-up command starts up.

Why: ``python -m tools.warmup MODEL`` spends a few tenths of a second importing numpy, gguf
and the pipeline, opening the table and measuring residency before its engine reads a byte;
``vmtouch -t`` reads from its first millisecond. For the plain warm-up (the whole file, no
mode or selection option) the command's first bytes are known from its arguments alone, so
``start_early`` reads the start of the file on a thread (``sendfile`` to ``/dev/null``, as
the engine does) while the imports run. The engine later measures
residency as usual and skips what is already there.

Only when the plain warm-up would not be refused: a regular file that starts with the GGUF
magic, whose size fits the RAM guard's room (``tools.warmup.ram_guard``'s margin, read from
``/proc/meminfo``) unless ``--force`` is given. This module imports nothing heavy.
"""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Sequence

__all__ = ["EARLY_MAX_BYTES", "EarlyRead", "plain_warm_target", "start_early"]

EARLY_MAX_BYTES = 1 << 30
"""At most this much of the file is asked for early: more than the start-up hides."""

_PIECE_BYTES = 8 << 20  # stop() waits for at most one piece
_MARGIN_BYTES = 2 << 30  # tools.warmup.ram_guard.MARGIN_BYTES (importing it costs start-up)
_MARGIN_FRACTION = 0.05  # tools.warmup.ram_guard.MARGIN_FRACTION


def plain_warm_target(argv: Sequence[str]) -> tuple[str, bool] | None:
    """``(MODEL, force)`` when ``argv`` asks for the plain warm-up of one model, else None.

    Accepted besides the model: ``--threads N``, ``--force`` and ``--debug``; any other
    option (a mode, a selection, ``--help``) or a second positional means None.
    """
    path: str | None = None
    force = False
    tokens = iter(argv)
    for token in tokens:
        if token == "--force":
            force = True
        elif token == "--debug" or token.startswith("--threads="):
            continue
        elif token == "--threads":
            next(tokens, None)
        elif token.startswith("-") or path is not None:
            return None
        else:
            path = token
    return None if path is None else (path, force)


def _room_bytes() -> int | None:
    """Available RAM minus the guard's margin, from ``/proc/meminfo`` (None: unknown)."""
    fields: dict[str, int] = {}
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                name, _, rest = line.partition(b":")
                if name in (b"MemTotal", b"MemAvailable"):
                    fields[name.decode()] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    if len(fields) < 2:
        return None
    margin = max(_MARGIN_BYTES, int(_MARGIN_FRACTION * fields["MemTotal"]))
    return fields["MemAvailable"] - margin


class EarlyRead:
    """The head start's reading thread; ``stop()`` ends it once the engine takes over.

    Args:
        fd: the model, opened; closed by the thread when it ends.
        nbytes: how much of its start to read.
    """

    __slots__ = ("_fd", "_nbytes", "_stop", "_thread")

    def __init__(self, fd: int, nbytes: int) -> None:
        self._fd = fd
        self._nbytes = nbytes
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, name="moestream-warm-early",
                                        daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 1.0) -> None:
        """Stop after the piece being read (the engine then reads the rest, not both)."""
        self._stop.set()
        self._thread.join(timeout_s)

    def join(self, timeout_s: float | None = None) -> None:
        """Wait for the reading to end by itself."""
        self._thread.join(timeout_s)

    def _read(self) -> None:
        """Splice the first bytes to ``/dev/null``: the kernel reads the pages (with
        sequential readahead) and copies nothing to user space. Closes the file.

        Not ``WILLNEED``: the kernel caps one such hint at the device's readahead window.
        """
        fd = self._fd
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            devnull = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
            try:
                done = 0
                while done < self._nbytes and not self._stop.is_set():
                    n = os.sendfile(devnull, fd, done, min(_PIECE_BYTES, self._nbytes - done))
                    if n == 0:
                        break
                    done += n
            finally:
                os.close(devnull)
        except OSError:
            pass  # a head start only: the engine reads what this did not, and reports errors
        finally:
            os.close(fd)


def start_early(argv: Sequence[str]) -> EarlyRead | None:
    """Start reading the model when ``argv`` is a plain warm-up that would go ahead.

    Returns:
        The reading (stop it before measuring what is resident), or None when nothing was
        started.
    """
    target = plain_warm_target(argv)
    if target is None:
        return None
    path, force = target
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None  # the command reports it, in its own words
    try:
        info = os.fstat(fd)
        room = None if force else _room_bytes()
        usable = (stat.S_ISREG(info.st_mode) and os.pread(fd, 4, 0) == b"GGUF"
                  and (force or (room is not None and info.st_size <= room)))
    except OSError:
        usable = False
    if not usable:
        os.close(fd)
        return None
    return EarlyRead(fd, min(info.st_size, EARLY_MAX_BYTES))
