"""The decode loop: tokens through every MoE layer, written against ``moestream``.

Per layer the loop fetches the layer's experts (``Session.fetch``; with oracle prefetch
also the next ``lookahead`` layers', across token boundaries, since the routing is known
ahead; with predict prefetch a ``Session.prefetch`` hint for the next layer), lets the
proxy engine (``pipeline.decode``) consume and release them, and at each token's end
checks what ``digest`` compute read, then ends the token through the session
(``Session.end_token``: verification, the controller, the token's log line), telling it
the compute the decode measured so the line splits the wall time into compute, upload
stalls and host work.
"""

from __future__ import annotations

import asyncio
import functools

from moestream import ExpertHandle, Lease, Session, TokenStats
from pipeline.decode import Decode
from pipeline.foundation.config import RunConfig
from pipeline.foundation.table import ExpertTable
from pipeline.logs import RunLog
from pipeline.routing import LiveRouter, Routing
from pipeline.trace import TraceRecorder
from pipeline.verify import Verifier

__all__ = ["DecodeLoop"]


class DecodeLoop:
    """Runs tokens; owns nothing, closes nothing (the run's session does).

    Args:
        config: prefetch, lookahead, log level.
        table: the model.
        routing: where each layer's experts come from (a trace, or the live router).
        session: the open ``moestream.Session`` the experts come through.
        decode: the proxy engine's compute.
        checker: compares what ``digest`` compute read with the file.
        runlog: where ``--log-level debug`` writes a ``layer`` event per layer.
        recorder: where each decoded token's routing is recorded (``--record-trace``).
    """

    def __init__(
        self,
        config: RunConfig,
        table: ExpertTable,
        routing: Routing,
        *,
        session: Session,
        decode: Decode,
        checker: Verifier,
        runlog: RunLog,
        recorder: TraceRecorder | None = None,
    ) -> None:
        self._cfg = config
        self._layers = table.moe_layers
        self._routing = routing
        self._ms = session
        self._live = isinstance(routing, LiveRouter)
        self._decode = decode
        self._checker = checker
        self._runlog = runlog
        self._ahead = config.lookahead if config.prefetch == "oracle" else 0
        self._predict = config.prefetch == "predict"
        self._debug = config.log_level == "debug"
        self._end = config.tokens * len(self._layers)
        self._fetched: dict[int, Lease] = {}  # layers fetched ahead, by position
        self._taken: dict[int, list[ExpertHandle]] = {}  # their handles, taken ahead
        self._routed: dict[int, tuple[list[int], list[float]]] = {}  # their routes
        # a trace routes every layer ahead: all-hit layers are planned during the one before
        self._plans_ahead = not self._live
        self.recorder = recorder

    def _fetch(self, position: int) -> Lease:
        token, i = divmod(position, len(self._layers))
        experts, _ = self._routing.route(token, i, None)
        return self._ms.fetch(self._layers[i], experts)

    def _meanwhile(self, position: int) -> None:
        """Host work while the devices compute the layer before ``position``: render the
        run log's pending lines, and plan the next layer if a trace knows its experts.

        The plan: fetch the next layer now if every expert it routes to is cached and
        ready (``Session.ready``), and take its handles (``Lease.available``) when it is
        in this token (taking them counts the lease in the token it is taken in). Such a
        fetch starts no load, so a run without prefetch still loads nothing early; it takes
        the next layer's planning off the host's path between one layer's end and the next
        one's kernels (issue 26: all cached at compute speed).
        """
        self._runlog.render()
        if not self._plans_ahead or position >= self._end or position in self._taken:
            return
        token, i = divmod(position, len(self._layers))
        lease = self._fetched.get(position)
        if lease is None:
            route = self._routed[position] = self._routing.route(token, i, None)
            experts = route[0]
            if not self._ms.ready(self._layers[i], experts):
                return
            lease = self._fetched[position] = self._ms.fetch(self._layers[i], experts)
        if i > 0:  # in this token: hand its experts out now (a planned layer: all of them)
            self._taken[position] = lease.available()

    async def token(self, t: int) -> TokenStats:
        """Decode token ``t``; returns what the session counted (and logged) for it.

        Raises:
            VerificationError: an expert loaded during the token differs from the file.
            StageError: an expert could not be loaded.
        """
        # A token whose experts all hit never suspends: yield once per token, before it
        # starts, so signals (cancellation), the log writer and the controller's sampler
        # still run, and a cancelled run has counted exactly the tokens it decoded.
        await asyncio.sleep(0)
        ms, decode, routing = self._ms, self._decode, self._routing
        n = len(self._layers)
        used: list[list[int]] = []
        used_weights: list[list[float]] = []
        compute_ms = upload_ms = 0.0
        device_ms = [0.0] * len(ms.devices)  # several devices: each one's compute
        if self._live:
            decode.set_hidden(routing.embedding(t))  # type: ignore[attr-defined]
        for i, layer in enumerate(self._layers):
            position = t * n + i
            # a trace's route ignores the hidden state: the one planned ahead is this one
            routed = self._routed.pop(position, None)
            experts, weights = routed if routed is not None else routing.route(
                t, i, decode.hidden)
            used.append(experts)
            used_weights.append(weights)
            for q in range(position + 1, min(self._end, position + 1 + self._ahead)):
                if q not in self._fetched:  # oracle: the trace names later layers' experts
                    self._fetched[q] = self._fetch(q)
            lease = self._fetched.pop(position, None)
            if lease is None:
                lease = ms.fetch(layer, experts)
            taken = self._taken.pop(position, None)
            if self._predict and i + 1 < n:
                # guess the next layer from the hidden state before this layer runs, so
                # its loads overlap this layer's compute
                ms.prefetch(self._layers[i + 1], routing.predict(t, i + 1, decode.hidden))
            result = await decode.run_layer(
                lease, weights, functools.partial(self._meanwhile, position + 1), taken)
            compute_ms += result.time.compute_ms
            upload_ms += result.time.upload_ms
            for device, ms_on_it in enumerate(result.device_compute_ms):
                device_ms[device] += ms_on_it
            if self._debug:
                self._runlog.emit("layer", token=t, layer=layer, hits=result.hits,
                                  misses=result.misses, stall_ms=round(result.stall_ms, 3),
                                  compute_ms=round(result.compute_ms, 3))
        self._checker.check(decode.take_use_digests())
        stats = await ms.end_token(compute_ms=device_ms if len(device_ms) > 1 else compute_ms,
                                   upload_ms=upload_ms)
        if self.recorder is not None:
            self.recorder.add(used, used_weights)
        return stats
