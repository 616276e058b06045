"""The synthetic routing presets: each one's shape and locality parameters.

Kept apart from the generator (``moestream.pipeline.proxy.synthetic``) because these are the
calibrated figures, fitted by search to the published measurements
(``moestream.pipeline.proxy.calibrate``), while the generator is the model they parameterise;
the one changes when a new measurement comes, the other when the model does.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PRESETS", "TracePreset"]


@dataclass(frozen=True, slots=True)
class TracePreset:
    """The shape and locality parameters of one synthetic routing preset.

    Attributes:
        name: the CLI name.
        description: what the preset imitates, one line.
        n_layers: MoE layers.
        n_experts: routed experts per layer.
        top_k: experts chosen per token per layer.
        skew: popularity exponent over expert quantiles (0: all arcs equal).
        floor: popularity quantile offset; smaller makes the hottest experts hotter.
        speed_per_k: how far the context moves per token, in experts per ``top_k``.
        window_per_k: Weibull scale of a choice's distance behind the context, likewise.
        window_shape: Weibull shape; below 1 is a sharp peak with a long tail.
        global_share: chance a candidate ignores the context (anywhere on the ring).
        gain_spread: per-layer window gains span ``[1 - spread, 1 + spread]``.
        switch: chance per token of switching between the two streams.
        hash_layers: leading layers routed by a hash of the token id.
    """

    name: str
    description: str
    n_layers: int
    n_experts: int
    top_k: int
    skew: float = 0.0
    floor: float = 1.0
    speed_per_k: float = 0.0
    window_per_k: float = 1.0
    window_shape: float = 1.0
    global_share: float = 1.0
    gain_spread: float = 0.0
    switch: float = 0.0
    hash_layers: int = 0


PRESETS: dict[str, TracePreset] = {
    preset.name: preset
    for preset in (
        TracePreset(
            name="qwen3.5-35b-a3b",
            description="Qwen3.5-35B-A3B decode: 48 layers, 256 experts, top-8",
            n_layers=48,
            n_experts=256,
            top_k=8,
            skew=1.4,
            floor=1.3,
            speed_per_k=0.12,
            window_per_k=1.12,
            window_shape=4.6,
            global_share=0.028,
            gain_spread=0.85,
            switch=0.55,
        ),
        TracePreset(
            name="ds4-flash",
            description="DeepSeek V4 Flash decode: 43 layers (3 hash-routed), 256 experts, top-6",
            n_layers=43,
            n_experts=256,
            top_k=6,
            skew=0.1,
            floor=0.18,
            speed_per_k=0.046,
            window_per_k=0.135,
            window_shape=1.0,
            global_share=0.25,
            gain_spread=0.95,
            switch=0.175,
            hash_layers=3,
        ),
        TracePreset(
            name="uniform",
            description="independent uniform choices (no locality), for comparison",
            n_layers=43,
            n_experts=256,
            top_k=6,
        ),
    )
}
"""The presets by CLI name. ``uniform`` has every candidate anywhere on equal arcs."""
