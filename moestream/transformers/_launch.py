"""A CuPy kernel launched on torch's stream, at the least host cost.

The experts calls launch a few kernels a layer (the gather, the dequantization), and on the
transformers path the host's time a token bounds the speed. Entering CuPy's device and
stream contexts a launch (to make torch's stream CuPy's current one, then restore it) cost
more than the launch itself; the stream is given to the launch instead, and the device made
current only where it is not.
"""

from __future__ import annotations

import ctypes
import functools
import threading
import warnings
from typing import Any

__all__ = ["RawLaunch", "current_stream", "on_stream", "raw_stream"]


@functools.lru_cache(maxsize=64)
def _stream(pointer: int, device: int) -> Any:
    """torch's stream as CuPy's (made once a stream)."""
    import cupy

    with warnings.catch_warnings():  # its successor needs a protocol older torch lacks
        warnings.simplefilter("ignore", DeprecationWarning)
        return cupy.cuda.ExternalStream(pointer, device)


def on_stream(function: Any, device: int, stream: int, grid: tuple[int, ...],
              block: tuple[int, ...], args: tuple[Any, ...]) -> None:
    """Launch ``function`` (a CuPy ``Function`` of ``device``) on ``stream`` (a raw CUDA
    stream pointer, torch's ``cuda_stream``)."""
    import cupy

    on = _stream(stream, device)
    if cupy.cuda.runtime.getDevice() == device:
        function(grid, block, args, stream=on)
    else:
        with cupy.cuda.Device(device):
            function(grid, block, args, stream=on)


class RawLaunch:
    """A CuPy kernel whose arguments are all 8 bytes wide (pointers, ``long long``),
    launched by the driver's ``cuLaunchKernel`` from an argument block made once: a
    launch writes the values and calls the driver (~4 us on an H100), where CuPy's call
    converts each argument again (~10 us). The experts calls launch on every layer of
    every token, and the host's time is what bounds them.

    Args:
        function: the kernel of ``device`` (``cupy.RawModule(...).get_function``: a
            ``RawKernel`` in CuPy 14, a ``Function`` before).
        device: its device index.
        arity: how many arguments it takes.
    """

    __slots__ = ("_device", "_function", "_lock", "_params", "_pointer", "_pointers", "_values")

    def __init__(self, function: Any, device: int, arity: int) -> None:
        self._function = function  # keeps its module, and so the kernel, loaded
        # CuPy 14's RawModule hands a RawKernel, its CUfunction in ``kernel.ptr``
        self._pointer = getattr(function, "kernel", function).ptr
        self._device = device
        self._values = (ctypes.c_int64 * arity)()  # a long long each; pointers fit
        first = ctypes.addressof(self._values)
        self._pointers = (ctypes.c_void_p * arity)(*(first + 8 * i for i in range(arity)))
        self._params = ctypes.addressof(self._pointers)
        self._lock = threading.Lock()  # one argument block: one launch at a time

    def __call__(self, stream: int, grid: tuple[int, int], block: int, *args: int) -> None:
        """Launch on ``stream`` (a raw CUDA stream pointer) over ``grid`` (x, y) blocks of
        ``block`` threads; ``args`` are ints (a pointer, or a signed size)."""
        import cupy

        with self._lock:
            self._values[:] = list(args)  # one slice: ~0.4 us, where a value at a time cost ~1.3
            if cupy.cuda.runtime.getDevice() == self._device:
                self._launch(stream, grid, block)
            else:
                with cupy.cuda.Device(self._device):
                    self._launch(stream, grid, block)

    def _launch(self, stream: int, grid: tuple[int, int], block: int) -> None:
        import cupy

        cupy.cuda.driver.launchKernel(self._pointer, grid[0], grid[1], 1, block, 1, 1, 0,
                                      stream, self._params, 0)


def current_stream(device: Any) -> Any:
    """torch's current stream on ``device`` (a torch CUDA device), asked by index: torch
    resolves a device object without one through the current device, ~25 us a call, and
    the experts calls ask a few times a layer."""
    import torch  # type: ignore[import-not-found, unused-ignore]

    index = device.index
    return torch.cuda.current_stream(torch.cuda.current_device() if index is None else index)


def raw_stream(device: Any) -> tuple[int, int]:
    """torch's current stream on ``device`` (a torch CUDA device) as a launch takes it: its
    device index and raw ``cudaStream_t``. torch's raw accessor (the one inductor's
    generated code calls before each launch) costs well under a microsecond; a ``Stream``
    object, made a call by :func:`current_stream`, costs a few more, on each gather launch
    of each layer of each token. Builds without the accessor fall back to the object."""
    import torch  # type: ignore[import-not-found, unused-ignore]

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is None:
        stream = current_stream(device)
        return stream.device_index, stream.cuda_stream
    index = torch.cuda.current_device() if device.index is None else device.index
    return index, int(raw(index))
