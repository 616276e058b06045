"""``python -m pipeline.run``: decode a MoE model while streaming its experts.

With no arguments it makes (once) the embedded tiny model, decodes a few tokens on
synthetic routing calibrated to real models, prints a summary and a verification line.
The decode is ``moestream``'s first client: a loop and a proxy engine written against the
public API (``moestream.pipeline.proxy.loop``, ``moestream.pipeline.proxy.decode``), on a
session opened with ``moestream.open_config``.
Errors print one line and exit non-zero (2 for bad input, 1 for a failed stage, 3 for a
verification mismatch: the run stops at the end of the token that found it, as an engine
would, after comparing what still waited for its digests); ``--debug`` shows the traceback
instead. A run that stopped part way also prints its summary. SIGINT, SIGTERM or SIGHUP
stops the run at once, cleanly: in-flight reads finish, uploads are synchronized, pinned and
device memory released, the log closed with its ``run_end`` event; the exit status is 130
(SIGINT), 143 (SIGTERM) or 129 (SIGHUP). A signal before the run has started (while Python
imports) exits at once with the same status and no log; a second SIGINT exits at once,
without cleaning up. ``--inject`` turns on fault injection (``pipeline.foundation.faults``).
Outputs (``--log``, ``--record-trace``) are checked before the model is opened
(``pipeline.foundation.outputs``); a log the file system stops taking ends the run at the next token
with its summary and exit 2. A closed stdout (``| true``) drops the summary quietly.
On a terminal a live line shows tokens, tokens/s, hit rate, mode and the current bound
(``moestream.pipeline.cli.progress``); not with ``--json`` or when stderr is not a terminal.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog
import uvloop

from moestream import RunSession, RunSummary, Sampler, open_config
from moestream.pipeline.cli.common import closable_stdout, print_error
from moestream.pipeline.cli.console import configure_console
from moestream.pipeline.cli.interrupts import (
    STOP_SIGNALS,
    exit_code,
    exit_on_signals,
    restore_signals,
)
from moestream.pipeline.cli.progress import LiveLine
from moestream.pipeline.cli.run_arguments import build_parser, config_from_args
from moestream.pipeline.cli.summary import print_summary
from moestream.pipeline.foundation.errors import (
    MoestreamError,
    TraceError,
    UsageError,
    VerificationError,
)
from moestream.pipeline.foundation.faults import FaultPlan, parse_faults
from moestream.pipeline.foundation.outputs import check_not_input, check_output
from moestream.pipeline.foundation.table import ExpertTable, open_table
from moestream.pipeline.foundation.trace import TraceRecorder, load_trace, save_trace
from moestream.pipeline.proxy.config import RunConfig
from moestream.pipeline.proxy.decode import Decode
from moestream.pipeline.proxy.loop import DecodeLoop
from moestream.pipeline.proxy.routing import BlockRouting, Routing, TraceRouting

__all__ = ["RunSummary", "build_parser", "config_from_args", "main", "run"]

_log = structlog.get_logger("moestream.run")


def _routing(cfg: RunConfig, table: ExpertTable) -> Routing:
    """The replay of ``--trace``, or else the synthetic routing, made block by block as the
    run asks for it: its memory does not grow with ``--tokens``."""
    n_layers = len(table.layers)
    if cfg.trace is None:
        from moestream.pipeline.proxy.synthetic import BLOCK_TOKENS, synthetic_blocks

        blocks = synthetic_blocks(cfg.routing_preset, seed=cfg.seed, n_layers=n_layers,
                                  n_experts=table.n_experts, top_k=table.top_k)
        # oracle prefetch asks up to ``lookahead`` layers beyond the token being decoded
        reach = 2 + cfg.lookahead // n_layers if cfg.prefetch == "oracle" else 1
        return BlockRouting(blocks, BLOCK_TOKENS, reach)
    trace = load_trace(cfg.trace)
    trace.check_fits(n_layers, table.n_experts, table.top_k)
    if trace.n_layers < n_layers:
        raise TraceError(f"{cfg.trace}: the trace routes {trace.n_layers} MoE layers, "
                         f"the model has {n_layers}")
    return TraceRouting(trace)


def _check_outputs(cfg: RunConfig) -> None:
    """Every file the run will write, checked before the model is opened: a bad path fails
    at once with one line, not after the run; an output never overwrites an input."""
    if cfg.log is not None:
        check_output(cfg.log, what="--log", in_place=True)
        check_not_input(cfg.log, {"--model": cfg.model, "--trace": cfg.trace,
                                  "--record-trace": cfg.record_trace}, what="--log")
    if cfg.record_trace is not None:
        check_output(cfg.record_trace, what="--record-trace")
        check_not_input(cfg.record_trace, {"--model": cfg.model}, what="--record-trace")


async def run(
    cfg: RunConfig,
    *,
    sampler: Sampler | None = None,
    faults: FaultPlan | None = None,
    summary: RunSummary | None = None,
) -> RunSummary:
    """Decode ``cfg.tokens`` tokens; returns the summary (raises MoestreamError subclasses).

    Cancelling the coroutine stops the run with the same cleanup as an error: everything is
    closed and the log ends with ``run_end`` (``exit: cancelled``); CancelledError is raised.

    Args:
        cfg: the run's configuration.
        sampler: machine readings for the controller (tests feed their own).
        faults: injected faults (default: those ``cfg.faults`` names, usually none).
        summary: filled in as the run goes, so a caller has the totals even when the run
            raises or is cancelled (default: a new one).
    """
    _check_outputs(cfg)
    if faults is None:
        faults = parse_faults(cfg.faults)
    if cfg.model is None:
        raise UsageError("no model to decode: pass -m MODEL")
    table = open_table(cfg.model)
    replay = _routing(cfg, table) if cfg.router == "trace" else None
    recorder = (TraceRecorder(cfg.tokens, len(table.layers), table.top_k, table.n_experts)
                if cfg.record_trace is not None else None)  # refuses too long a record now
    if summary is None:
        summary = RunSummary()
    session = _session(cfg, table, sampler, faults, summary)
    loop: DecodeLoop | None = None
    live = LiveLine(cfg.tokens, enabled=False)  # replaced once decoding starts
    try:
        # the session's open holds the run's first await, where a cancel (a signal) can
        # first land: a log file, once made, always ends with run_end
        await session
        loop = _decode_loop(cfg, table, session, replay, recorder)
        live = LiveLine(cfg.tokens, enabled=not cfg.json and sys.stderr.isatty())
        with _quiet_gc():
            for t in range(cfg.tokens):
                stats = await loop.token(t)
                live.update(stats.hits, stats.misses, stats.time, stats.mode)
        # compare what still waits for its digests, decode done
        await session.settle()
        summary.exit = "ok"
    except BaseException as exc:
        await _stopped(session, summary, exc)
        raise
    finally:
        live.close()  # erased before the summary or an error line is printed
        await _close(cfg, session, summary, loop)
    if session.log_error is not None:  # the last lines, written at close, were refused
        summary.exit = str(session.log_error)
        raise session.log_error
    return summary


def _session(cfg: RunConfig, table: ExpertTable, sampler: Sampler | None,
             faults: FaultPlan, summary: RunSummary) -> RunSession:
    """The run's session, not yet open, with what only the run has: its summary, fault
    plan, compute, bandwidths told and the table it opened already."""
    # a layer's experts, and those loaded ahead of it, may all live on one device: the
    # budget of each holds that many layers
    details = {"limits": cfg.limits.record()} if cfg.limits is not None else {}
    return open_config(cfg, layers_in_flight=1 + cfg.layers_ahead, sampler=sampler,
                       faults=faults, summary=summary, table=table, compute=cfg.compute,
                       run_details=details)


def _decode_loop(cfg: RunConfig, table: ExpertTable, session: RunSession,
                 replay: Routing | None, recorder: TraceRecorder | None) -> DecodeLoop:
    """The proxy engine on the open session: its own compute (kernels and streams on the
    session's devices), the routing (``replay``, or the model's live router), the loop."""
    assert session.compute is not None
    decode = Decode.for_devices(session.compute, table, session.device_backends, cfg.seed)
    routing: Routing = replay if replay is not None else session.router(cfg.seed)
    return DecodeLoop(cfg, table, routing, session=session, decode=decode, recorder=recorder)


async def _stopped(session: RunSession, summary: RunSummary, exc: BaseException) -> None:
    """Record why the run stopped (``summary.exit``); a verification mismatch stops at the
    end of its token, so what still waited for its digests is compared first: the final
    counts."""
    if isinstance(exc, asyncio.CancelledError):
        summary.exit = "cancelled"
    elif isinstance(exc, MoestreamError):
        summary.exit = str(exc)
        if isinstance(exc, VerificationError):
            with contextlib.suppress(MoestreamError):
                await session.settle()


DECODE_GC_YOUNG = 20_000
"""The garbage collector's first threshold during decode: above the objects a token holds
at once (its leases, handles and log fields: a few thousand on a large model's shape, such
as Qwen3-30B-A3B's 48 layers x top-8), so a steady decode crosses it only when garbage
really accumulates (a few reference cycles a token)."""


@contextlib.contextmanager
def _quiet_gc() -> Iterator[None]:
    """Decode with the garbage collector out of the token's way; restored at the run's end
    (``run`` is also called in-process, by benches and tests).

    Why: CPython collects its youngest generation every 700 net new container objects, and
    a token's working set swings by more than that, so collections came every token or two,
    each traversing what the token held: on the dev VM with a null device the token boundary
    took 170-230 us with them and 115-140 us with collections off, and ``end_token`` 120-150
    against 65-80 (Qwen3-30B-A3B shape, 48 layers x top-8). Decode makes almost no reference
    cycles (a few a token), so a young threshold above the token's swing collects only when
    they add up. ``gc.freeze`` first moves set-up's objects (the table, the caches, the
    imports) to the permanent generation, so the full collections that remain traverse only
    what decode allocated (~22 ms each on the dev VM before, a token's stall).
    """
    before = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(max(before[0], DECODE_GC_YOUNG), *before[1:])
    try:
        yield
    finally:
        gc.set_threshold(*before)
        gc.unfreeze()


async def _close(cfg: RunConfig, session: RunSession, summary: RunSummary,
                 loop: DecodeLoop | None) -> None:
    """Close the session (everything the run holds, in order, then ``run_end``), then write
    the routing the run decoded (``--record-trace``). A cancel (again) meanwhile stops
    neither: the session's close finishes, then raises it, and the routing is written
    before it goes on."""
    try:
        await session.aclose(outcome=summary.exit, check=False)
    except asyncio.CancelledError:
        _save_recorded(cfg, loop)
        raise
    _save_recorded(cfg, loop)


def _save_recorded(cfg: RunConfig, loop: DecodeLoop | None) -> None:
    recorded = loop.recorder.trace() if loop is not None and loop.recorder is not None else None
    if cfg.record_trace is not None and recorded is not None:
        save_trace(recorded, cfg.record_trace)


_SIGNAL_EXIT: dict[int, int] = {s: exit_code(s) for s in STOP_SIGNALS}  # 130, 143, 129


def _exit_at_once(signum: int, frame: object) -> None:
    """The second SIGINT: leave now, cleanup or not (a plain handler, so it runs even while
    cleanup blocks the event loop's thread, e.g. joining reader threads)."""
    os.write(2, b"moestream: second interrupt: exiting at once\n")
    os._exit(_SIGNAL_EXIT[signal.SIGINT])


@dataclass(slots=True)
class _Interrupt:
    """The signal that stopped the run, if one did."""

    signum: int | None = None


async def _run_until_signal(
    cfg: RunConfig, faults: FaultPlan, summary: RunSummary, interrupt: _Interrupt
) -> None:
    """Run, cancelling the run's task on the first SIGINT, SIGTERM or SIGHUP (cleanup still
    runs); returns normally when a signal stopped it, with ``interrupt.signum`` set."""
    loop = asyncio.get_running_loop()
    task = loop.create_task(run(cfg, faults=faults, summary=summary))
    previous = {s: signal.getsignal(s) for s in _SIGNAL_EXIT}

    def on_signal(signum: int) -> None:
        if interrupt.signum is not None:
            _log.warning("signal_during_cleanup", signal=signal.Signals(signum).name,
                         action="cleanup continues; a second SIGINT exits at once")
            return
        interrupt.signum = signum
        _log.warning("stopping", signal=signal.Signals(signum).name,
                     action="cancel the run, finish or abandon in-flight work, release all")
        signal.signal(signal.SIGINT, _exit_at_once)
        task.cancel()

    installed: list[int] = []
    for signum in _SIGNAL_EXIT:
        try:
            loop.add_signal_handler(signum, on_signal, signum)
            installed.append(signum)
        except (ValueError, RuntimeError, NotImplementedError) as exc:  # not the main thread
            _log.warning("signal_handler_unavailable", signal=signal.Signals(signum).name,
                         reason=str(exc))
    try:
        await task
    except asyncio.CancelledError:
        if interrupt.signum is None or not task.cancelled():
            raise
    finally:
        for signum in installed:
            loop.remove_signal_handler(signum)
        # back to main's handlers (exit at once), never to the default SIGTERM/SIGHUP death
        restore_signals({s: previous[s] for s in installed})


def main(argv: Sequence[str] | None = None, *,
         default_model: Callable[[], Path] | None = None) -> int:
    """CLI entry point; returns the exit code.

    Args:
        argv: the arguments (``sys.argv[1:]`` when None).
        default_model: makes the model decoded when ``-m`` is not given (the entry point
            passes the tiny model's maker); without it, ``-m`` is required.
    """
    # Until the run's event loop takes the signals over, and once it has given them back,
    # a stop signal exits at once with its status: no log is open then (it ends with run_end)
    previous = exit_on_signals("moestream")
    try:
        args = build_parser().parse_args(argv)
        configure_console(debug=args.debug)
        if args.engine == "transformers":  # a real model through moestream.transformers
            from moestream.pipeline.cli.transformers import main as generate

            return generate(args)
        return _main(args, default_model)
    finally:
        restore_signals(previous)


def _main(args: argparse.Namespace, default_model: Callable[[], Path] | None) -> int:
    summary = RunSummary()
    interrupt = _Interrupt()
    faults = FaultPlan()
    error: MoestreamError | None = None
    try:
        if args.model is None and default_model is not None:
            args.model = default_model()
        cfg = config_from_args(args)
        faults = parse_faults(cfg.faults)
        if faults:
            _log.warning("fault_injection_on", spec=str(faults))
        uvloop.run(_run_until_signal(cfg, faults, summary, interrupt))
    except MoestreamError as exc:
        if args.debug:
            raise
        error = exc
    except KeyboardInterrupt:  # before the handlers were installed
        print("moestream: interrupted", file=sys.stderr)
        return _SIGNAL_EXIT[signal.SIGINT]
    if faults:
        _log.warning("faults_injected", spec=str(faults), fired=dict(faults.fired))
    if error is not None:
        if summary.budget_bytes:  # decoding had started: say how far it got
            with closable_stdout():
                print_summary(summary, args.json)
        print_error("moestream: error: ", error)
        return error.exit_code
    if interrupt.signum is None or summary.budget_bytes:  # stopped before decoding: no summary
        with closable_stdout():  # a closed stdout drops the summary; the exit status stays
            print_summary(summary, args.json)
    if interrupt.signum is not None:  # even when the run was done as the signal came
        name = signal.Signals(interrupt.signum).name
        print(f"moestream: interrupted by {name} after {summary.tokens} tokens; "
              "in-flight work finished or abandoned, memory released", file=sys.stderr)
        return _SIGNAL_EXIT[interrupt.signum]
    if summary.mismatches:
        err = VerificationError(f"experts that differ from the file: {summary.mismatches}, "
                                f"first: {summary.first_mismatch}")
        print_error("moestream: error: ", err)
        return err.exit_code
    return 0

