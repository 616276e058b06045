"""The decode loop: tokens through every MoE layer, written against ``moestream``.

Per layer the loop fetches the layer's experts (``Session.fetch``; with oracle prefetch
also the next ``lookahead`` layers', across token boundaries, since the routing is known
ahead; with predict prefetch a ``Session.prefetch`` hint for the next layer), lets the
proxy engine (``moestream.pipeline.proxy.decode``) consume and release them, and at each token's end
checks what ``digest`` compute read, then ends the token through the session
(``Session.end_token``: verification, the controller, the token's log line), telling it
the compute the decode measured so the line splits the wall time into compute, upload
stalls and host work. On a device that computes after the host queued the work (a GPU),
when the token's last layer loaded nothing and the next token's first layer is leased
already, the token ends while the device computes that last layer, so the boundary costs
the device no more than the step between two layers.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from moestream import ExpertHandle, Lease, RunSession, Session, TokenStats
from moestream.pipeline.foundation.table import ExpertTable
from moestream.pipeline.foundation.trace import TraceRecorder
from moestream.pipeline.proxy.config import RunConfig
from moestream.pipeline.proxy.decode import Decode, Launched, LayerResult
from moestream.pipeline.proxy.routing import Routing

__all__ = ["DecodeLoop"]


class _Work:
    """The engine's measure of a token's compute, for ``end_token``: its layers' compute
    and upload waits, and each device's part when there are several."""

    __slots__ = ("compute_ms", "device_ms", "upload_ms")

    def __init__(self, devices: int) -> None:
        self.compute_ms = self.upload_ms = 0.0
        self.device_ms = [0.0] * devices

    def add(self, result: LayerResult) -> None:
        self.compute_ms += result.time.compute_ms
        self.upload_ms += result.time.upload_ms
        for device, ms in enumerate(result.device_compute_ms):
            self.device_ms[device] += ms

    async def end(self, session: Session) -> TokenStats:
        several = len(self.device_ms) > 1
        return await session.end_token(
            compute_ms=self.device_ms if several else self.compute_ms, upload_ms=self.upload_ms)


class DecodeLoop:
    """Runs tokens; owns nothing, closes nothing (the run's session does).

    Args:
        config: prefetch, lookahead, log level.
        table: the model.
        routing: where each layer's experts come from (a trace, or the live router).
        session: the open ``moestream.RunSession`` the experts come through.
        decode: the proxy engine's compute.
        recorder: where each decoded token's routing is recorded (``--record-trace``).
    """

    def __init__(
        self,
        config: RunConfig,
        table: ExpertTable,
        routing: Routing,
        *,
        session: RunSession,
        decode: Decode,
        recorder: TraceRecorder | None = None,
    ) -> None:
        self._cfg = config
        self._layers = table.moe_layers
        self._routing = routing
        self._ms = session
        # the model's own router (``Session.router``) starts each token from its embedding;
        # a trace's routing has none
        self._live = hasattr(routing, "embedding")
        self._decode = decode
        # bound once: called every layer. What ``digest`` compute read is compared with
        # the file (``RunSession.check_digests``); the run log's pending lines are rendered
        # while the devices compute (``RunSession.render_log``)
        self._check = session.check_digests
        self._render = session.render_log
        self._ahead = config.lookahead if config.prefetch == "oracle" else 0
        self._predict = config.prefetch == "predict"
        self._debug = config.log_level == "debug"
        self._end = config.tokens * len(self._layers)
        self._fetched: dict[int, Lease] = {}  # layers fetched ahead, by position
        self._taken: dict[int, list[ExpertHandle]] = {}  # their handles, taken ahead
        self._routed: dict[int, tuple[list[int], list[float]]] = {}  # their routes
        self._launched: dict[int, Launched] = {}  # their compute, queued (``_launch``)
        # a trace routes every layer ahead: all-hit layers are planned during the one before
        self._plans_ahead = not self._live
        self._ended: TokenStats | None = None  # the token ended beside its last layer
        self._carried: _Work | None = None  # that layer's compute, the next token's
        self._yielded = False  # the next token's yield happened beside the last layer too
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
        one's kernels, so a layer whose experts are all cached runs at compute speed.
        """
        self._render()
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

    def _launch(self, position: int) -> None:
        """Right after the wait for the layer before ``position``: queue that layer's compute
        now when every expert of it is in hand (planned by ``_meanwhile`` or
        ``_end_beside``), so the devices go on to it with only the wait's wake-up between
        the two layers, not the loop's counting and the next ``run_layer``'s set-up."""
        lease = self._fetched.get(position)
        if lease is None or lease.remaining or position not in self._taken:
            return
        route = self._routed.get(position)
        if route is None:
            token, i = divmod(position, len(self._layers))
            route = self._routed[position] = self._routing.route(token, i, None)
        self._launched[position] = self._decode.launch(lease, route[1],
                                                       self._taken.pop(position))

    async def _end_beside(self, position: int, last: Lease, work: _Work) -> None:
        """Host work while the devices compute a token's last layer: plan the next token's
        first layer (``_meanwhile``), and when it is leased already, end the token now,
        yield to the loop, and take that layer's handles, which starts the next token's
        clock: the token boundary's host work is then off the devices' path.

        The last layer's compute then counts in the next token (its wall time and
        ``compute_ms``): the tokens' times still add up to the run's. A token ends after
        its last layer's wait as before when that layer loaded experts (their digests are
        checked at the token's end, once their copies ran) or the next layer is not
        leased yet (the next token's clock would start only after the wait).
        """
        self._meanwhile(position)
        lease = self._fetched.get(position)
        if lease is None or last.misses:
            return
        self._check(self._decode.take_use_digests())
        self._ended = await work.end(self._ms)
        await asyncio.sleep(0)  # the next token's yield (see ``token``)
        self._yielded = True
        self._taken[position] = lease.available()

    def _lease(self, position: int, layer: int, experts: list[int]) -> Lease:
        """The lease of the layer at ``position``: fetched ahead, or fetched now; with oracle
        prefetch the next ``lookahead`` layers are fetched too (the trace names their
        experts)."""
        if self._ahead:
            for q in range(position + 1, min(self._end, position + 1 + self._ahead)):
                if q not in self._fetched:
                    self._fetched[q] = self._fetch(q)
        lease = self._fetched.pop(position, None)
        return lease if lease is not None else self._ms.fetch(layer, experts)

    def _run_layer(self, position: int, lease: Lease, weights: list[float], work: _Work,
                   *, beside: bool, last: bool) -> Coroutine[Any, Any, LayerResult]:
        """The run of the layer at ``position`` (to await) with the host work to do while
        the devices compute it: the next layer's plan, or (``beside``, the token's ``last``
        layer) the token's end; and (``beside``) the next layer's launch right after its
        wait. Not a coroutine itself: no second frame per layer on the decode's path."""
        meanwhile: Callable[[], Awaitable[None] | None]
        if last and beside and position + 1 < self._end:
            meanwhile = functools.partial(self._end_beside, position + 1, lease, work)
        else:
            meanwhile = functools.partial(self._meanwhile, position + 1)
        return self._decode.run_layer(
            lease, weights, meanwhile, self._taken.pop(position, None),
            launched=self._launched.pop(position, None),
            then=functools.partial(self._launch, position + 1) if beside else None)

    def _count(self, result: LayerResult, work: _Work, token: int, layer: int) -> None:
        """Add a layer's compute to its token's (the next token's when this token ended
        beside its last layer); ``--log-level debug`` logs the layer."""
        if self._ended is not None:  # the token ended during this, its last, layer
            self._carried = _Work(len(self._ms.devices))
            self._carried.add(result)
        else:
            work.add(result)
        if self._debug:
            self._ms.log_event("layer", token=token, layer=layer, hits=result.hits,
                               misses=result.misses, stall_ms=round(result.stall_ms, 3),
                               compute_ms=round(result.compute_ms, 3))

    async def token(self, t: int) -> TokenStats:
        """Decode token ``t``; returns what the session counted (and logged) for it.

        Raises:
            VerificationError: an expert loaded during the token differs from the file.
            StageError: an expert could not be loaded.
        """
        # A token whose experts all hit never suspends: yield once per token, before it
        # starts (or right after the token before ended beside its last layer), so signals
        # (cancellation), the log writer and the controller's sampler still run, and a
        # cancelled run has counted exactly the tokens it decoded.
        if not self._yielded:
            await asyncio.sleep(0)
        self._yielded = False
        ms, decode, routing = self._ms, self._decode, self._routing
        n = len(self._layers)
        used: list[list[int]] = []
        used_weights: list[list[float]] = []
        work, self._carried = self._carried or _Work(len(ms.devices)), None
        # ending beside the last layer needs devices computing it meanwhile, and ``digest``
        # compute's use digests are checked once its kernels ran: after the wait
        beside = self._plans_ahead and decode.queues and decode.compute.kind != "digest"
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
            lease = self._lease(position, layer, experts)
            if self._predict and i + 1 < n:
                # guess the next layer from the hidden state before this layer runs, so
                # its loads overlap this layer's compute
                ms.prefetch(self._layers[i + 1], routing.predict(t, i + 1, decode.hidden))
            result = await self._run_layer(position, lease, weights, work,
                                           beside=beside, last=i == n - 1)
            self._count(result, work, t, layer)
        stats, self._ended = self._ended, None
        if stats is None:
            self._check(decode.take_use_digests())
            stats = await work.end(ms)
        if self.recorder is not None:
            self.recorder.add(used, used_weights)
        return stats
