"""``python -m bench.contention``: what an engine's compute loses while moestream loads beside it.

An inference engine and moestream share one GPU. The two ways of loading resident misses
take different parts of it: the gather kernel (``RunConfig(gather=True)``) runs on the SMs
the engine computes on, the copy engines (``gather=False``, ``cudaMemcpyAsync`` per matrix)
leave the SMs alone but still share memory bandwidth with the engine. This bench measures
both sides of that trade in one process:

- the engine alone: a workload on its own non-blocking stream in its own thread, timed by
  CUDA events. ``gemm``: a compute-bound square matmul (bf16 where CuPy has it, else fp16:
  the same tensor-core rate on the H200), TFLOP/s. ``gemv``: a decode-like skinny matmul
  over ``--gemv-mib`` of fp16 weights, GB/s of weights read (memory-bound);
- loading alone: ``bench.pipeline``'s resident-miss sweep (the file in the page cache, a
  budget of half the sweep so every access misses, oracle prefetch), delivered GB/s and
  misses/s from the log's token events, for the gather kernel and for the copy engines;
- both at once: the engine runs while the sweep runs; only engine steps that fall inside the
  sweep's measured window (its token events' timestamps) count.

Rounds alternate the phases (engine alone, loading alone, both) so that drift between them
(clocks, thermals, the page cache) cancels in the medians. Figures, from medians:
``engine_slowdown`` = engine rate with loading / alone (1.0: the engine lost nothing),
``loading_ratio`` = delivered with the engine / alone, and delivered / pinned H2D.

The engine keeps about 20 ms of work queued on its stream, because its thread shares the GIL
with the pipeline's event loop: a step queued late would show as a GPU loss that is really
Python's. With ``--backend host`` the engine is numpy on a thread and the pipeline is the
host backend: the bench runs end to end (its tests) but its figures measure nothing of a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

import structlog

from bench.kit import make_resident, run_command
from bench.pipeline import Bench, add_run_options, sweep_trace
from bench.rates import window_rate
from bench.record import provenance, write_result
from bench.references import pinned_h2d_gbps
from moestream.gpu.selection import select_backend
from moestream.pipeline.foundation.errors import UsageError
from moestream.pipeline.foundation.table import open_table

__all__ = ["main"]

PROG = "bench_contention"
GB = 1e9
MIB = 1 << 20
METHODS = {"gather": True, "copies": False}
_QUEUE_S = 0.02  # engine work kept queued on its stream, seconds
_log = structlog.get_logger("moestream.bench.contention")


@dataclass(frozen=True, slots=True)
class Workload:
    """One engine step and what it does: ``work`` units (TFLOP or GB) per ``step()``.

    The arrays ``step`` reads must stay alive until the stream has finished its last step:
    the closure holds them."""

    name: str
    unit: str
    work: float
    shape: dict[str, Any]
    step: Callable[[], None]


def gemm(xp: Any, dtype: Any, n: int) -> Workload:
    """``c = a @ b`` on n x n matrices: 2 n^3 flops a step, compute-bound for large n."""
    rng = xp.random.default_rng(0)
    a, b = ((rng.random((n, n), dtype=xp.float32) - 0.5).astype(dtype) for _ in range(2))
    c = xp.empty((n, n), dtype=dtype)
    return Workload("gemm", "TFLOP/s", 2.0 * n**3 / 1e12,
                    {"n": n, "dtype": xp.dtype(dtype).name},
                    lambda: xp.matmul(a, b, out=c))


def gemv(xp: Any, dtype: Any, weight_bytes: int, hidden: int, batch: int) -> Workload:
    """``y = w @ x`` for a (rows, hidden) weight and ``batch`` columns: a decode step reads
    every weight byte once and does little with it, so it is memory-bound."""
    rows = max(1, weight_bytes // (xp.dtype(dtype).itemsize * hidden))
    rng = xp.random.default_rng(1)
    w = (rng.random((rows, hidden), dtype=xp.float32) - 0.5).astype(dtype)
    x = (rng.random((hidden, batch), dtype=xp.float32) - 0.5).astype(dtype)
    y = xp.empty((rows, batch), dtype=dtype)
    return Workload("gemv", "GB/s", w.nbytes / GB,
                    {"rows": rows, "hidden": hidden, "batch": batch,
                     "dtype": xp.dtype(dtype).name, "weight_bytes": int(w.nbytes)},
                    lambda: xp.matmul(w, x, out=y))


class StepClock(Protocol):
    """Where the engine's steps run and how their ends are timed (wall-clock seconds)."""

    def context(self) -> contextlib.AbstractContextManager[Any]: ...
    def anchor(self) -> float: ...
    def mark(self) -> Any: ...
    def wait(self, mark: Any) -> None: ...
    def times(self, marks: Sequence[Any]) -> list[float]: ...


class HostClock:
    """numpy steps run synchronously: a step's end is the time it returned."""

    anchor = mark = staticmethod(time.time)

    def context(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def wait(self, mark: Any) -> None:
        """Nothing to wait for: the step has run."""

    def times(self, marks: Sequence[Any]) -> list[float]:
        return [float(m) for m in marks]


class CudaClock:
    """Steps queued on a non-blocking stream, an event behind each. The anchor event is
    synchronized on the idle stream and stamped with ``time.time()``; an event's wall time is
    the anchor's plus the elapsed device time, so it compares with the log's timestamps."""

    def __init__(self) -> None:
        import cupy

        self._cp = cupy
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self._anchor: Any = None
        self._anchor_s = 0.0

    def context(self) -> contextlib.AbstractContextManager[Any]:
        return self.stream  # type: ignore[no-any-return]  # a CuPy stream is one

    def anchor(self) -> float:
        self._anchor = self.mark()
        self._anchor.synchronize()
        self._anchor_s = time.time()
        return self._anchor_s

    def mark(self) -> Any:
        event = self._cp.cuda.Event()
        event.record(self.stream)
        return event

    def wait(self, mark: Any) -> None:
        mark.synchronize()

    def times(self, marks: Sequence[Any]) -> list[float]:
        elapsed = self._cp.cuda.get_elapsed_time
        return [self._anchor_s + elapsed(self._anchor, m) / 1000.0 for m in marks]


class EngineThread:
    """A workload looping on its own thread until stopped; :meth:`stop` returns the anchor
    and every step's end. Steps are queued ``depth`` ahead (about ``_QUEUE_S`` of work,
    from a timed warm-up), then each waits for the one ``depth`` before it."""

    def __init__(self, workload: Workload, clock: StepClock) -> None:
        self.workload, self.clock = workload, clock
        with clock.context():
            workload.step()  # first call: library set-up, not timed
            clock.wait(clock.mark())
            t0 = time.perf_counter()
            for _ in range(3):
                workload.step()
            clock.wait(clock.mark())
        step_s = max((time.perf_counter() - t0) / 3, 1e-6)
        self.depth = min(512, max(2, math.ceil(_QUEUE_S / step_s)))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._result: tuple[float, list[float]] | None = None
        self._error: BaseException | None = None

    def start(self) -> None:
        self._stop.clear()
        self._result, self._error = None, None
        self._thread = threading.Thread(target=self._run, name=f"engine-{self.workload.name}")
        self._thread.start()

    def _run(self) -> None:
        clock = self.clock
        try:
            with clock.context():
                t0 = clock.anchor()
                marks: list[Any] = []
                while not self._stop.is_set():
                    self.workload.step()
                    marks.append(clock.mark())
                    if len(marks) > self.depth:
                        clock.wait(marks[-self.depth - 1])
                if marks:
                    clock.wait(marks[-1])
            self._result = (t0, clock.times(marks))
        except BaseException as exc:  # re-raised by stop(), in the calling thread
            self._error = exc

    def stop(self) -> tuple[float, list[float]]:
        assert self._thread is not None, "stop() before start()"
        self._stop.set()
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result


def engine_rate(t0: float, ends: Sequence[float], work: float, w0: float,
                w1: float) -> dict[str, float]:
    """The engine's rate over the steps that started and ended inside ``[w0, w1]``; a step
    starts when the one before it ended (the stream is kept full), so idle time counts."""
    starts = [t0, *ends[:-1]]
    inside = [(s, e) for s, e in zip(starts, ends, strict=True) if s >= w0 and e <= w1]
    span = inside[-1][1] - inside[0][0] if inside else 0.0
    return {"steps": len(inside), "rate": len(inside) * work / span if span > 0 else 0.0,
            "busy_s": span, "window_s": w1 - w0}


def _ts(event: dict[str, Any]) -> float:
    return datetime.fromisoformat(event["ts"]).timestamp()


def loading_figures(events: Sequence[dict[str, Any]], skip: int) -> dict[str, Any]:
    """``window_rate`` over the measured tokens (after the first ``skip``), misses per
    second, and the window in wall-clock seconds (from the token before it to the last)."""
    measured = events[skip:]
    rate: dict[str, Any] = window_rate(measured)
    wall_s = sum(e["wall_ms"] for e in measured) / 1000.0
    rate["misses_per_s"] = sum(e["misses"] for e in measured) / wall_s if wall_s else 0.0
    rate["window"] = (_ts(events[skip - 1]), _ts(events[-1]))
    return rate


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a and b else None


def _check(args: argparse.Namespace) -> None:
    for name in ("rounds", "sweep_tokens", "lookahead", "gemv_batch", "gemv_hidden"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1")
    if args.passes < 2:
        raise UsageError("--passes must be >= 2 (the first pass is not measured)")
    if args.engine_s <= 0:
        raise UsageError("--engine-s must be > 0")


def _gemm_dtype(cp: Any) -> tuple[Any, str | None]:
    """bf16 where CuPy computes it (CuPy 14 with ml_dtypes), else fp16 with the reason."""
    try:
        import ml_dtypes

        probe = cp.ones((16, 16), dtype=ml_dtypes.bfloat16)
        cp.matmul(probe, probe)
        return ml_dtypes.bfloat16, None
    except (ImportError, TypeError, ValueError, NotImplementedError,
            cp.cuda.compiler.CompileException) as exc:
        _log.warning("gemm_dtype_fallback", dtype="float16", reason=str(exc))
        return cp.float16, f"gemm in float16: no bfloat16 matmul in CuPy here ({exc})"


def _workloads(args: argparse.Namespace, gpu: bool, notes: list[str]) -> list[Workload]:
    names = ["gemm", "gemv"] if args.engine == "both" else [args.engine]
    if gpu:
        import cupy as xp

        dtype, note = _gemm_dtype(xp) if "gemm" in names else (None, None)
        notes += [note] if note else []
        gemv_dtype: Any = xp.float16
    else:  # numpy: no bf16, and fp16 matmul runs outside BLAS
        import numpy as xp

        dtype = gemv_dtype = xp.float32
    n = args.gemm_n or (8192 if gpu else 128)
    weight_bytes = (args.gemv_mib or (1536 if gpu else 4)) * MIB
    made = {"gemm": lambda: gemm(xp, dtype, n),
            "gemv": lambda: gemv(xp, gemv_dtype, weight_bytes, args.gemv_hidden,
                                 args.gemv_batch)}
    workloads = [made[name]() for name in names]
    if gpu:  # made on the legacy stream, which the engine's non-blocking stream ignores
        xp.cuda.runtime.deviceSynchronize()
    return workloads


def _round(bench: Bench, args: argparse.Namespace, engines: Sequence[EngineThread],
           budget: int, gpu: bool) -> dict[str, Any]:
    """One round: each engine alone, each method's sweep alone, then each pair at once."""
    sweep = sweep_trace(len(bench.table.layers), bench.table.n_experts, bench.table.top_k,
                        args.sweep_tokens, 0)
    out: dict[str, Any] = {"warm_file": make_resident(bench.table.files),
                           "pinned_h2d_gbps": pinned_h2d_gbps() if gpu else None,
                           "engine_alone": {}, "loading_alone": {}, "both": {}}

    def load(method: str, tag: str) -> dict[str, Any]:
        _, events = bench.run(f"{method}-{tag}", sweep, args.passes * args.sweep_tokens,
                              mode="resident", budget_bytes=budget, layer_ms=0.0,
                              lookahead=args.lookahead, gather=METHODS[method])
        return loading_figures(events, args.sweep_tokens)

    for engine in engines:
        engine.start()
        time.sleep(args.engine_s)
        t0, ends = engine.stop()
        out["engine_alone"][engine.workload.name] = engine_rate(
            t0, ends, engine.workload.work, t0, ends[-1] if ends else t0)
    for method in METHODS:
        out["loading_alone"][method] = load(method, "alone")
    for method in METHODS:
        for engine in engines:
            engine.start()
            try:
                loading = load(method, engine.workload.name)
            finally:
                t0, ends = engine.stop()
            rate = engine_rate(t0, ends, engine.workload.work, *loading["window"])
            out["both"].setdefault(method, {})[engine.workload.name] = {
                "engine": rate, "loading": loading}
    return out


def _median_of(rounds: Sequence[dict[str, Any]], *path: str) -> float | None:
    """The median over rounds of the value at ``path`` (keys) in each round's record."""
    values: list[float] = []
    for record in rounds:
        value: Any = record
        for key in path:
            value = value[key]
        values += [] if value is None else [value]
    return statistics.median(values) if values else None


def _summarize(rounds: Sequence[dict[str, Any]],
               engines: Sequence[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Medians over rounds, and the figures from them (ratios of medians)."""
    h2d = _median_of(rounds, "pinned_h2d_gbps")
    alone = {e: _median_of(rounds, "engine_alone", e, "rate") for e in engines}
    loading = {m: _median_of(rounds, "loading_alone", m, "delivered_gbps") for m in METHODS}
    both = {m: {e: {"engine_rate": _median_of(rounds, "both", m, e, "engine", "rate"),
                    **{k: _median_of(rounds, "both", m, e, "loading", k)
                       for k in ("delivered_gbps", "misses_per_s", "hit_rate")}}
                for e in engines} for m in METHODS}
    figures: dict[str, Any] = {}
    for m in METHODS:
        figures[m] = {"loading_alone_vs_pinned_h2d": _ratio(loading[m], h2d)}
        for e, pair in both[m].items():
            figures[m][e] = {
                "engine_slowdown": _ratio(pair["engine_rate"], alone[e]),
                "loading_ratio": _ratio(pair["delivered_gbps"], loading[m]),
                "delivered_vs_pinned_h2d": _ratio(pair["delivered_gbps"], h2d),
            }
    medians = {"pinned_h2d_gbps": h2d, "engine_alone": alone, "loading_alone": loading,
               "both": both}
    return medians, figures


def _print_table(workloads: Sequence[Workload], rounds: int, medians: dict[str, Any],
                 figures: dict[str, Any]) -> None:
    def f(value: float | None, spec: str) -> str:
        return format("-" if value is None else format(value, spec), ">9")

    units = {w.name: w.unit for w in workloads}
    h2d = medians["pinned_h2d_gbps"]
    print(f"\nmedians of {rounds} rounds; pinned H2D "
          + (f"{h2d:.1f} GB/s" if h2d else "-") + "; engines alone: " + ", ".join(
              f"{e} {rate:.1f} {units[e]}" for e, rate in medians["engine_alone"].items()))
    print(f"  {'method':<8}{'engine':<8}{'rate':>16}{'slowdown':>9}{'GB/s':>9}{'alone':>9}"
          f"{'ratio':>9}{'/h2d':>9}{'miss/s':>9}")
    for m, per_engine in medians["both"].items():
        for e, pair in per_engine.items():
            fig = figures[m][e]
            print(f"  {m:<8}{e:<8}{pair['engine_rate']:>8.1f} {units[e]:<7}"
                  + f(fig["engine_slowdown"], ".3f") + f(pair["delivered_gbps"], ".2f")
                  + f(medians["loading_alone"][m], ".2f") + f(fig["loading_ratio"], ".3f")
                  + f(fig["delivered_vs_pinned_h2d"], ".3f") + f(pair["misses_per_s"], ".0f"))


def _bench(args: argparse.Namespace, argv: Sequence[str]) -> int:
    _check(args)
    table = open_table(args.model)
    backend = select_backend(args.backend)
    try:
        gpu, device = backend.name == "cupy", backend.device_name
    finally:
        backend.close()
    args.backend = "cupy" if gpu else "host"  # the sweeps run where the engine runs
    notes: list[str] = [] if gpu else ["host backend: numpy engine, no GPU figures"]
    workloads = _workloads(args, gpu, notes)
    engines = [EngineThread(w, CudaClock() if gpu else HostClock()) for w in workloads]
    per_layer = min(table.n_experts, args.sweep_tokens * table.top_k)
    expert_bytes = next(iter(table.layers.values())).expert_bytes
    budget = len(table.layers) * per_layer * expert_bytes // 2  # half the sweep: all miss
    result: dict[str, Any] = {
        **provenance("bench.contention", argv, device=device),
        "model": table.summary(),
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "budget_bytes": budget,
        "engines": {w.name: {"unit": w.unit, "work_per_step": w.work, "shape": w.shape,
                             "queued_steps": e.depth} for w, e in zip(workloads, engines,
                                                                     strict=True)},
        "notes": notes,
    }
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="moestream-contention-") as tmp:
        bench = Bench(args, table, Path(tmp))
        for i in range(args.rounds):
            print(f"round {i + 1}/{args.rounds}", flush=True)
            rounds.append(_round(bench, args, engines, budget, gpu))
            rounds[-1]["budget_ok"] = all(r["budget_ok"] for r in bench.runs.values())
    result["budget_never_exceeded"] = all(r["budget_ok"] for r in rounds)
    result["rounds"] = rounds
    result["medians"], result["figures"] = _summarize(rounds, [w.name for w in workloads])
    out = args.out or Path("bench/results") / f"contention-{result['machine']['host']}.json"
    write_result(out, result)
    _print_table(workloads, args.rounds, result["medians"], result["figures"])
    print(f"written: {out}")
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.contention",
                                description=(__doc__ or "").split("\n")[0])
    p.add_argument("--model", type=Path, required=True, help="GGUF model or checkpoint directory")
    p.add_argument("--backend", default="auto", choices=["auto", "host", "cupy"])
    p.add_argument("--engine", default="both", choices=["gemm", "gemv", "both"])
    p.add_argument("--rounds", type=int, default=3, help="rounds of every phase (3)")
    p.add_argument("--engine-s", type=float, default=3.0, help="engine-alone seconds (3)")
    p.add_argument("--gemm-n", type=int, default=0, help="gemm size (8192; host 128)")
    p.add_argument("--gemv-mib", type=int, default=0, help="gemv weights (1536; host 4)")
    p.add_argument("--gemv-hidden", type=int, default=8192, help="gemv columns (8192)")
    p.add_argument("--gemv-batch", type=int, default=4, help="gemv batch (4)")
    p.add_argument("--sweep-tokens", type=int, default=8, help="tokens per sweep pass (8)")
    p.add_argument("--passes", type=int, default=8, help="sweep passes; the first unmeasured")
    p.add_argument("--lookahead", type=int, default=8, help="oracle prefetch depth (8)")
    add_run_options(p)
    p.add_argument("--no-verify", action="store_true",
                   help="sweeps without verification (with copies, its digest is a kernel)")
    p.add_argument("--out", type=Path, help="result JSON (bench/results/contention-HOST.json)")
    p.add_argument("--debug", action="store_true", help="tracebacks instead of one line")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point; returns the exit code (2 for bad input)."""
    return run_command(PROG, _parser(), _bench, argv)


if __name__ == "__main__":
    sys.exit(main())
