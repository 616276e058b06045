"""Where the proxy run's experts come from when it replays routing, and its guesses of the
next layer's experts.

- ``TraceRouting`` replays a trace (recorded, or the calibrated synthetic one). It knows
  the future, which the ``oracle`` prefetch uses as an upper bound; its honest guess of
  layer L+1 is the previous token's choice at L+1 (routing is strongly recurrent).
- ``BlockRouting`` does the same for routing made block by block as the run goes (the
  synthetic routing of ``pipeline.cli.run``): it holds a few blocks, never the whole run's.

The model's own router (``--router live``) is the public ``Session.router``'s; both satisfy
``Routing``, what the decode loop asks of its routing.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from moestream.pipeline.foundation.trace import Trace

__all__ = ["BlockRouting", "Routing", "TraceRouting"]


class Routing(Protocol):
    """Routing decisions for the decode loop."""

    def route(self, token: int, i: int, hidden: Any) -> tuple[list[int], list[float]]:
        """Experts and weights of MoE layer position ``i`` for ``token``."""

    def predict(self, token: int, i: int, hidden: Any) -> list[int]:
        """A guess of ``route(token, i, ...)`` made one layer early."""


class TraceRouting:
    """Replays ``trace`` cyclically; predicts from the previous token."""

    def __init__(self, trace: Trace) -> None:
        self.trace = trace

    def route(self, token: int, i: int, hidden: Any) -> tuple[list[int], list[float]]:
        row = token % self.trace.n_tokens
        experts: list[int] = self.trace.experts[row, i].tolist()
        weights: list[float] = self.trace.weights[row, i].tolist()
        return experts, weights

    def predict(self, token: int, i: int, hidden: Any) -> list[int]:
        if token == 0:
            return []
        return self.route(token - 1, i, hidden)[0]


class BlockRouting:
    """Replays routing made in blocks of ``block_tokens`` tokens, each made when first asked.

    The decode loop asks about the token it decodes, the previous one (``predict``) and,
    with oracle prefetch, tokens up to ``reach_tokens - 1`` ahead of it; blocks wholly
    before the furthest token asked minus ``reach_tokens`` are dropped. Memory is a few
    blocks whatever the run's length.

    Args:
        blocks: ``(experts, weights)`` arrays of shape ``[block_tokens, layers, top_k]``,
            in token order, as many as the run needs.
        block_tokens: tokens per block.
        reach_tokens: how far behind the furthest token asked a later question may be
            (at least 1, the previous token of ``predict``).
    """

    def __init__(
        self,
        blocks: Iterator[tuple[npt.NDArray[np.int32], npt.NDArray[np.float32]]],
        block_tokens: int,
        reach_tokens: int = 1,
    ) -> None:
        self._blocks = blocks
        self._block_tokens = block_tokens
        self._reach = max(1, reach_tokens)
        self._held: dict[int, tuple[npt.NDArray[np.int32], npt.NDArray[np.float32]]] = {}
        self._made = 0  # blocks taken from ``blocks``
        self._furthest = 0  # the furthest token asked about

    def _block(self, token: int) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.float32]]:
        number = token // self._block_tokens
        if token > self._furthest:
            self._furthest = token
            oldest = (token - self._reach) // self._block_tokens
            for old in [b for b in self._held if b < oldest]:
                del self._held[old]
        while self._made <= number:
            self._held[self._made] = next(self._blocks)
            self._made += 1
        held = self._held.get(number)
        if held is None:  # a caller asked further back than it promised
            raise LookupError(f"token {token}: its routing block was dropped (asked "
                              f"{self._furthest - token} tokens back, reach {self._reach})")
        return held

    def route(self, token: int, i: int, hidden: Any) -> tuple[list[int], list[float]]:
        experts, weights = self._block(token)
        row = token % self._block_tokens
        return experts[row, i].tolist(), weights[row, i].tolist()

    def predict(self, token: int, i: int, hidden: Any) -> list[int]:
        if token == 0:
            return []
        return self.route(token - 1, i, hidden)[0]
