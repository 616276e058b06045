"""Install: an expert becomes a ready cache entry once its upload event has completed.

Compute never needs to wait for this (it waits on the upload event on the device); install
is the cache's own bookkeeping, so that a later lookup can skip the device-side event wait.
A lookup that finds a load still in flight waits on ``entry.loaded`` (set once the upload is
queued) and then on the upload event, never reading the expert again.
"""

from __future__ import annotations

from gpu.cache import DeviceCache, Entry

__all__ = ["Installer"]


class Installer:
    """Tracks uploaded entries until their events complete, then marks them ready."""

    def __init__(self, cache: DeviceCache) -> None:
        self._cache = cache
        self._pending: list[Entry] = []
        self.installed = 0

    def submit(self, entry: Entry) -> None:
        """``entry`` was uploaded (its ``upload`` event is recorded)."""
        self._pending.append(entry)

    def poll(self) -> int:
        """Mark ready every pending entry whose upload has completed; returns how many."""
        still: list[Entry] = []
        done = 0
        finished: set[int] = set()  # events seen complete: a gathered layer shares one
        for entry in self._pending:
            upload = entry.upload
            if upload is not None and (id(upload) in finished or upload.done()):
                finished.add(id(upload))
                if entry.key in self._cache and self._cache.get(entry.key) is entry:
                    self._cache.mark_ready(entry)
                    done += 1
            else:
                still.append(entry)
        self._pending = still
        self.installed += done
        return done

    def drain(self) -> None:
        """Wait for every pending upload and install it (end of run)."""
        for entry in self._pending:
            if entry.upload is not None:
                entry.upload.synchronize()
        self.poll()

    @property
    def pending(self) -> int:
        return len(self._pending)
