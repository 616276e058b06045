"""Where an expert's bytes go: aligned file covers -> staging slot -> device buffer.

O_DIRECT needs offset, length and buffer 4096-aligned, and expert slices are not: each of
an expert's gate, up and down ranges is read as its aligned cover, the covers laid back to
back in a staging slot, and the ranges' own bytes copied 256-aligned into the device
buffer. Pure arithmetic, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from moestream.gpu.backend import PAGE
from moestream.pipeline.foundation.table import ExpertSlices, ExpertTable

__all__ = [
    "DEVICE_ALIGN",
    "ExpertLayout",
    "StagedRange",
    "aligned_cover",
    "iter_chunks",
    "largest_slot_bytes",
    "plan_expert",
]

DEVICE_ALIGN = 256  # each matrix starts 256-aligned in the device buffer (kernels read words)


def aligned_cover(offset: int, nbytes: int, align: int = PAGE) -> tuple[int, int]:
    """The smallest ``align``-aligned (start, length) that contains ``[offset, offset+nbytes)``."""
    start = offset - offset % align
    end = offset + nbytes
    end += (-end) % align
    return start, end - start


@dataclass(frozen=True, slots=True)
class StagedRange:
    """Where one of an expert's ranges goes: file cover -> slot -> device buffer.

    The cover ``[cover_start, cover_start + cover_bytes)`` is read into the slot at
    ``slot_offset``; the range's own bytes start ``skip`` bytes later and are copied to
    ``device_offset`` in the expert's device buffer.
    """

    file_offset: int
    nbytes: int
    cover_start: int
    cover_bytes: int
    slot_offset: int
    device_offset: int

    @property
    def skip(self) -> int:
        return self.file_offset - self.cover_start


@dataclass(frozen=True, slots=True)
class ExpertLayout:
    """An expert's three ranges laid out in a staging slot and in a device buffer."""

    ranges: tuple[StagedRange, ...]
    slot_bytes: int
    device_bytes: int


def plan_expert(slices: ExpertSlices, align: int = PAGE) -> ExpertLayout:
    """Lay out ``slices`` (gate, up, down): aligned covers back to back in the slot,
    ranges 256-aligned in the device buffer."""
    staged: list[StagedRange] = []
    slot_at = 0
    device_at = 0
    for r in slices.ranges:
        start, length = aligned_cover(r.offset, r.nbytes, align)
        staged.append(StagedRange(r.offset, r.nbytes, start, length, slot_at, device_at))
        slot_at += length
        device_at += r.nbytes + (-r.nbytes) % DEVICE_ALIGN
    return ExpertLayout(tuple(staged), slot_at, device_at)


def largest_slot_bytes(table: ExpertTable, align: int = PAGE) -> int:
    """The largest staging slot any expert of ``table`` needs (exact, not estimated).

    An expert's cover depends only on where its three slices start within a page, and
    expert ``e``'s slices start at ``base + e * stride``: the page offsets repeat with a
    period that divides ``align``, so the first ``align`` experts of a layer hold its
    largest cover. Expert 0 alone is not enough: an expert whose slices each straddle one
    more page needs up to three pages more (real files put slices at any offset).
    """
    return max(
        plan_expert(moe.slices(expert), align).slot_bytes
        for moe in table.layers.values()
        for expert in range(min(moe.n_experts, align))
    )


def iter_chunks(start: int, length: int, chunk_bytes: int) -> Iterator[tuple[int, int]]:
    """(offset, length) pieces of at most ``chunk_bytes`` covering ``[start, start+length)``."""
    done = 0
    while done < length:
        n = min(chunk_bytes, length - done)
        yield start + done, n
        done += n
