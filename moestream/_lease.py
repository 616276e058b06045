"""Leases: one fetch's experts, pinned on their devices until released.

``LeaseBase`` is the public face of ``pipeline.streaming.lease.LayerLease`` (its pins and
arrivals): it hands out ``ExpertHandle``s as experts land and releases the pins after the
engine's compute on them. ``Lease`` is its asynchronous face; ``SyncLease``
(``moestream._sync``) the synchronous one, the same object driven from other threads.
"""

from __future__ import annotations

import asyncio
from asyncio.events import _get_running_loop
from collections.abc import AsyncIterator, Mapping
from typing import Any, Self

from moestream._handles import ExpertHandle, LeaseShared
from moestream.gpu.backend import Event
from moestream.gpu.interop import StreamLike, event_after
from moestream.pipeline.foundation.errors import UsageError
from moestream.pipeline.streaming.lease import Arrival, LayerLease
from moestream.pipeline.streaming.lease_parts import LeasePart
from moestream.pipeline.streaming.session import StreamSession

__all__ = ["After", "Lease", "LeaseBase", "pins_held"]

After = StreamLike | Event | Mapping[int, Any]
"""What a release waits for: a stream (its work so far), an event, or one per device."""


class LeaseBase:
    """One layer's fetched experts, pinned on their devices until released: what both
    faces of a lease (``Lease``, ``SyncLease``) are, and what they ask for and found.

    Made by the session (``Session._fetch``), which hands it what it works with: the
    layer lease, the ``LeaseShared`` the handles this hands out share, the streaming
    session that releases it, and the session's event loop, the only one it is used on
    (the sync face's calls run with it set as their thread's running loop).
    """

    __slots__ = ("_handed", "_layer_lease", "_loop", "_shared", "_streaming")

    def __init__(self, layer_lease: LayerLease, shared: LeaseShared,
                 streaming: StreamSession, loop: asyncio.AbstractEventLoop) -> None:
        self._layer_lease = layer_lease
        self._shared = shared
        self._streaming = streaming
        self._loop = loop
        self._handed: list[ExpertHandle] = []

    @property
    def layer(self) -> int:
        return self._layer_lease.layer

    @property
    def experts(self) -> tuple[int, ...]:
        """The experts asked for, in the order asked."""
        return self._layer_lease.experts

    @property
    def hits(self) -> int:
        """Experts that were in the device cache (or already loading) when fetched."""
        return self._layer_lease.hits

    @property
    def misses(self) -> int:
        """Experts this fetch started loading."""
        return self._layer_lease.misses

    @property
    def released(self) -> bool:
        return self._layer_lease.released

    @property
    def remaining(self) -> int:
        """Experts not handed out yet (loading, or landed and waiting for ``available`` or
        the iteration); 0 once every one was, or failed."""
        return self._layer_lease.pending

    def _handle(self, arrival: Arrival) -> ExpertHandle:
        handle = ExpertHandle(self._shared, arrival)
        self._handed.append(handle)
        return handle

    def _in_order(self) -> list[ExpertHandle]:
        """Every handle handed out, in the order asked (``gather``'s answer)."""
        by_expert = {h.expert: h for h in self._handed}
        return [by_expert[e] for e in self.experts]

    def available(self) -> list[ExpertHandle]:
        """Every expert available now and not handed out yet, without waiting: the hits
        that have landed, then the misses that have (a layer copied in one launch lands
        at once). Stops before a failed one, which iterating then raises. Iterating goes
        on with those still to come.

        Raises:
            UsageError: the lease was released or the session closed; called from another
                thread than the session's loop.
        """
        self._check_loop()
        layer_lease = self._layer_lease
        arrivals = layer_lease.take_ready()
        arrivals.extend(layer_lease.take_landed())
        # made here, not per arrival through ``_handle``: a warm layer's experts are handed
        # out between two layers' kernels, where every microsecond shows
        shared = self._shared
        handles = [ExpertHandle(shared, a) for a in arrivals]
        self._handed.extend(handles)
        return handles

    def release(self, after: After = None, *, ordered: bool = False) -> None:
        """Unpin the experts (again: nothing happens). Idempotent.

        Args:
            after: what the engine's compute on these experts was queued on: a stream
                (CuPy, torch, an int ``cudaStream_t``), an event it recorded, or a mapping
                from device index to either; None: each device's current CuPy stream.
                Buffers are reused only after it. Ignored on the host backend.
            ordered: ``after`` comes after every earlier use of these experts on its
                device (the engine computes on one stream per device, and no other lease
                of them is held elsewhere): their earlier events are replaced, not joined
                on a device stream (a join per expert saved).

        A miss still loading (a fetch cancelled part way) keeps its pin until it lands.

        Raises:
            UsageError: called from another thread than the session's loop (a
                ``SyncLease`` may be released from any thread).
        """
        if self._layer_lease.released:
            return
        self._check_loop()
        streaming = self._streaming
        if after is None:  # each device's current stream: what the session ends leases with
            streaming.release(self._layer_lease, streaming.default_last_use, ordered=ordered)
            return
        backends = streaming.backends

        def last_use(part: LeasePart) -> Event | None:
            target = after.get(part.device) if isinstance(after, Mapping) else after
            return event_after(backends[part.device], target)

        streaming.release(self._layer_lease, last_use, ordered=ordered)

    def _check_loop(self) -> None:
        """Refuse a call from another thread than the session's loop."""
        if _get_running_loop() is not self._loop:
            raise UsageError("a Lease is used from the event loop that opened its session; "
                             "from other threads use moestream.open_sync")

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self.released else f"{self.hits} hits, {self.misses} misses"
        return (f"{type(self).__name__}(layer={self.layer}, experts={list(self.experts)}, "
                f"{state})")


class Lease(LeaseBase):
    """One layer's fetched experts, pinned on their devices until released.

    Iterate it (``async for``) for handles as experts become available, hits first, misses
    as they land; or ``await gather()`` for all of them in the order asked. Leave the
    ``with``/``async with`` block, or call ``release``, when the engine's compute on them is
    queued: their buffers are reused only after that compute has run.
    """

    __slots__ = ()

    def __aiter__(self) -> AsyncIterator[ExpertHandle]:
        return self

    async def __anext__(self) -> ExpertHandle:
        """The next expert available.

        Raises:
            StageError: this expert's load failed (its bytes never reach the cache);
                iterating again goes on with the other experts. ``ModelChangedError``:
                the model file changed under the session.
            UsageError: the lease was released or the session closed, also while waiting.
        """
        arrival = await self._layer_lease.next()
        if arrival is None:
            raise StopAsyncIteration
        return self._handle(arrival)

    async def gather(self) -> list[ExpertHandle]:
        """Every expert, once all have landed, in the order asked (those iterated already
        included).

        Raises:
            As ``__anext__``, for the first expert that fails.
        """
        async for _ in self:
            pass
        return self._in_order()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release()


def pins_held(streaming: StreamSession) -> str:
    """Who holds the pins of ``streaming``'s caches, for a fetch that cannot fit."""
    held = sorted(streaming.leases(), key=lambda c: (c.fetched_at, c.layer))
    words = [f"layer {c.layer} experts {list(c.experts)} (fetched in token {c.fetched_at}"
             + (", never used)" if c.on_use is not None else ")") for c in held]
    hinted = streaming.hinted_layers()
    loading = sum(1 for c in streaming.caches for e in c.entries()
                  if e.pins and e.loaded is not None and not e.loaded.done())
    return ("pins held by " + (f"{len(held)} leases: " + "; ".join(words) if held
                               else "no lease")
            + (f", and prefetch hints of layers {hinted}" if hinted else "")
            + (f", and {loading} loads in flight (a released lease's misses keep their "
               "pins until they land)" if loading else "")
            + " (release leases once their compute is queued; a lease used and still "
              "held ends at end_token)")
