"""The device-backend interface (``moestream.gpu.selection`` chooses between CuPy and the host).

Everything above ``gpu/`` talks to a ``Backend``: page-aligned (pinned, on a GPU) host
buffers for staging, device buffers for the cache, streams, events, asynchronous
host-to-device copies, and the few kernels decode needs. ``CupyBackend`` does this on a CUDA
device; ``HostBackend`` does the same work in host memory (real copies, events that complete
when the copy has), so every stage and every test runs on machines without a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol, TypeAlias

import numpy as np
import numpy.typing as npt

__all__ = [
    "Backend",
    "DeviceArray",
    "DeviceBuffer",
    "Event",
    "HostBuffer",
    "Kernels",
    "Stream",
    "aligned_host_array",
]

PAGE = 4096

DeviceArray: TypeAlias = Any
"""An array on the device: a numpy array on the host backend, a CuPy array on a GPU. The two
libraries share no static type, so this stays ``Any``; everything that crosses the boundary
around it (buffers, streams, events, kernels) is a protocol below."""


def aligned_host_array(nbytes: int, align: int = PAGE) -> npt.NDArray[np.uint8]:
    """A uint8 array of ``nbytes`` whose first byte is ``align``-aligned (O_DIRECT needs it).

    The array keeps its over-allocated base alive; dropping the array frees it.
    """
    raw = np.empty(nbytes + align, dtype=np.uint8)
    skip = (-raw.ctypes.data) % align
    return raw[skip : skip + nbytes]


class Event(Protocol):
    """Marks a point in a stream; done once everything queued before it has run."""

    def done(self) -> bool: ...

    def synchronize(self) -> None: ...


class Stream(Protocol):
    """An ordered queue of device work."""

    def wait(self, event: Event) -> None:
        """Make later work on this stream wait for ``event`` (device side, host never blocks)."""

    def record(self) -> Event:
        """An event that completes when the work queued so far has run."""

    def synchronize(self) -> None: ...


class HostBuffer(Protocol):
    """Page-aligned host memory (pinned on a GPU). ``array`` must stay alive while in use."""

    nbytes: int
    array: npt.NDArray[np.uint8]

    def close(self) -> None: ...


class DeviceBuffer(Protocol):
    """Device memory holding one cached expert."""

    nbytes: int
    ptr: int
    """Its device address (``Kernels.gather`` rows)."""

    def close(self) -> None: ...


class Backend(Protocol):
    """What the pipeline needs from a device."""

    name: str
    device_name: str
    device: int
    """This backend's device index (one backend per device of a run)."""
    async_copies: bool
    """True when ``copy_h2d`` only queues the copy (CUDA); False when it copies at once."""
    registers_host: bool
    """True when host memory must be registered (page-locked) for direct device copies."""
    maps_host: bool
    """True when kernels read registered host memory at its host address
    (``Kernels.gather``; on CUDA, ``cudaDevAttrCanUseHostPointerForRegisteredMem``)."""

    def alloc_host(self, nbytes: int) -> HostBuffer: ...

    def alloc_device(self, nbytes: int) -> DeviceBuffer: ...

    def device_free_bytes(self) -> int: ...

    def new_stream(self) -> Stream: ...

    def copy_h2d(
        self, dst: DeviceBuffer, dst_offset: int, src: npt.NDArray[np.uint8], stream: Stream
    ) -> None:
        """Queue a copy of ``src`` (pinned or registered host memory) into ``dst``.

        Called under ``activate()`` (CUDA's current device is per thread); ``src`` must stay
        alive and unchanged until an event recorded after this completes.
        """

    def copy_h2d_batch(self, copies: npt.NDArray[np.uint64], stream: Stream) -> None:
        """Queue ``copies`` ((3, n): host addresses, device addresses, bytes) as one call
        where the device has one (``moestream.gpu.batchcopy``), else one copy each.

        Each source lies in pinned memory or in one registration (a copy may not span two)
        and stays unchanged until an event recorded after this completes; called under
        ``activate()``. Raises ``UploadError`` when the device refuses them.
        """

    def register_host(self, array: npt.NDArray[np.uint8]) -> bool:
        """Page-lock ``array`` (read-only) so copies DMA straight from it; False if refused."""

    def unregister_host(self, array: npt.NDArray[np.uint8]) -> None: ...

    def device_bytes(self, buf: DeviceBuffer, offset: int, nbytes: int) -> Any:
        """A uint8 device array over part of ``buf`` (no copy)."""

    def to_host(self, arr: Any) -> npt.NDArray[Any]:
        """Copy a device array to host (synchronizing); for small results only."""

    def synchronize(self) -> None:
        """Wait for the whole device; only at shutdown."""

    def activate(self) -> AbstractContextManager[Any]:
        """Make this the current device for the calling thread (kernels, streams, arrays)."""

    def adopt(self, arr: Any) -> Any:
        """A copy on this device of a small array that may live on another device (the
        activations a layer's devices exchange; a peer copy on GPUs)."""

    def close(self) -> None: ...


class Kernels(Protocol):
    """The device work decode and verification queue (``moestream.gpu.kernels``: host or CUDA).

    Digest results live in a results array on the device (``new_results``): ``digest3``
    adds into three of its rows on ``stream``, ``read_results`` reads them back once per
    token, so the host never waits per expert.
    """

    def new_results(self, n: int) -> DeviceArray:
        """A zeroed (n, 2) uint64 results array."""

    def digest3(self, buf: DeviceBuffer, ranges: Sequence[tuple[int, int]],
                results: DeviceArray, row: int, stream: Stream) -> None:
        """Digest sums of three (offset, nbytes) ranges of ``buf`` into rows ``row..row+2``."""

    def digest_views(self, views: Sequence[DeviceArray], results: DeviceArray, row: int,
                     stream: Stream) -> None:
        """``digest3`` of three uint8 views of one device buffer (an expert's matrices, as
        an engine holds them) into rows ``row..row+2``."""

    def read_results(self, results: DeviceArray, n: int) -> npt.NDArray[np.uint64]:
        """The digests of the first ``n`` rows, uint64 (synchronizes with the device)."""

    def results_address(self, results: DeviceArray, row: int) -> int:
        """The device address of a results row (a ``gather`` row's digest address)."""

    def gather(self, copies: npt.NDArray[np.uint64], stream: Stream) -> None:
        """Queue ``copies`` (``moestream.gpu.kernels.COPY_FIELDS`` per row: host source, device
        destination, bytes, digest row address or 0, byte to invert or ``NO_FLIP``) on
        ``stream``: every copy and its digest, in one launch where the device can."""

    def busy(self, ms: float, data: DeviceArray | None, stream: Stream) -> None:
        """Keep the device busy for ``ms`` milliseconds (``--compute fixed``): the host
        backend's CPU reading ``data``, uint8 bytes of an expert; a GPU's clock (None)."""

    def swiglu(self, x: DeviceArray, gate: DeviceArray, up: DeviceArray, down: DeviceArray,
               stream: Stream) -> DeviceArray:
        """One SwiGLU expert: ``down @ (silu(gate @ x) * (up @ x))`` in float32."""

    def as_f16(self, data: DeviceArray, rows: int, cols: int) -> DeviceArray:
        """A (rows, cols) float16 view of uint8 device bytes (no copy)."""

    def zeros(self, n: int) -> DeviceArray:
        """A zeroed float32 vector."""
