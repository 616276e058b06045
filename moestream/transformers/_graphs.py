"""A held-whole decode step's experts call as one CUDA graph replay.

A model held whole computes a decode step's experts call with the gather launch and then
transformers' own ``batched_mm_experts_forward``: a dozen launches a layer, each some
microseconds of the host's time, and on the transformers path the host's time a token is
what bounds the speed (the GPU's work is queued ahead and waits for it). The call launches
the same kernels on the same shapes every decode step (one layer, the same pairs and dtypes;
the table's addresses fixed while the model is held whole), so its second call of a kind is
captured in a CUDA graph, and each call after copies its inputs into the graph's, replays
it and copies its output out: four launches and a replay. The replay runs the captured
kernels on the same shapes: the same bits as the calls it stands for.

A quantized layer's call dequantizes its slots by a kernel whose table of parameters is
copied to the device before it: captured, that table is one of the graphs' own kept tables
(``_kernel_tables.KeptTables``), which a replay copies again and nothing rewrites while the
graph lives.

What stays outside the graph: the routing kept for the token's end (the caller's), and
every call autograd records (a replay records nothing). A capture that fails turns the
graphs off for the model (one warning event); its calls run as before.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

import structlog
import torch  # type: ignore[import-not-found, unused-ignore]

from moestream.transformers._kernel_tables import KEPT_SLOTS, KeptTables, keeping
from moestream.transformers._launch import current_stream

__all__ = ["DecodeGraphs"]

_log = structlog.get_logger("moestream.transformers")

_MOST = KEPT_SLOTS // 2
"""Graphs kept at most (1024: each holds two kept tables at most, a GGUF layer of two types'
launches); past them a new kind of call runs as it is. Assisted generation's
verification forwards are decode steps of as many lengths as its drafts have (up to ~20),
each a kind in every layer; dropping every graph at the limit instead would capture the
same kinds again and again, each capture (and its instantiation) costing more than the
call run as it is."""
_MOST_BYTES = 256 << 20
"""The graphs' inputs and outputs kept at most (device memory outside the budget: a
server's large batches would otherwise keep their hidden states); past them a new kind of
call runs as it is."""

Step = Callable[[Any, Any, Any], Any]
"""A call's launches from ``(hidden, top_k_index, top_k_weights)`` to its output: no host
read, no synchronization, nothing kept past the call."""


class _Captured(NamedTuple):
    graph: Any
    hidden: Any
    index: Any
    weights: Any
    out: Any


class DecodeGraphs:
    """One CUDA graph per kind of call (the caller's key: its layer, shapes and dtypes, and
    torch's stream), captured at the kind's second call (the first runs as it is, on the
    stream captures use: lazy initializations, which a capture must not meet, happen then);
    one memory pool a stream.
    A pool is shared: its graphs replay one at a time on their stream, and what lives
    between two replays (each graph's inputs and output) is held by tensors, never reused.

    Args:
        device: the torch CUDA device.
    """

    def __init__(self, device: Any) -> None:
        self.device = torch.device(device)
        self.on = self.device.type == "cuda"
        """Whether calls are captured and replayed: on a CUDA device unless set False (and
        set False, for good, by a capture that failed)."""
        self.replays = 0
        self.kept_bytes = 0
        """Device bytes the graphs' inputs and outputs hold (``_MOST_BYTES`` at most)."""
        self._graphs: dict[Hashable, _Captured] = {}
        self._seen: set[Hashable] = set()  # kinds called once, uncaptured
        self._pools: dict[int, Any] = {}  # by stream
        self._side: Any = None  # the stream captures run on
        self._tables = KeptTables(self.device)  # the captured kernels' tables

    def call(self, key: Hashable, stream: int, step: Step, hidden: Any, top_k_index: Any,
             top_k_weights: Any) -> Any:
        """``step``'s output for these inputs: replayed where the graph of ``key`` (which
        names ``stream``, torch's current one, raw) is captured (captured now at its second
        call), run as it is otherwise."""
        if not self.on:
            return step(hidden, top_k_index, top_k_weights)
        captured = self._graphs.get(key)
        if captured is None:
            # inside the caller's own graph, or past the most graphs or bytes kept: as it is
            if (torch.cuda.is_current_stream_capturing() or len(self._graphs) >= _MOST
                    or self.kept_bytes >= _MOST_BYTES):
                return step(hidden, top_k_index, top_k_weights)
            if key not in self._seen:
                if len(self._seen) >= 4 * _MOST:  # kinds never called twice
                    self._seen.clear()
                self._seen.add(key)
                return self._warm(step, hidden, top_k_index, top_k_weights)
            captured = self._capture(stream, step, hidden, top_k_index, top_k_weights)
            if captured is None:
                return step(hidden, top_k_index, top_k_weights)
            self._graphs[key] = captured
            kept = (captured.hidden, captured.index, captured.weights, captured.out)
            self.kept_bytes += sum(t.numel() * t.element_size() for t in kept)
        captured.hidden.copy_(hidden)
        captured.index.copy_(top_k_index)
        captured.weights.copy_(top_k_weights)
        captured.graph.replay()
        self.replays += 1
        return captured.out.clone()  # the caller's own: the next replay rewrites ``out``

    def _warm(self, step: Step, hidden: Any, top_k_index: Any, top_k_weights: Any) -> Any:
        """A kind's first call, run on the side stream the captures run on (torch's recipe
        for graphs: lazy initializations for that stream, cuBLAS's workspace among them,
        happen outside a capture), ordered with torch's stream both ways; each tensor kept
        from reuse until the stream that did not allocate it is done with it."""
        current, side = current_stream(self.device), self._side_stream()
        side.wait_stream(current)
        with torch.cuda.stream(side):
            out = step(hidden, top_k_index, top_k_weights)
        current.wait_stream(side)
        for tensor in (hidden, top_k_index, top_k_weights):
            tensor.record_stream(side)
        out.record_stream(current)
        return out

    def _side_stream(self) -> Any:
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        return self._side

    def _capture(self, stream: int, step: Step, hidden: Any, top_k_index: Any,
                 top_k_weights: Any) -> _Captured | None:
        """``step`` captured on a side stream over inputs of these shapes (their values are
        copied in before each replay); None, and the graphs off, where the capture fails.
        Nothing runs on the device meanwhile: no synchronization."""
        current = current_stream(self.device)
        with torch.inference_mode(False):  # written by later calls, in inference mode or not
            inputs = (torch.empty_like(hidden), torch.empty_like(top_k_index),
                      torch.empty_like(top_k_weights))
        side = self._side_stream()
        side.wait_stream(current)  # the inputs' allocations, in stream order
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.stream(side), keeping(self._tables):
                # thread_local: the session's loop thread may query events meanwhile
                graph.capture_begin(pool=self._pools.get(stream),
                                    capture_error_mode="thread_local")
                try:
                    out = step(*inputs)
                finally:
                    graph.capture_end()
        except RuntimeError as exc:
            self.on = False
            self.clear()
            _log.warning("decode_graphs_off", reason=str(exc).splitlines()[0] if str(exc)
                         else type(exc).__name__)
            return None
        current.wait_stream(side)
        self._pools.setdefault(stream, graph.pool())
        return _Captured(graph, *inputs, out)

    def clear(self) -> None:
        """Drop every graph (the tables they read by are dropped): the kinds are captured
        again at their second call after, their kept tables reused."""
        self._graphs.clear()
        self.kept_bytes = 0
        self._seen.clear()
        self._pools.clear()
        self._tables.reset()
