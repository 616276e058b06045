"""A token's routing, read on the host once its device work is done.

``WholeLayers`` serves a held-whole model's experts calls with no host read of the
routing; the token's ids go to the host once a token, copied behind its work into pinned
memory, and are counted in the session at the token's end (or, deferred, a few tokens
later).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch  # type: ignore[import-not-found, unused-ignore]

__all__ = ["HELD_TOKENS", "Landings", "Routing"]

HELD_TOKENS = 8
"""How many tokens the whole-layer path served a decode holds before it ends them, together
(``ExpertStream.defer``): a token's end (its hits counted, its log line) then runs with the
ends before it, which costs the host less than each alone between two forwards."""


@dataclass(frozen=True, slots=True)
class Routing:
    """A token's calls served by :class:`WholeLayers`: each call's layer and number of
    routing ids, the ids end to end in ``ids`` (pinned host memory on a GPU, filled once
    ``landed`` completes; on the host a list of ints; None: no call)."""

    layers: list[int]
    sizes: list[int]
    ids: Any
    landed: Any


class Landings:
    """Where a token's routing lands on the host: pinned buffers and their events, used in
    turn, made once (a pinned allocation and an event a token cost host time on the
    critical path). A buffer is written again ``_TURNS`` tokens later: a token's routing is
    read at its own end or, deferred, with up to ``HELD_TOKENS`` tokens after it
    (``ExpertStream.defer``)."""

    _TURNS = HELD_TOKENS + 2

    def __init__(self) -> None:
        self._buffers: list[Any] = [None] * self._TURNS
        self._events: list[Any] = [None] * self._TURNS
        self._turn = 0

    def put(self, routings: list[Any], stream: Any) -> tuple[Any, Any]:
        """The routing tensors end to end in pinned host memory, and the event on
        ``stream`` their copy completes at (None, None: no routing)."""
        if not routings:
            return None, None
        flat = torch.cat([ids.reshape(-1) for ids in routings])
        turn, n = self._turn, flat.numel()
        self._turn = (turn + 1) % self._TURNS
        buffer = self._buffers[turn]
        if buffer is None or buffer.numel() < n or buffer.dtype != flat.dtype:
            buffer = self._buffers[turn] = torch.empty(n, dtype=flat.dtype, pin_memory=True)
            self._events[turn] = torch.cuda.Event()
        host = buffer[:n]
        host.copy_(flat, non_blocking=True)
        landed = self._events[turn]
        landed.record(stream)
        return host, landed
