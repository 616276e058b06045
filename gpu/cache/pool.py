"""Size-class pool of device buffers parked between evictions and installs.

A naive allocate-per-miss, free-per-eviction costs ~30% throughput (ds4's experience), so an
evicted expert's buffer is parked here and the next install of the same size pops it. Parked
bytes count against the cache budget exactly like live ones: the cache trims the pool before
it would exceed the budget. Each parked buffer carries the event after which it may be
overwritten (the last compute that read it).
"""

from __future__ import annotations

from collections import OrderedDict

import structlog

from moestream.gpu.backend import Backend, DeviceBuffer, Event
from moestream.pipeline.foundation.errors import DeviceMemoryError
from moestream.pipeline.foundation.faults import FaultPlan

__all__ = ["BufferPool"]

_log = structlog.get_logger("moestream.pool")


class BufferPool:
    """Parked device buffers by exact byte size; counts every allocation and free.

    Args:
        backend: allocates and frees the buffers.
        faults: injected faults (``device_oom``; tests and ``--inject`` only).
    """

    def __init__(self, backend: Backend, faults: FaultPlan | None = None) -> None:
        self._backend = backend
        self._faults = faults if faults else None  # an empty plan injects nothing either
        self._parked: OrderedDict[int, list[tuple[DeviceBuffer, Event | None]]] = OrderedDict()
        self.parked_bytes = 0
        self.allocations = 0
        self.frees = 0

    def take(self, nbytes: int, max_parked_bytes: int) -> tuple[DeviceBuffer, Event | None]:
        """A parked buffer of exactly ``nbytes`` and its reuse-after event; else a fresh one
        from the device (no event), the pool first trimmed to ``max_parked_bytes`` (the
        caller has made room in the budget for the new one).

        Raises:
            DeviceMemoryError: the device refused (nothing was allocated or counted).
        """
        bucket = self._parked.get(nbytes)
        if bucket:
            buf, event = bucket.pop()
            if not bucket:
                del self._parked[nbytes]
            self.parked_bytes -= nbytes
            return buf, event
        if self.parked_bytes > max_parked_bytes:
            self.trim(max_parked_bytes)
        if self._faults is not None and self._faults.hit("device_oom") is not None:
            raise DeviceMemoryError(f"device allocation of {nbytes} bytes failed (injected)")
        buf = self._backend.alloc_device(nbytes)
        self.allocations += 1
        return buf, None

    def park(self, buf: DeviceBuffer, reuse_after: Event | None) -> None:
        """Keep ``buf`` for reuse; it must not be overwritten before ``reuse_after``."""
        self._parked.setdefault(buf.nbytes, []).append((buf, reuse_after))
        self._parked.move_to_end(buf.nbytes)
        self.parked_bytes += buf.nbytes

    def trim(self, max_parked_bytes: int) -> int:
        """Free parked buffers, least recently parked size first, until under the cap."""
        freed = 0
        while self.parked_bytes > max_parked_bytes and self._parked:
            nbytes, bucket = next(iter(self._parked.items()))
            buf, event = bucket.pop(0)
            if not bucket:
                del self._parked[nbytes]
            if event is not None:
                event.synchronize()  # a compute may still read it: free only after
            buf.close()
            self.parked_bytes -= nbytes
            self.frees += 1
            freed += nbytes
        return freed

    def free(self, buf: DeviceBuffer, reuse_after: Event | None) -> None:
        """Give ``buf`` back to the device once ``reuse_after`` has passed."""
        if reuse_after is not None:
            reuse_after.synchronize()
        buf.close()
        self.frees += 1

    def close(self) -> None:
        """Give every parked buffer back to the device."""
        self.trim(0)
