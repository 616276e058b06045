"""moestream.stages.staging.WorkerPool: the readers' threads."""

from __future__ import annotations

import threading

import pytest
import structlog
from hypothesis import given, settings
from hypothesis import strategies as st

from moestream.stages.staging import WorkerPool


def _threads(name: str) -> int:
    return sum(t.name.startswith(f"{name}_") for t in threading.enumerate())


def test_every_call_runs_and_the_threads_start_only_when_needed() -> None:
    pool = WorkerPool(4, "lazy-pool")
    assert _threads("lazy-pool") == 0  # none started yet
    done: list[int] = []
    lock = threading.Lock()

    def add(i: int) -> None:
        with lock:
            done.append(i)

    for i in range(200):
        pool.submit(add, i)
    assert pool.shutdown(cancel=False) == 0
    assert sorted(done) == list(range(200))
    assert _threads("lazy-pool") == 0  # joined
    assert pool.shutdown(cancel=False) == 0  # idempotent


@settings(max_examples=20, deadline=None)
@given(threads=st.integers(1, 4), submitted=st.integers(0, 40))
def test_a_cancelling_shutdown_runs_or_drops_each_call_once(threads: int,
                                                            submitted: int) -> None:
    """Calls queued behind blocked workers: those not started are dropped and counted,
    the others ran exactly once."""
    pool = WorkerPool(threads, "test-pool")
    gate = threading.Event()
    ran: list[int] = []
    lock = threading.Lock()

    def call(i: int) -> None:
        gate.wait()
        with lock:
            ran.append(i)

    for i in range(submitted):
        pool.submit(call, i)
    stopper = threading.Thread(target=lambda: results.append(pool.shutdown(cancel=True)))
    results: list[int] = []
    stopper.start()
    gate.set()
    stopper.join()
    assert len(ran) == len(set(ran))
    assert len(ran) + results[0] == submitted
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit(call, 0)


def test_a_failing_call_is_logged_and_the_worker_goes_on() -> None:
    pool = WorkerPool(1, "test-pool")
    done = threading.Event()

    def fail() -> None:
        raise OSError("disk gone")

    with structlog.testing.capture_logs() as logs:
        pool.submit(fail)
        pool.submit(done.set)
        pool.shutdown(cancel=False)
    assert done.is_set()
    failed = [e for e in logs if e["event"] == "worker_call_failed"]
    assert len(failed) == 1 and "OSError: disk gone" in failed[0]["error"]


def test_a_pool_needs_a_thread() -> None:
    with pytest.raises(ValueError, match="needs a thread"):
        WorkerPool(0, "test-pool")
