"""The tables of parameters the dequantization kernels read, on their way to the device.

A launch's table (its kinds' parameters, each matrix's address, the experts' ids) is written
into pinned host memory and copied to the device on torch's stream, not waited for. The
ring (:class:`_Ring`) reuses its slots a lap later, safe by events; a launch a CUDA graph
captures takes a slot of its own instead (:class:`KeptTables`), since each replay copies
that slot again: nothing may rewrite it while the graph lives.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from typing import Any

import torch  # type: ignore[import-not-found, unused-ignore]

__all__ = ["KEPT_SLOT", "SLOT", "KeptTables", "keeping", "table_on_device"]

SLOT = 4096
"""int64 values a ring slot holds: the kinds' parameters and 4 a matrix (a batch of up to
~1000 experts; larger ones are launched in parts)."""
SLOTS = 64
KEPT_SLOT = 64
"""int64 values a kept table holds: a slot launch's kind parameters (no addresses)."""
KEPT_SLOTS = 2048
"""Kept tables at most; ``_graphs`` keeps half as many graphs (two launches each at most)."""


class _Ring:
    """Pinned host slots and their device twins, used in turn for the batches' tables.

    A table is written into the next host slot and copied to its device slot on torch's
    stream, not waited for. Reuse is safe by two events a lap: entering one half of the
    ring waits (on the host) for the event recorded when the other half was last entered,
    after every copy and kernel that used this half was queued; a change of stream makes
    the new stream wait for the old one first.
    """

    def __init__(self, device: Any) -> None:
        self.host = torch.empty((SLOTS, SLOT), dtype=torch.int64, pin_memory=True)
        self.values = self.host.numpy()
        self.device = torch.empty((SLOTS, SLOT), dtype=torch.int64, device=device)
        self.next = 0
        self.marks: list[Any] = [None, None]
        self.stream: Any = None

    def put(self, values: Sequence[int], stream: Any) -> int:
        """The device address of ``values`` (int64), queued on ``stream``."""
        if self.stream is not None and stream != self.stream:
            stream.wait_stream(self.stream)
        self.stream = stream
        slot, half = self.next, SLOTS // 2
        self.next = (slot + 1) % SLOTS
        if slot % half == 0:
            other = self.marks[1 - slot // half]
            if other is not None:
                other.synchronize()
            mark = torch.cuda.Event()
            mark.record(stream)
            self.marks[slot // half] = mark
        self.values[slot, :len(values)] = values
        return _copy(self.host[slot], self.device[slot], len(values), stream)


def _copy(host: Any, device: Any, m: int, stream: Any) -> int:
    """The first ``m`` values of ``host`` (a pinned int64 row) copied to ``device`` (its
    twin) on ``stream``, not waited for: the twin's address."""
    import cupy

    target = device.data_ptr()
    cupy.cuda.runtime.memcpyAsync(target, host.data_ptr(), m * 8,
                                  cupy.cuda.runtime.memcpyHostToDevice, stream.cuda_stream)
    return int(target)


@functools.cache
def _ring(device: int) -> _Ring:
    return _Ring(torch.device("cuda", device))


class KeptTables:
    """Pinned host slots and their device twins for the tables of launches CUDA graphs
    capture: a table is written once into a slot of its own, and the capture records its
    copy to the device, which each replay runs again; so a slot is never rewritten while a
    graph that copies it lives. Its memory is allocated before the first capture (a
    capture allocates no pinned memory); ``put``, within one, only writes and queues a
    copy.

    Args:
        device: the torch CUDA device.
    """

    def __init__(self, device: Any) -> None:
        self.device = torch.device(device)
        self.used = 0
        self._host: Any = None
        self._twin: Any = None

    def allocate(self) -> None:
        """The slots (``KEPT_SLOTS`` of ``KEPT_SLOT`` int64), once, before a capture, on
        a CUDA device (on the host no kernel is launched)."""
        if self._host is None and self.device.type == "cuda":
            self._host = torch.empty((KEPT_SLOTS, KEPT_SLOT), dtype=torch.int64,
                                     pin_memory=True)
            self._twin = torch.empty((KEPT_SLOTS, KEPT_SLOT), dtype=torch.int64,
                                     device=self.device)

    def put(self, values: Sequence[int], stream: Any) -> int:
        """The device address of ``values`` (int64), its copy queued on ``stream``.

        Raises:
            RuntimeError: no slot is left, or ``values`` outgrow one (the capture fails,
                and its launches run as they are).
        """
        m = len(values)
        if self._host is None or self.used == KEPT_SLOTS or m > KEPT_SLOT:
            raise RuntimeError(f"no kept table slot for {m} values ({self.used} of "
                               f"{KEPT_SLOTS} used)")
        slot, self.used = self.used, self.used + 1
        self._host.numpy()[slot, :m] = values
        return _copy(self._host[slot], self._twin[slot], m, stream)

    def reset(self) -> None:
        """Every slot free again: the graphs that copy them are dropped, and the device is
        past every replay of them queued (waited for here, once any slot was used)."""
        if self.used:
            torch.cuda.synchronize(self.device)
            self.used = 0


_keeping: ContextVar[KeptTables | None] = ContextVar("moestream_kept_tables", default=None)


@contextlib.contextmanager
def keeping(tables: KeptTables) -> Iterator[None]:
    """Within: this context's launches take their tables from ``tables`` (a capture)."""
    tables.allocate()
    token = _keeping.set(tables)
    try:
        yield
    finally:
        _keeping.reset(token)


def table_on_device(values: Sequence[int], stream: Any) -> int:
    """The device address of ``values`` (int64), copied on ``stream``: from the slots kept
    for the capture this context is in (:func:`keeping`), else from the device's ring."""
    return (_keeping.get() or _ring(stream.device_index)).put(values, stream)
