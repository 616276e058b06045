"""GGUF quantized expert matrices to float32 values on their device, for the proxy engine's
``real`` compute (``moestream.pipeline.proxy.decoder``).

Why here: the proxy engine computes a real SwiGLU on every expert it consumes, and a GGUF
model's experts are quantized blocks (ds4's IQ2_XXS gate/up and Q2_K down, the k-quants of
most GGUF MoE files). Both dequantizers give gguf-py's values bit for bit (the reference,
``gguf.quants.dequantize``, float32):

- ``HostDequantizer`` (the host backend) calls ``gguf.quants.dequantize`` itself;
- ``CudaDequantizer`` (CuPy) runs one raw kernel per type over many matrices at once (their
  rows in one table), written in ``moestream.gpu.dequantsource``: the proxy hands it a batch
  of arrived experts, so a layer costs one launch per type, not one per matrix.

The types are ``moestream.pipeline.foundation.compute.DEQUANTIZED``; another is refused in
one line.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from moestream.gpu.backend import DeviceArray, Stream
from moestream.gpu.cuda import CudaStream
from moestream.gpu.dequantsource import KERNELS, dequant_source
from moestream.pipeline.foundation.compute import DEQUANTIZED
from moestream.pipeline.foundation.errors import UsageError

__all__ = ["CudaDequantizer", "Dequantizer", "HostDequantizer", "make_dequantizer", "values_of"]

_THREADS = 256
_MAX_BLOCKS_X = 1024  # a grid-stride loop covers larger matrices
_MAX_ROWS = 65535  # gridDim.y


class Dequantizer(Protocol):
    """Quantized matrices of one type to float32 values on their device."""

    def dequantize(self, qtype: GGMLQuantizationType, sources: Sequence[DeviceArray],
                   out: DeviceArray, stream: Stream) -> list[DeviceArray]:
        """Write each source's values into ``out``, one after another, on ``stream``.

        Args:
            qtype: the sources' GGUF type, one of ``DEQUANTIZED``.
            sources: 1-D uint8 arrays of whole blocks (``Matrix.bytes``), on the device.
            out: a 1-D float32 array on the device, at least ``values_of`` of them all.
            stream: the stream the work is queued on (the host backend runs it inline).

        Returns:
            Each source's values: a 1-D view of ``out``, valid once the stream has run.

        Raises:
            UsageError: ``qtype`` is not one of ``DEQUANTIZED``, a source is not whole
                blocks of it, or ``out`` is too small.
        """
        ...


def values_of(qtype: GGMLQuantizationType, nbytes: int) -> int:
    """The values ``nbytes`` of ``qtype`` blocks hold.

    Raises:
        UsageError: a type not in ``DEQUANTIZED``, or not whole blocks.
    """
    if qtype not in DEQUANTIZED:
        names = ", ".join(sorted(q.name for q in DEQUANTIZED))
        raise UsageError(f"cannot dequantize {qtype.name} experts (real compute dequantizes "
                         f"{names}); use --compute digest or fixed")
    elems, size = GGML_QUANT_SIZES[qtype]
    if nbytes % size:
        raise UsageError(f"{nbytes} bytes are not whole {qtype.name} blocks of {size} bytes")
    return nbytes // size * elems


def _layout(qtype: GGMLQuantizationType, sources: Sequence[DeviceArray],
            out: DeviceArray) -> list[tuple[int, int]]:
    """Each source's (offset, values) in ``out``, checked."""
    spans, at = [], 0
    for src in sources:
        n = values_of(qtype, int(src.nbytes))
        spans.append((at, n))
        at += n
    if at > out.size:
        raise UsageError(f"{at} {qtype.name} values do not fit {out.size} floats")
    return spans


class HostDequantizer:
    """gguf-py's own ``dequantize`` on host memory: the reference itself."""

    def dequantize(self, qtype: GGMLQuantizationType, sources: Sequence[DeviceArray],
                   out: DeviceArray, stream: Stream) -> list[DeviceArray]:
        views = []
        for src, (at, n) in zip(sources, _layout(qtype, sources, out), strict=True):
            view = out[at : at + n]
            view[...] = gguf.quants.dequantize(src, qtype)
            views.append(view)
        return views


class CudaDequantizer:
    """The raw kernels of ``moestream.gpu.dequantsource``, built once (on first use of the
    device: CuPy compiles and caches the module)."""

    def __init__(self) -> None:
        import cupy

        self._cp = cupy
        self._module = cupy.RawModule(code=dequant_source())
        self._kernels: dict[GGMLQuantizationType, Any] = {}

    def _kernel(self, qtype: GGMLQuantizationType) -> Any:
        if qtype not in self._kernels:
            self._kernels[qtype] = self._module.get_function(KERNELS[qtype])
        return self._kernels[qtype]

    def dequantize(self, qtype: GGMLQuantizationType, sources: Sequence[DeviceArray],
                   out: DeviceArray, stream: Stream) -> list[DeviceArray]:
        """One launch for every source (up to 65535 a launch: the grid's rows)."""
        spans = _layout(qtype, sources, out)
        if not isinstance(stream, CudaStream):
            raise TypeError(f"CUDA dequantization got a {type(stream).__name__}")
        if not sources:
            return []
        kernel = self._kernel(qtype)
        base, elems = int(out.data.ptr), GGML_QUANT_SIZES[qtype][0]
        rows = np.array([(int(src.data.ptr), base + 4 * at, n // elems)
                         for src, (at, n) in zip(sources, spans, strict=True)], dtype=np.uint64)
        largest = max(n for _, n in spans)
        blocks = max(1, min(_MAX_BLOCKS_X, -(-largest // _THREADS)))
        with stream.raw:
            for start in range(0, len(rows), _MAX_ROWS):
                part = rows[start : start + _MAX_ROWS]
                # the table is copied on this stream and freed into this stream's pool:
                # CuPy reuses its memory only for later work on the same stream
                table = self._cp.asarray(part)
                kernel((blocks, len(part)), (_THREADS,), (table,))
        return [out[at : at + n] for at, n in spans]


def make_dequantizer(backend_name: str) -> Dequantizer:
    """The dequantizer matching a backend's name."""
    return CudaDequantizer() if backend_name == "cupy" else HostDequantizer()
