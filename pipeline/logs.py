"""Logging: library events to the console, and the run's structured JSON-lines log.

Two streams with two jobs. Library events (fallbacks, clamps, warnings) go through
structlog to stderr, rendered for people. The run log (``--log FILE``, schema in
``docs/LOG_SCHEMA.md``) is a structlog logger of its own whose JSON lines are collected in
memory and appended to the file by a background task through aiofiles, so the decode loop
never waits on the disk: rendering costs microseconds per token, the write happens off the
hot path, and ``aclose`` flushes what is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import sys
from pathlib import Path
from typing import Any

import aiofiles
import aiofiles.threadpool
import structlog

__all__ = ["SCHEMA_VERSION", "RunLog", "configure_console"]

SCHEMA_VERSION = 1


def configure_console(*, debug: bool = False) -> None:
    """Render library events on stderr: warnings and up, everything with ``debug``."""
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="%H:%M:%S", utc=False),
            structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty()),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.DEBUG if debug else logging.WARNING
        ),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )


class _LineSink:
    """A structlog logger that keeps rendered lines until the writer takes them."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def msg(self, message: str) -> None:
        self.lines.append(message)

    info = debug = warning = error = msg


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
        self._logger = structlog.wrap_logger(
            self._sink,
            processors=[
                structlog.processors.TimeStamper(fmt="iso", utc=True, key="ts"),
                structlog.processors.JSONRenderer(separators=(",", ":")),
            ],
            # a plain BoundLogger: the console's level filter must not apply to the run log
            wrapper_class=structlog.BoundLogger,
        )
        self._flush_s = flush_ms / 1000.0
        self._file: Any = None
        self._writer: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        self.lines_written = 0

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
        opening = loop.run_in_executor(None, functools.partial(open, self.path, "w",
                                                               encoding="utf-8"))
        try:
            raw = await asyncio.shield(opening)
        except asyncio.CancelledError:
            opening.add_done_callback(_close_opened)
            raise
        self._file = aiofiles.threadpool.wrap(raw, loop=loop)
        self._writer = asyncio.get_running_loop().create_task(self._write_loop())

    def emit(self, event: str, **fields: Any) -> None:
        """One event line (``event`` and ``schema`` first, then the fields)."""
        if self.path is None:
            return
        self._logger.msg(event, schema=SCHEMA_VERSION, **fields)

    async def _flush(self) -> None:
        if not self._sink.lines or self._file is None:
            return
        lines, self._sink.lines = self._sink.lines, []
        await self._file.write("\n".join(lines) + "\n")
        await self._file.flush()
        self.lines_written += len(lines)

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
