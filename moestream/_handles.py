"""Expert handles: an expert's gate, up and down matrices on its device, while leased.

A handle is valid while its lease is held. After the lease is released (or its session
closed) every accessor of the handle and of its matrices raises ``UsageError``: the buffer
may already hold another expert. An array taken out before the release (``.array``,
``.bytes``, a DLPack import) keeps the memory allocated (it is never freed under it) but
must not be read after the release, as with any borrowed buffer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType

from moestream.gpu.backend import Backend, Event
from moestream.gpu.host import HostEvent
from moestream.gpu.interop import StreamLike, wait_on
from moestream.pipeline.foundation.errors import UsageError
from moestream.pipeline.foundation.table import MoeLayer
from moestream.pipeline.streaming.lease import Arrival, LayerLease
from moestream.stages.layout import plan_expert

__all__ = ["ExpertHandle", "InPlace", "Matrix", "wait_uploads"]

_LANDED = HostEvent()
"""The event of an expert whose bytes were on the device before it was handed out."""
_TYPED = {GGMLQuantizationType.F16: "float16", GGMLQuantizationType.F32: "float32"}
_NAMES = ("gate", "up", "down")


class Matrix:
    """One of an expert's three matrices on its device: a view of the cache, not a copy.

    Attributes:
        name: ``gate``, ``up`` or ``down``.
        ggml_type: its GGUF tensor type (``GGMLQuantizationType``: ``.name`` is ``F16``,
            ``Q2_K``...; the int value is GGML's type id).
        shape: (rows, columns) in elements, GGUF order: gate and up are (ffn, hidden), down
            is (hidden, ffn); for FP4 and MXFP4 experts (``LayerInfo.quant.shapes``) the
            bytes as stored, two values a byte. In a transposed layer (gpt-oss,
            ``LayerInfo.transposed``) gate and up are the two row halves of gate_up
            (hidden, 2 * ffn), gate and up interleaved by column, each (hidden / 2,
            2 * ffn), and down is (ffn, hidden).
            In a layer without gates (Nemotron-H, ``LayerInfo.gated`` false) gate and up
            are the two row halves of the up projection (ffn, hidden), each (ffn / 2,
            hidden).
        nbytes: its bytes (the quantized blocks as the file stores them).
    """

    # the array over the cache's bytes is made on first use: an engine that takes only
    # addresses (``ptr``: a kernel's table) makes none, and a CuPy array costs ~3 us
    __slots__ = ("_array", "_bytes", "_handle", "_offset", "ggml_type", "name", "nbytes",
                 "shape")

    def __init__(self, handle: ExpertHandle, name: str, ggml_type: GGMLQuantizationType,
                 shape: tuple[int, int], offset: int, nbytes: int) -> None:
        self._handle = handle
        self.name = name
        self.ggml_type = ggml_type
        self.shape = shape
        self.nbytes = nbytes
        self._offset = offset  # in the expert's cache buffer
        self._bytes: Any = None
        self._array: Any = None

    def _raw(self) -> Any:
        raw = self._bytes
        if raw is None:
            raw = self._bytes = self._handle._matrix_bytes(self._offset, self.nbytes)
        return raw

    @property
    def bytes(self) -> Any:
        """The raw bytes: a 1-D uint8 array (CuPy on a GPU, numpy, read-only, on the host).

        Raises:
            UsageError: the lease was released.
        """
        self._handle.check()
        return self._raw()

    @property
    def array(self) -> Any:
        """The matrix typed: float16 or float32 of ``shape`` for F16 and F32 matrices, the
        raw bytes (uint8) for every quantized type. What ``__dlpack__`` exports.

        Raises:
            UsageError: the lease was released.
        """
        self._handle.check()
        if self._array is None:
            dtype = _TYPED.get(self.ggml_type)
            raw = self._raw()
            self._array = raw if dtype is None else raw.view(dtype).reshape(self.shape)
        return self._array

    @property
    def ptr(self) -> int:
        """The address of the first byte on the device (host memory on the host backend).

        Raises:
            UsageError: the lease was released.
        """
        self._handle.check()
        return self._handle._buffer_ptr() + self._offset

    @property
    def device(self) -> int:
        """The index of the device the matrix lives on (in ``Session.devices``)."""
        return self._handle.device

    def __dlpack__(self, *, stream: int | None = None, max_version: tuple[int, int] | None = None,
                   dl_device: tuple[int, int] | None = None, copy: bool | None = None) -> Any:
        """Export ``array`` without a copy (DLPack). On a GPU the consumer's ``stream`` is
        first made to wait for the expert's upload, on the device (None: the legacy
        default stream, as the protocol says; -1: no ordering).

        Host memory exports read-only to a consumer that asks for DLPack 1.0
        (``max_version``), whose capsule carries the flag; to one that does not (the legacy
        capsule cannot say read-only) it exports the same memory unflagged: the consumer
        must not write it, as with every view of the cache.

        Raises:
            UsageError: the lease was released.
            BufferError: a stream other than None or -1 was given for host memory.
        """
        array = self.array
        if isinstance(array, np.ndarray):
            if stream is not None and stream != -1:
                raise BufferError(f"host memory takes no stream (None or -1), got {stream!r}")
            if max_version is None or max_version[0] < 1:
                alias = array.view()  # the same memory; numpy refuses a read-only legacy export
                try:
                    alias.flags.writeable = True
                except ValueError:  # memory that is read-only underneath (a file's mapping)
                    raise BufferError(f"{self.name}: read-only memory needs DLPack 1.0 "
                                      "(max_version=(1, 0))") from None
                return alias.__dlpack__(dl_device=dl_device, copy=copy)
            return array.__dlpack__(max_version=max_version, dl_device=dl_device, copy=copy)
        if stream != -1:
            wait_on(self._handle.event, 1 if stream is None else stream)
        # only what the consumer gave: an older CuPy takes ``stream`` alone, and a consumer
        # asking for ``max_version`` retries without it on the TypeError
        given: dict[str, Any] = {"max_version": max_version, "dl_device": dl_device,
                                 "copy": copy}
        return array.__dlpack__(stream=-1, **{k: v for k, v in given.items() if v is not None})

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> Any:
        """``np.asarray(matrix)``: ``array`` itself on the host (no copy, read-only), or a
        copy when ``dtype`` differs or ``copy`` is true.

        Raises:
            UsageError: the lease was released.
            TypeError: the matrix lives on a GPU (copy ``bytes`` to the host explicitly).
        """
        array = self.array
        if not isinstance(array, np.ndarray):
            raise TypeError("a GPU matrix does not convert to numpy implicitly: use "
                            "cupy.from_dlpack(m) or m.array.get()")
        if copy is False and dtype is not None and np.dtype(dtype) != array.dtype:
            raise ValueError(f"{self.name}: {array.dtype} to {np.dtype(dtype)} needs a copy")
        if copy or (dtype is not None and np.dtype(dtype) != array.dtype):
            return np.array(array, dtype=dtype, copy=True)
        return array

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        """The CUDA array interface of ``array`` on a GPU (CuPy, Numba, PyTorch's
        ``torch.as_tensor``). The interface carries a stream, not an event, so an upload
        still in flight is waited for here, on the host; ``h.wait(stream)`` then DLPack
        orders on the device instead.

        Raises:
            AttributeError: host memory (use ``__array__`` or DLPack).
            UsageError: the lease was released.
        """
        array = self.array
        if isinstance(array, np.ndarray):
            raise AttributeError("host memory has no __cuda_array_interface__ (use "
                                 "np.asarray or DLPack)")
        if not self._handle.ready():
            self._handle.event.synchronize()
        interface: dict[str, Any] = dict(array.__cuda_array_interface__)
        interface["stream"] = None  # landed: no ordering left for the consumer
        return interface

    def __dlpack_device__(self) -> tuple[int, int]:
        """(device type, index): (1, 0) for host memory, (2, N) for CUDA device N."""
        self._handle.check()
        device: tuple[int, int] = self._raw().__dlpack_device__()
        return device

    def __repr__(self) -> str:
        return (f"Matrix({self.name}, {self.ggml_type.name}, shape={self.shape}, "
                f"nbytes={self.nbytes})")


_Spans = tuple[tuple[str, GGMLQuantizationType, int, int, tuple[int, int]], ...]


def _matrix_spans(info: MoeLayer) -> _Spans:
    """(name, type, device offset, bytes, shape) of the layer's experts' gate, up and down:
    where ``plan_expert`` lays them in a cache buffer (by their sizes: the same for every
    expert of a layer), and ``Matrix.shape``; for quantized experts whose bytes are not
    elements (FP4, MXFP4: two values a byte), the shapes of their bytes as stored."""
    hidden, ffn = info.shape
    shapes: tuple[tuple[int, int], ...]
    if info.quant is not None and info.quant.shapes is not None:
        shapes = info.quant.shapes
    elif info.transposed and not info.gated:  # Ergo: up [D, F] in two row halves
        shapes = (hidden // 2, ffn), (hidden // 2, ffn), (ffn, hidden)
    elif info.transposed:
        shapes = (hidden // 2, 2 * ffn), (hidden // 2, 2 * ffn), (ffn, hidden)
    elif not info.gated:
        shapes = (ffn // 2, hidden), (ffn // 2, hidden), (hidden, ffn)
    else:
        shapes = (ffn, hidden), (ffn, hidden), (hidden, ffn)
    types = (info.gate_up_type, info.gate_up_type, info.down_type)
    ranges = plan_expert(info.slices(0)).ranges
    return tuple((name, kind, r.device_offset, r.nbytes, shape) for name, kind, r, shape
                 in zip(_NAMES, types, ranges, shapes, strict=True))


class LeaseShared:
    """What the handles of one lease share: the lease (whose release ends them), the
    devices' backends and the layer's matrices: where they lie, their shapes and types.

    The public lease and its handles hold it, nothing else: when the last of them is
    dropped with the lease still held, ``on_drop`` is told (the session releases it).
    """

    __slots__ = ("__weakref__", "backends", "info", "lease", "on_drop", "spans")

    def __init__(self, lease: LayerLease, backends: Sequence[Backend], info: MoeLayer,
                 on_drop: Callable[[LayerLease], None] | None = None) -> None:
        self.lease = lease
        self.backends = backends
        self.info = info
        self.on_drop = on_drop
        # once a lease, not a handle, and only once a handle's matrices are asked for
        self.spans: _Spans | None = None

    def __del__(self) -> None:
        if not self.lease.released and self.on_drop is not None:
            self.on_drop(self.lease)


class ExpertHandle:
    """One leased expert: its three matrices on its device and the event of its upload.

    Attributes:
        layer: the model layer index.
        expert: the expert index within the layer.
        device: the index of its device in ``Session.devices``.
        gate, up, down: its matrices (``Matrix``), made on first use.
    """

    # made per expert between two layers' kernels: what every handle needs, nothing more
    __slots__ = ("_entry", "_matrices", "_shared", "device", "expert", "layer")

    def __init__(self, shared: LeaseShared, arrival: Arrival) -> None:
        entry = arrival.entry
        self._shared = shared
        self._entry = entry
        self.device = arrival.part.device
        self.layer, self.expert = entry.key
        self._matrices: tuple[Matrix, Matrix, Matrix] | None = None

    def _make_matrices(self) -> tuple[Matrix, Matrix, Matrix]:
        shared = self._shared
        spans = shared.spans
        if spans is None:
            spans = shared.spans = _matrix_spans(shared.info)
        matrices = [Matrix(self, name, kind, shape, offset, nbytes)
                    for name, kind, offset, nbytes, shape in spans]
        self._matrices = (matrices[0], matrices[1], matrices[2])
        return self._matrices

    def _matrix_bytes(self, offset: int, nbytes: int) -> Any:
        """A matrix's bytes as an array over the cache buffer (read-only on the host)."""
        raw = self._shared.backends[self.device].device_bytes(self._entry.buffer, offset,
                                                              nbytes)
        if isinstance(raw, np.ndarray):
            raw.flags.writeable = False  # the cache's bytes: compute reads, never writes
        return raw

    def _buffer_ptr(self) -> int:
        ptr: int = self._entry.buffer.ptr
        return ptr

    @property
    def matrices(self) -> tuple[Matrix, Matrix, Matrix]:
        """(gate, up, down).

        Raises:
            UsageError: the lease was released.
        """
        self.check()
        return self._matrices or self._make_matrices()

    @property
    def gate(self) -> Matrix:
        return self.matrices[0]

    @property
    def up(self) -> Matrix:
        return self.matrices[1]

    @property
    def down(self) -> Matrix:
        return self.matrices[2]

    def check(self) -> None:
        """Raise ``UsageError`` if the lease was released (or its session closed)."""
        lease = self._shared.lease
        if lease.released:
            why = f" ({lease.closed_reason})" if lease.closed_reason else ""
            raise UsageError(f"layer {self.layer} expert {self.expert}: used after its lease "
                             f"was released{why}")

    @property
    def key(self) -> tuple[int, int]:
        return (self.layer, self.expert)

    @property
    def released(self) -> bool:
        return self._shared.lease.released

    @property
    def event(self) -> Event:
        """Completes when the expert's bytes are on the device (``done()``,
        ``synchronize()``; ``raw`` is the ``cupy.cuda.Event`` on a GPU). Complete from the
        start on the host backend.

        Raises:
            UsageError: the lease was released.
        """
        self.check()
        upload = self._entry.upload
        return upload if upload is not None else _LANDED

    @property
    def cuda_event(self) -> Any:
        """The upload's ``cupy.cuda.Event`` (its ``ptr`` is the ``cudaEvent_t``); None on
        the host backend.

        Raises:
            UsageError: the lease was released.
        """
        return getattr(self.event, "raw", None)

    def ready(self) -> bool:
        """Whether the upload has completed (a query, never a wait; none at all for an
        expert installed before it was handed out)."""
        if self._shared.lease.released:
            self.check()  # raises
        entry = self._entry
        return entry.ready or entry.upload is None or entry.upload.done()

    def pending_event(self) -> Event | None:
        """The upload's event, or None once the expert is known to be on the device
        (installed: its event was seen complete). Never queries the device, so an
        engine that makes its stream wait on what this returns (once per distinct event:
        a layer copied in one launch shares one) pays one wait a layer instead of a
        ``ready()`` query per expert.

        Raises:
            UsageError: the lease was released.
        """
        self.check()
        entry = self._entry
        return None if entry.ready else entry.upload

    def wait(self, stream: StreamLike = None) -> None:
        """Make ``stream`` wait for the upload on the device; the host never blocks.

        Args:
            stream: a ``cupy.cuda.Stream``, a ``torch.cuda.Stream``, a ``cudaStream_t`` as
                an int, or None for CuPy's current stream. Ignored on the host backend.

        Raises:
            UsageError: the lease was released, or ``stream`` is not a stream.
        """
        wait_on(self.event, stream)

    def __repr__(self) -> str:
        state = "released" if self.released else f"device {self.device}"
        return f"ExpertHandle(layer={self.layer}, expert={self.expert}, {state})"


def wait_uploads(handles: Iterable[ExpertHandle], stream: StreamLike = None) -> int:
    """Make ``stream`` wait on the device for the uploads of ``handles`` not yet known
    installed, once per distinct event; the host never blocks.

    A layer's misses copied in one launch share one event, so a batch of handles costs one
    event query and at most one wait (``cudaStreamWaitEvent``) per launch, not a query
    and a wait an expert; installed experts cost nothing (``ExpertHandle.pending_event``).

    Args:
        handles: handles of held leases (a ``gather()``, an ``available()`` batch).
        stream: as ``ExpertHandle.wait``; ignored on the host backend.

    Returns:
        How many distinct upload events were still pending (each waited on unless it had
        completed meanwhile).

    Raises:
        UsageError: a handle's lease was released.
    """
    pending: set[int] = set()
    for h in handles:
        event = h.pending_event()
        if event is not None and id(event) not in pending:
            pending.add(id(event))
            wait_on(event, stream)
    return len(pending)


@dataclass(frozen=True, slots=True)
class InPlace:
    """Where experts of one layer lie in the model file's page-cache mapping, for the
    session's device to read them in place (``SyncSession.in_place``).

    Why: an engine that computes from a device table of addresses (a kernel that copies
    each routed expert's weights by it) can read an expert the cache does not hold straight
    from the registered mapping, so its experts call needs no host read of the routing and
    no load. ``addresses`` holds each asked expert's ranges' addresses in the mapping, in
    their order (gate, up, down, as the cache's matrices), ``sizes`` their bytes; they stay
    readable while ``SyncSession.in_place_current`` says so (the session leaves resident
    mode only after the whole device has synchronized).
    """

    layer: int
    addresses: tuple[tuple[int, ...], ...]
    sizes: tuple[tuple[int, ...], ...]
    mapping: Any
