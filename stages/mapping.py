"""The model's read-only mapping: the source of resident mode's uploads.

Resident mode reads nothing: ``ModelMapping`` maps the model and, on a GPU, page-locks it
window by window (``cudaHostRegister``, read-only) so the copy engine DMAs straight from
the page cache. A model of several files (a checkpoint's shards) is mapped into one reserved
region, each file at its base in the model's address space (``pipeline.foundation.files``),
so an offset is an address there as it is for one file; no window spans two files.
"""

from __future__ import annotations

import bisect
import ctypes
import os
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt
import structlog

from moestream.gpu.backend import Backend
from moestream.pipeline.foundation.files import ModelFile, model_files, open_checked
from moestream.stages.libc import libc

__all__ = ["ModelMapping"]

_log = structlog.get_logger("moestream.mapping")


class ModelMapping:
    """A read-only shared mapping of the model, registered with the device in windows.

    Registration page-locks (and, for pages not yet resident, faults in) a window; it is
    done once per window on first use. ``close`` unregisters, then unmaps: the pages can
    only be dropped after both (DESIGN.md: DONTNEED leaves registered or mapped pages).

    Args:
        model: the model's files (``ExpertTable.files``; each opened against the identity
            the table saw), or a path standing for a one-file model.
        backend: registers windows (a no-op on the host backend).
        window_bytes: registration granularity.
    """

    def __init__(self, model: Path | Sequence[ModelFile], backend: Backend,
                 window_bytes: int = 256 << 20) -> None:
        self._backend = backend
        self._window = window_bytes
        files = model_files(model)
        self._path = files[0].path
        self.file_bytes = files[-1].span_end
        # windows never span two files: one registration is one file's pages
        self._starts: list[int] = []
        self._lengths: list[int] = []
        for f in files:
            for start in range(f.base, f.span_end, window_bytes):
                self._starts.append(start)
                self._lengths.append(min(window_bytes, f.span_end - start))
        # mapped through libc, not Python's mmap: numpy views of a Python mmap pin it
        # (close raises while any view lives), and the lifetime here is explicit
        self._addr = libc.reserve(self.file_bytes, str(self._path)) if len(files) > 1 else 0
        try:
            for f in files:
                fd = open_checked(f)
                try:
                    if f.nbytes:
                        at = libc.map_read(fd, 0, f.span_end - f.base, str(f.path),
                                           fixed=self._addr + f.base if self._addr else None)
                        self._addr = self._addr or at
                finally:
                    os.close(fd)
        except BaseException:
            if self._addr:
                libc.munmap(self._addr, self.file_bytes)
            raise
        self.array: npt.NDArray[np.uint8] = np.ctypeslib.as_array(
            (ctypes.c_uint8 * self.file_bytes).from_address(self._addr)
        )
        self._registered: dict[int, npt.NDArray[np.uint8]] = {}
        self._refused: set[int] = set()
        self._lock = threading.Lock()
        self.registered_bytes = 0

    def register_resident_windows(self, stop: threading.Event | None = None) -> int:
        """Register every window whose pages are all resident; returns how many were new.

        A window with any page missing is skipped (registering it would read it from
        storage first); only windows not yet registered are checked, so a pass once all
        are costs nothing (a whole-file ``mincore`` took 0.33 s on the 34 GiB model).
        ``stop`` ends the pass early. Thread-safe.
        """
        if not self._backend.registers_host:
            return 0
        added = 0
        for w in range(len(self._starts)):
            if stop is not None and stop.is_set():
                break
            if w in self._registered or w in self._refused:
                continue
            with self._lock:
                if self.array.size == 0:
                    break  # closed meanwhile
                start, length = self._starts[w], self._lengths[w]
                if not libc.all_resident(self._addr + start, length, str(self._path)):
                    continue
                window = self.array[start : start + length]
                if self._backend.register_host(window):
                    self._registered[w] = window
                    self.registered_bytes += window.size
                    added += 1
                else:
                    self._refused.add(w)
        return added

    def is_registered(self, offset: int, nbytes: int) -> bool:
        """Every window covering the range is registered (a lock-free read)."""
        if not self._backend.registers_host:
            return True
        first = self._window_of(offset)
        last = self._window_of(offset + nbytes - 1)
        return all(w in self._registered for w in range(first, last + 1))

    def _window_of(self, offset: int) -> int:
        return bisect.bisect_right(self._starts, offset) - 1

    def address(self, offset: int) -> int:
        """The address of a byte of the mapping; on a device that maps registered memory
        (``Backend.maps_host``) kernels read a registered range at it, across windows."""
        return self._addr + offset

    def spans(self, offset: int, nbytes: int) -> list[tuple[int, int]]:
        """(offset within the range, bytes) pieces of a range, split at window boundaries.

        One copy may not span two registrations, so each piece lies in one window.
        """
        out = []
        at = offset
        end = offset + nbytes
        while at < end:
            w = self._window_of(at)
            stop = min(end, self._starts[w] + self._lengths[w])
            out.append((at - offset, stop - at))
            at = stop
        return out

    def pieces(self, offset: int, nbytes: int) -> list[tuple[int, npt.NDArray[np.uint8]]]:
        """``spans`` as (offset within the range, view of the mapping)."""
        return [(at, self.array[offset + at : offset + at + n])
                for at, n in self.spans(offset, nbytes)]

    def close(self) -> None:
        """Unregister every window, then unmap."""
        with self._lock:
            for window in self._registered.values():
                self._backend.unregister_host(window)
            self._registered.clear()
            self.registered_bytes = 0
        self.array = np.empty(0, dtype=np.uint8)
        if self._addr:
            libc.munmap(self._addr, self.file_bytes)
            self._addr = 0

    def __enter__(self) -> ModelMapping:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
