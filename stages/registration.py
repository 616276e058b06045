"""Resident mode's source: the model mapping, registered with the device window by window.

Registering a window page-locks it so the copy engine reads the page cache with no CPU
copy. Only windows whose pages are all resident are registered (registering a cold one
would fault it in from storage at disk speed while the misses that wait on it stall), in
background passes on a worker; the warm-up asks for another pass once it has loaded more.
Releasing runs the one order that gives the memory back: unregister and unmap, then drop
the pages (registered or mapped pages survive DONTNEED).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Sequence

import structlog

from moestream.gpu.backend import Backend
from moestream.pipeline.foundation.files import ModelFile
from moestream.stages.mapping import ModelMapping

__all__ = ["MappingRegistrar"]

_log = structlog.get_logger("moestream.registration")


class MappingRegistrar:
    """Owns the mapping of one model file and its registration passes (event-loop side).

    Args:
        files: the model's files (``ExpertTable.files``).
        backend: registers windows (the host backend registers nothing).
        wanted: whether another pass asked for meanwhile should still run (resident mode).
    """

    def __init__(self, files: Sequence[ModelFile], backend: Backend,
                 wanted: Callable[[], bool]) -> None:
        self._files = files
        self._backend = backend
        self._wanted = wanted
        self.mapping: ModelMapping | None = None
        self._pass: asyncio.Future[int] | None = None
        self._stop = threading.Event()
        self._again = False

    def open(self) -> ModelMapping:
        """The mapping, made on first use."""
        if self.mapping is None:
            self.mapping = ModelMapping(self._files, self._backend)
        return self.mapping

    @property
    def pinned_bytes(self) -> int:
        """Model bytes page-locked right now (registered windows)."""
        mapping = self.mapping
        return mapping.registered_bytes if mapping is not None else 0

    def register_resident(self) -> None:
        """Start a background pass registering every window whose pages are all resident;
        with one under way, run another after it."""
        mapping = self.mapping
        if mapping is None or not self._backend.registers_host:
            return
        if self._pass is not None and not self._pass.done():
            self._again = True
            return
        self._stop.clear()
        loop = asyncio.get_running_loop()
        self._pass = loop.run_in_executor(None, self._register_windows, mapping)
        self._pass.add_done_callback(self._passed)

    async def registered(self) -> None:
        """Wait for the pass under way, and for any pass asked for meanwhile (``_passed``
        starts it before this wakes)."""
        while self._pass is not None and not self._pass.done():
            with contextlib.suppress(Exception):  # a failure is logged by _passed
                await asyncio.shield(self._pass)

    async def release(self, before_unmap: Callable[[], None], drop_pages: Callable[[], None],
                      ) -> None:
        """Stop registering, then on a worker: ``before_unmap`` (no copy may still read the
        registered pages), unregister and unmap, ``drop_pages``."""
        await self.stop()
        mapping, self.mapping = self.mapping, None
        if mapping is None:
            return

        def release() -> None:
            before_unmap()
            mapping.close()
            drop_pages()

        await asyncio.get_running_loop().run_in_executor(None, release)

    async def stop(self) -> None:
        """End the pass under way early and wait for it; no further pass starts."""
        self._again = False
        self._stop.set()
        if self._pass is not None:
            with contextlib.suppress(Exception):  # a failure is logged by _passed
                await self._pass
            self._pass = None

    def close(self) -> None:
        """Unregister and unmap (after ``stop``, once no copy reads the mapping)."""
        mapping, self.mapping = self.mapping, None
        if mapping is not None:
            mapping.close()

    def _register_windows(self, mapping: ModelMapping) -> int:
        t0 = time.perf_counter()
        added = mapping.register_resident_windows(self._stop)
        _log.info("windows_registered", added=added, registered_bytes=mapping.registered_bytes,
                  seconds=round(time.perf_counter() - t0, 3))
        return added

    def _passed(self, future: asyncio.Future[int]) -> None:
        if not future.cancelled() and future.exception() is not None:
            _log.warning("register_failed", reason=str(future.exception()))
        if self._again and self._wanted():
            self._again = False
            self.register_resident()
