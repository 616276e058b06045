"""Which device owns each (layer, expert): the sharding of the expert cache across GPUs.

Each device caches, uploads and computes only the experts placed on it, so a placement
decides how the devices' memory and PCIe links add up. ``balanced_placement`` spreads every
layer's experts over the devices in proportion to their weights (their memory), counting
bytes, so a layer's load and a device's share of the model both follow the weights.
Anything mapping a key to a device index can stand in for it (``Placement``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from moestream.gpu.cache.policy import ExpertKey
from moestream.pipeline.foundation.errors import UsageError

__all__ = ["Placement", "balanced_placement", "split_budget"]

Placement = Callable[[ExpertKey], int]
"""(layer, expert) -> index into the run's devices."""


def balanced_placement(
    layers: Mapping[int, tuple[int, int]], weights: Sequence[float]
) -> Placement:
    """Place each layer's experts greedily on the device furthest below its share of bytes.

    Args:
        layers: layer -> (experts, bytes per expert).
        weights: one positive weight per device (e.g. its memory).

    Within a layer, consecutive experts alternate between devices of equal weight, and the
    starting device rotates with the layer, so hot low-numbered experts do not all land on
    one device.

    Raises:
        UsageError: no devices, or a weight that is not positive.
    """
    if not weights or any(w <= 0 for w in weights):
        raise UsageError(f"device weights must be positive, got {list(weights)}")
    n = len(weights)
    table: dict[ExpertKey, int] = {}
    placed = [0.0] * n
    for i, (layer, (experts, nbytes)) in enumerate(sorted(layers.items())):
        for e in range(experts):
            # least loaded relative to weight; ties go to the device the rotation favours
            device = min(range(n), key=lambda d: (placed[d] / weights[d], (d - i - e) % n))
            placed[device] += nbytes
            table[(layer, e)] = device

    def place(key: ExpertKey) -> int:
        return table[key]

    return place


def split_budget(total: int, weights: Sequence[float]) -> list[int]:
    """``total`` bytes split in proportion to ``weights`` (rounding down; never above)."""
    whole = sum(weights)
    return [int(total * w / whole) for w in weights]
