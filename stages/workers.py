"""The readers' threads: work handed over at the cost of one queue put.

Why not ``concurrent.futures.ThreadPoolExecutor``: the direct path hands its readers a
chunk at a time, three or more an expert, from the event loop's thread, and a ``submit``
builds a future (a condition, a lock) and a work item and checks the thread count each
time: 9.2 us a call on the dev VM against 0.16 us for a ``queue.SimpleQueue.put``, on the
thread that also decodes. Nothing here needs a future: a chunk reports its outcome to the
loop itself (``ExpertJobs._read_chunk``), so a pool is a queue and its threads.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import structlog

__all__ = ["WorkerPool"]

_log = structlog.get_logger("moestream.workers")

_STOP = None


class WorkerPool:
    """``threads`` daemon threads running submitted calls in submission order.

    The threads start with the first ``submit`` (a pool that is never used costs none).
    A call's exception is logged and the thread goes on: callers report their own outcome
    (a call that can fail catches its errors and hands them on itself).
    """

    def __init__(self, threads: int, name: str) -> None:
        if threads < 1:
            raise ValueError(f"a worker pool needs a thread, got {threads}")
        self._n = threads
        self._name = name
        self._queue: queue.SimpleQueue[tuple[Callable[..., None], tuple[Any, ...]] | None] = (
            queue.SimpleQueue())
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._lock = threading.Lock()  # a submit and a shutdown, from two threads

    def submit(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` on a worker.

        Raises:
            RuntimeError: the pool was shut down.
        """
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self._name}: submit after shutdown")
            if not self._threads:
                self._start()
            self._queue.put((fn, args))

    def _start(self) -> None:
        for i in range(self._n):
            thread = threading.Thread(target=self._work, name=f"{self._name}_{i}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def _work(self) -> None:
        get = self._queue.get
        while (item := get()) is not _STOP:
            fn, args = item
            try:
                fn(*args)
            except BaseException as exc:  # the caller's to report; the worker goes on
                _log.error("worker_call_failed", pool=self._name, call=getattr(
                    fn, "__qualname__", repr(fn)), error=f"{type(exc).__name__}: {exc}")

    def shutdown(self, *, cancel: bool) -> int:
        """Stop taking work, drop what has not started (``cancel``) or let it run, and join
        every thread (blocks: call it off the event loop). Returns how many calls were
        dropped. Idempotent."""
        with self._lock:
            self._closed = True
        dropped = 0
        if cancel:
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                dropped += item is not _STOP
        for _ in self._threads:
            self._queue.put(_STOP)
        for thread in self._threads:
            thread.join()
        self._threads.clear()
        return dropped
