"""``LoopThread.run_eager`` (``SyncSession.end_token``'s path): work that never waits runs on
the caller's thread with no hop; work that waits goes on on the loop from where it stopped,
its results, errors and cancellation as ``run``'s."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import warnings
from collections.abc import Iterator

import pytest

from moestream import UsageError
from moestream._loop_thread import LoopThread


@pytest.fixture
def loop_thread() -> Iterator[LoopThread]:
    thread = LoopThread()
    yield thread
    thread.stop()


async def _where(steps: int) -> tuple[int, int]:
    """The thread before and after ``steps`` waits on the loop."""
    before = threading.get_ident()
    for _ in range(steps):
        await asyncio.sleep(0.001)
    return before, threading.get_ident()


def test_work_that_never_waits_runs_on_the_callers_thread(loop_thread: LoopThread) -> None:
    assert loop_thread.run_eager(_where(0)) == (threading.get_ident(),) * 2


def test_work_that_waits_goes_on_on_the_loop(loop_thread: LoopThread) -> None:
    before, after = loop_thread.run_eager(_where(3))
    assert before == threading.get_ident() and after == loop_thread.thread.ident


async def _fails(wait: bool) -> None:
    if wait:
        await asyncio.sleep(0.001)
    raise ValueError("the work's own error")


@pytest.mark.parametrize("wait", [False, True])
def test_errors_come_back_from_either_part(loop_thread: LoopThread, wait: bool) -> None:
    with pytest.raises(ValueError, match="own error"):
        loop_thread.run_eager(_fails(wait))


def test_a_cancelled_wait_is_thrown_into_the_work(loop_thread: LoopThread) -> None:
    """What the task's cancellation throws reaches the work (its ``finally`` runs)."""
    seen: list[str] = []

    async def work() -> None:
        try:
            await asyncio.Event().wait()  # forever, unless cancelled
        finally:
            seen.append("cleaned up")

    def cancel_soon() -> None:
        for task in asyncio.all_tasks(loop_thread.loop):
            task.cancel()

    timer = threading.Timer(0.05, lambda: loop_thread.loop.call_soon_threadsafe(cancel_soon))
    timer.start()
    with pytest.raises(concurrent.futures.CancelledError):  # as ``run`` raises it
        loop_thread.run_eager(work())
    assert seen == ["cleaned up"]


def test_refused_work_is_closed_not_left_unawaited(loop_thread: LoopThread) -> None:
    loop_thread.stop()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # "coroutine ... was never awaited"
        with pytest.raises(UsageError):
            loop_thread.run_eager(_where(0))
