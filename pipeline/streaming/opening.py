"""Opening a session: the cache budget's check, the ``run_start`` header, and what
``run_end`` says when the open failed. Pure helpers: the session opens the parts itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

from moestream.gpu.backend import Backend
from moestream.gpu.cache.store import DeviceCache
from moestream.pipeline.foundation.config import ComputeSpec, StreamConfig
from moestream.pipeline.foundation.errors import MoestreamError, UsageError
from moestream.pipeline.foundation.table import ExpertTable
from moestream.stages.layout import plan_expert

__all__ = ["open_outcome", "plan_budget", "run_start"]


def plan_budget(config: StreamConfig, table: ExpertTable, layers_in_flight: int,
                devices: int) -> tuple[dict[int, int], int, int]:
    """Each MoE layer's expert bytes on a device, the cache budget (``config.budget``,
    default: every routed expert) and the least each device's cache must hold
    (``layers_in_flight`` layers' top-k experts).

    Raises:
        UsageError: the budget cannot hold that on every device.
    """
    layers = table.moe_layers
    device_sizes = {n: plan_expert(table.slices((n, 0))).device_bytes for n in layers}
    if config.budget is not None:
        budget = config.budget.resolve(max(device_sizes.values()))
    else:  # default: every routed expert
        budget = sum(size * table.layers[n].n_experts for n, size in device_sizes.items())
    min_bytes = layers_in_flight * table.top_k * max(device_sizes.values())
    _check_budget(config, table, layers_in_flight, devices, budget, min_bytes,
                  max(device_sizes.values()))
    return device_sizes, budget, min_bytes


def _check_budget(config: StreamConfig, table: ExpertTable, layers_in_flight: int,
                  devices: int, budget: int, min_bytes: int, expert_bytes: int) -> None:
    """Refuse a budget that cannot pin ``layers_in_flight`` layers' top-k experts on
    every device, in the caller's terms (experts and bytes)."""
    if budget >= min_bytes * devices:
        return
    experts = min_bytes // expert_bytes * devices
    given = config.budget
    asked = (f"{_count(given.experts, 'expert')} ({_count(budget, 'byte')})"
             if given is not None and given.experts is not None
             else _count(budget, "byte"))
    in_flight = (f"each of the {layers_in_flight} layers in flight"
                 if layers_in_flight > 1 else "the one layer in flight")
    raise UsageError(
        f"cache budget of {asked} cannot hold one layer's "
        f"top-{_count(table.top_k, 'expert')} for {in_flight}"
        + (f" on each of {devices} devices" if devices > 1 else "")
        + f" ({_count(experts, 'expert')}, {_count(min_bytes * devices, 'byte')}; it holds "
        f"{_count(budget // expert_bytes, 'expert')} of {_count(expert_bytes, 'byte')} each): "
        f"give a budget of at least {_count(experts, 'expert')}")


def run_start(config: StreamConfig, compute: ComputeSpec | None, table: ExpertTable,
              device_sizes: dict[int, int], machine: dict[str, object], budget_bytes: int,
              backends: Sequence[Backend], caches: Sequence[DeviceCache],
              details: Mapping[str, Any]) -> dict[str, Any]:
    """The ``run_start`` header's fields; ``compute`` None: an engine's own decode.

    ``config`` is described whole (a client's config that extends the library's names its
    own settings too); ``details`` are the client's fields beside it (a proxy run's
    ``limits``)."""
    described = str(compute) if compute is not None else "engine"
    settings = config.describe()
    return dict(
        config=settings if compute is not None else {**settings, "compute": described},
        model={**table.summary(),
               "expert_bytes": [device_sizes[n] for n in table.moe_layers]},
        machine=machine,
        budget_bytes=budget_bytes,
        devices=[{"device": b.device, "name": b.device_name, "budget_bytes": c.budget_bytes}
                 for b, c in zip(backends, caches, strict=True)],
        policy=config.policy,
        compute=described,
        backend=backends[0].name,
        **details,
    )


def open_outcome(exc: BaseException) -> str:
    """``run_end``'s ``exit`` for what stopped the open: a cancel, or the error's words."""
    if isinstance(exc, asyncio.CancelledError):
        return "cancelled"
    if isinstance(exc, MoestreamError):
        return str(exc)
    return f"failed to open: {type(exc).__name__}"


def _count(n: int, noun: str) -> str:
    """``n`` and ``noun``, plural unless ``n`` is one (``1 expert``, ``48 experts``)."""
    return f"{n} {noun}{'' if n == 1 else 's'}"
