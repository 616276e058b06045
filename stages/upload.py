"""Upload: queue an expert's host bytes onto a CUDA stream and record its event.

Uploads go round-robin over at least two non-default streams, so the copy of one expert
overlaps the read of the next. Before writing into a recycled device buffer the stream
waits (on the device, the host never blocks) for the last compute that read it.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

from gpu.backend import Backend, Event, Stream
from gpu.cache import Entry

__all__ = ["Uploader"]


class Uploader:
    """Host-to-device copies on a set of streams.

    Args:
        backend: the device.
        n_streams: upload streams used in turn (at least 2 on a GPU).
    """

    def __init__(self, backend: Backend, n_streams: int = 2) -> None:
        if n_streams < 1:
            raise ValueError(f"need at least one upload stream, got {n_streams}")
        self._backend = backend
        self.streams: list[Stream] = [backend.new_stream() for _ in range(n_streams)]
        self._turn = itertools.cycle(range(n_streams))
        self._lock = threading.Lock()
        self.bytes_uploaded = 0
        self.copies = 0

    def next_stream(self) -> Stream:
        with self._lock:
            return self.streams[next(self._turn)]

    def upload(
        self,
        entry: Entry,
        pieces: Sequence[tuple[int, npt.NDArray[np.uint8]]],
        stream: Stream,
        then: Callable[[Stream], None] | None = None,
    ) -> Event:
        """Queue ``pieces`` (device offset, host view: pinned or registered) into the entry.

        The host views must stay unchanged until the returned event completes. A view must
        not span two separately registered host regions (CUDA rejects such a copy), so
        resident-mode callers split at registration windows. ``then`` queues more work
        on the stream (the install digest) before the event, so the event covers it.
        Thread-safe: workers call it for their own entries.
        """
        if entry.reuse_after is not None:
            stream.wait(entry.reuse_after)
        for device_offset, src in pieces:
            self._backend.copy_h2d(entry.buffer, device_offset, src, stream)
        if then is not None:
            then(stream)
        event = stream.record()
        entry.upload = event
        with self._lock:
            self.bytes_uploaded += sum(int(src.size) for _, src in pieces)
            self.copies += len(pieces)
        return event

    def synchronize(self) -> None:
        for stream in self.streams:
            stream.synchronize()

    def close(self) -> None:
        self.synchronize()
