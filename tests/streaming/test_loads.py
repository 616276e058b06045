"""``streaming.loads.Arrivals``: the FIFO a layer's landed loads reach their lease by."""

from __future__ import annotations

import asyncio
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from moestream.pipeline.streaming.loads import Arrivals, ThreadWaiter


@given(st.lists(st.one_of(st.integers(), st.none()), max_size=60))
def test_items_come_out_in_order(ops: list[int | None]) -> None:
    """Puts (an int) and takes (None) in any order: what comes out is what went in, in
    order, and a take from an empty queue raises ``QueueEmpty``."""
    q: Arrivals[int] = Arrivals()
    model: list[int] = []
    for op in ops:
        if op is not None:
            q.put_nowait(op)
            model.append(op)
        elif model:
            assert q.get_nowait() == model.pop(0)
        else:
            with pytest.raises(asyncio.QueueEmpty):
                q.get_nowait()
        assert q.empty() == (not model)
    assert [q.get_nowait() for _ in model] == model and q.empty()


async def test_get_waits_and_waiters_are_served_in_turn() -> None:
    q: Arrivals[str] = Arrivals()
    first = asyncio.create_task(q.get())
    second = asyncio.create_task(q.get())
    await asyncio.sleep(0)
    assert not first.done() and not second.done()
    q.put_nowait("a")
    q.put_nowait("b")
    assert await first == "a" and await second == "b"


async def test_a_cancelled_waiter_hands_its_item_on() -> None:
    """Woken, then cancelled before it ran: the item stays for the next waiter, as with
    ``asyncio.Queue``."""
    q: Arrivals[str] = Arrivals()
    first = asyncio.create_task(q.get())
    second = asyncio.create_task(q.get())
    await asyncio.sleep(0)
    q.put_nowait("x")  # wakes ``first``
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    assert await asyncio.wait_for(second, 1.0) == "x"


async def test_a_cancelled_waiter_leaves_no_trace() -> None:
    q: Arrivals[int] = Arrivals()
    waiting = asyncio.create_task(q.get())
    await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    q.put_nowait(1)
    assert await q.get() == 1


async def test_a_thread_waiter_is_served_in_turn_with_tasks() -> None:
    """A thread blocked without the loop is woken by the put that is its turn, from the
    loop's thread, and may wait again once woken."""
    q: Arrivals[str] = Arrivals()
    first = asyncio.create_task(q.get())
    await asyncio.sleep(0)
    waiter = ThreadWaiter()
    q.add_waiter(waiter)
    woken = threading.Event()

    def block() -> None:
        waiter.wait()
        woken.set()

    thread = threading.Thread(target=block)
    thread.start()
    q.put_nowait("a")  # the task's
    assert await first == "a"
    assert not woken.wait(0.05) and not waiter.done()
    q.put_nowait("b")  # the thread's
    assert woken.wait(5.0)
    thread.join()
    assert q.get_nowait() == "b" and not waiter.done()  # woken and waited: armed again
    q.add_waiter(waiter)
    q.put_nowait("c")
    assert waiter.done()


async def test_a_thread_waiter_that_stops_hands_its_item_on() -> None:
    """Woken, then interrupted before it took its item: ``drop_waiter`` wakes the next."""
    q: Arrivals[str] = Arrivals()
    gone, second = ThreadWaiter(), ThreadWaiter()
    q.add_waiter(gone)
    q.add_waiter(second)
    q.put_nowait("x")  # wakes ``gone``
    assert gone.done() and not second.done()
    q.drop_waiter(gone)
    assert second.done()
    never = ThreadWaiter()
    q.add_waiter(never)
    q.drop_waiter(never)  # never woken: forgotten
    q.put_nowait("y")
    assert not never.done()


@given(st.lists(st.integers(), max_size=20), st.lists(st.integers(), max_size=20),
       st.integers(0, 20))
def test_put_many_take_all_put_back(first: list[int], more: list[int], used: int) -> None:
    """A layer's items put at once come out in order after those before them; what
    ``take_all`` took and did not use goes back to the front, in order."""
    q: Arrivals[int] = Arrivals()
    q.put_many(first)
    q.put_many(more)
    taken = q.take_all()
    assert taken == first + more and q.empty()
    used = min(used, len(taken))
    q.put_nowait(-1)
    q.put_back(taken[used:])
    assert q.take_all() == [*taken[used:], -1]


async def test_put_many_wakes_one_waiter_an_item() -> None:
    q: Arrivals[str] = Arrivals()
    waiters = [asyncio.create_task(q.get()) for _ in range(3)]
    await asyncio.sleep(0)
    q.put_many(["a", "b"])
    await asyncio.sleep(0)
    assert [w.result() for w in waiters[:2]] == ["a", "b"] and not waiters[2].done()
    q.put_many(["c"])
    assert await waiters[2] == "c"
