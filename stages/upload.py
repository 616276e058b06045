"""Upload: queue an expert's host bytes onto a CUDA stream and record its event.

Uploads go round-robin over at least two non-default streams, so the copy of one expert
overlaps the read of the next. A layer's resident misses from the registered mapping go as
one ``gather`` launch instead, where the device reads registered memory in place, or, on
the copy engines, as one batched copy on one stream with one install-digest launch
(``upload_layer``). Before writing into a recycled device buffer the stream waits (on the
device, the host never blocks) for the last compute that read it.

A failed upload leaves no copy running: the stream is synchronized before the error is
raised, so the entry's buffer (dropped, never installed) can be reused safely.

Install: an uploaded expert becomes a ready cache entry once its upload event has completed
(``Installer``). Compute never needs to wait for this (it waits on the upload event on the
device); install is the cache's own bookkeeping, so that a later lookup can skip the
device-side event wait. A lookup that finds a load still in flight waits on ``entry.loaded``
(set once the upload is queued) and then on the upload event, never reading the expert again.

The ``corrupt`` fault (``pipeline.foundation.faults``) flips one byte of an expert's device copy
right here: after its copies, before its install digest and its event, in stream order, in either
I/O mode and on either backend.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
import structlog

from moestream.gpu.backend import Backend, Event, Kernels, Stream
from moestream.gpu.cache.store import DeviceCache, Entry
from moestream.gpu.kernels import COPY_FIELDS, NO_FLIP, copy_rows
from moestream.pipeline.foundation.errors import MoestreamError, UploadError
from moestream.pipeline.foundation.faults import FaultPlan

__all__ = ["Installer", "Uploader", "gather_rows"]

_Item = TypeVar("_Item", bound=tuple[Any, ...])
"""A layer's expert for ``Uploader._admitted``: (entry, its copies, then what its path
adds)."""

_log = structlog.get_logger("moestream.upload")


class Uploader:
    """Host-to-device copies on a set of streams.

    Args:
        backend: the device.
        n_streams: upload streams used in turn (at least 2 on a GPU).
        faults: injected faults (``upload``; tests and ``--inject`` only).
    """

    def __init__(
        self, backend: Backend, n_streams: int = 2, faults: FaultPlan | None = None
    ) -> None:
        if n_streams < 1:
            raise ValueError(f"need at least one upload stream, got {n_streams}")
        self._backend = backend
        self._faults = faults if faults else None  # an empty plan injects nothing either
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

        Raises:
            UploadError: a copy failed; the copies queued before it have finished (the
                stream was synchronized), and ``entry.upload`` is left unset.
        """
        try:
            # the copies after the buffer's last reader; an injected ``corrupt`` after them
            if entry.reuse_after is not None:
                stream.wait(entry.reuse_after)
            for i, (device_offset, src) in enumerate(pieces):
                self._backend.copy_h2d(entry.buffer, device_offset, src, stream)
                if i == 0 and self._faults is not None and self._faults.hit("upload") is not None:
                    raise UploadError(f"copy of {sum(int(s.size) for _, s in pieces)} bytes "
                                      "to the device failed (injected)")
            if (self._faults is not None and pieces
                    and self._faults.hit("corrupt") is not None):
                self._corrupt(entry, pieces[0][0] + pieces[0][1].size // 2, stream)
            with self._lock:  # counted once queued
                self.bytes_uploaded += sum(int(src.size) for _, src in pieces)
                self.copies += len(pieces)
            if then is not None:
                then(stream)
            event = stream.record()
        except BaseException as exc:
            self._settle(stream, entry)
            if isinstance(exc, MoestreamError) or not isinstance(exc, Exception):
                raise
            raise UploadError(f"copy to the device failed: {exc}") from exc
        entry.upload = event
        return event

    def upload_layer(
        self, kernels: Kernels,
        items: Sequence[tuple[Entry, Sequence[tuple[int, int, int]],
                              Sequence[tuple[int, int, int]]]],
    ) -> list[Event | Exception]:
        """Queue a layer's experts on one stream as one batched copy
        (``Backend.copy_h2d_batch``), then the install digests of them all as one
        ``Kernels.gather`` launch over the copies in place, then one event for the layer
        (as the gather path's).

        Why: the copy engines pay a fixed cost per copy, and the host one Python call per
        copy; a layer's slices in one driver call move at the copy engines' rate for large
        copies (``moestream.gpu.batchcopy``). An install digest launched per expert was host work a
        miss that held DeepSeek-V2-Lite's shape at 0.87 x pinned H2D against 0.95 without
        verification (``bench/results/shapes-h200-1952d34/``): one launch a layer. Each
        digest row's source is its destination: the kernel reads the copied words, adds
        them to the row's digest and writes them back unchanged.

        ``items``: per expert, its copies (device offset, host address in pinned or
        registered memory, bytes; none spanning two registrations) and its digest ranges
        (device offset, bytes, results row address; none when unverified). The stream first
        waits for every buffer's ``reuse_after``. Per expert, as ``upload``: an ``upload``
        fault fails it alone (its copies left out), a ``corrupt`` fault inverts the middle
        byte of its first copy after the copies, before its digest. A refused batch or a
        failed digest launch fails every expert queued (the stream synchronized first).
        The caller makes the device current.
        """
        stream = self.next_stream()
        faults = self._faults
        failed: list[Exception | None] = []
        srcs: list[int] = []  # per copy: host address, device address, bytes
        dsts: list[int] = []
        sizes: list[int] = []
        rows: list[int] = []  # the digest launch's rows, ``COPY_FIELDS`` fields each
        queued: list[Entry] = []
        corrupt: list[tuple[Entry, int]] = []
        for entry, pieces, digests in self._admitted(items, stream, failed):
            base = entry.buffer.ptr
            for offset, src, nbytes in pieces:
                srcs.append(src)
                dsts.append(base + offset)
                sizes.append(nbytes)
            if faults is not None and pieces and faults.hit("corrupt") is not None:
                corrupt.append((entry, pieces[0][0] + pieces[0][2] // 2))
            for offset, nbytes, out in digests:
                rows += (base + offset, base + offset, nbytes, out, NO_FLIP)
            queued.append(entry)
        if queued and srcs:
            error = self._copy_batch(stream, (srcs, dsts, sizes), corrupt, queued)
            if error is not None:
                return [error if f is None else f for f in failed]
        return self._one_event(kernels, rows, stream, queued, failed,
                               f"install digest of {len(queued)} experts on the device",
                               counts=(sum(sizes), len(sizes)))

    def _copy_batch(self, stream: Stream, copies: tuple[list[int], list[int], list[int]],
                    corrupt: Sequence[tuple[Entry, int]],
                    queued: Sequence[Entry]) -> UploadError | None:
        """One driver call for a layer's copies (host addresses, device addresses, bytes),
        then the injected ``corrupt`` flips; the error that fails every expert queued (the
        stream synchronized first), or None."""
        try:
            self._backend.copy_h2d_batch(np.array(copies, dtype=np.uint64), stream)
            for entry, at in corrupt:
                self._corrupt(entry, at, stream)
        except Exception as exc:
            self._settle(stream, queued[0])
            return UploadError(f"copy of {len(queued)} experts to the device failed: {exc}")
        return None

    def gather(
        self, kernels: Kernels, items: Sequence[tuple[Entry, Sequence[int], int]],
    ) -> list[Event | Exception]:
        """Queue several experts as one ``Kernels.gather`` launch on the next stream.

        ``items``: per expert, its launch rows relative to its buffer (``gather_rows``:
        the device offset where the launch has the destination, no digest, no flip) and
        the address of its first copy's digest row, the others 16 bytes apart (0: none).
        The stream first waits for every buffer's ``reuse_after``; every expert gets the
        launch's event. Per expert, as ``upload``: an ``upload`` fault fails it alone (its
        copies are left out of the launch), a ``corrupt`` fault inverts the middle byte of
        its first copy as it is written, before its digest. A failed launch fails them all
        (the stream synchronized first). The caller makes the device current.
        """
        stream = self.next_stream()
        faults = self._faults
        failed: list[Exception | None] = []  # per item: its injected failure, or queued
        rows: list[int] = []  # the launch's copies, ``COPY_FIELDS`` fields each
        queued: list[Entry] = []
        for entry, template, digest_at in self._admitted(items, stream, failed):
            # an expert's rows in a few list operations, not five fields a copy
            first = len(rows)
            rows += template
            end = len(rows)
            base = entry.buffer.ptr
            rows[first + 1 : end : COPY_FIELDS] = [base + offset
                                                   for offset in template[1::COPY_FIELDS]]
            if digest_at:
                rows[first + 3 : end : COPY_FIELDS] = range(
                    digest_at, digest_at + 16 * ((end - first) // COPY_FIELDS), 16)
            if faults is not None and template and faults.hit("corrupt") is not None:
                nbytes = rows[first + 2]
                rows[first + 4] = nbytes // 2
                _log.warning("corrupt_injected", key=entry.key,
                             device_offset=template[1] + nbytes // 2)
            queued.append(entry)
        return self._one_event(kernels, rows, stream, queued, failed,
                               f"gather of {len(rows) // COPY_FIELDS} copies to the device",
                               counts=(sum(rows[2::COPY_FIELDS]), len(rows) // COPY_FIELDS))

    def _admitted(self, items: Sequence[_Item], stream: Stream,
                  failed: list[Exception | None]) -> Iterator[_Item]:
        """The experts of a layer queued on one ``stream`` (``upload_layer``, ``gather``):
        each one an injected ``upload`` fault fails has its error put in ``failed`` and is
        skipped; for the others, in order, the stream waits for the buffer's ``reuse_after``
        (once for the event a layer's freed buffers share), None goes in ``failed``, and
        the item is yielded (the copies it names are the caller's to queue)."""
        faults = self._faults
        waited: Event | None = None
        for item in items:
            entry = item[0]
            if faults is not None and faults.hit("upload") is not None:
                failed.append(UploadError(f"copy of {entry.nbytes} bytes to the device "
                                          "failed (injected)"))
                continue
            if entry.reuse_after is not None and entry.reuse_after is not waited:
                waited = entry.reuse_after
                stream.wait(waited)
            failed.append(None)
            yield item

    def _one_event(self, kernels: Kernels, rows: list[int], stream: Stream,
                   queued: Sequence[Entry], failed: Sequence[Exception | None], what: str,
                   counts: tuple[int, int] = (0, 0)) -> list[Event | Exception]:
        """A layer's one ``gather`` launch of ``rows`` (if any) on ``stream`` and one event
        for every expert ``queued`` there; a failed launch fails them all (the stream
        synchronized first). Returns ``failed`` with that event (or error) in the places
        of the queued experts; ``counts`` (bytes, copies) are added once it was queued."""
        result: Event | Exception = UploadError("nothing queued")
        if queued:
            try:
                if rows:
                    kernels.gather(copy_rows(rows), stream)
                result = stream.record()
            except Exception as exc:
                self._settle(stream, queued[0])
                result = UploadError(f"{what} failed: {exc}")
            else:
                for entry in queued:
                    entry.upload = result
                with self._lock:
                    self.bytes_uploaded += counts[0]
                    self.copies += counts[1]
        return [result if f is None else f for f in failed]

    def _corrupt(self, entry: Entry, at: int, stream: Stream) -> None:
        """Injected: flip the byte at device offset ``at`` (the middle of the first piece)
        in the device copy, queued on ``stream`` after the copies (on the host backend, at
        once: its copies are done)."""
        view = self._backend.device_bytes(entry.buffer, at, 1)
        raw = getattr(stream, "raw", None)  # a CUDA stream: make it current for the kernel
        with raw if raw is not None else contextlib.nullcontext():
            view ^= 0xFF
        _log.warning("corrupt_injected", key=entry.key, device_offset=at)

    @staticmethod
    def _settle(stream: Stream, entry: Entry) -> None:
        """After a failed upload: wait for the copies already queued, so none still writes
        into the buffer once it is dropped and reused."""
        try:
            stream.synchronize()
        except Exception as exc:  # the stream is broken too: the run is stopping anyway
            _log.error("upload_stream_unusable", key=entry.key, reason=str(exc),
                       action="buffer may still be written by queued copies; run stops")

    def synchronize(self) -> None:
        for stream in self.streams:
            stream.synchronize()

    def close(self) -> None:
        self.synchronize()


def gather_rows(copies: Sequence[tuple[int, int, int]]) -> list[int]:
    """An expert's ``gather`` launch rows relative to its buffer, from its copies (device
    offset, source address, bytes): made once per expert and mapping; ``Uploader.gather``
    adds the buffer's address and the digest rows."""
    return [f for offset, src, nbytes in copies for f in (src, offset, nbytes, 0, NO_FLIP)]


class Installer:
    """Tracks uploaded entries until their events complete, then marks them ready."""

    def __init__(self, cache: DeviceCache) -> None:
        self._cache = cache
        self.pending: list[Sequence[Entry]] = []
        """Uploads still to be looked at (an expert's, or a layer's under one event)."""
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
            self.pending.append(entries)

    def poll(self) -> int:
        """Mark ready every pending entry whose upload has completed; returns how many."""
        done = 0
        landed = 0
        # in the order submitted, up to the first still in flight: a device query a poll
        # for what is pending (uploads finish about in order; a later one that finished
        # first is installed a poll later, which only delays its ``ready``)
        for group in self.pending:
            if not _landed(group):
                break
            done += self._cache.mark_ready(group)
            landed += 1
        del self.pending[:landed]
        self.installed += done
        return done

    def drain(self) -> None:
        """Wait for every pending upload and install it (end of run)."""
        for group in self.pending:
            for entry in group:
                if entry.upload is not None:
                    entry.upload.synchronize()
        self.poll()


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
