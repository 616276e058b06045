"""``pipeline.arrivals.Arrivals``: the FIFO a layer's landed loads reach their lease by."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline.arrivals import Arrivals


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
