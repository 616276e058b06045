"""A streaming session: the one setup and teardown of a run's parts, for any decode loop.

An engine drives its own decode loop and asks for experts layer by layer; ``pipeline.cli.run``
drives moestream's proxy decode. Both open their parts here: ``StreamSession`` opens the
model's expert table, one backend, kernels, cache and streamer per device, the verifier
(and the digest manifest of a file without digests), the mode controller and the run log
with its ``run_start`` header, and closes everything in one order (``run_end`` last). For
an engine it also hands out layer leases and prefetch hints (``streaming.desk``, over
``streaming.lease``), keeps the per-token accounting (``streaming.ledger``) and writes it in
the log's schema (``docs/LOG_SCHEMA.md``). Public faces: ``moestream.Session``, ``RunSession``.

All methods run on the event loop's thread that opened the session.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import structlog

from moestream.gpu.backend import Backend, Kernels
from moestream.gpu.cache.placement import balanced_placement, split_budget
from moestream.gpu.cache.store import DeviceCache
from moestream.gpu.kernels import make_kernels
from moestream.pipeline.foundation.compute import resolve_compute
from moestream.pipeline.foundation.config import ComputeSpec, StreamConfig
from moestream.pipeline.foundation.describe import describe_experts
from moestream.pipeline.foundation.errors import (
    DeviceMemoryError,
    ModelChangedError,
    UsageError,
    VerificationError,
)
from moestream.pipeline.foundation.faults import FaultPlan, parse_faults
from moestream.pipeline.foundation.machine import machine_info, process_read_bytes
from moestream.pipeline.foundation.table import ExpertTable, open_table
from moestream.pipeline.runlog.write import RunLog
from moestream.pipeline.streaming.closing import (
    close_devices,
    finish,
    manifest_failure,
    take_last_digests,
)
from moestream.pipeline.streaming.controller import ModeController, Sampler
from moestream.pipeline.streaming.desk import LastUse, LeaseDesk
from moestream.pipeline.streaming.lease_parts import EventJoiner
from moestream.pipeline.streaming.ledger import DeviceTotals
from moestream.pipeline.streaming.opening import open_outcome, plan_budget, run_start
from moestream.pipeline.streaming.shards import CacheGroup, StreamerGroup, open_backends
from moestream.pipeline.streaming.streamer import ExpertStreamer
from moestream.pipeline.streaming.summary import RunSummary, TokenTotals
from moestream.pipeline.streaming.verify import Verifier
from moestream.stages.run_manifest import RunManifest

__all__ = ["LastUse", "StreamSession"]

_log = structlog.get_logger("moestream.session")


class StreamSession(LeaseDesk):
    """The parts an engine's fetches go through, for one model, from ``open`` to ``aclose``.

    Args:
        config: the library's settings (a client's config that extends them is described
            whole in the log header).
        layers_in_flight: how many layers' experts may be pinned at once (a fetched layer
            and a prefetched one, or concurrent fetches); the budget must hold that many.
        sampler: machine readings for the controller (tests feed their own).
        faults: injected faults (default: those ``config.faults`` names, usually none).
        summary: the totals to fill in as the session goes (default: a new one), so a
            caller has them even when opening or decoding raises.
        table: the model's table, when the caller opened it already (``config.model``
            is then not opened again).
        compute: what the client's decode does with the experts (the proxy run's); None:
            an engine's own. ``digest`` needs the file's digests even without ``verify``.
        run_details: the client's own fields for the ``run_start`` header (``limits``).
    """

    def __init__(
        self,
        config: StreamConfig,
        *,
        layers_in_flight: int = 2,
        sampler: Sampler | None = None,
        faults: FaultPlan | None = None,
        summary: RunSummary | None = None,
        table: ExpertTable | None = None,
        compute: ComputeSpec | None = None,
        run_details: Mapping[str, Any] | None = None,
    ) -> None:
        if layers_in_flight < 1:
            raise UsageError(f"layers_in_flight must be >= 1, got {layers_in_flight}")
        super().__init__()
        self.config = config
        self._layers_in_flight = layers_in_flight
        self._sampler = sampler
        self.faults = faults if faults is not None else parse_faults(config.faults)
        self.table = table
        self.compute = compute
        self._run_details = dict(run_details or {})
        self.backends: list[Backend] = []
        self.kernels: list[Kernels] = []
        self.streamer: Any = None  # the one streamer, or a StreamerGroup (the controller's)
        self.cache: Any = None  # the one cache, or a CacheGroup
        self.controller: ModeController | None = None
        self.verifier: Verifier | None = None
        self.manifest: RunManifest | None = None
        self.runlog = RunLog(config.log)
        self.summary = summary if summary is not None else RunSummary()
        self.opened = False
        self._settled = False
        self._build_reported = False  # the manifest builder's failure was raised
        self._settle_error: BaseException | None = None
        self._reported = 0  # mismatches end_token has raised for

    # -- open ------------------------------------------------------------------------------

    async def open(self) -> None:
        """Open the model, the devices' caches and streamers, the log and the controller.

        Raises:
            UsageError: a bad setting (budget below ``layers_in_flight`` layers, devices).
            ModelFileError: the model cannot be used. StageError: a device or pinned
            allocation failed (``DeviceMemoryError``, a ``MemoryError`` met while opening
            too). OutputError: the log cannot be written. Whatever was opened is closed
            again before the error propagates.
        """
        if self.opened:
            raise UsageError("the session is already open")
        self.opened = True
        try:
            await self._open()
            return
        except MemoryError as exc:
            where = traceback.extract_tb(exc.__traceback__)[-1]
            await finish(self._close(outcome="failed to open: out of memory", settle=False))
        except BaseException as exc:
            await finish(self._close(outcome=open_outcome(exc), settle=False))
            raise
        # raised here, out of the handler: the MemoryError's frames (what was half made when
        # memory ran out) are let go with it, not kept alive as this error's context
        raise DeviceMemoryError(f"memory ran out while opening the session (at "
                                f"{Path(where.filename).name}:{where.lineno}); everything "
                                "opened was released")

    async def _open(self) -> None:
        cfg = self.config
        if cfg.log is not None:
            from moestream.pipeline.foundation.outputs import check_output

            check_output(cfg.log, what="log", in_place=True)
        if self.table is None:
            if cfg.model is None:  # the caller chooses a default model, never the session
                raise UsageError("no model: the session needs a model path or an opened table")
            self.table = open_table(cfg.model)
        table = self.table
        self._position = {layer: i for i, layer in enumerate(table.moe_layers)}
        self._experts = [[] for _ in table.moe_layers]
        self.backends = open_backends(cfg)
        home = self.backends[0]
        summary = self.summary
        summary.backend, summary.model = home.name, str(table.path)
        summary.experts = describe_experts(table.layers.values())
        summary.device = " + ".join(b.device_name for b in self.backends)
        await finish(self.runlog.open())
        device_sizes, budget, min_bytes = plan_budget(cfg, table, self._layers_in_flight,
                                                      len(self.backends))
        self._open_devices(table, device_sizes, budget, min_bytes)
        if self.compute is not None:  # refused here, before the log header, if it cannot run
            self.compute = resolve_compute(self.compute, table)
        await self._open_verification(table)
        self.controller = ModeController(cfg, table, self.streamer, self.runlog,
                                         sampler=self._sampler)
        summary.budget_bytes = self.cache.budget_bytes
        machine = machine_info(table.path, home.device_name if home.name == "cupy" else None)
        self.runlog.emit("run_start", **run_start(
            cfg, self.compute, table, device_sizes, machine, summary.budget_bytes,
            self.backends, self.caches, self._run_details))
        await self.controller.start()  # its first decision follows the header
        self._read_bytes = process_read_bytes()

    def _open_devices(self, table: ExpertTable, device_sizes: dict[int, int], budget: int,
                      min_bytes: int) -> None:
        """Each device's kernels, cache (its share of ``budget``), streamer and event
        joiner; with several, the placement of experts on them."""
        cfg, home = self.config, self.backends[0]
        # by device memory; the host backend's emulated devices share one RAM, whose free
        # bytes move between two readings: split evenly (a tight budget split by two
        # readings a few KiB apart left one device short of a layer, a flaky refusal)
        weights = ([1.0] * len(self.backends) if home.name == "host"
                   else [float(b.device_free_bytes()) for b in self.backends])
        for backend, share in zip(self.backends, split_budget(budget, weights), strict=True):
            with backend.activate():
                kernels = make_kernels(backend.name, cfg.gather_blocks)
                self.kernels.append(kernels)
                cache = DeviceCache(backend, share, cfg.policy, min_bytes=min_bytes,
                                    faults=self.faults)
                self.caches.append(cache)
                self.streamers.append(ExpertStreamer(
                    cfg, table, backend, cache, kernels, self.faults,
                    primary=self.streamers[0] if self.streamers else None,
                    layers_ahead=self._layers_in_flight - 1))
                self._joiners.append(EventJoiner(backend.new_stream(), backend.activate))
        if len(self.backends) == 1:
            self.streamer, self.cache = self.streamers[0], self.caches[0]
        else:
            self._devices = [DeviceTotals() for _ in self.backends]
            sizes = {n: (table.layers[n].n_experts, device_sizes[n]) for n in table.moe_layers}
            self._place = balanced_placement(sizes, weights)
            self.streamer = StreamerGroup(self.streamers)
            self.cache = CacheGroup(self.caches)

    async def _open_verification(self, table: ExpertTable) -> None:
        """The verifier, and the digest manifest of a file without digests (computed in
        the background if need be) when experts are checked."""
        checks = self.config.verify or (self.compute is not None
                                        and self.compute.kind == "digest")
        if checks and table.digests is None:
            # no digests in the file: its manifest, computed in the background if need be
            group = self.streamer
            self.manifest = await RunManifest.open(table, lambda: group.mode == "direct")
            self._background = self.manifest.builder
        self.verifier = Verifier(table, self.manifest.manifest if self.manifest else None)
        self.summary.digests = ("off" if not checks else "file" if self.manifest is None
                                else self.manifest.source)

    @property
    def mode(self) -> str:
        return str(self.streamer.mode) if self.streamer is not None else "direct"

    # -- token boundary --------------------------------------------------------------------

    async def end_token(self, *, compute_ms: float | Sequence[float] | None = None,
                        upload_ms: float = 0.0, wall_ms: float | None = None
                        ) -> dict[str, Any]:
        """End the token: release what is still held, verify what was loaded, let the
        controller look at the machine, log the token; returns the token's log fields.

        A lease used during the token and still held is released here; one not used yet
        (a later layer fetched ahead, across the boundary) stays held for its own token.

        Args:
            compute_ms: the engine's own measure of its compute this token (its waits for
                its devices' work included), or one per device (``backends`` order), adding
                up to it; the rest of the wall time that moestream's waits do not explain
                is then charged to ``host``. None: that rest is the engine's compute.
            upload_ms: the part of the engine's device waits its compute stream spent
                waiting on expert upload events (charged to ``upload``).
            wall_ms: the engine's measure of the token's wall time, for a token it ends
                after it ran; None: from the token's first fetch, hint or use to now.

        Raises:
            UsageError: the session is closed.
            VerificationError: an expert loaded during this token differs from the file.
            OutputError: the log file stopped taking lines.
        """
        table = self._check_open()
        assert self.controller is not None and self.verifier is not None
        self._clock()
        self._release_used()
        for streamer in self.streamers:
            streamer.poll_installs()
        self.cache.advance_token()
        mismatches = self.verifier.mismatches
        for streamer in self.streamers:
            self.verifier.check(streamer.take_digests())
        mode = self.mode
        t_controller = time.perf_counter()
        await self.controller.at_token(self._token)
        totals = self._totals
        totals.time.charge("switch", time.perf_counter() - t_controller)
        fields, now = self._token_line(mode, self.streamers, self.cache,
                                       self.controller.last_ram_available, compute_ms,
                                       upload_ms, wall_ms)
        if self._devices:
            fields["devices"] = self._device_lines(self.backends, self.caches)
        if self._hinted:
            fields["prefetch"] = {"predicted": totals.predicted, "correct": totals.correct,
                                  "loaded": totals.loaded, "wasted_bytes": totals.wasted_bytes}
        self.runlog.emit("token", **fields)
        self.summary.add(totals, fields["storage_bytes"], mode)
        assert self._first_t0 is not None
        self.summary.elapsed_s = now - self._first_t0
        self.record_verification()
        self._next_token(len(table.moe_layers))
        self.runlog.raise_if_failed()
        self._raise_found(mismatches)
        return fields

    def _raise_found(self, mismatches: int) -> None:
        """Raise for what the token just ended found: experts that differ from the file
        (beyond the ``mismatches`` before it), or a model file changed under the run."""
        assert self.verifier is not None
        self._reported = self.verifier.mismatches
        if self.verifier.mismatches > mismatches:
            raise VerificationError(  # the count last: "1 experts" never reads
                f"experts loaded during token {self._token - 1} that differ from the file: "
                f"{self.verifier.mismatches - mismatches}, first: "
                f"{self.verifier.first_mismatch}")
        failed = manifest_failure(self.manifest, self.verifier)
        if isinstance(failed, ModelChangedError) and not self._build_reported:
            # the file changed: what is read now is not the file verified (a failed read
            # leaves the experts unverified, which the close raises for)
            self._build_reported = True
            raise failed

    def record_verification(self) -> None:
        """Copy the verifier's counts into the summary (after each token, and at close)."""
        assert self.verifier is not None
        s = self.summary
        s.verified, s.mismatches = self.verifier.verified, self.verifier.mismatches
        s.first_mismatch, s.unverified = self.verifier.first_mismatch, self.verifier.unverified

    # -- close -----------------------------------------------------------------------------

    async def settle(self) -> None:
        """Compare what still waits for its digests (a file without recorded digests: its
        manifest is being computed), decoding done; the summary then has the final counts.
        Once; ``aclose`` does it when it was not done.

        Raises:
            StageError: the manifest's reads failed (the experts stay unverified).
        """
        self._settled = True
        take_last_digests(self.verifier, self.streamers)
        if self.manifest is not None and self.verifier is not None:
            await self.manifest.settle(self.verifier)
        if self.verifier is not None:
            self.record_verification()

    async def aclose(self, *, outcome: str = "ok", check: bool = True) -> None:
        """Release every lease and hint, stop the loads, close everything, log ``run_end``.

        Idempotent; finishes even if cancelled meanwhile. With ``outcome="ok"`` and
        ``check`` the experts still waiting for their digests (a file without them) are
        compared first, unless ``settle`` did.

        Args:
            outcome: how the client's decode ended (``run_end``'s ``exit``).
            check: raise for what closing found; False: the caller reads the mismatches
                from ``summary`` and a log error from ``runlog.error`` (``pipeline.cli.run``).

        Raises:
            VerificationError: a mismatch no ``end_token`` raised for (found by that last
                comparison, or in a token never ended).
            OutputError: the log's last lines could not be written.
        """
        if self.closed or not self.opened:
            self.closed = True
            return
        settle = check and outcome == "ok" and not self._settled
        await finish(self._close(outcome=outcome, settle=settle))
        if not check:
            return
        if self.runlog.error is not None:
            raise self.runlog.error
        found = self.summary.mismatches - self._reported
        if outcome == "ok" and found:  # compared at close: not yet raised by end_token
            raise VerificationError(f"experts that differ from the file: {found}, "
                                    f"first: {self.summary.first_mismatch}")
        if outcome == "ok" and self.summary.unverified:
            # never a clean close with experts consumed but not compared with the file
            raise (manifest_failure(self.manifest, self.verifier, self._settle_error)
                   or VerificationError(f"{self.summary.unverified} expert checks were never "
                                        "compared with the file"))

    async def _close(self, *, outcome: str, settle: bool) -> None:
        self.closed = True
        summary = self.summary
        self._release_all("the session was closed")
        await self._stop_launchers()  # loads still waiting for staging slots
        if settle:
            try:
                take_last_digests(self.verifier, self.streamers)
            except Exception as exc:  # a broken device: the run is failing anyway
                _log.warning("install_digests_unread", reason=str(exc))
        if self.manifest is not None:
            if settle and self.verifier is not None:
                try:
                    await self.manifest.settle(self.verifier)
                except Exception as exc:  # what stopped the builder: ``aclose`` raises it
                    self._settle_error = exc
                    _log.warning("digest_manifest_unsettled", reason=str(exc))
            await self.manifest.aclose()
            summary.manifest_bytes = self.manifest.bytes_read
        if self.verifier is not None:
            self.record_verification()
        if self.controller is not None:
            await self.controller.aclose()
            summary.switches = self.controller.switches
            summary.modes = self.controller.tokens_in_mode
        await close_devices(summary, self.streamers, self.caches)
        summary.exit = outcome
        if self.table is not None:
            self.runlog.emit("run_end", **summary.as_dict(), hit_rate_final=summary.hit_rate)
        await self.runlog.aclose()

    def counters_now(self) -> tuple[RunSummary, TokenTotals]:
        """The totals of the tokens ended so far, and those of the token under way."""
        return replace(self.summary), replace(self._totals)
