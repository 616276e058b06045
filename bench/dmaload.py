"""``python -m bench.dmaload``: host-to-device traffic in the background, for a while.

A question the warm-miss figures raise: the library's Python per layer takes 130-220 us on
the H200's host with a stand-in device (``bench.hostpath``) but 450-550 us beside the real
device moving the same layer's bytes (``bench.profile --backend cupy``), although CUDA's
own calls are a small part of the profile. One explanation is the host's memory under the
device's reads at ~50 GB/s, which Python's pointer chasing feels as latency. Run this in
the background and ``bench.hostpath`` beside it: the stand-in device's Python time, with
and without the device reading host memory, tells whether the traffic slows the host.

Two kinds of traffic, as the streamer makes them:

- ``copy``: pinned host -> device copies on a copy engine (the batched copy engines' path);
- ``gather``: the gather kernel reading pinned host memory in place over the link (the
  small experts' default path), ``Kernels.gather`` with 1.75 MiB rows.

Prints the bytes moved a second at the end (the load's own rate).
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Sequence

import numpy as np

from bench.kit import exit_with, require_gpu
from moestream.pipeline.foundation.errors import UsageError

__all__ = ["main"]

GB = 1e9


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.dmaload",
                                description=__doc__.split("\n")[0] if __doc__ else None)
    p.add_argument("--mode", choices=("copy", "gather"), default="copy")
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--mib", type=int, default=1024, help="pinned source size (1024)")
    args = p.parse_args(argv)
    if args.seconds <= 0 or args.mib < 2:
        raise UsageError("--seconds must be > 0 and --mib >= 2")
    require_gpu("bench.dmaload")
    import cupy

    from moestream.gpu.cuda import CupyBackend
    from moestream.gpu.kernels import COPY_FIELDS, NO_FLIP, CudaKernels

    nbytes = args.mib << 20
    piece = 1792 << 10  # the fine-grained shape's expert
    with contextlib.ExitStack() as stack:
        backend = CupyBackend()
        stack.callback(backend.close)
        host = backend.alloc_host(nbytes)
        stack.callback(host.close)
        dev = backend.alloc_device(nbytes)
        stack.callback(dev.close)
        host.array[:] = 1
        stream = backend.new_stream()
        kernels = CudaKernels()
        n = nbytes // piece
        rows = np.array([(host.array.ctypes.data + i * piece, dev.ptr + i * piece, piece, 0,
                          NO_FLIP) for i in range(n)], dtype=np.uint64).reshape(n, COPY_FIELDS)
        step = nbytes if args.mode == "copy" else n * piece  # bytes one pass moves
        moved, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < args.seconds:
            for _ in range(4):
                if args.mode == "copy":
                    cupy.cuda.runtime.memcpyAsync(dev.ptr, host.array.ctypes.data, nbytes,
                                                  cupy.cuda.runtime.memcpyHostToDevice,
                                                  stream.raw.ptr)
                else:
                    kernels.gather(rows, stream)
                moved += step
            stream.synchronize()
        elapsed = time.perf_counter() - t0
    print(f"dmaload {args.mode}: {moved / elapsed / GB:.1f} GB/s for {elapsed:.1f} s")
    return 0


if __name__ == "__main__":
    exit_with("python -m bench.dmaload", main)
