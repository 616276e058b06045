"""The proxy run's configuration: the library's settings and the run's own, one frozen object.

``pipeline.run`` builds it from the command line; benches and tests build it directly.
The streaming layer takes it as the ``StreamConfig`` it extends and reads only the
library's fields; what is the run's alone (how many tokens, where the routing comes from,
prefetch, the compute, the summary's form, the tracebacks, the bandwidths told) lives here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from moestream.pipeline.foundation.config import (
    ComputeSpec,
    Limits,
    StreamConfig,
    check_bound,
    layer_ms_problem,
)
from moestream.pipeline.foundation.errors import UsageError

__all__ = ["RunConfig"]


@dataclass(frozen=True, kw_only=True)
class RunConfig(StreamConfig):
    """Everything a proxy run needs to know, fixed before it starts: the library's settings
    (``StreamConfig``, whose fields it has) and these.

    Attributes:
        tokens: tokens to decode.
        compute: what decode does with the experts.
        prefetch: ``none``; ``predict``: while a layer computes, load the experts the next
            layer is guessed to pick; ``oracle``: start loads of the next layers early from
            the routing, which a trace knows ahead (the upper bound).
        lookahead: how many layers ahead ``oracle`` prefetch runs.
        router: ``trace`` replays the trace (or synthetic routing); ``live`` applies the
            model's router tensors to the hidden state.
        seed: synthetic routing seed.
        trace: a routing trace to replay instead of synthetic routing.
        record_trace: write the routing this run used here.
        routing_preset: the synthetic generator's preset.
        log_level: ``info`` or ``debug`` (per-layer events).
        json: print the summary as JSON.
        debug: show tracebacks.
        limits: storage-read and host-to-device bandwidths the run is told, logged in
            ``run_start`` for the analysis's device limit (None: none given).
    """

    tokens: int = 32
    compute: ComputeSpec = field(default_factory=lambda: ComputeSpec("real"))
    prefetch: str = "none"
    lookahead: int = 1
    router: str = "trace"
    seed: int = 0
    trace: Path | None = None
    record_trace: Path | None = None
    routing_preset: str = "ds4-flash"
    log_level: str = "info"
    json: bool = False
    debug: bool = False
    limits: Limits | None = None

    def __post_init__(self) -> None:
        layer_ms = layer_ms_problem(self.compute.layer_ms)
        checks = [
            (self.tokens >= 1, f"--tokens must be >= 1, got {self.tokens}"),
            (self.log_level in ("info", "debug"), f"unknown --log-level {self.log_level!r}"),
            (layer_ms is None, f"--compute fixed:MS {layer_ms}"),
            (self.prefetch in ("none", "oracle", "predict"),
             f"unknown --prefetch {self.prefetch!r}"),
            (self.router in ("trace", "live"), f"unknown --router {self.router!r}"),
            (not (self.router == "live" and self.prefetch == "oracle"),
             "--prefetch oracle needs the routing ahead: a trace, not --router live"),
        ]
        for ok, message in checks:
            if not ok:
                raise UsageError(message)
        check_bound("lookahead", self.lookahead)
        StreamConfig.__post_init__(self)

    @property
    def layers_ahead(self) -> int:
        """Layers whose experts the run loads ahead of the one it decodes: ``lookahead``
        with oracle prefetch, the next layer with predict prefetch, else none."""
        return {"oracle": self.lookahead, "predict": 1}.get(self.prefetch, 0)

    def describe(self) -> dict[str, object]:
        """JSON-ready options, for the log header."""
        out = StreamConfig.describe(self)
        out["compute"] = str(self.compute)
        return out
