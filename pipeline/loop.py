"""The decode loop: tokens through every MoE layer, with accounting, verification and log.

Per layer the loop fetches the layer's experts through the session (``pipeline.session``:
a lease per device, ``pipeline.lease``, the pins and arrivals ``moestream``'s fetch hands an
engine; with oracle prefetch also the next ``lookahead`` layers', across token boundaries,
since the routing is known ahead), lets the decoder consume and release them, and adds up
what the layer cost. At each token's end it checks the
digests of everything installed or consumed, lets the controller look at the machine, and
writes the token's log event, with its wall time split by what decode waited on
(``pipeline.timesplit``: the layers' waits, the controller's pause, and the rest as host).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from pipeline.controller import ModeController
from pipeline.decode import LayerResult
from pipeline.foundation.config import RunConfig
from pipeline.foundation.table import ExpertTable
from pipeline.lease import LayerLease
from pipeline.logs import RunLog
from pipeline.machine import process_read_bytes
from pipeline.routing import LiveRouter, Routing
from pipeline.streamer import StageTimes
from pipeline.timesplit import TimeSplit
from pipeline.trace import TraceRecorder
from pipeline.verify import Digests, Verifier

__all__ = ["DecodeLoop", "TokenTotals"]


class Streamer(Protocol):
    """What the loop uses of one device's ``ExpertStreamer`` or a ``StreamerGroup``."""

    @property
    def mode(self) -> str: ...

    def poll_installs(self) -> None: ...

    def take_digests(self, *, wait: bool = False) -> Digests: ...

    def take_times(self) -> StageTimes: ...


class Decoding(Protocol):
    """What the loop uses of a ``Decoder`` or a ``ShardedDecoder``."""

    @property
    def hidden(self) -> Any: ...

    def set_hidden(self, hidden: Any) -> None: ...

    async def run_layer(self, leases: Sequence[LayerLease], experts: Sequence[int],
                        weights: Sequence[float], prefetched: Sequence[LayerLease] = (),
                        meanwhile: Callable[[], None] | None = None) -> LayerResult: ...

    def take_use_digests(self) -> Digests: ...

    def take_device_counters(self) -> list[dict[str, Any]] | None: ...


class Background(Protocol):
    """Reads that yield to decode (the digest manifest's builder): paused while a layer's
    misses load."""

    def pause(self) -> None: ...

    def resume(self) -> None: ...


class Fetcher(Protocol):
    """What the loop uses of the ``StreamSession``: its experts, one lease per device."""

    def all_ready(self, layer: int, experts: Sequence[int]) -> bool: ...

    def lease_per_device(self, layer: int, experts: Sequence[int], *, prefetch: bool = False
                         ) -> list[LayerLease]: ...


class Cache(Protocol):
    """What the loop uses of a ``DeviceCache`` or a ``CacheGroup``."""

    @property
    def live_bytes(self) -> int: ...

    @property
    def parked_bytes(self) -> int: ...

    def advance_token(self) -> None: ...


@dataclass(slots=True)
class TokenTotals:
    """What one token did, summed over its layers; ``wall_ms`` and ``time``: its wall time
    and what that time was charged to (``host`` is the rest)."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0
    file_bytes: int = 0
    cache_bytes: int = 0
    stall_ms: float = 0.0
    compute_ms: float = 0.0
    predicted: int = 0
    correct: int = 0
    loaded: int = 0
    wasted_bytes: int = 0
    wall_ms: float = 0.0
    time: TimeSplit = field(default_factory=TimeSplit)


class DecodeLoop:
    """Runs tokens; owns nothing, closes nothing (the run's session does).

    Args:
        config: prefetch, lookahead, verify, log level.
        table: the model.
        routing: where each layer's experts come from (a trace, or the live router).
        session: where the experts are fetched (``StreamSession.lease_per_device``).
        cache, streamer, decoder, verifier, controller, runlog: the run's parts.
        recorder: where each decoded token's routing is recorded (``--record-trace``).
        background: reads to pause while a layer's misses (or the loads it starts ahead)
            are loading: the digest manifest's builder, on a file without digests.
    """

    def __init__(
        self,
        config: RunConfig,
        table: ExpertTable,
        routing: Routing,
        *,
        session: Fetcher,
        cache: Cache,
        streamer: Streamer,
        decoder: Decoding,
        verifier: Verifier,
        controller: ModeController,
        runlog: RunLog,
        background: Background | None = None,
        recorder: TraceRecorder | None = None,
    ) -> None:
        self._cfg = config
        self._layers = table.moe_layers
        self._routing = routing
        self._session = session
        self._live = isinstance(routing, LiveRouter)
        self._cache = cache
        self._streamer = streamer
        self._decoder = decoder
        self._verifier = verifier
        self._controller = controller
        self._runlog = runlog
        self._background = background
        self._ahead = config.lookahead if config.prefetch == "oracle" else 0
        self._predict = config.prefetch == "predict"
        self._end = config.tokens * len(self._layers)
        self._loads: dict[int, list[LayerLease]] = {}  # oracle fetches ahead, by position
        # a trace routes every layer ahead: all-hit layers are planned during the one before
        self._plans_ahead = not self._live
        self._read_bytes = process_read_bytes()
        self.storage_bytes = 0
        self.recorder = recorder

    def _start(self, position: int) -> list[LayerLease]:
        token, i = divmod(position, len(self._layers))
        experts, _ = self._routing.route(token, i, None)
        return self._session.lease_per_device(self._layers[i], experts)

    def _plan_ready(self, position: int) -> None:
        """While the device computes a layer: lease the next one now if every expert it
        routes to (a trace knows) is cached and ready. Such a lease starts no load, so a
        run without prefetch still loads nothing early; it only takes the next layer's
        planning off the host's path between one layer's end and the next one's kernels
        (issue 14: all cached at compute speed)."""
        if position in self._loads:
            return
        token, i = divmod(position, len(self._layers))
        experts, _ = self._routing.route(token, i, None)
        if self._session.all_ready(self._layers[i], experts):
            self._loads[position] = self._session.lease_per_device(self._layers[i], experts)

    async def token(self, t: int) -> TokenTotals:
        """Decode token ``t``; returns its totals (and logs its event)."""
        # A token whose experts all hit never suspends: yield once per token, before it
        # starts, so signals (cancellation), the log writer and the controller's sampler
        # still run, and a cancelled run has counted exactly the tokens it decoded.
        await asyncio.sleep(0)
        t0 = time.perf_counter()
        n = len(self._layers)
        totals = TokenTotals()
        used: list[list[int]] = []
        used_weights: list[list[float]] = []
        guesses: dict[int, tuple[list[int], list[LayerLease]]] = {}
        if self._live:
            self._decoder.set_hidden(self._routing.embedding(t))  # type: ignore[attr-defined]
        for i, layer in enumerate(self._layers):
            experts, weights = self._routing.route(t, i, self._decoder.hidden)
            used.append(experts)
            used_weights.append(weights)
            position = t * n + i
            started: list[LayerLease] = []
            for q in range(position + 1, min(self._end, position + 1 + self._ahead)):
                if q not in self._loads:  # oracle: the trace names later layers' experts
                    self._loads[q] = self._start(q)
                    started.extend(self._loads[q])
            leases = self._loads.pop(position, None)
            if leases is None:
                leases = self._session.lease_per_device(layer, experts)
            if self._predict and i + 1 < n:
                # guess the next layer from the hidden state before this layer runs, so
                # its loads overlap this layer's compute
                guess = self._routing.predict(t, i + 1, self._decoder.hidden)
                guesses[i + 1] = (guess, self._session.lease_per_device(
                    self._layers[i + 1], guess, prefetch=True))
                started.extend(guesses[i + 1][1])
            guessed = guesses[i][1] if i in guesses else []
            # background reads wait while this layer's misses load (decode's reads first)
            yielding = self._background
            if yielding is not None and not any(x.misses for x in (*leases, *started)):
                yielding = None
            if yielding is not None:
                yielding.pause()
            try:
                result = await self._decoder.run_layer(
                    leases, experts, weights, guessed,
                    functools.partial(self._plan_ready, position + 1)
                    if self._plans_ahead and i + 1 < n else None)
            finally:
                if yielding is not None:
                    yielding.resume()
            if i in guesses:
                guess = guesses[i][0]
                loaded = [e for lease in guessed for e, _ in lease.entries]
                totals.predicted += len(guess)
                totals.correct += len(set(guess) & set(experts))
                totals.loaded += len(loaded)  # guesses not already cached
                totals.wasted_bytes += sum(e.nbytes for e in loaded if e.key[1] not in experts)
            totals.hits += result.hits
            totals.misses += result.misses
            totals.evictions += result.evictions
            totals.file_bytes += result.file_bytes
            totals.cache_bytes += result.cache_bytes
            totals.stall_ms += result.stall_ms
            totals.compute_ms += result.compute_ms
            totals.time.add(result.time)
            if self._cfg.log_level == "debug":
                self._runlog.emit("layer", token=t, layer=layer, hits=result.hits,
                                  misses=result.misses, stall_ms=round(result.stall_ms, 3),
                                  compute_ms=round(result.compute_ms, 3))
        self._streamer.poll_installs()
        self._cache.advance_token()
        self._verifier.check(self._streamer.take_digests())
        self._verifier.check(self._decoder.take_use_digests())
        mode = self._streamer.mode
        t_controller = time.perf_counter()
        await self._controller.at_token(t)
        totals.time.charge("switch", time.perf_counter() - t_controller)
        read_bytes = process_read_bytes()
        storage, self._read_bytes = read_bytes - self._read_bytes, read_bytes
        times = self._streamer.take_times()
        devices = self._decoder.take_device_counters()
        totals.wall_ms = (time.perf_counter() - t0) * 1000.0
        self._runlog.emit(
            "token", token=t, wall_ms=round(totals.wall_ms, 3),
            read_ms=round(times.read_ms, 3), stage_ms=round(times.stage_ms, 3),
            upload_ms=round(times.upload_ms, 3), install_ms=round(times.install_ms, 3),
            stall_ms=round(totals.stall_ms, 3), compute_ms=round(totals.compute_ms, 3),
            hits=totals.hits, misses=totals.misses, evictions=totals.evictions,
            file_bytes=totals.file_bytes, cache_bytes=totals.cache_bytes,
            storage_bytes=storage, mode=mode,
            ram_available_bytes=self._controller.last_ram_available,
            cache_live_bytes=self._cache.live_bytes,
            cache_parked_bytes=self._cache.parked_bytes,
            experts=used,
            time=totals.time.record(totals.wall_ms),
            **({"devices": devices} if devices is not None else {}),
            **({"prefetch": {"predicted": totals.predicted, "correct": totals.correct,
                             "loaded": totals.loaded, "wasted_bytes": totals.wasted_bytes}}
               if self._predict else {}),
        )
        self.storage_bytes = storage
        if self.recorder is not None:
            self.recorder.add(used, used_weights)
        return totals
