"""Tokens' routing, read on the host once their device work is done.

``WholeLayers`` serves a held-whole model's experts calls with no host read of the
routing: a token's calls' routing stays on the device, gathered into one tensor at the
forward's end (a ``Routing`` a token), until the token ends. Tokens that end together
(``ExpertStream.defer``) cross to the host together: one concatenation and one copy into
pinned memory, on a stream of their own behind the event of the last one's work, so that
the host waits for that token alone, not for those queued after it, and pays one transfer
for several tokens, not one a token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch  # type: ignore[import-not-found, unused-ignore]

from moestream.transformers._launch import current_stream

__all__ = ["HELD_TOKENS", "Landing", "Routing"]

HELD_TOKENS = 8
"""How many tokens the whole-layer path served a decode holds before it ends them, together
(``ExpertStream.defer``): a token's end (its routing's copy, its hits counted, its log
line) then runs with the ends before it, which costs the host less than each alone between
two forwards."""


@dataclass(frozen=True, slots=True)
class Routing:
    """A token's calls served by ``WholeLayers``: each call's layer and number of ids, and
    the ids end to end in one tensor of the token's own (on the device on a GPU; None: no
    call). Its own, made at the token's end: a router's output may be a buffer the next
    forward writes again (a compiled model's CUDA graphs replay into the same memory)."""

    layers: list[int]
    sizes: list[int]
    ids: Any


class Landing:
    """Where routings cross to the host on a GPU: a pinned buffer and a stream, made once
    (a pinned allocation costs host time on the critical path)."""

    def __init__(self, device: Any) -> None:
        self._device = device
        self._buffer: Any = None
        self._stream: Any = None

    def land(self, routings: Sequence[Routing], after: Any = None) -> list[list[list[int]]]:
        """Each routing's calls' ids as ints, once ``after`` (a CUDA event: the last
        routing's work, recorded on torch's stream; None: what torch's current stream has
        queued so far) completes; on the host, at once."""
        tensors = [routing.ids for routing in routings if routing.ids is not None]
        if not tensors:
            return [[] for _ in routings]
        if self._device.type == "cuda":
            flat = self._copied(tensors, after)
        else:
            flat = [i for ids in tensors for i in ids.tolist()]
        out, at = [], 0
        for routing in routings:
            calls = []
            for size in routing.sizes:
                calls.append(flat[at:at + size])
                at += size
            out.append(calls)
        return out

    def _copied(self, tensors: list[Any], after: Any) -> list[int]:
        """The tensors' ids end to end, through one copy to pinned memory on this object's
        stream, which waits for ``after`` first: the host waits for that and the copy, no
        more."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self._device)
        stream = self._stream
        if after is None:
            after = torch.cuda.Event()
            after.record(current_stream(self._device))
        stream.wait_event(after)
        with torch.cuda.stream(stream):
            flat = torch.cat(tensors)
            n = flat.numel()
            buffer = self._buffer
            if buffer is None or buffer.numel() < n or buffer.dtype != flat.dtype:
                # kept for later calls, in inference mode or not: made under it, it could
                # never be written outside it ("Inplace update to inference tensor")
                with torch.inference_mode(False):
                    buffer = self._buffer = torch.empty(n, dtype=flat.dtype, pin_memory=True)
            host = buffer[:n]
            host.copy_(flat, non_blocking=True)
        stream.synchronize()
        ids: list[int] = host.tolist()
        return ids
