"""Decode: consume each layer's experts on a compute stream, hits first, misses as they land.

The experts come through the layer's lease (``pipeline.lease``, what ``moestream``'s fetch
hands an engine): compute for a layer is queued on one stream, hit experts at once, each
miss as soon as the lease hands it out (its upload queued), after a device-side wait on that
expert's upload event (never a device-wide synchronize). At the end of the layer one event
is recorded: the lease is released after it (the buffers are reused only once the layer's
compute has run) and the host waits for it, as an engine waits for the router's output
before it can choose the next layer's experts.

What "compute" is: ``real`` runs a SwiGLU expert on a hidden state (F16 experts), ``digest``
reads every byte of every used expert and checks it against the file, ``fixed:MS`` keeps the
device busy MS milliseconds per layer, like an engine's kernels would. ``real`` on a model
without F16 experts falls back to ``digest`` (logged); on one whose layers mix F16 and other
types it is refused before decoding (``ExpertLayoutError``, exit 2).

Each layer also reports where its wall time went (``pipeline.timesplit``): a wait for a miss
is charged to what that miss's load was doing meanwhile; on a GPU the end-of-layer wait is
split, in queue order, into the compute stream working (``compute``) and the compute stream
stalled on an upload event (``upload``): before each device-side wait on an upload an event
is recorded, and the host waits on that event, then on the upload, then on the next.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import structlog
from gguf import GGMLQuantizationType

from gpu.backend import Backend, Event, Kernels
from gpu.cache import Entry
from pipeline.foundation.config import ComputeSpec
from pipeline.foundation.errors import ExpertLayoutError, MoestreamError, StageError
from pipeline.foundation.table import ExpertTable
from pipeline.lease import LayerLease
from pipeline.streamer import ExpertStreamer, LayerLoad
from pipeline.timesplit import LoadPhases, TimeSplit
from pipeline.verify import DigestRows, Digests

__all__ = ["Decoder", "LayerResult", "resolve_compute"]

_log = structlog.get_logger("moestream.decode")

_HOST_SLICE_MS = 10.0
"""``fixed`` compute on the host backend spins the CPU on the event loop's thread, in slices
of at most this long with a yield to the loop after each: a signal or a cancel lands within
a slice, not after the layer (``fixed:1000`` is a second per layer)."""


def _all_f16(table: ExpertTable) -> bool:
    """Whether ``real`` compute can run: every MoE layer's experts are F16 (True), or none
    are (False: the run falls back to ``digest``, logged once).

    Raises:
        ExpertLayoutError: some layers are F16 and others are not (every layer is checked
            here, before decoding, not when a token first reaches the other type).
    """
    f16 = GGMLQuantizationType.F16
    types = {n: (layer.gate_up_type, layer.down_type) for n, layer in table.layers.items()}
    other = {n: t for n, t in types.items() if t != (f16, f16)}
    if not other:
        return True
    n, (gate_up, down) = next(iter(other.items()))
    if len(other) < len(types):
        f16_layer = next(m for m in types if m not in other)
        raise ExpertLayoutError(
            table.path, f"real compute needs F16 experts in every MoE layer: layer {f16_layer} "
            f"is F16, layer {n} is {gate_up.name}/{down.name}; use --compute digest or fixed")
    _log.warning("compute_fallback", requested="real", using="digest",
                 reason=f"experts are {gate_up.name}/{down.name}; real SwiGLU needs F16")
    return False


def resolve_compute(compute: ComputeSpec, table: ExpertTable) -> ComputeSpec:
    """The compute a run on ``table`` does: ``real`` becomes ``digest`` on a model without
    F16 experts (logged once).

    Raises:
        ExpertLayoutError: some MoE layers are F16 and others are not.
    """
    if compute.kind == "real" and not _all_f16(table):
        return ComputeSpec("digest")
    return compute


@dataclass(slots=True)
class LayerResult:
    """What one layer cost and found; ``time``: what the layer's waits were charged to."""

    hits: int
    misses: int
    evictions: int
    file_bytes: int
    cache_bytes: int
    stall_ms: float
    compute_ms: float
    time: TimeSplit = field(default_factory=TimeSplit)


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
    """Runs a model's MoE layers over the experts its leases hand out, one token at a time.

    Args:
        compute: what to do with each expert.
        table: the model's expert table.
        backend: the device.
        kernels: the backend's kernels.
        streamer: the device's streamer (the layout of each expert in its buffer).
        seed: the initial hidden state's seed.
        partial: one of several devices: ``run_layer`` leaves its weighted sum of expert
            outputs in ``partial_sum`` for the combine (``pipeline.shards``) instead of
            updating the hidden state itself.
    """

    def __init__(
        self,
        compute: ComputeSpec,
        table: ExpertTable,
        backend: Backend,
        kernels: Kernels,
        streamer: ExpertStreamer,
        seed: int = 0,
        *,
        partial: bool = False,
    ) -> None:
        self._table = table
        self._partial = partial
        self.partial_sum: Any = None
        self._backend = backend
        self._kernels = kernels
        self._streamer = streamer
        self.stream = backend.new_stream()
        # array module and contexts (device, stream), fixed for the run: looked up once
        self._xp: Any = np
        self._ctx: Any = contextlib.nullcontext()
        if backend.name == "cupy":
            import cupy

            self._xp = cupy
            self._ctx = _OnDevice(backend, self.stream.raw)  # type: ignore[attr-defined]
        self.compute = compute = resolve_compute(compute, table)
        self._hidden = self._initial_hidden(seed) if compute.kind == "real" else None
        self.use_digests = DigestRows(kernels, len(table.layers) * table.top_k)
        # (buffer, ms) of host compute queued by _consume, spent by _spend_host_compute
        self._spins_host = backend.name == "host"
        self._host_compute: list[tuple[Any, float]] = []
        # a GPU queues kernels and copies (the host waits at the layer's end); the host
        # backend runs them inline, so its compute is the time spent in them
        self._queues = backend.async_copies
        # (event before the wait, upload event) of each device-side wait of this layer
        self._device_waits: list[tuple[Event, Event]] = []
        self._waited_on: Event | None = None  # the upload event the stream last waited for
        # the layer being consumed: its waits, their charges, the guesses' loads
        self._stall_s = 0.0
        self._split = TimeSplit()
        self._guess_loads: list[LayerLoad] = []

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
        with self._ctx:
            x = self._hidden + acc
            self._hidden = x / (self._xp.sqrt(self._xp.mean(x * x)) + 1e-6)

    def take_device_counters(self) -> list[dict[str, Any]] | None:
        """Per-device counters of the last token: none on one device (the token's own)."""
        return None

    def take_use_digests(self) -> Digests:
        """The digests of every expert consumed since the last call (``--compute digest``)."""
        return self.use_digests.take()

    def _views(self, entry: Entry) -> list[Any]:
        layout = self._streamer.layout(entry.key)
        return [
            self._backend.device_bytes(entry.buffer, s.device_offset, s.nbytes)
            for s in layout.ranges
        ]

    def _consume(self, entry: Entry, weight: float, acc: Any, layer_ms: float) -> None:
        """Queue the compute of one expert on the compute stream."""
        upload = entry.upload
        # a layer gathered in one launch shares one event: the stream waits for it once
        if not entry.ready and upload is not None and upload is not self._waited_on:
            self._waited_on = upload
            if self._queues:
                self._device_waits.append((self.stream.record(), upload))
            self.stream.wait(upload)
        kind = self.compute.kind
        if kind == "real":
            views = self._views(entry)
            hidden, ffn = self._table.layers[entry.key[0]].shape
            k = self._kernels
            out = k.swiglu(
                self._hidden,
                k.as_f16(views[0], ffn, hidden),
                k.as_f16(views[1], ffn, hidden),
                k.as_f16(views[2], hidden, ffn),
                self.stream,
            )
            acc += weight * out
        elif kind == "digest":
            results, row = self.use_digests.reserve(entry.key)
            ranges = [(s.device_offset, s.nbytes) for s in self._streamer.layout(entry.key).ranges]
            self._kernels.digest3(entry.buffer, ranges, results, row, self.stream)
            self.use_digests.complete(results, row, self.stream.record())
        elif layer_ms > 0 and self._spins_host:
            self._host_compute.append((entry.buffer, layer_ms))
        elif layer_ms > 0:
            self._kernels.busy(layer_ms, entry.buffer, self.stream)

    async def _spend_host_compute(self) -> None:
        """Run the ``fixed`` host compute ``_consume`` queued, yielding to the event loop
        between slices (a device kernel runs beside the loop; the host's spins on it)."""
        queued, self._host_compute = self._host_compute, []
        for buffer, ms in queued:
            left = ms
            while left > 0:
                piece = min(left, _HOST_SLICE_MS)
                self._kernels.busy(piece, buffer, self.stream)
                left -= piece
                await asyncio.sleep(0)

    def _waited(self, entry: Entry | None, load: LayerLoad | None, start: float,
                end: float) -> None:
        """A lease's ``on_wait``: the layer waited for ``entry``, a stall charged to what its
        load did meanwhile (the lease's own load, or the guess that loads it)."""
        self._stall_s += end - start
        phases: LoadPhases | None = None
        for source in (load, *self._guess_loads):
            if source is not None and entry is not None:
                phases = source.phases.get(entry.key)
                if phases is not None:
                    break
        if phases is None:  # a load started for another layer's lookup: reading
            self._split.charge("read", end - start)
        else:
            phases.charge(self._split, start, end)

    async def run_layer(
        self,
        leases: Sequence[LayerLease],
        experts: Sequence[int],
        weights: Sequence[float],
        prefetched: Sequence[LayerLease] = (),
        meanwhile: Callable[[], None] | None = None,
    ) -> LayerResult:
        """Consume one MoE layer's selected experts as its lease hands them out: hits first,
        misses (and hits whose load is still in flight, started by a prefetch) as their
        uploads are queued; then release the lease after the layer's compute.

        Args:
            leases: the layer's lease on this device (none: only guesses to release).
            experts, weights: the experts it consumes and their router weights.
            prefetched: the guesses made for this layer, released at the end, used or not
                (a wrong guess still loading keeps its pin until it lands).
            meanwhile: host work for the caller while the device computes the layer (run
                after its work is queued and its lease released, before the wait).

        Raises:
            StageError: a miss could not be loaded; the layer's other experts are unpinned,
                the failed ones dropped from the cache (never installed).
        """
        weight_of = {int(e): float(w) for e, w in zip(experts, weights, strict=True)}
        # a layer's fixed time is for its top-k experts, wherever they run
        per_expert_ms = self.compute.layer_ms / self._table.top_k
        acc = self._kernels.zeros(self._table.hidden) if self.compute.kind == "real" else None
        compute_s = 0.0
        self._stall_s = 0.0
        split = self._split = TimeSplit()
        self._guess_loads = [part.load for guess in prefetched for part in guess.parts]
        self._device_waits.clear()  # a failed layer leaves its own behind
        self._waited_on = None
        ctx = self._ctx
        failures: list[MoestreamError] = []
        for lease in leases:
            lease.on_wait = self._waited
            t0 = time.perf_counter()
            with ctx:  # the hits that have landed, at once
                for hit in lease.take_ready():
                    entry = hit.entry
                    self._consume(entry, weight_of[entry.key[1]], acc, per_expert_ms)
            await self._spend_host_compute()
            compute_s += time.perf_counter() - t0
            while lease.pending:  # then the others as they land
                landed = lease.take_landed()
                if landed:  # a gathered layer's misses land together: consume them at once
                    t_got = time.perf_counter()
                    with ctx:
                        for one in landed:
                            entry = one.entry
                            self._consume(entry, weight_of[entry.key[1]], acc, per_expert_ms)
                    await self._spend_host_compute()
                    compute_s += time.perf_counter() - t_got
                    continue
                try:
                    arrival = await lease.next()
                except MoestreamError as exc:  # dropped from the cache; the others go on
                    failures.append(exc)
                    continue
                if arrival is None:
                    break
                t_got = time.perf_counter()
                entry = arrival.entry
                with ctx:
                    self._consume(entry, weight_of[entry.key[1]], acc, per_expert_ms)
                await self._spend_host_compute()
                compute_s += time.perf_counter() - t_got
        t0 = time.perf_counter()
        if self._partial:
            self.partial_sum = acc
        elif acc is not None and not failures:
            self.advance(acc)
        done = self.stream.record()
        for lease in leases:  # every use of this device's entries is on self.stream
            lease.release(lambda part: done, ordered=True)
        for guess in prefetched:  # used ones end with the layer's compute (their last use)
            guess.release(lambda part: None)
        if failures:
            error = failures[0]
            if not isinstance(error, StageError):
                raise error  # e.g. the model file changed: its own class and exit code
            raise StageError(str(error)) from error
        # the device computes the layer meanwhile: the host's bookkeeping goes here
        result = LayerResult(0, 0, 0, 0, 0, 0.0, 0.0, split)
        for lease in leases:
            for part in lease.parts:
                plan = part.load.plan
                result.hits += len(plan.hits)
                result.misses += len(plan.misses)
                result.evictions += plan.evicted
                result.file_bytes += sum(e.nbytes for e in plan.misses)
                result.cache_bytes += sum(e.nbytes for e in plan.hits)
        if meanwhile is not None:
            meanwhile()
        self._wait_for_layer(done, split)
        compute_s += time.perf_counter() - t0
        if not self._queues:  # kernels ran inline: the time spent in them is the compute
            split.compute_ms = compute_s * 1000.0
        result.stall_ms, result.compute_ms = self._stall_s * 1000.0, compute_s * 1000.0
        return result

    def _wait_for_layer(self, done: Event, split: TimeSplit) -> None:
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
