"""A CuPy kernel launched on torch's stream, at the least host cost.

The experts calls launch a few kernels a layer (the gather, the dequantization), and on the
transformers path the host's time a token bounds the speed. Entering CuPy's device and
stream contexts a launch (to make torch's stream CuPy's current one, then restore it) cost
more than the launch itself; the stream is given to the launch instead, and the device made
current only where it is not.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

__all__ = ["current_stream", "on_stream"]


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


def current_stream(device: Any) -> Any:
    """torch's current stream on ``device`` (a torch CUDA device), asked by index: torch
    resolves a device object without one through the current device, ~25 us a call, and
    the experts calls ask a few times a layer."""
    import torch  # type: ignore[import-not-found, unused-ignore]

    index = device.index
    return torch.cuda.current_stream(torch.cuda.current_device() if index is None else index)
