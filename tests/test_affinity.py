"""Pinning the decode loop's thread (``pipeline.foundation.affinity``) as a run uses it:
the thread's mask during the block and after it, the helper threads a pinned thread
starts, and a run pinned end to end."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import uvloop
from hypothesis import given
from hypothesis import strategies as st

from pipeline.foundation.affinity import _ranges, parse_pin, pinned, resolve_cpu, widen_thread
from pipeline.foundation.config import ComputeSpec, RunConfig
from pipeline.foundation.errors import UsageError
from pipeline.run import run

needs_two = pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="pinning needs a thread that may use two CPUs or more")


def _mask_of_new_thread(initializer: bool) -> set[int]:
    """The CPU mask a pool thread started from the calling thread gets."""
    pool = (ThreadPoolExecutor(1, initializer=widen_thread) if initializer
            else ThreadPoolExecutor(1))
    with pool:
        mask: set[int] = pool.submit(os.sched_getaffinity, 0).result()
    return mask


class TestParse:
    @pytest.mark.parametrize(("text", "spec"), [("auto", "auto"), ("off", None), ("3", 3)])
    def test_accepted(self, text: str, spec: object) -> None:
        assert parse_pin(text) == spec

    @pytest.mark.parametrize("text", ["", "-1", "cpu3", "1.5"])
    def test_refused_in_one_line(self, text: str) -> None:
        with pytest.raises(UsageError, match="--pin-cpu must be a CPU index, auto or off"):
            parse_pin(text)

    def test_config_refuses_a_negative_index(self) -> None:
        with pytest.raises(UsageError, match="--pin-cpu"):
            RunConfig(pin_cpu=-1)


@given(st.sets(st.integers(0, 300), min_size=1))
def test_ranges_name_exactly_the_cpus(cpus: set[int]) -> None:
    named: set[int] = set()
    for part in _ranges(sorted(cpus)).split(","):
        low, _, high = part.partition("-")
        named.update(range(int(low), int(high or low) + 1))
    assert named == cpus


@needs_two
class TestPinned:
    def test_auto_is_the_highest_allowed_cpu(self) -> None:
        assert resolve_cpu("auto") == max(os.sched_getaffinity(0))
        assert resolve_cpu(None) is None

    def test_a_cpu_not_allowed_is_refused(self) -> None:
        with pytest.raises(UsageError, match="not a CPU this process may use"):
            resolve_cpu(max(os.sched_getaffinity(0)) + 1000)

    def test_the_thread_is_pinned_for_the_block_only(self) -> None:
        before = os.sched_getaffinity(0)
        cpu = min(before)
        with pinned(cpu) as got:
            assert got == cpu and os.sched_getaffinity(0) == {cpu}
        assert os.sched_getaffinity(0) == before

    def test_helper_threads_started_while_pinned_are_widened(self) -> None:
        before = os.sched_getaffinity(0)
        with pinned("auto") as cpu:
            # why the pools take the initializer: a new thread inherits its creator's mask
            assert _mask_of_new_thread(initializer=False) == {cpu}
            assert _mask_of_new_thread(initializer=True) == before
        assert _mask_of_new_thread(initializer=True) == before

    def test_an_error_in_the_block_restores_the_mask(self) -> None:
        before = os.sched_getaffinity(0)
        with pytest.raises(RuntimeError), pinned("auto"):
            raise RuntimeError("decode failed")
        assert os.sched_getaffinity(0) == before

    def test_a_pinned_run_reads_off_its_cpu_and_gives_the_mask_back(
            self, tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """A whole run with ``pin_cpu`` (direct mode: every miss a job for the reader
        pool): the loop thread hands the reads out from its one CPU, the readers run
        with the caller's mask, and the caller's thread has its mask back afterwards."""
        before = os.sched_getaffinity(0)
        cpu = resolve_cpu("auto")
        submitters: list[set[int]] = []
        workers: list[set[int]] = []
        submit = ThreadPoolExecutor.submit

        def spy(pool: ThreadPoolExecutor, fn: Callable[..., Any], /, *args: Any,
                **kwargs: Any) -> Future[Any]:
            def job() -> Any:
                if threading.current_thread().name.startswith("moestream-read"):
                    workers.append(os.sched_getaffinity(0))
                return fn(*args, **kwargs)

            if threading.current_thread() is threading.main_thread():
                submitters.append(os.sched_getaffinity(0))
            return submit(pool, job)

        monkeypatch.setattr(ThreadPoolExecutor, "submit", spy)
        cfg = RunConfig(model=tiny_model, tokens=4, mode="direct", backend="host",
                        compute=ComputeSpec("fixed", 0.05), pin_cpu="auto",
                        log=tmp_path / "run.jsonl")
        summary = uvloop.run(run(cfg))
        assert summary.exit == "ok" and summary.mismatches == 0
        assert os.sched_getaffinity(0) == before
        assert {cpu} in [set(mask) for mask in submitters]
        assert workers and all(mask == before for mask in workers)
