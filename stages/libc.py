"""The kernel calls on pages that Python's ``os`` and ``mmap`` modules do not make.

Residency needs ``mincore`` over a mapping, pinning needs ``mlock``, and the resident-mode
mapping (``moestream.stages.mapping``) places each file of a model at a fixed address inside
one reserved region; Python's ``mmap`` objects offer none of these, so they go through libc
with ``errno`` kept for the messages. The page-cache modules (``stages.residency``,
``stages.pagelock``) share one ``libc`` and one way of naming the file they work on: a path
they open, or a descriptor the caller owns.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
from collections.abc import Iterator

import numpy as np

from moestream.pipeline.foundation.errors import ResidencyError

__all__ = ["PAGE_BYTES", "FileRef", "Libc", "libc", "opened"]

PAGE_BYTES = mmap.PAGESIZE
"""The kernel page size: the unit of residency."""

_MAP_FAILED = ctypes.c_void_p(-1).value
_MAP_FIXED = 0x10  # Linux values; Python's mmap module exports neither
_PROT_NONE = 0
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)

FileRef = str | os.PathLike[str] | int
"""A path, or an open file descriptor (which stays owned by the caller)."""


class Libc:
    """The few libc calls Python's ``mmap`` module does not expose, with errno kept."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self.mmap = libc.mmap
        self.mmap.restype = ctypes.c_void_p
        self.mmap.argtypes = [
            ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
            ctypes.c_long,
        ]
        self.munmap = libc.munmap
        self.munmap.restype = ctypes.c_int
        self.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self.mincore = libc.mincore
        self.mincore.restype = ctypes.c_int
        self.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        self.mlock = libc.mlock
        self.mlock.restype = ctypes.c_int
        self.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self.munlock = libc.munlock
        self.munlock.restype = ctypes.c_int
        self.munlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]

    def reserve(self, length: int, what: str) -> int:
        """An inaccessible region of ``length`` bytes of address space (no memory), for
        ``map_read(fixed=...)`` to place files in; ``munmap`` frees it and them."""
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
        addr = self.mmap(None, length, _PROT_NONE, flags, -1, 0)
        if addr is None or addr == _MAP_FAILED:
            err = ctypes.get_errno()
            raise ResidencyError(f"{what}: reserving {length} bytes of address space failed: "
                                 f"{os.strerror(err)}")
        return int(addr)

    def map_read(self, fd: int, offset: int, length: int, what: str, *,
                 fixed: int | None = None) -> int:
        """Map ``length`` bytes of ``fd`` at page-aligned ``offset``, read-only and shared;
        at address ``fixed`` (inside a ``reserve``d region) when given."""
        flags = mmap.MAP_SHARED | (_MAP_FIXED if fixed is not None else 0)
        addr = self.mmap(fixed, length, mmap.PROT_READ, flags, fd, offset)
        if addr is None or addr == _MAP_FAILED:
            err = ctypes.get_errno()
            raise ResidencyError(
                f"{what}: mmap of {length} bytes at offset {offset} failed: {os.strerror(err)}"
            )
        return int(addr)

    def mincore_into(self, addr: int, length: int, out_addr: int, what: str) -> None:
        """``mincore`` of a mapping into the vector at ``out_addr``, raising on failure."""
        if self.mincore(addr, length, out_addr) != 0:
            err = ctypes.get_errno()
            raise ResidencyError(f"{what}: mincore: {os.strerror(err)}")

    def all_resident(self, addr: int, length: int, what: str) -> bool:
        """Whether every page of an existing mapping (page-aligned ``addr``) is in the page
        cache: ``mincore`` on the caller's mapping, no new one, so a check of one window
        costs only that window's page lookups."""
        vec = np.empty(-(-length // PAGE_BYTES), dtype=np.uint8)
        self.mincore_into(addr, length, vec.ctypes.data, what)
        return bool((vec & 1).all())


libc = Libc()
"""The one instance: residency, page locks and the resident-mode mapping go through it."""


@contextlib.contextmanager
def opened(target: FileRef) -> Iterator[tuple[int, str]]:
    """An fd for ``target`` and a name for messages; closes only what it opened."""
    if isinstance(target, int):
        yield target, f"fd {target}"
        return
    name = os.fspath(target)
    try:
        fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise ResidencyError(f"{name}: cannot open: {exc.strerror}") from None
    try:
        yield fd, name
    finally:
        os.close(fd)
