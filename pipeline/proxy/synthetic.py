"""Synthetic routing traces whose cache behaviour matches published measurements.

Why: a cache, a prefetcher and a budget are only as well tested as the routing that drives
them. Uniformly random experts make every cache look useless; a fixed hot set makes every
cache look perfect. Real routers sit in between, and the few public measurements of that
middle (``tests/data/routing_locality.json``: per-layer LRU hit rates on Qwen3.5-35B-A3B,
ds4's shared-budget and 100 GB hit rates on DeepSeek V4 Flash, consecutive-token overlap)
are what the presets (``moestream.pipeline.proxy.routing_presets``) are calibrated to
(``moestream.pipeline.proxy.calibrate`` measures them; ``python -m tools.make_trace --check``
prints the table). ``moestream.pipeline.cli.run`` routes with ``synthetic_blocks`` when no
recorded trace is given.

The generative model, per MoE layer:

- **A ring of experts.** Each layer lays its experts on a ring in random order, each taking
  an arc proportional to its popularity, ``(q + floor) ** -skew`` at popularity quantile
  ``q`` (plus one unit, so none is unreachable). The ring stands for the router's geometry:
  neighbouring experts serve neighbouring contexts.
- **A moving context.** The text's position on the ring moves forward ``speed`` experts per
  token. A choice lands a random distance behind that position (Weibull, scale ``window``
  experts, shape ``window_shape``: 1 is exponential, larger clusters the choices about
  ``window`` behind), or, with probability ``global_share``, anywhere on the ring. Experts
  just behind the position are hot (small LRUs hit), those passed a while ago are warm
  (mid-sized LRUs hit), those ahead are new: so hit rates climb with the cache size, then
  flatten, and a long session has touched everything once and then only reuses (the
  100 GB case climbing toward 0.96-0.98).
- **Two interleaved streams.** Tokens alternate between two positions (think content and
  function words), switching with probability ``switch`` per token. This keeps
  consecutive-token overlap as low as measured (0.08-0.34) while tokens two or three apart
  still share experts, which is what a 16-expert LRU's 49% needs.
- **Layers differ.** Each layer's window is divided by a gain, spread evenly over
  ``[1 - gain_spread, 1 + gain_spread]`` and shuffled across layers, so overlap varies by
  layer as published.
- **Hash-routed layers.** DeepSeek V4 routes its first 3 layers by a hash of the token id;
  the ``ds4-flash`` preset does too: token ids follow a Zipf law over a vocabulary, and a
  fixed random table maps each id to ``top_k`` experts.
- **Distinct choices.** Each (token, layer) draws ``4 * top_k`` candidates, then ``top_k``
  distinct fallback experts, and keeps the first ``top_k`` distinct ones.
- **Weights.** Flat Dirichlet rows (normalised exponentials).

Calibration (``pipeline.proxy.calibrate``, ``tools.make_trace --check``): the Qwen curve is matched
over a 128-token decode and the ds4 shared budget and 100 GB short bench over ~220 tokens.
Lengths matter: the Qwen curve goes flat from 64 to 128 experts (68% -> 71%) while 29% still
miss, which only first-use misses of a short run explain, and a 220-token run that touches
almost every expert of each layer misses at least 256 / (220 * 6) = 19% even with everything
cached, hence ds4's 0.81. The presets' parameters were fitted to these figures by search over
this model; they hold within about 3 points across seeds.

Sizes are in units of ``top_k`` (``speed_per_k``, ``window_per_k``) so that a trace reshaped
to a small model (say 4 layers x 32 experts x top-4) keeps the preset's character; hash
layers scale with the layer count. Everything is vectorised over blocks of 1024 tokens (no
per-token Python loop): 100,000 tokens x 43 layers x top-6 take a few seconds. The expert
choices come from one generator seeded by ``seed``, the weights from a second stream spawned
from the same seed, both drawn per fixed-size block: a trace is deterministic and a shorter
trace is a prefix of a longer one. ``synthetic_blocks`` yields the blocks one at a time, so
``moestream.pipeline.cli.run`` routes any number of tokens in the memory of a few blocks.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TypeAlias

import numpy as np
import numpy.typing as npt

from moestream.pipeline.foundation.errors import UsageError
from moestream.pipeline.foundation.trace import MAX_TRACE_ENTRIES, Trace
from moestream.pipeline.proxy.routing_presets import PRESETS, TracePreset

__all__ = ["BLOCK_TOKENS", "PRESETS", "TracePreset", "synthetic_blocks", "synthetic_trace"]

IntArray: TypeAlias = npt.NDArray[np.int32]
FloatArray: TypeAlias = npt.NDArray[np.float32]

BLOCK_TOKENS = 1024
"""Tokens generated per block; fixed so that traces are prefixes of longer ones."""

_RING_UNITS_PER_EXPERT = 64
"""Ring resolution: an expert of average popularity spans this many units."""

_SOURCE_LEVELS = 1 << 12
"""Resolution of the per-layer table that turns one uniform draw into a ring offset."""

_HASH_VOCAB = 8192
"""Vocabulary size of the token-id process behind hash-routed layers."""

_HASH_VOCAB_SKEW = 1.0
"""Zipf exponent of token ids (natural text is close to 1)."""

_CANDIDATES_PER_K = 4
"""Candidates drawn per choice before the fallback; enough that the fallback is rare."""


def synthetic_trace(
    preset: str,
    n_tokens: int,
    *,
    seed: int = 0,
    n_layers: int | None = None,
    n_experts: int | None = None,
    top_k: int | None = None,
) -> Trace:
    """Generate a routing trace from a preset, optionally reshaped to a model.

    Args:
        preset: a key of ``PRESETS``.
        n_tokens: tokens to generate.
        seed: the random seed; equal arguments give equal traces.
        n_layers: MoE layers, if not the preset's.
        n_experts: routed experts per layer, if not the preset's.
        top_k: experts per token per layer, if not the preset's.

    Returns:
        The trace; its ``preset`` is the preset name.

    Raises:
        UsageError: unknown preset, an impossible shape, or more than ``MAX_TRACE_ENTRIES``
            entries (the memory of a trace grows with it: ``synthetic_blocks`` does not).
    """
    generator = _generator(preset, seed, n_layers, n_experts, top_k)
    if n_tokens <= 0:
        raise UsageError(f"tokens must be positive, got {n_tokens}")
    entries = n_tokens * generator.n_layers * generator.top_k
    if entries > MAX_TRACE_ENTRIES:
        raise UsageError(f"{n_tokens} tokens x {generator.n_layers} layers x "
                         f"top-{generator.top_k} is {entries} entries, more than the "
                         f"{MAX_TRACE_ENTRIES} a trace holds")
    made = generator.blocks()
    blocks = [next(made) for _ in range(-(-n_tokens // BLOCK_TOKENS))]
    ids = np.concatenate([b[0] for b in blocks])[:n_tokens]
    weights = np.concatenate([b[1] for b in blocks])[:n_tokens]
    return Trace(ids, weights, generator.n_experts, preset)


def synthetic_blocks(
    preset: str,
    *,
    seed: int = 0,
    n_layers: int | None = None,
    n_experts: int | None = None,
    top_k: int | None = None,
) -> Iterator[tuple[IntArray, FloatArray]]:
    """The routing ``synthetic_trace`` makes, as an endless run of ``BLOCK_TOKENS`` blocks.

    Block ``b`` holds tokens ``b * BLOCK_TOKENS`` onwards, exactly the rows
    ``synthetic_trace`` gives them for the same arguments; only the blocks asked for are
    ever made, so memory does not grow with the number of tokens.

    Args:
        preset, seed, n_layers, n_experts, top_k: as for ``synthetic_trace``.

    Returns:
        An iterator of ``(experts, weights)``: int32 and float32 arrays of shape
        ``[BLOCK_TOKENS, layers, top_k]``.

    Raises:
        UsageError: unknown preset or an impossible shape (at the call, not at the first
            block).
    """
    return _generator(preset, seed, n_layers, n_experts, top_k).blocks()


def _generator(
    preset: str, seed: int, n_layers: int | None, n_experts: int | None, top_k: int | None
) -> _Generator:
    """The generator of a preset reshaped to a model, after checking the arguments."""
    spec = PRESETS.get(preset)
    if spec is None:
        raise UsageError(f"unknown trace preset {preset!r} (known: {', '.join(PRESETS)})")
    layers = spec.n_layers if n_layers is None else n_layers
    experts = spec.n_experts if n_experts is None else n_experts
    k = spec.top_k if top_k is None else top_k
    for name, value in (("layers", layers), ("experts", experts)):
        if value <= 0:
            raise UsageError(f"{name} must be positive, got {value}")
    if not 0 < k <= experts:
        raise UsageError(f"top-k must be in [1, experts={experts}], got {k}")
    if seed < 0:
        raise UsageError(f"seed must be >= 0, got {seed}")
    return _Generator(spec, layers, experts, k, seed)


class _Generator:
    """One trace's generation: per-layer ring tables, stream state and the random stream."""

    def __init__(
        self, spec: TracePreset, n_layers: int, n_experts: int, top_k: int, seed: int
    ) -> None:
        self.n_layers = n_layers
        self.n_experts = n_experts
        self.top_k = top_k
        self.switch = spec.switch
        self.rng = np.random.default_rng(seed)
        # The weights draw from their own stream, so that a block's weights need nothing
        # from later blocks and the expert choices are those of the choices-only stream.
        self.weight_rng = np.random.default_rng(np.random.SeedSequence(seed).spawn(1)[0])
        rng = self.rng
        if n_layers == spec.n_layers:
            self.n_hash = spec.hash_layers
        else:
            self.n_hash = min(n_layers, round(spec.hash_layers * n_layers / spec.n_layers))
        self.n_routed = n_layers - self.n_hash
        self.ring_units = n_experts * _RING_UNITS_PER_EXPERT
        self.speed_units = spec.speed_per_k * top_k * _RING_UNITS_PER_EXPERT
        # Evenly spread gains, shuffled over layers: the spread of per-layer locality is
        # then the same for every seed, not at the mercy of the extreme draws.
        gains = rng.permutation(
            np.linspace(1.0 - spec.gain_spread, 1.0 + spec.gain_spread, self.n_routed)
        )
        self.ring = np.stack([self._ring_table(spec) for _ in range(self.n_routed)])
        self.offsets = np.stack([self._offset_table(spec, float(gain)) for gain in gains])
        # The two streams sit half a ring apart, so how much they share is set by the
        # window, not by where two random phases happened to fall.
        start = rng.uniform(0.0, self.ring_units, size=self.n_routed)
        self.phase = np.stack([start, start + self.ring_units / 2])
        self.stream = 0
        self.token = 0
        if self.n_hash:
            points = (np.arange(_HASH_VOCAB * 4) + 0.5) / (_HASH_VOCAB * 4)
            vocab_weights = _zipf_weights(_HASH_VOCAB, _HASH_VOCAB_SKEW, 0.0)
            self.vocab = rng.permutation(_HASH_VOCAB)[_inverse_cdf(vocab_weights, points)]
            # Each token id gets top_k experts running from a random start along a random
            # order of the layer's experts: distinct by construction, and two ids share
            # k * k / n_experts experts on average, as two random k-subsets would.
            first = rng.integers(0, n_experts, size=(self.n_hash, _HASH_VOCAB, 1))
            runs = (first + np.arange(top_k)) % n_experts
            orders = np.argsort(rng.random((self.n_hash, n_experts)), axis=1)
            self.hash_table: IntArray = np.take_along_axis(orders[:, None, :], runs, axis=2).astype(
                np.int32
            )

    def _ring_table(self, spec: TracePreset) -> IntArray:
        """Ring unit -> expert: experts in random order, arcs by popularity (>= 1 unit)."""
        order = self.rng.permutation(self.n_experts)
        popularity = _zipf_weights(self.n_experts, spec.skew, spec.floor)
        arcs = popularity[self.rng.permutation(self.n_experts)]
        spare = self.ring_units - self.n_experts
        ends = np.round(np.cumsum(arcs) / arcs.sum() * spare).astype(np.int64)
        ends += np.arange(1, self.n_experts + 1)
        slots = np.searchsorted(ends, np.arange(self.ring_units), side="right")
        return order[slots].astype(np.int32)

    def _offset_table(self, spec: TracePreset, gain: float) -> IntArray:
        """Uniform level -> distance behind the context, in ring units.

        The first ``global_share`` of the levels spread over the whole ring; the rest follow
        the Weibull quantile function, so one integer draw and one lookup give a distance.
        """
        level = (np.arange(_SOURCE_LEVELS) + 0.5) / _SOURCE_LEVELS
        share = spec.global_share
        scale = spec.window_per_k * self.top_k * _RING_UNITS_PER_EXPERT / max(gain, 1e-3)
        tail = np.clip((level - share) / max(1.0 - share, 1e-12), 0.0, 1.0 - 1e-12)
        distance = scale * (-np.log1p(-tail)) ** (1.0 / spec.window_shape)
        anywhere = level / max(share, 1e-12) * self.ring_units
        offset = np.where(level < share, anywhere, distance)
        return (np.floor(offset) % self.ring_units).astype(np.int32)

    def blocks(self) -> Iterator[tuple[IntArray, FloatArray]]:
        """Endless blocks of ``BLOCK_TOKENS`` tokens, each made only when asked for."""
        while True:
            ids = np.empty((BLOCK_TOKENS, self.n_layers, self.top_k), dtype=np.int32)
            if self.n_hash:
                ids[:, : self.n_hash] = self._hash_block()
            if self.n_routed:
                ids[:, self.n_hash :] = self._routed_block()
            weights = self.weight_rng.standard_exponential(ids.shape, dtype=np.float32)
            weights += np.float32(1e-6)  # every weight, and so every row sum, stays positive
            weights /= weights.sum(axis=2, keepdims=True)
            yield ids, weights

    def _hash_block(self) -> IntArray:
        token_ids = self.vocab[self.rng.integers(0, self.vocab.size, size=BLOCK_TOKENS)]
        block: IntArray = self.hash_table[:, token_ids].transpose(1, 0, 2)
        return block

    def _fronts(self) -> npt.NDArray[np.int64]:
        """The context's ring position for each token of the block and routed layer."""
        flips = self.rng.random(BLOCK_TOKENS) < self.switch
        stream = (self.stream + np.cumsum(flips)) % 2
        self.stream = int(stream[-1])
        steps = (self.token + np.arange(BLOCK_TOKENS)) * self.speed_units % self.ring_units
        self.token += BLOCK_TOKENS
        fronts = self.phase[stream] + steps[:, None]
        wrapped: npt.NDArray[np.int64] = np.floor(fronts).astype(np.int64) % self.ring_units
        return wrapped

    def _routed_block(self) -> IntArray:
        """One block of the routed layers' choices: candidates, then the first distinct."""
        tokens, layers, k = BLOCK_TOKENS, self.n_routed, self.top_k
        m = _CANDIDATES_PER_K * k
        levels = self.rng.integers(0, _SOURCE_LEVELS, size=(tokens, layers, m), dtype=np.int32)
        levels += (np.arange(layers, dtype=np.int32) * _SOURCE_LEVELS)[:, None]
        position = self._fronts().astype(np.int32)[:, :, None] - np.take(self.offsets, levels)
        position %= self.ring_units
        position += (np.arange(layers, dtype=np.int32) * self.ring_units)[:, None]
        cand = np.empty((tokens, layers, m + k), dtype=np.int32)
        np.take(self.ring, position, out=cand[:, :, :m])
        # Fallback: k distinct experts, so every row surely holds k distinct candidates.
        start = self.rng.integers(0, self.n_experts, size=(tokens, layers, 1), dtype=np.int32)
        np.remainder(start + np.arange(k, dtype=np.int32), self.n_experts, out=cand[:, :, m:])
        return _first_distinct(cand.reshape(tokens * layers, m + k), k).reshape(tokens, layers, k)


def _zipf_weights(n: int, skew: float, floor: float) -> npt.NDArray[np.float64]:
    """``n`` weights ``(q + floor) ** -skew`` at quantiles ``q = (i + 0.5) / n``, summing to 1."""
    quantile = (np.arange(n) + 0.5) / n
    weights = (quantile + floor) ** -skew
    normalised: npt.NDArray[np.float64] = weights / weights.sum()
    return normalised


def _inverse_cdf(
    weights: npt.NDArray[np.float64], points: npt.NDArray[np.float64]
) -> npt.NDArray[np.intp]:
    """The index whose cumulative weight first exceeds each of ``points`` (in [0, 1))."""
    cdf = np.cumsum(weights)
    cdf /= cdf[-1]
    found: npt.NDArray[np.intp] = np.minimum(
        np.searchsorted(cdf, points, side="right"), weights.size - 1
    )
    return found


def _first_distinct(cand: IntArray, k: int) -> IntArray:
    """Per row, the first ``k`` distinct values in order (each row must hold ``k``).

    Sorting ``value * width + position`` groups equal values with their first occurrence
    leading; the repeats are marked there and scattered back to their positions.
    """
    rows, width = cand.shape
    keys = cand * np.int32(width) + np.arange(width, dtype=np.int32)
    keys.sort(axis=1)
    values = keys // width
    repeated_sorted = np.zeros((rows, width), dtype=bool)
    np.equal(values[:, 1:], values[:, :-1], out=repeated_sorted[:, 1:])
    flat = keys - values * width
    flat += (np.arange(rows, dtype=np.int32) * width)[:, None]
    repeated = np.empty(rows * width, dtype=bool)
    repeated[flat.ravel()] = repeated_sorted.ravel()
    keep = ~repeated.reshape(rows, width)
    keep &= np.cumsum(keep, axis=1, dtype=np.int16) <= k
    chosen: IntArray = cand[keep].reshape(rows, k)
    return chosen
