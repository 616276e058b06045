"""Closing a run: cleanup that a cancellation cannot stop half-way, the device parts
released in their one safe order, their counters kept for the summary, and what to raise
for experts whose digests will never come."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Sequence
from typing import Any

from moestream.gpu.cache.store import DeviceCache
from moestream.pipeline.foundation.errors import (
    ModelChangedError,
    MoestreamError,
    VerificationError,
)
from moestream.pipeline.streaming.streamer import ExpertStreamer
from moestream.pipeline.streaming.summary import RunSummary
from moestream.pipeline.streaming.verify import Verifier
from moestream.stages.run_manifest import RunManifest

__all__ = ["close_devices", "finish", "manifest_failure", "take_last_digests"]


async def finish(work: Coroutine[Any, Any, None]) -> None:
    """Await ``work`` to its end even if cancelled meanwhile, however often, then raise the
    cancellation (``work``'s own error first). ``work`` runs as its own task behind a
    shield, so a cancel never stops it half-way."""
    task = asyncio.ensure_future(work)
    cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            cancelled = True
    task.result()
    if cancelled:
        raise asyncio.CancelledError


async def close_devices(summary: RunSummary, streamers: Sequence[ExpertStreamer],
                        caches: Sequence[DeviceCache]) -> None:
    """Close the streamers (the home device's, which owns the mapping, last), then the
    caches, and put each device's budget, peak, allocations, frees and resident misses'
    path in ``summary`` (``streamers[i]`` serves ``caches[i]``; an open that failed
    partway may have made a device's cache and not its streamer: no path then)."""
    paths = [streamer.registered_path for streamer in streamers]
    for streamer in reversed(streamers):
        await streamer.aclose()
    budgets = []
    for i, cache in enumerate(caches):
        budgets.append(cache.budget_bytes)  # smaller after a device-OOM shrink
        cache.close()
        c = cache.counters
        device: dict[str, int | str] = {
            "device": cache.device, "budget_bytes": budgets[-1],
            "peak_device_bytes": c.peak_device_bytes, "allocations": c.allocations,
            "frees": c.frees}
        if i < len(paths):
            device["registered_path"] = paths[i]
        summary.devices.append(device)
    # several devices: each one's peak is within its own budget; the sum bounds the total
    summary.peak_device_bytes = sum(cache.counters.peak_device_bytes for cache in caches)
    summary.allocations = sum(cache.counters.allocations for cache in caches)
    summary.frees = sum(cache.counters.frees for cache in caches)
    summary.final_budget_bytes = sum(budgets)


def take_last_digests(verifier: Verifier | None, streamers: Sequence[ExpertStreamer]) -> None:
    """Compare the install digests a token's end left (``DigestRows.take`` never waits
    there): loads started ahead, still copying then, and never consumed since."""
    if verifier is not None:
        for streamer in streamers:
            verifier.check(streamer.take_digests(wait=True))


def manifest_failure(manifest: RunManifest | None, verifier: Verifier | None,
                     error: BaseException | None = None) -> MoestreamError | None:
    """What to raise when the digest manifest's computation stopped (``error``, or the
    builder's): the experts waiting for it can never be verified. A changed file is a
    ``ModelChangedError``; any other stop a ``VerificationError``."""
    builder = manifest.builder if manifest is not None else None
    error = error or (builder.error if builder is not None else None)
    if error is None:
        return None
    waiting = verifier.unverified if verifier is not None else 0
    if isinstance(error, ModelChangedError):
        return ModelChangedError(error.path, f"{error.problem}; {waiting} expert checks "
                                 "wait for digests that will never be computed")
    return VerificationError(f"{waiting} expert checks can never be compared with the "
                             f"file: the digest manifest's computation stopped ({error})")
