"""``Tuning``: the session's rarely changed settings, each checked against its range."""

from __future__ import annotations

from dataclasses import dataclass, field

from moestream._args import index, milliseconds
from moestream.pipeline.foundation.config import GATHER_BLOCKS, check_bound
from moestream.pipeline.foundation.errors import UsageError, UsageTypeError
from moestream.pipeline.streaming.controller import Sampler

__all__ = ["Tuning"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Tuning:
    """Settings that rarely need changing (the defaults are ``moestream.pipeline.cli.run``'s).

    Each setting has a range, checked here, at once, in one line (``UsageError``; the same
    ranges as ``pipeline.cli.run``'s flags, ``pipeline.foundation.config.TUNING_BOUNDS``): the
    upper ends keep a typo from asking for gigabytes of pinned memory or thousands of
    threads. A staging ring that would take more than half the RAM available when the
    session opens is refused then, before anything is allocated.

    Attributes:
        queue_depth: reader threads per device (reads in flight); 1 to 64.
        chunk_bytes: largest single read (a multiple of 4096); 4096 to 256 MiB.
        staging_slots: experts staged in pinned memory at once, per device; 1 to 1024.
        upload_streams: upload streams per device; 1 to 16.
        gather: a layer's resident misses copied by one gather kernel on the SMs, where it
            serves (small expert matrices, ``streaming.streamer.GATHER_BELOW_BYTES``); False:
            always the copy engines, which leave the SMs to the engine's kernels.
        gather_blocks: the gather's blocks per copy, at most (its SM budget); 1 to 1024.
        layers_in_flight: layers whose experts may be pinned at once (a fetched layer and
            a prefetched one, or concurrent fetches); the budget must hold that many
            layers' top-k experts; 1 to 256.
        ram_limit: the RAM the controller may believe in, at most (bytes); 0 to 2**62.
        sample_ms: the controller's sampling period; 1 to 60,000 ms.
        margin_bytes: the controller's safety margin (None: max(2 GiB, 5% of RAM));
            0 to 2**62 bytes.
        warmup: in resident mode, warm the model's missing pages in the background.
        dwell_s: least time between two mode switches; 0 to 3600 s.
        sampler: machine readings for the controller (tests feed their own).
        faults: injected faults (``moestream.pipeline.foundation.faults``), a test facility.
    """

    queue_depth: int = 8
    chunk_bytes: int = 4 << 20
    staging_slots: int = 16
    upload_streams: int = 2
    gather: bool = True
    gather_blocks: int = GATHER_BLOCKS
    layers_in_flight: int = 2
    ram_limit: int | None = None
    sample_ms: float = 250.0
    margin_bytes: int | None = None
    warmup: bool = True
    dwell_s: float = 2.0
    sampler: Sampler | None = field(default=None, repr=False)
    faults: str = ""

    def __post_init__(self) -> None:
        # the ranges are ``pipeline.foundation.config.TUNING_BOUNDS``, the command line's too
        for name in ("queue_depth", "staging_slots", "upload_streams", "layers_in_flight",
                     "gather_blocks"):
            check_bound(name, index(getattr(self, name), f"Tuning.{name}"), f"Tuning.{name}")
        if not isinstance(self.gather, bool):
            raise UsageTypeError(f"Tuning.gather must be True or False, not {self.gather!r}")
        chunk = index(self.chunk_bytes, "Tuning.chunk_bytes")
        if chunk % 4096:
            raise UsageError(f"Tuning.chunk_bytes must be a multiple of 4096, not {chunk}")
        check_bound("chunk_bytes", chunk, "Tuning.chunk_bytes")
        for name in ("ram_limit", "margin_bytes"):
            value = getattr(self, name)
            if value is not None:
                check_bound(name, index(value, f"Tuning.{name}"), f"Tuning.{name}")
        check_bound("sample_ms", milliseconds(self.sample_ms, "Tuning.sample_ms"),
                    "Tuning.sample_ms")
        check_bound("dwell_s", milliseconds(self.dwell_s, "Tuning.dwell_s"), "Tuning.dwell_s")
