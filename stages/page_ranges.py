"""Byte ranges of a model as the page cache sees them: joined, widened to pages, per file.

The page-cache calls (``stages.residency``, ``stages.pagelock``) take ranges of a model's
address space, which may overlap, touch, straddle pages or span two of a model's files; the
kernel takes whole pages of one file. These helpers turn the one into the other. A range is
anything with ``offset`` and ``nbytes`` (``pipeline.foundation.table.ByteRange`` and
``TensorInfo`` both fit).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from moestream.pipeline.foundation.files import ModelFile, pieces
from moestream.pipeline.foundation.table import ByteRange
from moestream.stages.libc import PAGE_BYTES

__all__ = ["RangeLike", "coalesce", "file_ranges", "page_cover", "ranges_by_file"]


class RangeLike(Protocol):
    """A contiguous byte range of a file (``ByteRange``, ``TensorInfo``)."""

    @property
    def offset(self) -> int: ...

    @property
    def nbytes(self) -> int: ...


def coalesce(ranges: Iterable[RangeLike]) -> list[ByteRange]:
    """The union of ``ranges`` as sorted, disjoint, non-adjacent ``ByteRange``s.

    Empty ranges are dropped.
    """
    spans = sorted((r.offset, r.offset + r.nbytes) for r in ranges if r.nbytes > 0)
    merged: list[list[int]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [ByteRange(start, end - start) for start, end in merged]


def page_cover(r: RangeLike) -> tuple[int, int]:
    """First page and one past the last page that range ``r`` touches."""
    return r.offset // PAGE_BYTES, -(-(r.offset + r.nbytes) // PAGE_BYTES)


def file_ranges(files: Sequence[ModelFile]) -> list[ByteRange]:
    """Every file of a model whole, as ranges of its address space (no padding)."""
    return [ByteRange(f.base, f.nbytes) for f in files]


def ranges_by_file(
    files: Sequence[ModelFile], ranges: Iterable[RangeLike] | None = None
) -> list[tuple[ModelFile, list[ByteRange]]]:
    """``ranges`` of a model's address space (every file whole when None) as each file's own
    ranges, for the calls that work on one file (``evict``, ``lock_pages``)."""
    wanted = file_ranges(files) if ranges is None else coalesce(ranges)
    out: dict[int, tuple[ModelFile, list[ByteRange]]] = {}
    for r in wanted:
        for part in pieces(files, r.offset, r.nbytes):
            out.setdefault(part.file.base, (part.file, []))[1].append(
                ByteRange(part.local, part.nbytes))
    return list(out.values())
