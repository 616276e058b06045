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

What "compute" is (``real``, ``digest``, ``fixed:MS``) is each device's ``Decoder``
(``moestream.pipeline.proxy.decoder``); ``real`` on a model whose experts are neither F16
nor a GGUF type it dequantizes falls back to ``digest``
(``moestream.pipeline.foundation.compute``). Quantized experts are computed per batch the
handles come in (``Decoder.flush`` after each): one dequantization launch per type a batch.

Each layer also measures its own compute for the token's time split (``end_token``'s
``compute_ms`` and ``upload_ms``): on a GPU the end-of-layer wait is split, in queue order,
into the compute stream working (``compute``) and the compute stream stalled on an upload
event (``upload``): before each device-side wait on an upload an event is recorded, and
the host waits on that event, then on the upload, then on the next. On the host backend
kernels run inline and their time is the compute. Waits for experts to land are the
session's to charge (``moestream.pipeline.foundation.timesplit``).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from moestream import ExpertHandle, Lease
from moestream.gpu.backend import Backend, Event
from moestream.gpu.kernels import make_kernels
from moestream.pipeline.foundation.compute import resolve_compute
from moestream.pipeline.foundation.config import ComputeSpec
from moestream.pipeline.foundation.errors import MoestreamError, StageError
from moestream.pipeline.foundation.table import ExpertTable
from moestream.pipeline.foundation.timesplit import TimeSplit
from moestream.pipeline.proxy.decoder import Decoder
from moestream.pipeline.streaming.verify import Digests

__all__ = ["Decode", "Decoder", "Launched", "LayerResult"]


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
                    seed: int = 0) -> Decode:
        """One ``Decoder`` per device, made on its device with the kernels for its backend
        (``RunSession.device_backends``: the engine brings its own compute, the session
        only the devices); ``real`` needs F16 experts or quantized ones it dequantizes."""
        compute = resolve_compute(compute, table)
        kernels = [make_kernels(b.name) for b in backends]
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
        """Queue ``batch``'s compute, each expert on its device's stream; then each device
        computes what it held back (quantized experts: one dequantization a type)."""
        per_expert_ms = self._per_expert_ms
        if self._several:
            for h in batch:
                t_one = time.perf_counter()
                d = self._decoders[h.device]
                used[h.device] = True
                with d.ctx:
                    d.consume(h, weight_of[h.expert], per_expert_ms)
                device_s[h.device] += time.perf_counter() - t_one
            for i in {h.device for h in batch}:
                t_one = time.perf_counter()
                d = self._decoders[i]
                with d.ctx:
                    d.flush()
                device_s[i] += time.perf_counter() - t_one
            return
        used[0] = True
        d = self._home
        with d.ctx:
            for h in batch:
                d.consume(h, weight_of[h.expert], per_expert_ms)
            d.flush()

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
                with only the wait's wake-up between the two layers (so a layer whose
                experts are all cached runs at compute speed). Its time is not this
                layer's.

        Raises:
            StageError: a miss could not be loaded (or the model file changed: its own
                class); the layer's other experts were consumed and the lease released.
        """
        failures: list[MoestreamError] = []
        if launched is None:
            launched, batch, weight_of = self._begin(lease, weights, taken)
        else:  # its experts were all consumed by ``launch``: no weights to look up
            batch, weight_of = [], {}
        stall_s = await self._consume_all(lease, batch, weight_of, launched, failures)
        t0 = time.perf_counter()
        used = launched.used
        done = {i: self._finish(i, failures) for i in range(len(used)) if used[i]}
        lease.release(done, ordered=True)  # every use on one compute stream per device
        if failures:
            _raise_first(failures)
        hits, misses = lease.hits, lease.misses  # counted while the devices compute
        if meanwhile is not None:  # the devices compute the layer meanwhile
            more = meanwhile()
            if more is not None:
                await more
        split, waits = self._wait_for(done)
        if self._several and self._home.acc is not None:
            self._combine([i for i in done if i])
        t_then = time.perf_counter()
        if then is not None:
            then()
        compute_s = launched.seconds + t_then - t0
        return self._result(LayerResult(hits, misses, stall_s * 1000.0, compute_s * 1000.0,
                                        split), waits, launched.device_s)

    def _begin(self, lease: Lease, weights: Sequence[float],
               taken: Sequence[ExpertHandle] | None
               ) -> tuple[Launched, Sequence[ExpertHandle], dict[int, float]]:
        """A layer not launched ahead: every device begins it; the host's time consuming
        it (and, several devices, on each device) starts at zero; the first batch is what
        the caller took already, or what is available now."""
        n = len(self._decoders)
        for d in self._decoders:
            d.begin()
        batch = lease.available() if taken is None else taken
        return (Launched([False] * n, [0.0] * n), batch,
                dict(zip(lease.experts, weights, strict=True)))

    async def _consume_all(self, lease: Lease, batch: Sequence[ExpertHandle],
                           weight_of: dict[int, float], launched: Launched,
                           failures: list[MoestreamError]) -> float:
        """Consume ``batch``, then the lease's other experts as they are available or land,
        adding the host's time to ``launched``; a miss that failed goes to ``failures``
        (the others go on). Returns the host's waits for experts to land, in seconds."""
        decoders, several = self._decoders, self._several
        device_s = launched.device_s
        stall_s = 0.0
        while True:
            if batch:
                t0 = time.perf_counter()
                self._consume(batch, weight_of, launched.used, device_s)
                if several:
                    for i, d in enumerate(decoders):
                        t_one = time.perf_counter()
                        await d.spend_host_compute()
                        device_s[i] += time.perf_counter() - t_one
                else:
                    await self._home.spend_host_compute()
                launched.seconds += time.perf_counter() - t0
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
        return stall_s

    def _wait_for(self, done: dict[int, Event]) -> tuple[TimeSplit, dict[int, TimeSplit]]:
        """Wait for each device's layer (``done``: its last event); the waits' split in all
        and per device."""
        split = TimeSplit()
        waits: dict[int, TimeSplit] = {}
        for i, event in done.items():
            waits[i] = TimeSplit()
            self._decoders[i].wait_for_layer(event, waits[i])
            split.add(waits[i])
        return split, waits

    def _result(self, result: LayerResult, waits: dict[int, TimeSplit],
                device_s: Sequence[float]) -> LayerResult:
        """``result`` with its time split as the devices ran: inline kernels (the host
        backend) are all compute; several devices, each one's part."""
        queues = self._home.queues
        if not queues:  # kernels ran inline: the time spent in them is compute
            result.time = TimeSplit(compute_ms=result.compute_ms)
        if self._several:
            result.device_compute_ms = [
                waits[i].compute_ms if queues and i in waits else device_s[i] * 1000.0
                for i in range(len(self._decoders))]
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


def _raise_first(failures: Sequence[MoestreamError]) -> None:
    """Raise a layer's first failed miss: a ``StageError``, or its own class (e.g. the model
    file changed: its own exit code)."""
    error = failures[0]
    if not isinstance(error, StageError):
        raise error
    raise StageError(str(error)) from error
