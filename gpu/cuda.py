"""The CuPy backend: pinned host memory, cudaMalloc'd cache buffers, streams and events.

Device buffers come straight from ``cudaMalloc`` (``cupy.cuda.Memory``), not from CuPy's
memory pool: the cache budget counts every byte, and a pool that keeps freed blocks would
hide them. Staging buffers come from ``cudaHostAlloc`` (page-aligned, so O_DIRECT can read
into them). ``register_host`` page-locks a read-only file mapping
(``cudaHostRegisterReadOnly``, portable: one registration serves every device) so uploads
DMA from the page cache with no CPU copy.

One backend drives one device: it makes that device current around everything it creates,
and ``activate()`` does the same for callers (decode's kernels, upload workers, once per
expert around its copies), since CUDA's current device is per thread.
"""

from __future__ import annotations

from typing import Any, cast

import numpy as np
import numpy.typing as npt
import structlog

from moestream.gpu.backend import PAGE, DeviceArray, DeviceBuffer, Event, Stream
from moestream.gpu.batchcopy import open_batch_copy
from moestream.pipeline.foundation.errors import DeviceMemoryError, UploadError

__all__ = ["CupyBackend", "unavailable_reason"]

_log = structlog.get_logger("moestream.gpu")
# cudaHostRegisterPortable | cudaHostRegisterMapped | cudaHostRegisterReadOnly: every device
# copies from a window, and kernels read it in place (``Kernels.gather``)
_HOST_REGISTER_FLAGS = 0x01 | 0x02 | 0x08
_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM = 91  # cudaDeviceAttr


def unavailable_reason() -> str | None:
    """None when CuPy imports and a CUDA device answers; else why not, in a few words."""
    try:
        import cupy
    except ImportError:
        return "cupy is not installed"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA device"
    except Exception as exc:  # CUDARuntimeError; its type lives in a module cupy may lack
        return f"CUDA unavailable: {exc}"
    return None


class CudaEvent:
    """A CUDA event recorded on a stream."""

    __slots__ = ("_event",)

    def __init__(self, event: Any) -> None:
        self._event = event

    def done(self) -> bool:
        return bool(self._event.done)

    def synchronize(self) -> None:
        self._event.synchronize()

    @property
    def raw(self) -> Any:
        return self._event


class CudaStream:
    """A non-blocking CUDA stream."""

    __slots__ = ("raw",)

    def __init__(self) -> None:
        import cupy

        self.raw = cupy.cuda.Stream(non_blocking=True)

    def wait(self, event: Event) -> None:
        if isinstance(event, CudaEvent):
            self.raw.wait_event(event.raw)

    def record(self) -> CudaEvent:
        import cupy

        event = cupy.cuda.Event(block=False, disable_timing=True)
        event.record(self.raw)
        return CudaEvent(event)

    def synchronize(self) -> None:
        self.raw.synchronize()


class CudaPinned:
    """Pinned, page-aligned host memory from cudaHostAlloc."""

    __slots__ = ("_mem", "array", "nbytes")

    def __init__(self, nbytes: int) -> None:
        import cupy

        try:
            self._mem: Any = cupy.cuda.PinnedMemory(nbytes + PAGE)
        except Exception as exc:
            raise DeviceMemoryError(
                f"pinned host allocation of {nbytes} bytes failed: {exc}"
            ) from exc
        pointer = cupy.cuda.PinnedMemoryPointer(self._mem, 0)
        raw = np.frombuffer(pointer, dtype=np.uint8, count=nbytes + PAGE)
        skip = (-raw.ctypes.data) % PAGE
        self.array: npt.NDArray[np.uint8] = raw[skip : skip + nbytes]
        self.nbytes = nbytes

    def close(self) -> None:
        self.array = np.empty(0, dtype=np.uint8)
        self._mem = None


class CudaDeviceBuffer:
    """One cudaMalloc allocation."""

    __slots__ = ("mem", "nbytes", "ptr")

    def __init__(self, nbytes: int) -> None:
        import cupy

        try:
            self.mem: Any = cupy.cuda.Memory(nbytes)
        except cupy.cuda.memory.OutOfMemoryError as exc:
            raise DeviceMemoryError(f"device allocation of {nbytes} bytes failed: {exc}") from exc
        self.ptr = int(self.mem.ptr)
        self.nbytes = nbytes

    def close(self) -> None:
        self.mem = None
        self.ptr = 0


class CupyBackend:
    """A ``moestream.gpu.backend.Backend`` on one CUDA device through CuPy."""

    name = "cupy"
    async_copies = True
    registers_host = True

    def __init__(self, device: int = 0) -> None:
        import cupy

        self._cp = cupy
        self.device = device
        props = cupy.cuda.runtime.getDeviceProperties(device)
        raw_name = props["name"]
        self.device_name = raw_name.decode() if isinstance(raw_name, bytes) else str(raw_name)
        self.maps_host = bool(cupy.cuda.runtime.deviceGetAttribute(
            _CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM, device))
        self._batch = open_batch_copy(device)

    def activate(self) -> Any:
        # a new Device each time: a Device keeps the devices it replaced in a list of its
        # own, so one shared by threads (upload workers) would restore the wrong one
        return self._cp.cuda.Device(self.device)

    def alloc_host(self, nbytes: int) -> CudaPinned:
        with self.activate():
            return CudaPinned(nbytes)

    def alloc_device(self, nbytes: int) -> CudaDeviceBuffer:
        with self.activate():
            return CudaDeviceBuffer(nbytes)

    def device_free_bytes(self) -> int:
        with self.activate():
            free, _total = self._cp.cuda.runtime.memGetInfo()
        return int(free)

    def new_stream(self) -> CudaStream:
        with self.activate():
            return CudaStream()

    def copy_h2d(
        self, dst: DeviceBuffer, dst_offset: int, src: npt.NDArray[np.uint8], stream: Stream
    ) -> None:
        rt = self._cp.cuda.runtime
        # a backend is only ever handed its own buffers and streams (it made them)
        ptr, raw = cast(CudaDeviceBuffer, dst).ptr, cast(CudaStream, stream).raw
        try:  # the caller made this device current (per expert, not per piece)
            rt.memcpyAsync(ptr + dst_offset, src.ctypes.data, src.size, rt.memcpyHostToDevice,
                           raw.ptr)
        except Exception as exc:
            raise UploadError(f"host-to-device copy of {src.size} bytes failed: {exc}") from exc

    def copy_h2d_batch(self, copies: npt.NDArray[np.uint64], stream: Stream) -> None:
        raw = cast(CudaStream, stream).raw
        if self._batch is not None:
            try:
                self._batch(copies, raw.ptr)
                return
            except UploadError as exc:  # a driver that has the call but refuses it here
                _log.warning("batched_copy_refused", device=self.device, reason=str(exc),
                             action="one copy a piece from now on")
                self._batch = None
        rt = self._cp.cuda.runtime  # a driver before CUDA 12.8: one copy each
        try:
            for src, dst, nbytes in zip(*copies.tolist(), strict=True):
                rt.memcpyAsync(dst, src, nbytes, rt.memcpyHostToDevice, raw.ptr)
        except Exception as exc:
            raise UploadError(f"host-to-device copy of {copies.shape[1]} pieces failed: "
                              f"{exc}") from exc

    def adopt(self, arr: Any) -> Any:
        with self.activate():
            out = self._cp.empty_like(arr)
            out.data.copy_from_device(arr.data, arr.nbytes)  # peer copy when arr is elsewhere
        return out

    def register_host(self, array: npt.NDArray[np.uint8]) -> bool:
        try:
            self._cp.cuda.runtime.hostRegister(
                array.ctypes.data, array.size, _HOST_REGISTER_FLAGS
            )
        except Exception as exc:
            _log.warning("host_register_refused", nbytes=array.size, reason=str(exc))
            return False
        return True

    def unregister_host(self, array: npt.NDArray[np.uint8]) -> None:
        self._cp.cuda.runtime.hostUnregister(array.ctypes.data)

    def device_bytes(self, buf: DeviceBuffer, offset: int, nbytes: int) -> DeviceArray:
        cp = self._cp
        pointer = cp.cuda.MemoryPointer(cast(CudaDeviceBuffer, buf).mem, offset)
        return cp.ndarray((nbytes,), dtype=cp.uint8, memptr=pointer)

    def to_host(self, arr: Any) -> npt.NDArray[Any]:
        result: npt.NDArray[Any] = self._cp.asnumpy(arr)
        return result

    def synchronize(self) -> None:
        with self.activate():
            self._cp.cuda.runtime.deviceSynchronize()

    def close(self) -> None:
        self.synchronize()
