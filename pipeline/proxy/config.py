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
    StreamConfig,
    check_bound,
    layer_ms_problem,
    parse_size,
)
from moestream.pipeline.foundation.errors import UsageError

__all__ = ["Limits", "RunConfig", "parse_limits"]


@dataclass(frozen=True, slots=True)
class Limits:
    """Bandwidths the run is told (``--limits``), for the device limit the analysis puts
    beside the measured rate: ``read`` from storage, ``copy`` host to device; bytes/s."""

    read_bytes_per_s: float | None = None
    copy_bytes_per_s: float | None = None

    def record(self) -> dict[str, float | str]:
        """``run_start.limits``: the figures given, and where they came from."""
        out: dict[str, float | str] = {"source": "told"}
        if self.read_bytes_per_s is not None:
            out["read_bytes_per_s"] = self.read_bytes_per_s
        if self.copy_bytes_per_s is not None:
            out["copy_bytes_per_s"] = self.copy_bytes_per_s
        return out


def parse_limits(text: str) -> Limits:
    """``read=1.8GB/s,copy=55GB/s`` (either may be left out) -> ``Limits`` in bytes/s.

    Raises:
        UsageError: another key, a repeated key, or a rate that is not a positive size
            per second (``GB/s`` is 10**9 bytes, ``GiB/s`` 2**30).
    """
    given: dict[str, float] = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in ("read", "copy") or key in given:
            raise UsageError(f"cannot read --limits {text!r} (expected read=RATE,copy=RATE, "
                             "e.g. read=1.8GB/s,copy=55GB/s)")
        rate = value.strip()
        if not rate.lower().endswith("/s"):
            raise UsageError(f"--limits {key}={rate!r}: a rate needs /s (e.g. 1.8GB/s)")
        nbytes = parse_size(rate[:-2])
        if nbytes <= 0:
            raise UsageError(f"--limits {key}={rate!r}: a rate must be above 0")
        given[key] = float(nbytes)
    return Limits(given.get("read"), given.get("copy"))


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
