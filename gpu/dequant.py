"""GGUF quantized expert matrices to float32 values on their device, for the proxy engine's
``real`` compute (``moestream.pipeline.proxy.decoder``).

Why here: the proxy engine computes a real SwiGLU on every expert it consumes, and a GGUF
model's experts are quantized blocks (ds4's IQ2_XXS gate/up and Q2_K down, the k-quants of
most GGUF MoE files). Both dequantizers give gguf-py's values bit for bit (the reference,
``gguf.quants.dequantize``, float32):

- ``HostDequantizer`` (the host backend) calls ``gguf.quants.dequantize`` itself;
- ``CudaDequantizer`` (CuPy) runs one raw kernel per type over many matrices at once (their
  rows in one table, read in place from pinned memory), written in
  ``moestream.gpu.dequantsource``: the proxy hands it a batch
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
_SLOTS = 16
_SLOT_ROWS = 256  # matrices a launch, at most (a layer's batch is top-k x 3 of them)


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
            # extreme scales overflow to inf (inf - inf is NaN) in gguf-py as on the device:
            # the values are the reference's, not a fault to warn of
            with np.errstate(over="ignore", invalid="ignore"):
                view[...] = gguf.quants.dequantize(src, qtype)
            views.append(view)
        return views


class CudaDequantizer:
    """The raw kernels of ``moestream.gpu.dequantsource``, built once (on first use of the
    device: CuPy compiles and caches the module)."""

    def __init__(self) -> None:
        import cupy

        self._module = cupy.RawModule(code=dequant_source())
        self._kernels: dict[GGMLQuantizationType, Any] = {}
        self._rows = _RowSlots(_SLOTS, _SLOT_ROWS)

    def _kernel(self, qtype: GGMLQuantizationType) -> Any:
        if qtype not in self._kernels:
            self._kernels[qtype] = self._module.get_function(KERNELS[qtype])
        return self._kernels[qtype]

    def dequantize(self, qtype: GGMLQuantizationType, sources: Sequence[DeviceArray],
                   out: DeviceArray, stream: Stream) -> list[DeviceArray]:
        """One launch for every source (up to 256 a launch), its table read in place from
        pinned host memory."""
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
            for start in range(0, len(rows), _SLOT_ROWS):
                part = rows[start : start + _SLOT_ROWS]
                slot, table = self._rows.take()
                table[: len(part)] = part
                kernel((blocks, len(part)), (_THREADS,), (np.uint64(table.ctypes.data),))
                self._rows.used(slot, stream.raw)
        return [out[at : at + n] for at, n in spans]


class _RowSlots:
    """Pinned tables of ``Row``s for the launches, reused in turn once the launch that read
    one has run.

    ``cudaHostAlloc`` memory is mapped for the device (unified addressing), so a kernel reads
    its table in place: no copy from pageable memory (which can make the host wait for the
    stream) and no allocation a launch. A slot is rewritten only after the event recorded
    behind its last launch (``_SLOTS`` launches ago: long done, so the wait is a check).
    """

    def __init__(self, slots: int, rows: int) -> None:
        import cupy

        from moestream.gpu.cuda import CudaPinned

        self._pinned = CudaPinned(slots * rows * 3 * 8)
        self._rows = self._pinned.array.view(np.uint64).reshape(slots, rows, 3)
        self._events = [cupy.cuda.Event(block=False, disable_timing=True) for _ in range(slots)]
        self._recorded = [False] * slots
        self._next = 0  # one decoder's dequantizer: used on the event loop's thread only

    def take(self) -> tuple[int, Any]:
        slot = self._next
        self._next = (slot + 1) % len(self._events)
        if self._recorded[slot]:
            self._events[slot].synchronize()
            self._recorded[slot] = False
        return slot, self._rows[slot]

    def used(self, slot: int, stream: Any) -> None:
        """Record ``slot``'s event on ``stream`` (a CuPy stream) right after its launch."""
        self._events[slot].record(stream)
        self._recorded[slot] = True


def make_dequantizer(backend_name: str) -> Dequantizer:
    """The dequantizer matching a backend's name."""
    return CudaDequantizer() if backend_name == "cupy" else HostDequantizer()
