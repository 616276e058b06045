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

__all__ = ["on_stream"]


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
