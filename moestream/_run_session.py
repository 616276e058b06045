"""``moestream.open_config`` and ``RunSession``: a session for a client that runs its own
decode around it and builds the library's settings itself (``python -m pipeline.run``'s
proxy engine).

Such a client brings what only it has (its summary, kept through errors; its fault plan;
the table it opened already; its compute and its own fields for the log's header) and needs
a little more than an engine's face: the devices' backends to compute on without a runtime
of its own, its digests and events handed to the session's verification and log, the last
comparison without closing, and a close that says how the run ended and lets it read what
closing found instead of raising it. ``Session``'s face stays the engine's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from moestream._session import Session
from moestream.gpu.backend import Backend
from moestream.pipeline.foundation.config import ComputeSpec, StreamConfig
from moestream.pipeline.foundation.errors import MoestreamError, UsageTypeError
from moestream.pipeline.foundation.faults import FaultPlan
from moestream.pipeline.foundation.table import ExpertTable
from moestream.pipeline.streaming.controller import Sampler
from moestream.pipeline.streaming.session import StreamSession
from moestream.pipeline.streaming.summary import RunSummary
from moestream.pipeline.streaming.verify import Digests

__all__ = ["RunSession", "open_config"]


def open_config(
    config: StreamConfig,
    *,
    layers_in_flight: int = 2,
    sampler: Sampler | None = None,
    faults: FaultPlan | None = None,
    summary: RunSummary | None = None,
    table: ExpertTable | None = None,
    compute: ComputeSpec | None = None,
    run_details: Mapping[str, Any] | None = None,
) -> RunSession:
    """A session over the library's settings made by the caller, with what only the caller
    has; ``await`` it or use it with ``async with``, as ``open``'s (``open`` builds its
    ``StreamConfig`` from its arguments and opens the same parts). Logging is left as the
    caller configured it (a command line renders events on its console).

    Args:
        config: the library's settings (a client's config may extend it: the log header
            describes it whole).
        layers_in_flight: layers whose experts may be pinned at once (as ``Tuning``).
        sampler: machine readings for the controller (as ``Tuning``).
        faults: the fault plan to inject (default: the one ``config.faults`` names); the
            caller keeps it and reads its ``fired`` counts once the run is over.
        summary: the totals to fill in as the session goes, kept by the caller, so it has
            them even when opening, decoding or closing raises.
        table: the model's table when the caller opened it already (``config.model`` is
            not opened again).
        compute: what the client's own decode does with the experts (``real``, ``digest``,
            ``fixed``): checked against the model when it opens (``RunSession.compute``
            then has it as resolved) and named in the log header; ``digest`` needs the
            file's digests even without ``config.verify``. None: an engine's own compute.
        run_details: the client's own fields for the log's ``run_start`` header.

    Raises:
        UsageTypeError: ``config`` is not a ``StreamConfig``.
        UsageError: ``layers_in_flight`` below 1; when opened, as ``open``.
    """
    if not isinstance(config, StreamConfig):
        raise UsageTypeError(f"config must be a moestream.StreamConfig, not "
                             f"{type(config).__name__}")
    return RunSession(StreamSession(
        config, layers_in_flight=layers_in_flight, sampler=sampler, faults=faults,
        summary=summary, table=table, compute=compute, run_details=run_details))


class RunSession(Session):
    """A ``Session`` (``open_config`` makes one) with what a client running its own decode
    needs beyond an engine's face. Every method runs on the event loop that opened it."""

    @property
    def device_backends(self) -> tuple[Backend, ...]:
        """The devices' backends (``devices`` order), for an engine without a runtime of
        its own: buffers, streams, events and, with ``moestream.gpu.kernels``, kernels on
        the devices the experts live on."""
        return tuple(self._streaming.backends)

    @property
    def compute(self) -> ComputeSpec | None:
        """The client's compute (``open_config``) as resolved for this model when it
        opened (``real`` on experts it cannot compute is ``digest``), or None."""
        return self._streaming.compute

    def check_digests(self, digests: Digests) -> None:
        """Compare the digests the client took of the experts its compute read (``digest``
        compute) with the file's, counted with the session's own checks; a mismatch is
        raised by the token's ``end_token``.

        Raises:
            UsageError: the session is not open, or called from another loop or thread.
        """
        self._here()
        verifier = self._streaming.verifier
        assert verifier is not None  # set when the session opened
        verifier.check(digests)

    def log_event(self, event: str, **fields: Any) -> None:
        """Write the client's own event into the run log (readers skip events they do not
        know: ``docs/LOG_SCHEMA.md``); nothing without a log.

        Raises:
            UsageError: the session is not open, or called from another loop or thread.
        """
        self._here()
        self._streaming.runlog.emit(event, **fields)

    def render_log(self) -> None:
        """Render the run log's pending lines now: called while the devices compute, so
        the token's end writes less on the path between two tokens."""
        self._streaming.runlog.render()

    async def settle(self) -> None:
        """Compare what still waits for its digests (a file without recorded digests: its
        manifest is computed beside decode) now, decoding done, without closing: the
        summary then has the final verification counts. Once; ``aclose`` does it when it
        was not done.

        Raises:
            StageError: the manifest's reads failed (the experts stay unverified).
        """
        await self._streaming.settle()

    async def aclose(self, *, outcome: str = "ok", check: bool = True) -> None:
        """As ``Session.aclose``, saying how the client's decode ended; once begun, the
        close finishes even if the caller is cancelled meanwhile (the cancellation is
        raised after).

        Args:
            outcome: the log's ``run_end`` ``exit`` (``ok``, ``cancelled``, an error's
                words).
            check: raise for what closing found; False: the caller reads it instead
                (mismatches from its ``summary``, a log failure from ``log_error``).
        """
        await self._streaming.aclose(outcome=outcome, check=check)

    @property
    def log_error(self) -> MoestreamError | None:
        """The error the run log met (the file stopped taking lines), or None."""
        return self._streaming.runlog.error
