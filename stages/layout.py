"""Where an expert's bytes go: aligned file covers -> staging slot -> device buffer.

O_DIRECT needs offset, length and buffer 4096-aligned, and expert slices are not: each of
an expert's gate, up and down ranges is read as its aligned cover, the covers laid back to
back in a staging slot, and the ranges' own bytes copied 256-aligned into the device
buffer. Pure arithmetic, no I/O: a streamer plans every expert once, at open
(``plan_table``), and a miss only looks its plan up.
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
    "plan_expert",
    "plan_table",
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
    """An expert's three ranges laid out in a staging slot and in a device buffer.

    ``copies``: each range's own bytes in the slot as (device offset, slot start, slot end).
    """

    ranges: tuple[StagedRange, ...]
    slot_bytes: int
    device_bytes: int
    copies: tuple[tuple[int, int, int], ...]

    def reads(self, chunk_bytes: int) -> list[tuple[int, int, int]]:
        """The covers cut into reads of at most ``chunk_bytes``: (file offset, slot offset,
        bytes). Made per miss, not kept: a large expert read in small chunks has dozens."""
        return [(off, s.slot_offset + off - s.cover_start, n) for s in self.ranges
                for off, n in iter_chunks(s.cover_start, s.cover_bytes, chunk_bytes)]


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
    copies = tuple((s.device_offset, s.slot_offset + s.skip, s.slot_offset + s.skip + s.nbytes)
                   for s in staged)
    return ExpertLayout(tuple(staged), slot_at, device_at, copies)


def plan_table(table: ExpertTable, align: int = PAGE) -> dict[tuple[int, int], ExpertLayout]:
    """Every expert's layout, by (layer, expert): planned once at open, so a miss only looks
    its own up (``bench.plan_table``: about 1.4 KB and 7 us an expert). The staging slot
    must hold the largest ``slot_bytes`` of them all, not expert 0's: an expert whose slices
    each straddle one more page needs up to three pages more (real files put slices at any
    offset)."""
    return {(n, e): plan_expert(moe.slices(e), align)
            for n, moe in table.layers.items() for e in range(moe.n_experts)}


def iter_chunks(start: int, length: int, chunk_bytes: int) -> Iterator[tuple[int, int]]:
    """(offset, length) pieces of at most ``chunk_bytes`` covering ``[start, start+length)``."""
    done = 0
    while done < length:
        n = min(chunk_bytes, length - done)
        yield start + done, n
        done += n
