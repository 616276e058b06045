"""The library's settings (``StreamConfig``): one frozen object, passed down.

A client's own settings (the proxy run's tokens, routing and output) extend it where the
client lives (``pipeline.proxy.config.RunConfig``).

Parsing helpers turn user text (``20GiB``, ``2522``, ``fixed:0.57``) into typed values and
raise ``UsageError`` with a one-line reason for anything else.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Literal

from moestream.pipeline.foundation.errors import UsageError

GATHER_BLOCKS = 2
"""The gather kernel's blocks per copy, at most: its SM budget beside an engine's kernels.
On the H200, 2 blocks loaded as fast as 16 (fine-grained shape, loading alone: 44.4 against
45.6 GB/s; Qwen3-30B-A3B shape, warm misses 0.889 and 0.878 against 0.889 and 0.842 x
pinned H2D) while an engine's bf16 GEMM beside it kept 0.80-0.83 of its rate instead of
0.53, and a decode-like GEMV 0.43-0.47 instead of 0.25 (``bench.contention``,
``bench/results/shapes-h200-843c99d/``)."""

__all__ = [
    "MAX_BUDGET_EXPERTS",
    "MAX_LAYER_MS",
    "MAX_SIZE_BYTES",
    "TUNING_BOUNDS",
    "Bound",
    "Budget",
    "ComputeSpec",
    "Mode",
    "StreamConfig",
    "check_bound",
    "layer_ms_problem",
    "parse_budget",
    "parse_compute",
    "parse_devices",
    "parse_size",
]

Mode = Literal["auto", "direct", "resident"]

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+)(?:\.(\d+))?\s*([a-zA-Z]*)\s*$")
_BARE_DECIMAL = re.compile(r"^(\d+)\.(\d+)$")  # a budget without a unit: experts

MAX_SIZE_BYTES = 2**62
"""The largest size accepted (4 EiB): far above any memory or file, far below where byte
counts stop fitting an int64 or a float stops counting bytes exactly."""

MAX_BUDGET_EXPERTS = 2**32
"""The largest cache budget given as an expert count (a model has thousands)."""

_SIZE_DIGITS = 20  # digits before the point: 10**20 is already above MAX_SIZE_BYTES
_FRACTION_DIGITS = 30  # digits after it that can matter: the largest unit is under 10**13


def _shown(text: str) -> str:
    """``text`` for a one-line message: a 400-digit number is cut, not printed whole."""
    return repr(text) if len(text) <= 40 else repr(text[:32] + "...") + f" ({len(text)} chars)"


def parse_size(text: str) -> int:
    """Bytes from ``512``, ``11GB`` (10**9), ``20GiB`` (2**30), ``1.5G`` (2**30).

    Parsed exactly, in integers (a fraction of a byte is dropped), so a number of any
    length gives a size or a one-line error, never a float overflow.

    Raises:
        UsageError: not a size, or larger than ``MAX_SIZE_BYTES``.
    """
    match = _SIZE.match(text)
    if not match or match.group(3).lower() not in _UNITS:
        raise UsageError(f"cannot read size {_shown(text)} (examples: 4096, 11GB, 20GiB)")
    whole, fraction, unit = match.group(1).lstrip("0"), match.group(2) or "", match.group(3)
    fraction = fraction[:_FRACTION_DIGITS]
    if len(whole) > _SIZE_DIGITS:
        nbytes = MAX_SIZE_BYTES + 1
    else:
        scaled = int(whole or "0") * 10 ** len(fraction) + int(fraction or "0")
        nbytes = scaled * _UNITS[unit.lower()] // 10 ** len(fraction)
    if nbytes > MAX_SIZE_BYTES:
        raise UsageError(f"size {_shown(text)} is larger than the {MAX_SIZE_BYTES} bytes "
                         "(4 EiB) a size may be")
    return nbytes


@dataclass(frozen=True, slots=True)
class Bound:
    """The values one tuning setting may take.

    The upper ends are there so that a typo (``--staging-slots 10000000``, ``--queue-depth
    100000``) is refused in one line before anything is allocated, instead of asking for
    gigabytes of pinned memory or tens of thousands of threads; each lies well above what
    any measured setting needed.

    Attributes:
        flag: the command line's spelling (None: the API's only).
        low: the least value.
        high: the largest value.
        why: what the upper end protects, said in the refusal.
    """

    flag: str | None
    low: float
    high: float
    why: str


TUNING_BOUNDS: Mapping[str, Bound] = MappingProxyType({
    "queue_depth": Bound("--queue-depth", 1, 64, "reader threads per device"),
    "chunk_bytes": Bound("--chunk", 4096, 256 << 20, "one read's buffer: 256 MiB"),
    "staging_slots": Bound("--staging-slots", 1, 1024, "pinned staging buffers per device"),
    "upload_streams": Bound("--streams", 1, 16, "CUDA streams per device"),
    "gather_blocks": Bound("--gather-blocks", 1, 1024, "thread blocks per gather copy"),
    "layers_in_flight": Bound(None, 1, 256, "layers pinned at once"),
    "lookahead": Bound("--lookahead", 0, 256, "layers loaded ahead"),
    "sample_ms": Bound("--sample-ms", 1, 60_000, "the controller's period: a minute"),
    "dwell_s": Bound(None, 0, 3600, "seconds between mode switches: an hour"),
    "ram_limit": Bound("--ram-limit", 0, MAX_SIZE_BYTES, "4 EiB"),
    "margin_bytes": Bound("--margin", 0, MAX_SIZE_BYTES, "4 EiB"),
})
"""Every tuning setting's range, by the name ``StreamConfig`` (or the proxy's ``RunConfig``)
and ``moestream.Tuning`` give it: the one table both check against (``check_bound``), so
the command line and the API refuse the same values."""


def _number(value: float) -> str:
    """``value`` for a one-line message; an integer of hundreds of digits as its size."""
    if isinstance(value, int) and abs(value) >= 10**20:
        return f"{'-' if value < 0 else ''}2**{abs(value).bit_length() - 1} or more"
    return f"{value:g}" if isinstance(value, float) else str(value)


def check_bound(name: str, value: float, spelled: str | None = None) -> None:
    """Refuse ``value`` for the tuning setting ``name`` outside its ``TUNING_BOUNDS`` range.

    Args:
        name: the setting (``queue_depth``).
        value: its value (NaN is outside every range).
        spelled: the name in the caller's words (default: the command line's flag).

    Raises:
        UsageError: below the least or above the largest value, in one line.
    """
    bound = TUNING_BOUNDS[name]
    what = spelled or bound.flag or name
    if not value >= bound.low:
        raise UsageError(f"{what} must be >= {_number(bound.low)}, not {_number(value)}")
    if not value <= bound.high:
        raise UsageError(f"{what} must be <= {_number(bound.high)} ({bound.why}), "
                         f"not {_number(value)}")


@dataclass(frozen=True, slots=True)
class Budget:
    """A cache budget as ds4's ``--ssd-streaming-cache-experts`` takes it: N experts or bytes."""

    experts: int | None = None
    nbytes: int | None = None

    def resolve(self, expert_bytes: int) -> int:
        """The budget in bytes, given the size of one expert's device buffer."""
        if self.nbytes is not None:
            return self.nbytes
        assert self.experts is not None
        return min(self.experts * expert_bytes, MAX_SIZE_BYTES)

    def __str__(self) -> str:
        if self.experts is not None:
            return f"{self.experts} expert{'' if self.experts == 1 else 's'}"
        return f"{self.nbytes} byte{'' if self.nbytes == 1 else 's'}"


def parse_budget(text: str) -> Budget:
    """``2522`` (experts) or a size with a unit (``11GB``, ``20GiB``, ``4096B``).

    A bare number is always experts: ``4.0`` is 4 experts, like ``4``; ``4.5`` is refused
    (a fraction of an expert, or a size missing its unit), never read as bytes.

    Raises:
        UsageError: neither, a bare number with a fraction, or more than
            ``MAX_BUDGET_EXPERTS`` experts or ``MAX_SIZE_BYTES`` bytes.
    """
    stripped = text.strip()
    bare = _BARE_DECIMAL.match(stripped)
    if bare:
        if bare.group(2).strip("0"):
            raise UsageError(f"cache budget {_shown(stripped)}: a bare number is experts, a "
                             "whole number of them; a size takes its unit (e.g. 4.5GiB)")
        stripped = bare.group(1)
    if stripped.isdigit():
        digits = stripped.lstrip("0")
        if len(digits) > len(str(MAX_BUDGET_EXPERTS)) or int(digits or "0") > MAX_BUDGET_EXPERTS:
            raise UsageError(f"cache budget {_shown(stripped)} is more than the "
                             f"{MAX_BUDGET_EXPERTS} experts a budget may hold (give a size, "
                             "e.g. 20GiB, or leave it out to hold every expert)")
        return Budget(experts=int(stripped))
    match = _SIZE.match(stripped)
    if not match or match.group(3).lower() not in _UNITS:  # parse_size's examples are bytes
        raise UsageError(f"cannot read cache budget {_shown(stripped)}: a number of experts "
                         "(64) or a size with its unit (4096B, 11GB, 20GiB)")
    return Budget(nbytes=parse_size(stripped))


@dataclass(frozen=True, slots=True)
class ComputeSpec:
    """What decode does with the experts: ``real`` SwiGLU, ``digest`` every byte, or
    ``fixed`` device-busy milliseconds per layer (an engine's compute, emulated)."""

    kind: Literal["real", "digest", "fixed"]
    layer_ms: float = 0.0

    def __str__(self) -> str:
        return f"fixed:{self.layer_ms}" if self.kind == "fixed" else self.kind


def parse_devices(text: str) -> tuple[int, ...]:
    """``0,1`` -> (0, 1).

    Raises:
        UsageError: not a comma list of device indices.
    """
    try:
        devices = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise UsageError(f"--devices takes device indices like 0,1, not {text!r}") from None
    return devices


MAX_LAYER_MS = 1000.0
"""The most ``fixed:MS`` compute per layer: an engine's layer takes about a millisecond
(0.57 ms for ds4 on an H200); a larger value is a typo, and ``inf`` would never end."""


def layer_ms_problem(ms: float) -> str | None:
    """Why ``ms`` cannot be ``fixed:MS`` compute per layer, or None when it can."""
    if not math.isfinite(ms) or not 0 <= ms <= MAX_LAYER_MS:
        return f"takes 0 to {MAX_LAYER_MS:g} ms of compute per layer, got {ms:g}"
    return None


def parse_compute(text: str) -> ComputeSpec:
    """``real``, ``digest``, ``fixed`` (0.57 ms per layer) or ``fixed:MS``.

    Raises:
        UsageError: anything else, and an MS that is not a number from 0 to
            ``MAX_LAYER_MS`` (``inf``, ``nan``, ``1e9``).
    """
    if text in ("real", "digest"):
        return ComputeSpec(text)  # type: ignore[arg-type]
    if text == "fixed":
        return ComputeSpec("fixed", 0.57)
    if text.startswith("fixed:"):
        try:
            ms = float(text.removeprefix("fixed:"))
        except ValueError:
            pass
        else:
            problem = layer_ms_problem(ms)
            if problem is not None:
                raise UsageError(f"--compute {text!r}: fixed:MS {problem}")
            return ComputeSpec("fixed", ms)
    raise UsageError(f"cannot read --compute {text!r} (expected real, digest or fixed:MS)")


@dataclass(frozen=True, kw_only=True)
class StreamConfig:
    """The library's settings for one streaming session, fixed before it opens.

    ``moestream.open`` builds one from its arguments; a client with settings of its own
    (``pipeline.proxy.config.RunConfig``: tokens, routing, prefetch, output) extends it,
    and the streaming layer reads only these fields.

    Attributes:
        model: the model's file (a GGUF file or a checkpoint); None only before the caller
            chose one (the session refuses it: a default model is the caller's choice).
        budget: device cache budget (experts or bytes); None holds every expert.
        mode: ``auto`` lets the controller choose; ``direct``/``resident`` force it.
        policy: cache eviction policy (``lru`` or ``freq``).
        backend: ``auto``, ``host`` or ``cupy``.
        devices: device indices to shard the experts over (None: every visible device;
            on the host backend, indices emulate devices).
        queue_depth: reader threads (reads in flight at once).
        chunk_bytes: largest single read request.
        staging_slots: experts that can be staged in pinned memory at once.
        upload_streams: CUDA streams used in turn for uploads.
            These, ``gather_blocks``, ``sample_ms``, ``dwell_s``, ``ram_limit`` and
            ``margin_bytes`` lie in their ``TUNING_BOUNDS`` ranges.
        gather: resident misses of a layer copied by one gather kernel that reads the
            registered mapping (and digests as it writes), where the device maps registered
            memory and the experts' matrices average under 2 MiB
            (``pipeline.streaming.streamer.GATHER_BELOW_BYTES``: above it the copy engines
            are as fast);
            False: the copy engines always (a layer's copies as one batched copy), which
            leave the SMs to an engine's compute (``--no-gather``).
        gather_blocks: the gather kernel's blocks per copy, at most: its SM budget beside
            an engine's kernels (``--gather-blocks``).
        verify: check every installed expert against the file's bytes.
        log: JSON-lines log file (one event per token).
        ram_limit: cap on the RAM the controller believes it has.
        sample_ms: controller sampling period.
        margin_bytes: the controller's safety margin (None: max(2 GiB, 5% of RAM)).
        warmup: in resident mode, warm the model's missing pages in the background.
        dwell_s: least time between two mode switches (pressure overrides it).
        faults: injected faults, ``kind[=value]@N[+]`` items (``pipeline.foundation.faults``);
            empty (the default) injects nothing. A test facility.
    """

    model: Path | None = None
    budget: Budget | None = None
    mode: Mode = "auto"
    policy: str = "lru"
    backend: str = "auto"
    devices: tuple[int, ...] | None = None
    queue_depth: int = 8
    chunk_bytes: int = 4 << 20
    staging_slots: int = 16
    upload_streams: int = 2
    gather_blocks: int = GATHER_BLOCKS
    gather: bool = True
    verify: bool = True
    log: Path | None = None
    ram_limit: int | None = None
    sample_ms: float = 250.0
    margin_bytes: int | None = None
    warmup: bool = True
    dwell_s: float = 2.0
    faults: str = ""

    def __post_init__(self) -> None:
        checks = [
            (self.chunk_bytes % 4096 == 0,
             f"--chunk must be a multiple of 4096, got {self.chunk_bytes}"),
            (self.mode in ("auto", "direct", "resident"), f"unknown --mode {self.mode!r}"),
            (self.policy in ("lru", "freq"), f"unknown --policy {self.policy!r}"),
            (self.devices is None or (len(self.devices) >= 1 and min(self.devices) >= 0
                                      and len(set(self.devices)) == len(self.devices)),
             f"--devices must name distinct device indices, got {self.devices}"),
        ]
        for ok, message in checks:
            if not ok:
                raise UsageError(message)
        for name in ("queue_depth", "staging_slots", "upload_streams", "gather_blocks",
                     "sample_ms", "dwell_s", "chunk_bytes"):
            check_bound(name, getattr(self, name))
        for name in ("ram_limit", "margin_bytes"):
            if getattr(self, name) is not None:
                check_bound(name, getattr(self, name))
        if self.faults:
            from moestream.pipeline.foundation.faults import parse_faults

            parse_faults(self.faults)  # a malformed spec fails here, with its reason

    def describe(self) -> dict[str, object]:
        """JSON-ready settings, for the log header (``run_start.config``)."""
        out = asdict(self)
        for key, value in out.items():
            if isinstance(value, Path):
                out[key] = str(value)
        out["budget"] = str(self.budget) if self.budget else None
        return out
