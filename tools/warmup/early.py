"""Start loading the model while the warm-up command starts up.

Why: ``python -m tools.warmup MODEL`` spends 0.5-0.7 s on the H200's host importing numpy,
gguf, structlog and the pipeline before its engine can read a byte; ``vmtouch -t`` reads
from its first millisecond. For the plain warm-up (the whole file, no mode or selection
option) what the command reads is known from its arguments alone, so ``start_early`` starts
reading the file from its start, with the engine's threads and pieces, while the imports
run, and keeps reading while the command measures what is resident and checks the RAM; the
command then stops it and hands the engine only what lies past the start it read through
(``EarlyRead.stop``).

Only when the plain warm-up would not be refused: a regular file that starts with the GGUF
magic, whose size fits the RAM guard's room (``tools.warmup.ram_guard``'s margin, read from
``/proc/meminfo``) unless ``--force`` is given. This module imports nothing heavy.
"""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Sequence
from typing import NamedTuple

from moestream.pipeline.foundation.warm_threads import STREAM_PIECE_BYTES, default_threads

__all__ = ["EarlyRead", "PlainWarm", "plain_warm_target", "start_early"]

_MARGIN_BYTES = 2 << 30  # tools.warmup.ram_guard.MARGIN_BYTES (importing it costs start-up)
_MARGIN_FRACTION = 0.05  # moestream.tools.warmup.ram_guard.MARGIN_FRACTION


class PlainWarm(NamedTuple):
    """A plain warm-up's arguments."""

    path: str
    force: bool
    threads: int | None


def plain_warm_target(argv: Sequence[str]) -> PlainWarm | None:
    """The arguments when ``argv`` asks for the plain warm-up of one model, else None.

    Accepted besides the model: ``--threads N``, ``--force`` and ``--debug``; any other
    option (a mode, a selection, ``--help``) or a second positional means None, and so does
    a ``--threads`` that is not a positive number (the command reports it).
    """
    path: str | None = None
    force = False
    threads: str | None = None
    tokens = iter(argv)
    for token in tokens:
        if token == "--force":
            force = True
        elif token == "--debug":
            continue
        elif token.startswith("--threads="):
            threads = token.partition("=")[2]
        elif token == "--threads":
            threads = next(tokens, "")
        elif token.startswith("-") or path is not None:
            return None
        else:
            path = token
    if path is None:
        return None
    if threads is None:
        return PlainWarm(path, force, None)
    if not threads.isdigit() or int(threads) < 1:
        return None
    return PlainWarm(path, force, int(threads))


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
    """The head start's reading threads; ``stop()`` hands over to the engine.

    Threads take the file's next piece in turn (the order stays sequential, so the kernel's
    readahead works as for one reader) and splice it to ``/dev/null``: the kernel reads the
    pages and copies nothing to user space. Several threads because one ``sendfile`` at a
    time left the disk part idle (1.3-1.5 GB/s on the H200's disk, against 1.8 for the
    engine's threads and vmtouch). Not ``WILLNEED``: the kernel caps one such hint at the
    device's readahead window.

    Args:
        fd: the model, opened; closed once the last thread ends.
        nbytes: how much of its start to read.
        threads: reading threads.
        piece_bytes: bytes a thread takes at a time.

    Attributes:
        file_id: the file read, ``(st_dev, st_ino)``.
    """

    __slots__ = ("_claimed", "_done", "_fd", "_lock", "_nbytes", "_piece", "_running",
                 "_stop", "_threads", "file_id")

    def __init__(self, fd: int, nbytes: int, threads: int,
                 piece_bytes: int = STREAM_PIECE_BYTES) -> None:
        info = os.fstat(fd)
        self.file_id = (info.st_dev, info.st_ino)
        self._fd = fd
        self._nbytes = nbytes
        self._piece = piece_bytes
        self._lock = threading.Lock()
        self._claimed = 0  # the next piece starts here
        self._done: list[tuple[int, int]] = []  # pieces read through, (start, end)
        self._stop = threading.Event()
        self._running = threads
        self._threads = [threading.Thread(target=self._read, name="moestream-warm-early",
                                          daemon=True) for _ in range(threads)]
        for t in self._threads:
            t.start()

    def stop(self, timeout_s: float = 5.0) -> int:
        """Stop once the pieces being read are read; returns how many bytes from the
        file's start were all read (the engine need not read them again)."""
        self._stop.set()
        self.join(timeout_s)
        return self.read_prefix()

    def join(self, timeout_s: float | None = None) -> None:
        """Wait for the reading to end (by itself, or after ``stop``)."""
        for t in self._threads:
            t.join(timeout_s)

    def read_prefix(self) -> int:
        """The length of the file's start whose every piece was read through."""
        with self._lock:
            pieces = sorted(self._done)
        prefix = 0
        for start, end in pieces:
            if start != prefix:
                break
            prefix = end
        return prefix

    def _claim(self) -> tuple[int, int] | None:
        with self._lock:
            start = self._claimed
            if start >= self._nbytes or self._stop.is_set():
                return None
            self._claimed = end = min(start + self._piece, self._nbytes)
            return start, end

    def _read(self) -> None:
        fd = self._fd
        try:
            devnull = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
            try:
                while (piece := self._claim()) is not None:
                    start, end = piece
                    done = start
                    while done < end:
                        n = os.sendfile(devnull, fd, done, end - done)
                        if n == 0:
                            return  # the file shrank: the engine reports what it finds
                        done += n
                    with self._lock:
                        self._done.append(piece)
            finally:
                os.close(devnull)
        except OSError:
            pass  # a head start only: the engine reads what this did not, and reports errors
        finally:
            with self._lock:
                self._running -= 1
                last = self._running == 0
            if last:
                os.close(fd)


def start_early(argv: Sequence[str]) -> EarlyRead | None:
    """Start reading the model when ``argv`` is a plain warm-up that would go ahead.

    Returns:
        The reading (stop it before the engine reads), or None when nothing was started.
    """
    target = plain_warm_target(argv)
    if target is None:
        return None
    try:
        fd = os.open(target.path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None  # the command reports it, in its own words
    try:
        info = os.fstat(fd)
        room = None if target.force else _room_bytes()
        usable = (stat.S_ISREG(info.st_mode) and os.pread(fd, 4, 0) == b"GGUF"
                  and (target.force or (room is not None and info.st_size <= room)))
        if usable:  # WarmEngine's stream descriptor's advice: a larger readahead window
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
    except OSError:
        usable = False
    if not usable:
        os.close(fd)
        return None
    return EarlyRead(fd, info.st_size, target.threads or default_threads())
