"""A layer lease's parts: one device's share of a fetch (``LeasePart``, started by
``LeaseDesk.start_parts``), the pins dropped once a load has landed, and the event joiner
that lets a buffer be reused only after every user of it.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from moestream.gpu.backend import Event, Stream
from moestream.gpu.cache.store import DeviceCache, Entry
from moestream.pipeline.streaming.loads import LayerLoad

__all__ = ["EventJoiner", "LeasePart", "unpin", "unpin_when_landed"]


class EventJoiner:
    """One event that completes after two others, recorded on a device stream of its own.

    Args:
        stream: a stream of the device (used by the event loop's thread only).
        activate: makes the device current (events are created on the current device).
    """

    __slots__ = ("_activate", "_stream")

    def __init__(self, stream: Stream, activate: Callable[[], AbstractContextManager[Any]]
                 ) -> None:
        self._stream = stream
        self._activate = activate

    def join(self, a: Event | None, b: Event | None) -> Event | None:
        """``a`` and ``b`` both done; either alone when the other is absent or done."""
        if a is None or a is b or a.done():
            return b
        if b is None or b.done():
            return a
        with self._activate():
            self._stream.wait(a)
            self._stream.wait(b)
            return self._stream.record()


@dataclass(slots=True)
class LeasePart:
    """One device's share of a lease: its cache, event joiner and load."""

    device: int
    cache: DeviceCache
    joiner: EventJoiner
    load: LayerLoad


def unpin(part: LeasePart, entry: Entry, last_use: Event | None) -> None:
    """Drop one pin of ``entry`` if it is still the cache's entry for its key (a dropped
    entry's key may already belong to a new entry, whose pins are not ours to take)."""
    if part.cache.get(entry.key) is not entry:
        return
    part.cache.release([entry], part.joiner.join(entry.last_use, last_use or entry.upload))


def _landed_then_unpin(part: LeasePart, entry: Entry, _loaded: asyncio.Future[None]) -> None:
    unpin(part, entry, None)


def unpin_when_landed(part: LeasePart, entry: Entry) -> None:
    """Drop one pin of ``entry`` now if its load has landed, else once it does; the buffer
    is then reused only after the upload (and every earlier user's event)."""
    loaded = entry.loaded
    if loaded is None or loaded.done():
        unpin(part, entry, None)
    else:
        loaded.add_done_callback(functools.partial(_landed_then_unpin, part, entry))
