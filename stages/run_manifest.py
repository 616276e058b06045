"""A run's digest manifest: loaded from the user's cache, completed beside decode, saved.

A file that records no digests is verified against a manifest computed from the file once
(``moestream.stages.manifest_build.ManifestBuilder``) and kept in the user's cache
(``pipeline.foundation.manifest``). A run opens it here: what is stored is used at once,
what is missing is computed in the background while decode goes on, the experts still
waited for are computed first at the end, and what was learned is saved for the next run.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from moestream.pipeline.foundation.errors import ModelFileError, OutputError
from moestream.pipeline.foundation.manifest import DigestManifest, load_manifest, manifest_path
from moestream.pipeline.foundation.table import ExpertTable
from moestream.stages.manifest_build import BuildResult, ManifestBuilder

__all__ = ["RunManifest"]

_log = structlog.get_logger("moestream.manifest")


class RunManifest:
    """A run's digest manifest, for a file without recorded digests.

    ``open`` loads the stored manifest (a stale or damaged one is ignored, logged once) and,
    while it is incomplete, starts a ``ManifestBuilder`` task beside decode: the decode loop
    pauses it while misses load (``builder``), the verifier compares each expert once its
    digests are known, and ``settle`` (after the last token) computes first the experts
    still waiting, so a run that completes has compared everything it installed. ``aclose``
    stops the builder and saves what was learned (atomically; a file that changed
    meanwhile, or a cache that refuses the file, is logged and not saved).

    Attributes:
        manifest: the digests known so far.
        builder: the background builder (pause/resume), None when the manifest was complete.
        source: ``manifest`` (loaded complete) or ``manifest-built`` (computed, at least in
            part, by this run).
    """

    def __init__(self, table: ExpertTable, manifest: DigestManifest, path: Path,
                 builder: ManifestBuilder | None) -> None:
        self._table = table
        self.manifest = manifest
        self.path = path
        self.builder = builder
        self.source = "manifest" if builder is None else "manifest-built"
        self._task: asyncio.Task[BuildResult] | None = None
        self._saving: asyncio.Future[None] | None = None

    @classmethod
    async def open(cls, table: ExpertTable, direct: Callable[[], bool],
                   path: Path | None = None) -> RunManifest:
        """Load ``table``'s manifest and start computing what it lacks (loop thread).

        Args:
            table: the model.
            direct: asked per job: read with O_DIRECT (direct mode) or buffered.
            path: where the manifest is kept (default: ``manifest_path`` of the model).
        """
        path = path or manifest_path(table.path)
        loop = asyncio.get_running_loop()
        manifest = await loop.run_in_executor(None, load_manifest, table, path)
        builder = None
        if not manifest.complete:
            builder = ManifestBuilder(table, manifest, direct=direct)
        self = cls(table, manifest, path, builder)
        if builder is not None:
            missing = manifest.total - manifest.known_count
            _log.info("digest_manifest_computing", model=str(table.path), path=str(path),
                      experts=missing, known=manifest.known_count,
                      hint="python -m tools.warmup MODEL --digests computes it ahead")
            self._task = loop.create_task(builder.build())
            self._task.add_done_callback(self._built)
        return self

    def _built(self, task: asyncio.Task[BuildResult]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            _log.warning("digest_manifest_failed", model=str(self._table.path),
                         reason=str(exc), action="experts not yet compared stay unverified")
            return
        # saved now, so a run that fails or is killed later keeps it
        self._saving = asyncio.get_running_loop().run_in_executor(None, self._save)

    @property
    def bytes_read(self) -> int:
        return self.builder.bytes_read if self.builder is not None else 0

    async def settle(self, verifier: Any) -> None:
        """Digest the experts the verifier still waits for, then let it compare them.

        Raises:
            MoestreamError: what stopped the builder (a failed read, a changed file).
        """
        keys = verifier.waiting_keys
        if keys and self.builder is not None:
            t0 = time.perf_counter()
            await self.builder.ensure(keys)
            _log.info("digest_manifest_settled", experts=len(keys),
                      seconds=round(time.perf_counter() - t0, 3))
        verifier.resolve()

    def _save(self) -> None:
        """Save the manifest if it learned anything and the file is still the one keyed."""
        if not self.manifest.dirty:
            return
        try:
            changed = self.manifest.save_if_current(self._table, self.path)
        except (OutputError, ModelFileError) as exc:
            _log.warning("digest_manifest_not_saved", path=str(self.path), reason=str(exc))
            return
        if changed:
            _log.warning("digest_manifest_not_saved", path=str(self.path),
                         reason=f"the model changed ({', '.join(changed)})")

    async def aclose(self) -> None:
        """Stop the builder, join its threads, and save what was learned."""
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task  # its failure was logged by _built
        if self.builder is not None:
            await self.builder.aclose()
        if self._saving is not None:
            await self._saving
        await asyncio.get_running_loop().run_in_executor(None, self._save)
