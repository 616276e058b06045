"""Routing traces: which experts each token picks in each MoE layer, on disk and in memory.

The pipeline is driven by a router's choices, not by a model's arithmetic: replaying a trace
tells the cache, prefetcher and upload stages exactly what a decode would ask for, so a run
is repeatable and can be compared across budgets and modes. A trace is either recorded from
a real router or made by ``tools.make_trace``.

Two on-disk forms, chosen by the file name when saving and by the file's first bytes when
loading:

- ``.npz`` (``np.savez``): arrays ``experts`` (int32 ``[tokens, layers, top_k]``),
  ``weights`` (float32, same shape), and 0-d ``format``, ``version``, ``n_experts``,
  ``preset``. Loaded with ``allow_pickle=False``: an archive holding object arrays is
  refused rather than unpickled.
- ``.jsonl``: a header object ``{"format": "moestream-trace", "version": 1, "n_layers",
  "n_experts", "top_k", "preset"}`` on the first line, then one object per token
  ``{"token": i, "experts": [[...], ...], "weights": [[...], ...]}``. Parsed with ``json``
  only, never ``eval``.

Every way a file can be wrong (bad header, ids out of range, a repeated id within one
token's layer, ragged or mismatched shapes, non-finite or negative weights, a truncated file)
becomes a ``TraceError`` naming the file and the problem on one line.
"""

from __future__ import annotations

import json
import os
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from pipeline.errors import TraceError
from pipeline.outputs import atomic_output

__all__ = ["TRACE_FORMAT", "TRACE_VERSION", "Trace", "load_trace", "save_trace"]

TRACE_FORMAT = "moestream-trace"
"""The ``format`` value both file forms carry."""

TRACE_VERSION = 1
"""The only format version this module reads and writes."""

_WEIGHT_SUM_TOLERANCE = 1e-3
"""How far a row of weights may sum from 1 (float32 rounding, text round trips)."""

_NPZ_MAGIC = b"PK"


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
        with open(path, "rb") as probe:
            head = probe.read(64)
    except OSError as exc:
        raise TraceError(f"{source}: cannot read trace: {exc.strerror or exc}") from exc
    if head.startswith(_NPZ_MAGIC):
        experts, weights, n_experts, preset = _read_npz(path, source)
    elif head.lstrip().startswith((b"{", b"[")):
        experts, weights, n_experts, preset = _read_jsonl(path, source)
    else:
        raise TraceError(f"{source}: neither an .npz archive nor a JSON-lines trace")
    return Trace(experts, weights, n_experts, preset, source=source)


_Arrays = tuple[npt.NDArray[np.int32], npt.NDArray[np.float32], int, str]


def _as_ids(values: Any, source: str) -> npt.NDArray[np.int32]:
    """Expert ids as int32, refusing non-integers and values int32 cannot hold."""
    array = np.asarray(values)
    if array.dtype.kind not in "iu":
        raise TraceError(f"{source}: expert ids must be integers, got {array.dtype}")
    if array.size and (
        array.min() < np.iinfo(np.int32).min or array.max() > np.iinfo(np.int32).max
    ):
        raise TraceError(f"{source}: expert id {array.max()} does not fit in int32")
    return array.astype(np.int32)


def _as_weights(values: Any, source: str) -> npt.NDArray[np.float32]:
    array = np.asarray(values)
    if array.dtype.kind not in "fiu":
        raise TraceError(f"{source}: weights must be numbers, got {array.dtype}")
    return array.astype(np.float32)


def _scalar(archive: Any, name: str, kind: str, source: str) -> Any:
    if name not in archive.files:
        raise TraceError(f"{source}: archive lacks '{name}'")
    value = archive[name]
    if value.shape != () or value.dtype.kind not in kind:
        raise TraceError(f"{source}: '{name}' must be a scalar of kind {kind!r}")
    return value.item()


def _read_npz(path: str | os.PathLike[str], source: str) -> _Arrays:
    try:
        with np.load(path, allow_pickle=False) as archive:
            fmt = _scalar(archive, "format", "U", source)
            version = _scalar(archive, "version", "iu", source)
            if fmt != TRACE_FORMAT or version != TRACE_VERSION:
                raise TraceError(
                    f"{source}: not a {TRACE_FORMAT} version {TRACE_VERSION} archive "
                    f"(format {fmt!r}, version {version!r})"
                )
            n_experts = int(_scalar(archive, "n_experts", "iu", source))
            preset = str(_scalar(archive, "preset", "U", source))
            for name in ("experts", "weights"):
                if name not in archive.files:
                    raise TraceError(f"{source}: archive lacks '{name}'")
            experts = _as_ids(archive["experts"], source)
            weights = _as_weights(archive["weights"], source)
    except TraceError:
        raise
    except ValueError as exc:
        # np.load raises ValueError for object arrays under allow_pickle=False, and for
        # corrupt array headers.
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise TraceError(f"{source}: unreadable .npz trace: {first}") from exc
    except (OSError, EOFError, zipfile.BadZipFile, KeyError) as exc:
        raise TraceError(f"{source}: truncated or corrupt .npz trace ({exc})") from exc
    return experts, weights, n_experts, preset


def _read_jsonl(path: str | os.PathLike[str], source: str) -> _Arrays:
    experts_rows: list[Any] = []
    weights_rows: list[Any] = []
    try:
        with open(path, encoding="utf-8") as lines:
            header = _header(lines.readline(), source)
            n_layers, top_k = header["n_layers"], header["top_k"]
            for number, line in enumerate(lines, start=2):
                if not line.strip():
                    continue
                token = len(experts_rows)
                row = _json_object(line, f"{source}:{number}")
                if row.get("token") != token:
                    raise TraceError(
                        f"{source}:{number}: expected token {token}, got {row.get('token')!r}"
                    )
                for name in ("experts", "weights"):
                    value: Any = row.get(name)
                    shape = np.shape(value)
                    if shape != (n_layers, top_k):
                        raise TraceError(
                            f"{source}:{number}: '{name}' has shape {shape}, "
                            f"the header says ({n_layers}, {top_k})"
                        )
                experts_rows.append(row["experts"])
                weights_rows.append(row["weights"])
    except UnicodeDecodeError as exc:
        raise TraceError(f"{source}: not UTF-8 text at byte {exc.start}") from exc
    except ValueError as exc:  # np.shape of a ragged list
        raise TraceError(f"{source}: ragged rows ({str(exc).splitlines()[0]})") from exc
    except OSError as exc:
        raise TraceError(f"{source}: cannot read trace: {exc.strerror or exc}") from exc
    if not experts_rows:
        raise TraceError(f"{source}: header but no tokens")
    try:
        experts = _as_ids(experts_rows, source)
    except OverflowError as exc:
        raise TraceError(f"{source}: expert id too large for int32") from exc
    weights = _as_weights(weights_rows, source)
    return experts, weights, header["n_experts"], header["preset"]


def _json_object(line: str, where: str) -> dict[str, Any]:
    try:
        value = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}: not JSON ({exc.msg}); truncated file?") from exc
    if not isinstance(value, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(value).__name__}")
    return value


def _header(line: str, source: str) -> dict[str, Any]:
    if not line.strip():
        raise TraceError(f"{source}: empty file, no trace header")
    header = _json_object(line, f"{source}:1")
    if header.get("format") != TRACE_FORMAT:
        raise TraceError(
            f"{source}: header format is {header.get('format')!r}, not {TRACE_FORMAT!r}"
        )
    if header.get("version") != TRACE_VERSION:
        raise TraceError(
            f"{source}: unsupported trace version {header.get('version')!r} "
            f"(this reader knows {TRACE_VERSION})"
        )
    for name in ("n_layers", "n_experts", "top_k"):
        value = header.get(name)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise TraceError(f"{source}: header '{name}' must be a positive integer, got {value!r}")
    if not isinstance(header.get("preset"), str):
        raise TraceError(f"{source}: header 'preset' must be a string")
    return header
