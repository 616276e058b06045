"""The run's structured JSON-lines log.

Library events (fallbacks, clamps, warnings) go through structlog wherever the application
pointed it (a command line renders them on stderr, ``pipeline.cli.console``). The run log
(``--log FILE``, schema in ``docs/LOG_SCHEMA.md``) is a structlog logger of its own whose
JSON lines are collected in memory and appended to the file by a background task through
aiofiles, so the decode loop never waits on the disk. Rendering is deferred too: ``emit``
keeps the event's fields and its time (a token's line took 112 us to render on the H200
machine's host, a third of the device's idle time at a token boundary); ``render`` turns
what is kept into lines, and the writer calls it before each append. An engine that has host
time to spare while its device computes (``pipeline.proxy.loop`` does, after queuing a
layer) calls ``render`` there, so the lines cost nothing on the path between one layer and
the next. ``aclose`` renders and flushes what is left.

The file is an output of ``pipeline.foundation.outputs``: a regular file, locked while the run
writes it, so a second run given the same ``--log`` is refused before it truncates anything. When
the file system refuses a write (full, file too large, I/O error) the log is cut back to its
last complete line, stops, and :attr:`RunLog.error` says so; the run raises it at its next
token boundary (:meth:`RunLog.raise_if_failed`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import time
from collections.abc import MutableMapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiofiles
import aiofiles.threadpool
import structlog

from moestream.pipeline.foundation.errors import OutputError
from moestream.pipeline.foundation.outputs import open_exclusive

__all__ = ["SCHEMA_VERSION", "RunLog"]

SCHEMA_VERSION = 2
"""The run log's schema (docs/LOG_SCHEMA.md); 2 added the token event's required ``time``."""


class _LineSink:
    """A structlog logger that keeps rendered lines until the writer takes them."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def msg(self, message: str) -> None:
        self.lines.append(message)

    info = debug = warning = error = msg


def _stamp(_logger: Any, _name: str,
           event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """``ts``, the float ``emit`` took, as ISO 8601 in UTC (structlog's ``TimeStamper``
    form, stamped when the event happened rather than when its line was rendered)."""
    ts = datetime.fromtimestamp(event_dict.pop("ts"), UTC)
    event_dict["ts"] = ts.isoformat().replace("+00:00", "Z")  # last, after ``event``, as before
    return event_dict


def _open_log(path: Path) -> Any:
    """The log file, locked and truncated, unbuffered: each write reaches the file whole or
    fails, so a failed flush knows how many bytes are in it."""
    return os.fdopen(open_exclusive(path, what="--log"), "wb", buffering=0)


def _close_opened(opening: asyncio.Future[Any]) -> None:
    """Close the file an abandoned open made (the run was cancelled while it ran)."""
    if not opening.cancelled() and opening.exception() is None:
        opening.result().close()


class RunLog:
    """The run's JSON-lines log; a no-op when no file was asked for.

    Args:
        path: the log file (truncated), or None.
        flush_ms: how often the background writer appends collected lines.
    """

    def __init__(self, path: Path | None, *, flush_ms: float = 200.0) -> None:
        self.path = path
        self._sink = _LineSink()
        self._pending: list[tuple[str, float, dict[str, Any]]] = []  # emitted, not rendered
        self._logger = structlog.wrap_logger(
            self._sink,
            # the time is taken at ``emit`` (``_stamp``), not when the line is rendered
            processors=[_stamp, structlog.processors.JSONRenderer(separators=(",", ":"))],
            # a plain BoundLogger: the console's level filter must not apply to the run log
            wrapper_class=structlog.BoundLogger,
        )
        self._flush_s = flush_ms / 1000.0
        self._file: Any = None
        self._writer: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        self.lines_written = 0
        self._bytes_written = 0
        self.error: OutputError | None = None
        """Why the log stopped being written (the file system refused a write), or None."""

    @property
    def enabled(self) -> bool:
        return self.path is not None

    async def open(self) -> None:
        """Open the file and start the background writer."""
        if self.path is None:
            return
        # the open runs on a worker thread and finishes even if this run is cancelled
        # meanwhile; then nobody would own the file it made, so close it right there
        loop = asyncio.get_running_loop()
        opening = loop.run_in_executor(None, functools.partial(_open_log, self.path))
        try:
            raw = await asyncio.shield(opening)
        except asyncio.CancelledError:
            opening.add_done_callback(_close_opened)
            raise
        self._file = aiofiles.threadpool.wrap(raw, loop=loop)
        self._writer = asyncio.get_running_loop().create_task(self._write_loop())

    def emit(self, event: str, **fields: Any) -> None:
        """One event line: ``schema``, the fields, ``event``, then ``ts``, the time of this
        call. Rendered later (``render``): the caller must not change the
        values it passed (a token's lists are made fresh for each line)."""
        if self.path is None or self.error is not None:
            return
        self._pending.append((event, time.time(), fields))

    def render(self) -> None:
        """Render the emitted events into lines (the writer appends them)."""
        if not self._pending:  # called once a layer: most calls find nothing
            return
        pending, self._pending = self._pending, []
        msg = self._logger.msg
        for event, ts, fields in pending:
            msg(event, schema=SCHEMA_VERSION, **fields, ts=ts)

    def raise_if_failed(self) -> None:
        """Raise :attr:`error` if the log could not be written."""
        if self.error is not None:
            raise self.error

    async def _flush(self) -> None:
        self.render()
        if not self._sink.lines or self._file is None or self.error is not None:
            return
        lines, self._sink.lines = self._sink.lines, []
        data = memoryview(("\n".join(lines) + "\n").encode("utf-8"))
        done = 0
        try:
            while done < len(data):  # an unbuffered write may be partial
                done += await self._file.write(data[done:])
        except OSError as exc:
            taken = data[:done].tobytes()  # what reached the file: keep its whole lines
            whole = taken.rfind(b"\n") + 1
            self._bytes_written += whole
            self.lines_written += taken.count(b"\n", 0, whole)
            await self._failed(exc)
            return
        self._bytes_written += done
        self.lines_written += len(lines)

    async def _failed(self, exc: OSError) -> None:
        """Cut the file back to its last complete line, stop the log, keep the reason."""
        assert self.path is not None
        kept = (f"it keeps its first {self.lines_written} lines" if self.lines_written
                else "it is empty")
        self.error = OutputError(self.path, f"cannot write the run log "
                                 f"({exc.strerror or exc}); {kept}", what="--log")
        self._sink.lines.clear()
        self._pending.clear()
        try:
            await self._file.truncate(self._bytes_written)
        except OSError as cut:
            structlog.get_logger("moestream.logs").warning(
                "log_not_cut_back", path=str(self.path), reason=str(cut),
                effect="the log may end with part of a line")

    async def _write_loop(self) -> None:
        # Never cancelled mid-write: aiofiles writes on a worker thread, and a cancelled
        # await would let the final flush write concurrently and interleave lines.
        while not self._stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self._flush_s)
            await self._flush()

    async def aclose(self) -> None:
        """Stop the writer after its last flush, then close the file."""
        if self._writer is not None:
            self._stopping.set()
            await asyncio.shield(self._writer)
            self._writer = None
        if self._file is not None:
            await self._flush()
            await self._file.close()
            self._file = None

    async def __aenter__(self) -> RunLog:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
