"""Install: an expert becomes a ready cache entry once its upload event has completed.

Compute never needs to wait for this (it waits on the upload event on the device); install
is the cache's own bookkeeping, so that a later lookup can skip the device-side event wait.
A lookup that finds a load still in flight waits on ``entry.loaded`` (set once the upload is
queued) and then on the upload event, never reading the expert again.
"""

from __future__ import annotations

from collections.abc import Sequence

from moestream.gpu.cache.store import DeviceCache, Entry

__all__ = ["Installer"]


class Installer:
    """Tracks uploaded entries until their events complete, then marks them ready."""

    def __init__(self, cache: DeviceCache) -> None:
        self._cache = cache
        self._pending: list[Sequence[Entry]] = []
        self.installed = 0

    def submit(self, entries: Sequence[Entry]) -> None:
        """``entries`` were uploaded (their ``upload`` events are recorded): one expert's,
        or a layer's queued under one event, looked at together.

        Raises:
            ValueError: an entry has no upload event (it would hold up every later one).
        """
        if any(entry.upload is None for entry in entries):
            raise ValueError("submitted an entry with no upload event")
        if entries:
            self._pending.append(entries)

    def poll(self) -> int:
        """Mark ready every pending entry whose upload has completed; returns how many."""
        done = 0
        landed = 0
        # in the order submitted, up to the first still in flight: a device query a poll
        # for what is pending (uploads finish about in order; a later one that finished
        # first is installed a poll later, which only delays its ``ready``)
        for group in self._pending:
            if not _landed(group):
                break
            done += self._cache.mark_ready(group)
            landed += 1
        del self._pending[:landed]
        self.installed += done
        return done

    def drain(self) -> None:
        """Wait for every pending upload and install it (end of run)."""
        for group in self._pending:
            for entry in group:
                if entry.upload is not None:
                    entry.upload.synchronize()
        self.poll()

    @property
    def pending(self) -> int:
        """Uploads still to be looked at (an expert's, or a layer's under one event)."""
        return len(self._pending)


def _landed(group: Sequence[Entry]) -> bool:
    """Whether every entry's upload has completed (each distinct event asked once: a
    layer's entries share one)."""
    asked = None
    for entry in group:
        upload = entry.upload
        assert upload is not None  # ``submit`` takes none without
        if upload is not asked:
            if not upload.done():
                return False
            asked = upload
    return True
