"""The host backend: the device is host memory, copies are real memcpy, events are eager.

It exists so the whole pipeline (staging ring, uploads, install, cache, budget) runs and is
tested on machines without a GPU. Copies happen when queued, so an event recorded after
them is already complete; the ordering contracts of the stages hold trivially here and are
exercised for real by the CuPy backend.

An allocation the host refuses (``MemoryError``) is a ``DeviceMemoryError`` here, as the
CuPy backend's are: the cache shrinks its budget on it, the staging ring keeps the slots it
got, and an open that fails on it says so in the documented error.
"""

from __future__ import annotations

import contextlib
import ctypes
from typing import Any, cast

import numpy as np
import numpy.typing as npt
import psutil

from moestream.gpu.backend import PAGE, DeviceBuffer, Event, Stream, aligned_host_array
from moestream.pipeline.foundation.errors import DeviceMemoryError

__all__ = ["HostBackend", "HostDeviceBuffer", "HostEvent", "HostStream"]


def _host_array(nbytes: int, align: int, what: str) -> npt.NDArray[np.uint8]:
    """``aligned_host_array``, its ``MemoryError`` as the backends' ``DeviceMemoryError``."""
    try:
        return aligned_host_array(nbytes, align)
    except MemoryError as exc:
        raise DeviceMemoryError(f"{what} allocation of {nbytes} bytes failed: "
                                f"{exc or 'out of memory'}") from None


class HostEvent:
    """Complete from birth: host copies finish before ``copy_h2d`` returns."""

    __slots__ = ()

    def done(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


_DONE = HostEvent()


class HostStream:
    """Work on the host runs when queued; waits are therefore no-ops."""

    __slots__ = ()

    def wait(self, event: Event) -> None:
        pass

    def record(self) -> Event:
        return _DONE

    def synchronize(self) -> None:
        pass


class HostPinned:
    """A page-aligned host buffer (the host stand-in for pinned memory)."""

    __slots__ = ("array", "nbytes")

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.array = _host_array(nbytes, PAGE, "host staging")

    def close(self) -> None:
        self.array = np.empty(0, dtype=np.uint8)


class HostDeviceBuffer:
    """Host memory standing in for device memory."""

    __slots__ = ("array", "nbytes", "ptr")

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.array = _host_array(nbytes, 256, "emulated device")
        self.ptr = int(self.array.ctypes.data)

    def close(self) -> None:
        self.array = np.empty(0, dtype=np.uint8)
        self.ptr = 0


class HostBackend:
    """A ``gpu.backend.Backend`` over host memory; ``device`` numbers an emulated device."""

    name = "host"
    async_copies = False
    registers_host = False
    maps_host = True  # its "device" memory is host memory

    def __init__(self, device: int = 0) -> None:
        self.device = device
        self.device_name = "host" if device == 0 else f"host:{device}"

    def alloc_host(self, nbytes: int) -> HostPinned:
        return HostPinned(nbytes)

    def alloc_device(self, nbytes: int) -> HostDeviceBuffer:
        return HostDeviceBuffer(nbytes)

    def device_free_bytes(self) -> int:
        return int(psutil.virtual_memory().available)

    def new_stream(self) -> HostStream:
        return HostStream()

    def copy_h2d(
        self, dst: DeviceBuffer, dst_offset: int, src: npt.NDArray[np.uint8], stream: Stream
    ) -> None:
        # a backend is only ever handed its own buffers (the cache allocates them here)
        cast(HostDeviceBuffer, dst).array[dst_offset : dst_offset + src.size] = src

    def copy_h2d_batch(self, copies: npt.NDArray[np.uint64], stream: Stream) -> None:
        for src, dst, nbytes in zip(*copies.tolist(), strict=True):  # host memory both sides
            ctypes.memmove(dst, src, nbytes)

    def register_host(self, array: npt.NDArray[np.uint8]) -> bool:
        return False  # host memory needs no registration (``registers_host`` is False)

    def unregister_host(self, array: npt.NDArray[np.uint8]) -> None:
        pass

    def device_bytes(self, buf: DeviceBuffer, offset: int, nbytes: int) -> npt.NDArray[np.uint8]:
        return cast(HostDeviceBuffer, buf).array[offset : offset + nbytes]

    def to_host(self, arr: Any) -> npt.NDArray[Any]:
        return np.asarray(arr)

    def synchronize(self) -> None:
        pass

    def activate(self) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()

    def adopt(self, arr: Any) -> Any:
        return np.array(arr, copy=True)

    def close(self) -> None:
        pass
