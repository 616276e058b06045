"""Decode: ``pipeline.cli.run``'s proxy engine, computing each layer's experts as ``moestream``
hands them out.

This is the API's first client: per layer the loop (``pipeline.proxy.loop``) fetches the experts
through ``moestream.Session.fetch``, and ``Decode.run_layer`` consumes the lease's handles
as an engine would: the ones available at once (``Lease.available``: hits, and misses that
have landed), then the others as they land (``async for``). Each is computed on its
device's compute stream (``Decoder``, one per device), after a device-side wait on its
upload event when it has not landed (never a device-wide synchronize). At the end of the
layer each device records one event; the lease is released after them (the buffers are
reused only once the layer's compute has run) and the host waits for them, as an engine
waits for the router's output before it can choose the next layer's experts. With several
devices each one's weighted sum is combined on the first (the home), which keeps the
hidden state.

What "compute" is: ``real`` runs a SwiGLU expert on a hidden state (F16 experts, from the
handles' float16 views), ``digest`` reads every byte of every used expert and checks it
against the file, ``fixed:MS`` keeps the device busy MS milliseconds per layer, like an
engine's kernels would. ``real`` on a model without F16 experts falls back to ``digest``
(``moestream.pipeline.foundation.compute``).

Each layer also measures its own compute for the token's time split (``end_token``'s
``compute_ms`` and ``upload_ms``): on a GPU the end-of-layer wait is split, in queue order,
into the compute stream working (``compute``) and the compute stream stalled on an upload
event (``upload``): before each device-side wait on an upload an event is recorded, and
the host waits on that event, then on the upload, then on the next. On the host backend
kernels run inline and their time is the compute. Waits for experts to land are the
session's to charge (``moestream.pipeline.foundation.timesplit``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from moestream import ExpertHandle, Lease
from moestream.gpu.backend import Backend, Event, Kernels
from moestream.pipeline.foundation.compute import resolve_compute
from moestream.pipeline.foundation.config import ComputeSpec
from moestream.pipeline.foundation.errors import MoestreamError, StageError
from moestream.pipeline.foundation.table import ExpertTable
from moestream.pipeline.foundation.timesplit import TimeSplit
from moestream.pipeline.streaming.verify import DigestRows, Digests

__all__ = ["Decode", "Decoder", "Launched", "LayerResult"]

_HOST_SLICE_MS = 10.0
"""``fixed`` compute on the host backend spins the CPU on the event loop's thread, in slices
of at most this long with a yield to the loop after each: a signal or a cancel lands within
a slice, not after the layer (``fixed:1000`` is a second per layer)."""


@dataclass(slots=True)
class LayerResult:
    """What one layer found and cost: its lease's hits and misses, the host's waits for
    experts to land (``stall_ms``), and the decode's own time (``compute_ms``), of which
    ``time`` holds the ``compute`` and ``upload`` parts."""

    hits: int
    misses: int
    stall_ms: float
    compute_ms: float
    time: TimeSplit = field(default_factory=TimeSplit)
    device_compute_ms: list[float] = field(default_factory=list)
    """Several devices: each one's part of ``time``'s compute."""


@dataclass(slots=True)
class Launched:
    """A layer's compute queued ahead of its ``run_layer`` (``Decode.launch``): the devices
    it used, the host's time on each (several devices) and in all."""

    used: list[bool]
    device_s: list[float]
    seconds: float = 0.0


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
        if kind == "real":
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


class Decode:
    """Runs a model's MoE layers over the handles of their leases, on every device.

    Args:
        decoders: one per device (``Session.devices`` order), the home first.
        top_k: the experts a layer computes (``fixed`` time is per layer, shared by them).
    """

    def __init__(self, decoders: Sequence[Decoder], top_k: int) -> None:
        self._decoders = list(decoders)
        self._home = self._decoders[0]
        self._several = len(self._decoders) > 1
        self.compute = self._home.compute
        self._per_expert_ms = self.compute.layer_ms / top_k

    @classmethod
    def for_devices(cls, compute: ComputeSpec, table: ExpertTable, backends: Sequence[Backend],
                    kernels: Sequence[Kernels], seed: int = 0) -> Decode:
        """One ``Decoder`` per device, made on its device; ``real`` needs F16 experts."""
        compute = resolve_compute(compute, table)
        decoders = []
        for backend, k in zip(backends, kernels, strict=True):
            with backend.activate():
                decoders.append(Decoder(compute, table, backend, k, seed))
        return cls(decoders, table.top_k)

    @property
    def hidden(self) -> Any:
        return self._home.hidden

    @property
    def queues(self) -> bool:
        """Whether the devices run the compute after the host queued it (a GPU), rather
        than inline as it is queued (the host backend)."""
        return self._home.queues

    def set_hidden(self, hidden: Any) -> None:
        self._home.set_hidden(hidden)
        for d in self._decoders[1:]:
            d.set_hidden(None if hidden is None else d.backend.adopt(hidden))

    def take_use_digests(self) -> Digests:
        return Digests.join(d.take_use_digests() for d in self._decoders)

    def launch(self, lease: Lease, weights: Sequence[float],
               handles: Sequence[ExpertHandle]) -> Launched:
        """Queue a layer's compute now, with every expert of it in hand (``handles``: all
        that ``lease.available()`` gave; a planned all-hit layer), so the devices start on
        it the moment the layer before it ends; its ``run_layer(launched=...)`` then
        releases the lease, waits and counts. A device that queues only (a GPU): the host
        backend runs compute inline.
        """
        t0 = time.perf_counter()
        for d in self._decoders:
            d.begin()
        launched = Launched([False] * len(self._decoders), [0.0] * len(self._decoders))
        self._consume(handles, dict(zip(lease.experts, weights, strict=True)),
                      launched.used, launched.device_s)
        launched.seconds = time.perf_counter() - t0
        return launched

    def _consume(self, batch: Sequence[ExpertHandle], weight_of: dict[int, float],
                 used: list[bool], device_s: list[float]) -> None:
        """Queue ``batch``'s compute, each expert on its device's stream."""
        per_expert_ms = self._per_expert_ms
        if self._several:
            for h in batch:
                t_one = time.perf_counter()
                d = self._decoders[h.device]
                used[h.device] = True
                with d.ctx:
                    d.consume(h, weight_of[h.expert], per_expert_ms)
                device_s[h.device] += time.perf_counter() - t_one
            return
        used[0] = True
        d = self._home
        with d.ctx:
            for h in batch:
                d.consume(h, weight_of[h.expert], per_expert_ms)

    async def run_layer(
        self,
        lease: Lease,
        weights: Sequence[float],
        meanwhile: Callable[[], Awaitable[None] | None] | None = None,
        taken: Sequence[ExpertHandle] | None = None,
        *,
        launched: Launched | None = None,
        then: Callable[[], None] | None = None,
    ) -> LayerResult:
        """Consume one MoE layer's experts as its lease hands them out: those available at
        once, then the others as they land; release the lease after the layer's compute
        and wait for it.

        Args:
            lease: the layer's fetch.
            weights: the router weights of ``lease.experts``, in that order.
            meanwhile: host work for the caller while the devices compute the layer (run
                after their work is queued and the lease released, before the wait); an
                awaitable it returns is awaited there too.
            taken: the handles ``lease.available()`` gave the caller already (it planned
                the layer while the devices computed the one before).
            launched: the layer's compute, queued already (``launch``).
            then: host work for the caller right after the wait, before this layer's
                counting: the next layer's ``launch``, which then starts on the devices
                with only the wait's wake-up between the two layers (issue 26: all cached
                at compute speed). Its time is not this layer's.

        Raises:
            StageError: a miss could not be loaded (or the model file changed: its own
                class); the layer's other experts were consumed and the lease released.
        """
        # a launched layer's experts were all consumed by ``launch``: no weights to look up
        weight_of = dict(zip(lease.experts, weights, strict=True)) if launched is None else {}
        decoders, several = self._decoders, self._several
        failures: list[MoestreamError] = []
        stall_s = 0.0
        if launched is None:
            for d in decoders:
                d.begin()
            used = [False] * len(decoders)
            device_s = [0.0] * len(decoders)  # several devices: the host's time on each
            compute_s = 0.0
            batch = lease.available() if taken is None else taken
        else:
            used, device_s, compute_s = launched.used, launched.device_s, launched.seconds
            batch = []
        while True:
            if batch:
                t0 = time.perf_counter()
                self._consume(batch, weight_of, used, device_s)
                if several:
                    for i, d in enumerate(decoders):
                        t_one = time.perf_counter()
                        await d.spend_host_compute()
                        device_s[i] += time.perf_counter() - t_one
                else:
                    await self._home.spend_host_compute()
                compute_s += time.perf_counter() - t0
            if not lease.remaining:  # all handed out (a warm layer: at the first look)
                break
            batch = lease.available()
            if batch:
                continue
            t_wait = time.perf_counter()
            try:
                batch = [await lease.__anext__()]
            except StopAsyncIteration:
                break
            except MoestreamError as exc:  # dropped from the cache; the others go on
                failures.append(exc)
                batch = []
            stall_s += time.perf_counter() - t_wait
        t0 = time.perf_counter()
        done = {i: self._finish(i, failures) for i in range(len(decoders)) if used[i]}
        lease.release(done, ordered=True)  # every use on one compute stream per device
        if failures:
            error = failures[0]
            if not isinstance(error, StageError):
                raise error  # e.g. the model file changed: its own class and exit code
            raise StageError(str(error)) from error
        hits, misses = lease.hits, lease.misses  # counted while the devices compute
        if meanwhile is not None:  # the devices compute the layer meanwhile
            more = meanwhile()
            if more is not None:
                await more
        split = TimeSplit()
        waits: dict[int, TimeSplit] = {}
        for i, event in done.items():
            waits[i] = TimeSplit()
            decoders[i].wait_for_layer(event, waits[i])
            split.add(waits[i])
        if several and self._home.acc is not None and not failures:
            self._combine([i for i in done if i])
        t_then = time.perf_counter()
        if then is not None:
            then()
        compute_s += t_then - t0
        result = LayerResult(hits, misses, stall_s * 1000.0, compute_s * 1000.0, split)
        queues = self._home.queues
        if not queues:  # kernels ran inline: the time spent in them is compute
            result.time = TimeSplit(compute_ms=compute_s * 1000.0)
        if several:
            result.device_compute_ms = [
                waits[i].compute_ms if queues and i in waits else device_s[i] * 1000.0
                for i in range(len(decoders))]
        return result

    def _finish(self, i: int, failures: Sequence[MoestreamError]) -> Event:
        """Device ``i``'s last work of the layer: the residual step on the home device
        (one device, ``real`` compute), then the event the lease is released after."""
        d = self._decoders[i]
        if not self._several and d.acc is not None and not failures:
            d.advance(d.acc)
        return d.stream.record()

    def _combine(self, others: Sequence[int]) -> None:
        """Several devices, their layer computed: add the other devices' sums to the
        home's, step the hidden state there and hand it to every device for the next."""
        home = self._home
        total = home.acc
        for i in others:
            total = total + home.backend.adopt(self._decoders[i].acc)
        home.advance(total)
        for d in self._decoders[1:]:
            d.set_hidden(d.backend.adopt(home.hidden))
