"""The staging ring: page-aligned (pinned, on a GPU) host slots that reads land in.

A slot is handed out again only after the upload that read it has completed: the slot
keeps that upload's event, and the next user waits on it before writing. Reuse is never
inferred from counts (flashpack's habit: safe only while two numbers happen to match).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from gpu.backend import Backend, Event, HostBuffer

__all__ = ["StagingRing", "StagingSlot"]


@dataclass(slots=True, eq=False)
class StagingSlot:
    """One staging buffer. ``array`` is valid until the ring closes.

    ``busy_until``: the event of the last upload that read this slot; whoever writes into
    the slot next must wait for it first (``wait_reusable``).
    """

    index: int
    buffer: HostBuffer
    busy_until: Event | None = None

    @property
    def array(self) -> npt.NDArray[np.uint8]:
        return self.buffer.array

    def wait_reusable(self) -> None:
        """Block until the previous upload out of this slot is done (call off the loop)."""
        if self.busy_until is not None:
            self.busy_until.synchronize()
            self.busy_until = None


class StagingRing:
    """A fixed set of staging slots handed out in turn.

    Args:
        backend: allocates the (pinned) host memory.
        n_slots: how many experts can be staged at once.
        slot_bytes: the largest aligned cover of one expert.
    """

    def __init__(self, backend: Backend, n_slots: int, slot_bytes: int) -> None:
        if n_slots < 1:
            raise ValueError(f"need at least one staging slot, got {n_slots}")
        self.slot_bytes = slot_bytes
        self._slots = [StagingSlot(i, backend.alloc_host(slot_bytes)) for i in range(n_slots)]
        self._free: asyncio.Queue[StagingSlot] = asyncio.Queue()
        for slot in self._slots:
            self._free.put_nowait(slot)
        self._closed = False

    @property
    def n_slots(self) -> int:
        return len(self._slots)

    @property
    def n_free(self) -> int:
        return self._free.qsize()

    async def acquire(self) -> StagingSlot:
        """The next free slot; it may still be read by an upload (see ``wait_reusable``)."""
        if self._closed:
            raise RuntimeError("staging ring is closed")
        return await self._free.get()

    def release(self, slot: StagingSlot, busy_until: Event | None) -> None:
        """Return ``slot``; it stays unwritable until ``busy_until`` completes.

        Must be called on the event loop's thread (workers use call_soon_threadsafe).
        """
        slot.busy_until = busy_until
        self._free.put_nowait(slot)

    def close(self) -> None:
        """Wait for uploads still reading the slots, then free the memory."""
        self._closed = True
        for slot in self._slots:
            slot.wait_reusable()
            slot.buffer.close()

    def __enter__(self) -> StagingRing:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
