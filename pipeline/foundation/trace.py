"""Routing traces: which experts each token picks in each MoE layer, on disk and in memory.

The pipeline is driven by a router's choices, not by a model's arithmetic: replaying a trace
tells the cache, prefetcher and upload stages exactly what a decode would ask for, so a run
is repeatable and can be compared across budgets and modes. A trace is either recorded from
a real router or made by ``tools.make_trace``.

Two on-disk forms, chosen by the file name when saving and by the file's first bytes when
loading:

- ``.npz`` (``np.savez``): arrays ``experts`` (int32 ``[tokens, layers, top_k]``),
  ``weights`` (float32, same shape), and 0-d ``format``, ``version``, ``n_experts``,
  ``preset``. Each member's ``.npy`` header is read first and checked against the member's
  size in the zip directory and against ``MAX_TRACE_ENTRIES`` before anything is allocated
  for it; an archive holding object arrays is refused rather than unpickled.
- ``.jsonl``: a header object ``{"format": "moestream-trace", "version": 1, "n_layers",
  "n_experts", "top_k", "preset"}`` on the first line, then one object per token
  ``{"token": i, "experts": [[...], ...], "weights": [[...], ...]}``. Parsed with ``json``
  only, never ``eval``.

Every way a file can be wrong (bad header, ids out of range, a repeated id within one
token's layer, ragged or mismatched shapes, non-finite or negative weights, a truncated file)
becomes a ``TraceError`` naming the file and the problem on one line.

Memory is bounded by design: a trace holds at most ``MAX_TRACE_ENTRIES`` (token, layer,
choice) entries, 1 GiB as int32 ids and float32 weights. Loading refuses a larger one from
what its headers declare, before reading it (a ``.jsonl`` as soon as its rows pass the
bound; its lines are read with a length cap); ``TraceRecorder`` refuses a run that would
record more before the run starts. The two forms' readers, and those bounds, are
``pipeline.foundation.trace_read``'s.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from moestream.pipeline.foundation.errors import TraceError
from moestream.pipeline.foundation.inputs import open_input
from moestream.pipeline.foundation.outputs import atomic_output
from moestream.pipeline.foundation.trace_read import (
    TRACE_FORMAT,
    TRACE_VERSION,
    read_jsonl,
    read_npz,
)

__all__ = [
    "MAX_TRACE_ENTRIES",
    "TRACE_FORMAT",
    "TRACE_VERSION",
    "Trace",
    "TraceRecorder",
    "load_trace",
    "save_trace",
]

_WEIGHT_SUM_TOLERANCE = 1e-3
"""How far a row of weights may sum from 1 (float32 rounding, text round trips)."""

_NPZ_MAGIC = b"PK"

MAX_TRACE_ENTRIES = 1 << 27
"""The most (token, layer, choice) entries a trace may hold: 1 GiB as int32 ids and float32
weights, about 520,000 tokens of DeepSeek V4 Flash (43 MoE layers x top-6)."""


def _problem(experts: np.ndarray, weights: np.ndarray, n_experts: int) -> str | None:
    """The first thing wrong with a trace's arrays, or None if they are a valid trace."""
    if isinstance(n_experts, bool) or not isinstance(n_experts, int) or n_experts <= 0:
        return f"n_experts must be a positive integer, got {n_experts!r}"
    if experts.dtype != np.int32:
        return f"experts must be int32, got {experts.dtype}"
    if weights.dtype != np.float32:
        return f"weights must be float32, got {weights.dtype}"
    if experts.ndim != 3:
        return f"experts must be [tokens, layers, top_k], got shape {experts.shape}"
    if weights.shape != experts.shape:
        return f"weights shape {weights.shape} differs from experts shape {experts.shape}"
    tokens, layers, top_k = experts.shape
    if tokens == 0 or layers == 0 or top_k == 0:
        return f"empty trace (shape {experts.shape})"
    if top_k > n_experts:
        return f"top_k {top_k} exceeds n_experts {n_experts}"
    low, high = int(experts.min()), int(experts.max())
    if low < 0 or high >= n_experts:
        bad = low if low < 0 else high
        where = np.argwhere((experts < 0) | (experts >= n_experts))[0]
        return (
            f"expert id {bad} out of range [0, {n_experts}) at token {where[0]}, layer {where[1]}"
        )
    repeated = _repeated_within_row(experts)
    if repeated is not None:
        token, layer = repeated
        return f"expert id repeated within token {token}, layer {layer}"
    if not np.isfinite(weights).all():
        token, layer, _ = np.argwhere(~np.isfinite(weights))[0]
        return f"non-finite weight at token {token}, layer {layer}"
    if (weights < 0).any():
        token, layer, _ = np.argwhere(weights < 0)[0]
        return f"negative weight at token {token}, layer {layer}"
    sums = weights.sum(axis=2, dtype=np.float64)
    off = np.abs(sums - 1.0) > _WEIGHT_SUM_TOLERANCE
    if off.any():
        token, layer = np.argwhere(off)[0]
        return f"weights at token {token}, layer {layer} sum to {sums[token, layer]:.6g}, not 1"
    return None


def _repeated_within_row(experts: np.ndarray) -> tuple[int, int] | None:
    """The first (token, layer) whose row repeats an id, or None.

    Comparing each pair of columns is much cheaper than sorting rows when top_k is small.
    """
    top_k = experts.shape[2]
    if top_k > 16:
        ordered = np.sort(experts, axis=2)
        repeated = (ordered[:, :, 1:] == ordered[:, :, :-1]).any(axis=2)
    else:
        repeated = np.zeros(experts.shape[:2], dtype=bool)
        for i in range(top_k):
            for j in range(i + 1, top_k):
                repeated |= experts[:, :, i] == experts[:, :, j]
    if not repeated.any():
        return None
    token, layer = np.argwhere(repeated)[0]
    return int(token), int(layer)


@dataclass(frozen=True, eq=False)
class Trace:
    """A routing trace: per token, per MoE layer, the chosen experts and their weights.

    Construction validates the arrays (see the module docstring) and raises ``TraceError``
    on the first problem.

    Attributes:
        experts: int32 ``[tokens, n_moe_layers, top_k]`` expert ids, distinct within a row.
        weights: float32, same shape; finite, non-negative, each row summing to 1.
        n_experts: routed experts per layer in the model the trace was made for.
        preset: how the trace was made (a ``tools.make_trace`` preset, or ``"recorded"``).
        source: where it came from (a path), for error messages; empty if made in memory.
    """

    experts: npt.NDArray[np.int32]
    weights: npt.NDArray[np.float32]
    n_experts: int
    preset: str
    source: str = ""

    def __post_init__(self) -> None:
        problem = _problem(self.experts, self.weights, self.n_experts)
        if problem is not None:
            raise TraceError(self._say(problem))

    def _say(self, problem: str) -> str:
        return f"{self.source}: {problem}" if self.source else f"trace: {problem}"

    @property
    def n_tokens(self) -> int:
        """Tokens in the trace."""
        return int(self.experts.shape[0])

    @property
    def n_layers(self) -> int:
        """MoE layers per token."""
        return int(self.experts.shape[1])

    @property
    def top_k(self) -> int:
        """Experts chosen per token per layer."""
        return int(self.experts.shape[2])

    def check_fits(self, n_layers: int, n_experts: int, top_k: int) -> None:
        """Refuse a trace that asks for more than the model has.

        A trace with fewer layers than the model is accepted (it drives the first layers);
        one with more layers, a larger expert count, an expert id the model lacks, or a
        different ``top_k`` is not.

        Args:
            n_layers: MoE layers in the model.
            n_experts: routed experts per layer in the model.
            top_k: experts the model's router picks per token.

        Raises:
            TraceError: one line naming the mismatch.
        """
        if self.n_layers > n_layers:
            raise TraceError(
                self._say(f"trace has {self.n_layers} MoE layers, the model has {n_layers}")
            )
        max_id = int(self.experts.max())
        if self.n_experts > n_experts or max_id >= n_experts:
            raise TraceError(
                self._say(
                    f"trace is for {self.n_experts} experts per layer (largest id {max_id}), "
                    f"the model has {n_experts}"
                )
            )
        if self.top_k != top_k:
            raise TraceError(
                self._say(f"trace picks top-{self.top_k}, the model routes top-{top_k}")
            )


class TraceRecorder:
    """The routing a run uses, row by row, for ``--record-trace``.

    Its arrays are made for the whole run at once (pages are committed only as rows are
    written), so a run that would record more than ``MAX_TRACE_ENTRIES`` is refused before
    it starts, not after hours of decoding; recording costs 8 bytes per entry.

    Args:
        tokens: tokens the run will decode.
        n_layers: MoE layers per token.
        top_k: experts chosen per token per layer.
        n_experts: routed experts per layer.

    Raises:
        TraceError: the run's trace would hold more than ``MAX_TRACE_ENTRIES`` entries.
    """

    def __init__(self, tokens: int, n_layers: int, top_k: int, n_experts: int) -> None:
        entries = tokens * n_layers * top_k
        if entries > MAX_TRACE_ENTRIES:
            most = MAX_TRACE_ENTRIES // (n_layers * top_k)
            raise TraceError(
                f"--record-trace: {tokens} tokens x {n_layers} MoE layers x top-{top_k} is "
                f"{entries} entries, more than the {MAX_TRACE_ENTRIES} a trace holds; record "
                f"at most {most} tokens"
            )
        self.n_experts = n_experts
        self.tokens = 0
        self._experts = np.zeros((tokens, n_layers, top_k), dtype=np.int32)
        self._weights = np.zeros((tokens, n_layers, top_k), dtype=np.float32)

    def add(self, experts: list[list[int]], weights: list[list[float]]) -> None:
        """Record the next token's experts and weights, one list per MoE layer."""
        self._experts[self.tokens] = experts
        self._weights[self.tokens] = weights
        self.tokens += 1

    def trace(self) -> Trace | None:
        """The tokens recorded so far, or None before the first."""
        if not self.tokens:
            return None
        return Trace(self._experts[: self.tokens], self._weights[: self.tokens],
                     self.n_experts, "recorded")


def save_trace(trace: Trace, path: str | os.PathLike[str]) -> None:
    """Write ``trace`` atomically: JSON lines if ``path`` ends in ``.jsonl``, else ``.npz``.

    The file appears under its name only once complete (temporary file, fsync, rename), so
    a reader never sees half a trace.

    Args:
        trace: the trace to write.
        path: the destination; its parent directory must exist.
    """
    target = Path(path)
    with atomic_output(target) as out:
        if target.suffix == ".jsonl":
            for line in _jsonl_lines(trace):
                out.write(line.encode("utf-8"))
        else:
            np.savez(
                out,
                format=np.array(TRACE_FORMAT),
                version=np.array(TRACE_VERSION, dtype=np.int64),
                n_experts=np.array(trace.n_experts, dtype=np.int64),
                preset=np.array(trace.preset),
                experts=trace.experts,
                weights=trace.weights,
            )


def _jsonl_lines(trace: Trace) -> Iterator[str]:
    header = {
        "format": TRACE_FORMAT,
        "version": TRACE_VERSION,
        "n_layers": trace.n_layers,
        "n_experts": trace.n_experts,
        "top_k": trace.top_k,
        "preset": trace.preset,
    }
    yield json.dumps(header) + "\n"
    for token in range(trace.n_tokens):
        # float32 -> Python float is exact, and json writes the shortest repr that reads
        # back to the same double, so a round trip restores the float32 bits.
        row = {
            "token": token,
            "experts": trace.experts[token].tolist(),
            "weights": trace.weights[token].tolist(),
        }
        yield json.dumps(row, separators=(",", ":")) + "\n"


def load_trace(path: str | os.PathLike[str]) -> Trace:
    """Read and validate a trace written by ``save_trace`` (or recorded in either form).

    The form is told by the file's first bytes, not its name.

    Args:
        path: an ``.npz`` archive or a JSON-lines file.

    Returns:
        The validated trace, with ``source`` set to ``path``.

    Raises:
        TraceError: the file is missing, unreadable, truncated or malformed; the message
            names the path and the first problem found.
    """
    source = str(path)
    try:
        with open_input(path) as probe:  # a FIFO or a device is refused, never waited on
            head = probe.read(64)
    except OSError as exc:
        raise TraceError(f"{source}: cannot read trace: {exc.strerror or exc}") from exc
    if head.startswith(_NPZ_MAGIC):
        experts, weights, n_experts, preset = read_npz(path, source, MAX_TRACE_ENTRIES)
    elif head.lstrip().startswith((b"{", b"[")):
        experts, weights, n_experts, preset = read_jsonl(path, source, MAX_TRACE_ENTRIES)
    else:
        raise TraceError(f"{source}: neither an .npz archive nor a JSON-lines trace")
    return Trace(experts, weights, n_experts, preset, source=source)
