"""One device's part of the proxy decode (``moestream.pipeline.proxy.decode``): its compute
stream, its copy of the hidden state, what it computes per expert, and the split of its
end-of-layer wait.

What "compute" is: ``real`` runs a SwiGLU expert on a hidden state in float32 (F16 experts
from the handles' float16 views; GGUF quantized experts dequantized to float32 first,
``moestream.gpu.dequant``, bitwise ``gguf.quants.dequantize``), ``digest`` reads every byte
of every used expert and checks it against the file, ``fixed:MS`` keeps the device busy MS
milliseconds per layer, like an engine's kernels would.

The wait is split, in queue order, into the compute stream working (``compute``) and the
compute stream stalled on an upload event (``upload``): before each device-side wait on an
upload an event is recorded, and the host waits on that event, then on the upload, then on
the next. On the host backend kernels run inline and every event is complete.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType

from moestream import ExpertHandle
from moestream.gpu.backend import Backend, Event, Kernels
from moestream.gpu.dequant import Dequantizer, make_dequantizer, values_of
from moestream.pipeline.foundation.config import ComputeSpec
from moestream.pipeline.foundation.errors import DeviceMemoryError
from moestream.pipeline.foundation.table import ExpertTable
from moestream.pipeline.foundation.timesplit import TimeSplit
from moestream.pipeline.streaming.verify import DigestRows, Digests

__all__ = ["Decoder"]

_HOST_SLICE_MS = 10.0
"""``fixed`` compute on the host backend spins the CPU on the event loop's thread, in slices
of at most this long with a yield to the loop after each: a signal or a cancel lands within
a slice, not after the layer (``fixed:1000`` is a second per layer)."""
_F16 = GGMLQuantizationType.F16


class _OnDevice:
    """Makes the backend's device and the compute stream current. Used on the loop thread
    only, never nested, so one device context serves every layer."""

    __slots__ = ("_device", "_stream")

    def __init__(self, backend: Backend, stream: Any) -> None:
        self._device: Any = backend.activate()
        self._stream = stream

    def __enter__(self) -> None:
        self._device.__enter__()
        self._stream.__enter__()

    def __exit__(self, *exc: object) -> None:
        self._stream.__exit__(*exc)
        self._device.__exit__(*exc)


class Decoder:
    """One device's part of the proxy decode: its compute stream, its copy of the hidden
    state, the digests of what it consumed (``digest`` compute).

    Args:
        compute: what to do with each expert (``resolve_compute``d).
        table: the model's expert table.
        backend: the device.
        kernels: the backend's kernels.
        seed: the initial hidden state's seed.
    """

    def __init__(self, compute: ComputeSpec, table: ExpertTable, backend: Backend,
                 kernels: Kernels, seed: int = 0) -> None:
        self._table = table
        self.backend = backend
        self._kernels = kernels
        self.stream = backend.new_stream()
        # array module and contexts (device, stream), fixed for the run: looked up once
        self._xp: Any = np
        self.ctx: Any = contextlib.nullcontext()
        if backend.name == "cupy":
            import cupy

            self._xp = cupy
            self.ctx = _OnDevice(backend, self.stream.raw)  # type: ignore[attr-defined]
        self.compute = compute
        self._hidden = self._initial_hidden(seed) if compute.kind == "real" else None
        # quantized experts (``real``): held by ``consume`` until the batch's ``flush``
        # dequantizes them, one launch per type, into ``_scratch`` (reused, grown as needed)
        self._dequant: Dequantizer | None = None
        if compute.kind == "real" and any(
                {layer.gate_up_type, layer.down_type} != {_F16} for layer in table.layers.values()):
            self._dequant = make_dequantizer(backend.name)
        self._held: list[tuple[ExpertHandle, float]] = []
        self._scratch: Any = None
        self.acc: Any = None  # the layer's weighted sum of expert outputs (``real``)
        self.use_digests = DigestRows(kernels, len(table.layers) * table.top_k)
        # (bytes, ms) of host compute queued by consume, spent by spend_host_compute
        self._spins_host = backend.name == "host"
        self._host_compute: list[tuple[Any, float]] = []
        # a GPU queues kernels and copies (the host waits at the layer's end); the host
        # backend runs them inline, so its compute is the time spent in them
        self.queues = backend.async_copies
        # (event before the wait, upload event) of each device-side wait of this layer
        self._device_waits: list[tuple[Event, Event]] = []
        self._waited_on: Event | None = None  # the upload event the stream last waited for

    def _initial_hidden(self, seed: int) -> Any:
        rng = np.random.default_rng([seed, 0x5EED])
        x = rng.standard_normal(self._table.hidden).astype(np.float32)
        x /= np.sqrt(np.mean(x * x))
        return self._xp.asarray(x)

    @property
    def hidden(self) -> Any:
        return self._hidden

    def set_hidden(self, hidden: Any) -> None:
        """Start a token from this hidden state (the live router's token embedding).

        Only ``real`` compute changes it layer by layer; with ``digest`` or ``fixed`` the
        live router routes every layer from the embedding itself.
        """
        self._hidden = hidden

    def advance(self, acc: Any) -> None:
        """The residual step: hidden + the weighted expert outputs, RMS-normalized."""
        with self.ctx:
            x = self._hidden + acc
            self._hidden = x / (self._xp.sqrt(self._xp.mean(x * x)) + 1e-6)

    def take_use_digests(self) -> Digests:
        """The digests of every expert consumed since the last call (``--compute digest``)."""
        return self.use_digests.take()

    def begin(self) -> None:
        """A new layer: no waits yet, a zero sum for ``real`` compute."""
        self._device_waits.clear()  # a failed layer leaves its own behind
        self._waited_on = None
        self._held.clear()
        if self.compute.kind == "real":
            with self.ctx:
                self.acc = self._kernels.zeros(self._table.hidden)

    def consume(self, h: ExpertHandle, weight: float, layer_ms: float) -> None:
        """Queue the compute of one expert on the compute stream (inside ``ctx``)."""
        upload = h.pending_event()  # no device query: waiting on a done event is free
        # a layer gathered in one launch shares one event: the stream waits for it once
        if upload is not None and upload is not self._waited_on:
            self._waited_on = upload
            if self.queues:
                self._device_waits.append((self.stream.record(), upload))
            self.stream.wait(upload)
        kind = self.compute.kind
        if kind == "real" and self._dequant is not None and any(
                m.ggml_type != _F16 for m in h.matrices):
            self._held.append((h, weight))  # computed by ``flush``, with the batch's others
        elif kind == "real":
            gate, up, down = h.matrices
            self.acc += weight * self._kernels.swiglu(self._hidden, gate.array, up.array,
                                                      down.array, self.stream)
        elif kind == "digest":
            results, row = self.use_digests.reserve(h.key)
            self._kernels.digest_views([m.bytes for m in h.matrices], results, row,
                                       self.stream)
            self.use_digests.complete(results, row, self.stream.record())
        elif layer_ms > 0 and self._spins_host:
            self._host_compute.append((h.down.bytes, layer_ms))
        elif layer_ms > 0:  # the device spins on its clock: no view to make
            self._kernels.busy(layer_ms, None, self.stream)

    def flush(self) -> None:
        """Compute the quantized experts ``consume`` held (inside ``ctx``, after the batch):
        their matrices dequantized to float32 on the compute stream, one launch per type for
        the whole batch (a layer whose experts are all in hand is one batch), then each
        expert's SwiGLU, in the order they were consumed.

        Raises:
            DeviceMemoryError: the float32 scratch for the batch could not be allocated.
        """
        if not self._held:
            return
        held, self._held = self._held, []
        # each held expert's (gate, up, down) values: F16 views now, the others filled below
        values = [[m.array if m.ggml_type == _F16 else None for m in h.matrices]
                  for h, _ in held]
        by_type: dict[GGMLQuantizationType, list[tuple[list[Any], int, Any]]] = {}
        for (h, _), row in zip(held, values, strict=True):
            for i, m in enumerate(h.matrices):
                if row[i] is None:
                    by_type.setdefault(m.ggml_type, []).append((row, i, m))
        sizes = {q: sum(values_of(q, m.nbytes) for _, _, m in ms) for q, ms in by_type.items()}
        scratch = self._scratch_for(sum(sizes.values()))
        at = 0
        assert self._dequant is not None  # held only with a dequantizer
        for qtype, ms in by_type.items():
            views = self._dequant.dequantize(qtype, [m.bytes for _, _, m in ms],
                                             scratch[at : at + sizes[qtype]], self.stream)
            for (row, i, m), view in zip(ms, views, strict=True):
                row[i] = view.reshape(m.shape)
            at += sizes[qtype]
        for (_, weight), (gate, up, down) in zip(held, values, strict=True):
            self.acc += weight * self._kernels.swiglu(self._hidden, gate, up, down, self.stream)

    def _scratch_for(self, n: int) -> Any:
        """``n`` float32 of scratch on the device: the one kept, grown when too small. Its
        earlier contents are read only by work queued before on the same stream."""
        if self._scratch is None or self._scratch.size < n:
            self._scratch = None  # the old one goes back before the larger is made
            try:
                self._scratch = self._xp.empty(n, dtype=self._xp.float32)
            except MemoryError as exc:  # CuPy's OutOfMemoryError is one
                raise DeviceMemoryError(
                    f"no device memory for {n * 4} bytes of dequantized experts (real "
                    "compute's scratch); use a smaller --cache-budget or --compute digest"
                ) from exc
        return self._scratch[:n]

    async def spend_host_compute(self) -> None:
        """Run the ``fixed`` host compute ``consume`` queued, yielding to the event loop
        between slices (a device kernel runs beside the loop; the host's spins on it)."""
        if not self._host_compute:
            return
        queued, self._host_compute = self._host_compute, []
        for data, ms in queued:
            left = ms
            while left > 0:
                piece = min(left, _HOST_SLICE_MS)
                self._kernels.busy(piece, data, self.stream)
                left -= piece
                await asyncio.sleep(0)

    def wait_for_layer(self, done: Event, split: TimeSplit) -> None:
        """Wait for the layer's compute, charging each stretch of the wait to the compute
        stream working (``compute``) or stalled on an upload event (``upload``).

        The stream runs in queue order: once the event recorded before its wait on upload
        ``i`` has completed, and every earlier upload has, it can only be computing (until
        that event) or idle until upload ``i`` lands. On the host backend every event is
        complete and this costs nothing.
        """
        t = time.perf_counter()
        for before, upload in self._device_waits:
            before.synchronize()
            t_work = time.perf_counter()
            upload.synchronize()
            t_landed = time.perf_counter()
            split.charge("compute", t_work - t)
            split.charge("upload", t_landed - t_work)
            t = t_landed
        self._device_waits.clear()
        done.synchronize()
        split.charge("compute", time.perf_counter() - t)
