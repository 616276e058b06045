"""The experts one call routes to, leased from the session a budget-sized group at a time.

Shared by the experts implementation (``_experts.py``) and the swapped experts modules
(``_swap.py``): each group is one ``fetch``; its handles come in batches, those already
there first, then each as it lands; on a GPU torch's current stream waits on the device
for each upload not yet installed, and the lease is released after the work queued on
that stream, so that the cache reuses no buffer before the device has read it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from moestream import ExpertHandle, SyncSession
from moestream.transformers._launch import current_stream

__all__ = ["groups", "leased"]


def groups(wanted: Sequence[int], size: int) -> Iterator[list[int]]:
    """``wanted`` in groups of at most ``size`` experts (what one fetch may pin)."""
    for i in range(0, len(wanted), size):
        yield list(wanted[i:i + size])


@contextmanager
def leased(session: SyncSession, device: Any, layer: int, experts: Sequence[int],
           then: Callable[[], object] | None = None) -> Iterator[Iterator[list[ExpertHandle]]]:
    """The experts' handles in batches: those already there first, then each as it
    lands; on a GPU (``device``) torch's stream waits on the device for each upload not
    yet installed, once per event (``ExpertHandle.pending_event``: no query an expert).
    The lease is released on leaving, after the work queued on torch's stream.

    ``then`` (a next layer's prefetch hint) runs while the experts are pinned, so that it
    can evict nothing this lease holds: on the host before any is computed (its reads run
    on reader threads meanwhile); on a GPU once the block has queued the compute, so that
    the device starts it while the host queues the hint's copies (in resident mode the
    caller's thread queues them itself), not after. An error in the block skips it."""
    lease = session.fetch(layer, experts)
    cuda_stream = current_stream(device) if device.type == "cuda" else None

    def batches() -> Iterator[list[ExpertHandle]]:
        waited = None  # torch's stream waits once per upload event: a layer's misses share one
        while lease.remaining:
            batch = lease.available() or [next(lease)]
            if cuda_stream is not None:
                for h in batch:
                    event = h.pending_event()  # None once installed: nothing to wait for
                    if event is not None and event is not waited:
                        h.wait(cuda_stream)
                        waited = event
            yield batch

    try:
        if then is not None and cuda_stream is None:
            then()
        yield batches()
        if then is not None and cuda_stream is not None:
            then()
    finally:
        lease.release(after=cuda_stream)
