"""Read a moestream run log (docs/LOG_SCHEMA.md) into numpy columns, tolerantly.

Logs are read after the fact, often from runs that were killed, so the reader accepts what a
real file looks like (blank lines, a cut-off last line, fields and events from newer
writers) and counts every line it could not use instead of failing or hiding it. Only a file
that is not a moestream log at all is refused, with a ``TraceError`` that names the path,
and so is an expert id no int32 holds (naming the line). A line holding an integer no int64
holds (a 4000-digit ``wall_ms``) is skipped and counted (``out_of_range``), never turned
into a float that overflows. Lines are read with a length cap
(``MAX_LINE_BYTES``): a longer one is skipped a piece at a time, never held whole, so a file
without newlines costs no more memory than one line.

Token lines are turned into numbers 4096 at a time, folded into running sums
(``moestream.pipeline.runlog.stats``) and, where asked, kept as numpy columns for intervals and
plots; where asked, the expert ids of every token become one ``(tokens, layers, top_k)``
array that the what-if simulator replays. What that array may take follows the log's size,
never a value in it (``ExpertBuffer``): a token listing more experts in a layer than the
model has keeps its numbers but not its lists (a counted problem), and a log whose few wide
lists would pad every token past 64 bytes a byte of log is refused in one line. Plain
``json`` parsing dominates the cost; reading is synchronous because there is nothing to
overlap it with (a single sequential file read, CPU-bound parsing), so ``aiofiles`` would
only add overhead.

This module is the reading pass; the schema it checks lines against is
``moestream.pipeline.runlog.schema``, the events are collected into a ``RunLog`` by
``moestream.pipeline.runlog.builder``, the records it fills are in ``pipeline.runlog.records``
and the per-device fields are read by ``moestream.pipeline.runlog.devices``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import structlog

from moestream.pipeline.foundation.errors import TraceError, printable
from moestream.pipeline.foundation.inputs import load_json_bounded, open_input
from moestream.pipeline.runlog.builder import RunLogBuilder
from moestream.pipeline.runlog.expert_ids import MAX_LAYER_EXPERTS, MAX_MOE_LAYERS
from moestream.pipeline.runlog.records import LineCounts, RunLog
from moestream.pipeline.runlog.schema import (
    KNOWN_EVENTS,
    SCHEMA_VERSION,
    SCHEMA_VERSIONS,
    TIME_COLUMNS,
    TOKEN_COLUMNS,
    first_object,
    out_of_range,
)

__all__ = ["KNOWN_EVENTS", "MAX_LAYER_EXPERTS", "MAX_LINE_BYTES", "MAX_MOE_LAYERS",
           "SCHEMA_VERSION", "SCHEMA_VERSIONS", "TIME_COLUMNS", "TOKEN_COLUMNS", "log_lines",
           "read_log"]

log = structlog.get_logger(__name__)

_MAX_PROBLEMS = 20

MAX_LINE_BYTES = 1 << 20
"""The longest log line read (a token line of 43 MoE layers x top-6 is about 2 KB)."""


def log_lines(handle: IO[bytes]) -> Iterator[bytes | None]:
    """The lines of a log, each at most ``MAX_LINE_BYTES``; ``None`` for a longer line,
    which is skipped a piece at a time and never held whole."""
    while line := handle.readline(MAX_LINE_BYTES + 1):
        if len(line) <= MAX_LINE_BYTES or line.endswith(b"\n"):
            yield line
            continue
        while line and not line.endswith(b"\n"):
            line = handle.readline(MAX_LINE_BYTES)
        yield None


def read_log(path: str | Path, *, experts: bool = True, columns: bool = True) -> RunLog:
    """Read one run log.

    What is held per token line: with ``columns``, its numbers as float64 columns (about 30
    values, 8 bytes each), else only ``wall_ms`` and the mode code (9 bytes); with
    ``experts``, its expert ids (4 bytes per MoE layer and top-k slot: 1 KB at 43 layers x
    top-6, what the what-if replay needs); never the decoded line. The sums the summary,
    the time split and the checks need are kept as the log is read (``tokens.stats``,
    ``tokens.totals``) either way.

    Args:
        path: the JSON-lines file written by a moestream run.
        experts: keep every token's expert ids (``tokens.experts``); without, that array
            has no rows.
        columns: keep every token's numbers (``tokens.values``: the CSV, plots and the
            replay need them); without, ``tokens.values`` holds only ``wall_ms``.

    Returns:
        The run's header, token columns, controller events, summary line and line counts.

    Raises:
        TraceError: the file cannot be read, or its first non-blank line is not a
            moestream event of a known schema.
    """
    path = Path(path)
    try:
        handle = open_input(path)  # a FIFO or a device is refused, never waited on
    except OSError as exc:
        raise TraceError(f"{path}: cannot read ({exc.strerror or exc})") from exc
    with handle:
        lines = _LinePass(path, RunLogBuilder(path, keep_experts=experts, keep_columns=columns))
        try:
            lines.read(handle)
        except OSError as exc:
            raise TraceError(f"{path}: cannot read ({exc.strerror or exc})") from exc
    counts = lines.counts
    counts.truncated = lines.pending_bad
    if not lines.started:
        raise TraceError(f"{path}: not a moestream log (no events: the file is empty)")
    result = lines.builder.build()
    _warn(path, counts, result)
    return result


class _LinePass:
    """One pass over a log's lines, each handed to the builder or counted as not used."""

    def __init__(self, path: Path, builder: RunLogBuilder) -> None:
        self.path, self.builder, self.counts = path, builder, builder.counts
        self.pending_bad = 0  # unparsable lines not yet known to be the last one
        self.started = False

    def read(self, handle: IO[bytes]) -> None:
        """Read every line of ``handle``, up to a second run's ``run_start``."""
        counts, builder = self.counts, self.builder
        for raw in log_lines(handle):
            counts.lines += 1
            builder.log_bytes += MAX_LINE_BYTES if raw is None else len(raw)
            if raw is None:  # longer than any line a run writes
                if not self.started:
                    raise TraceError(f"{self.path}: not a moestream log (line {counts.lines} "
                                     f"is longer than {MAX_LINE_BYTES} bytes)")
                self._unparsable()
                continue
            if not raw.strip():
                counts.blank += 1
                continue
            obj = self._object(raw)
            if obj is None:
                continue
            event = obj.get("event")
            if event not in KNOWN_EVENTS:
                counts.unknown_events[printable(str(event))] += 1
                continue
            if event == "run_start" and builder.header is not None:
                self._after_second_run(handle)
                break
            builder.add(obj, event)
            counts.used += 1

    def _unparsable(self) -> None:
        """A line not read: malformed, unless it turns out to be the cut-off last one."""
        self.counts.malformed += self.pending_bad
        self.pending_bad = 1

    def _object(self, raw: bytes) -> dict[str, Any] | None:
        """The line's event as an object, or None when it is counted as not used; the first
        decides whether the file is a moestream log at all."""
        counts = self.counts
        if not self.started:
            obj = first_object(self.path, raw)
            if out_of_range(raw, obj):
                raise TraceError(f"{self.path}: not a moestream log (line {counts.lines} "
                                 "holds an integer no int64 holds)")
            self.builder.set_schema(obj["schema"])
            self.started = True
            return obj
        try:
            obj = load_json_bounded(raw, f"{self.path}:{counts.lines}")
        except ValueError:  # not JSON, or nested deeper than any event
            self._unparsable()
            return None
        counts.malformed += self.pending_bad
        self.pending_bad = 0
        if not isinstance(obj, dict):
            counts.malformed += 1
            return None
        if out_of_range(raw, obj):  # no column takes it: the line is bad
            counts.out_of_range += 1
            return None
        if obj.get("schema", self.builder.schema) != self.builder.schema:
            counts.other_schema += 1
            return None
        return obj

    def _after_second_run(self, handle: IO[bytes]) -> None:
        """Count the lines from a second run's ``run_start`` on: none of them is read."""
        counts = self.counts
        counts.after_second_run += 1
        for rest in log_lines(handle):
            counts.lines += 1
            if rest is None or rest.strip():
                counts.after_second_run += 1
            else:
                counts.blank += 1


def _warn(path: Path, counts: LineCounts, result: RunLog) -> None:
    """Log what was not understood, and what does not add up."""
    if counts.skipped or counts.unknown_fields or counts.missing_fields:
        log.warning(
            "log_lines_not_understood",
            path=str(path),
            skipped=counts.skipped,
            truncated=counts.truncated,
            malformed=counts.malformed,
            out_of_range=counts.out_of_range,
            unknown_events=dict(counts.unknown_events),
            unknown_fields=sum(counts.unknown_fields.values()),
            missing_fields=sum(counts.missing_fields.values()),
        )
    if result.problems:
        log.warning("log_inconsistent", path=str(path), problems=list(result.problems))
