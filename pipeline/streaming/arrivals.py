"""``Arrivals``: the queue a layer's landed loads reach their lease through.

``asyncio.Queue`` did the job, but it also counts tasks for ``join`` and keeps putters
for a bound no arrival queue has; on a fine-grained shape (200 misses a token) its
``put_nowait`` and ``get_nowait`` were a visible share of a warm miss's host time. This
keeps what a lease uses: ``put_nowait`` (and ``put_many``), ``get_nowait`` (and
``take_all``), ``empty`` and ``get``, for the event loop's thread only.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Sequence
from typing import Generic, TypeVar

__all__ = ["Arrivals"]

T = TypeVar("T")


class Arrivals(Generic[T]):
    """An unbounded FIFO for one event loop; ``get`` waits for an item (several waiters
    are served in the order they came, as ``asyncio.Queue`` serves them)."""

    __slots__ = ("_getters", "_items")

    def __init__(self) -> None:
        self._items: collections.deque[T] = collections.deque()
        self._getters: collections.deque[asyncio.Future[None]] = collections.deque()

    def empty(self) -> bool:
        return not self._items

    def put_nowait(self, item: T) -> None:
        self._items.append(item)
        if self._getters:
            self._wake_next()

    def put_many(self, items: Sequence[T]) -> None:
        """``put_nowait`` each of ``items``, in order (a layer landed at once)."""
        self._items.extend(items)
        for _ in items:  # each item wakes one waiter, as ``put_nowait`` would
            if not self._getters:
                break
            self._wake_next()

    def take_all(self) -> list[T]:
        """Every item queued, oldest first, at once (none: an empty list)."""
        items = list(self._items)
        self._items.clear()
        return items

    def put_back(self, items: Sequence[T]) -> None:
        """Return ``items`` taken by ``take_all`` and not used to the front, in order."""
        self._items.extendleft(reversed(items))

    def get_nowait(self) -> T:
        """The oldest item.

        Raises:
            asyncio.QueueEmpty: there is none.
        """
        if not self._items:
            raise asyncio.QueueEmpty
        return self._items.popleft()

    async def get(self) -> T:
        """The oldest item, waiting for one if there is none."""
        while not self._items:
            getter = asyncio.get_running_loop().create_future()
            self._getters.append(getter)
            try:
                await getter
            except BaseException:
                getter.cancel()  # a no-op if it was woken already
                if getter in self._getters:
                    self._getters.remove(getter)
                elif self._items:  # woken, then cancelled: the item goes to the next one
                    self._wake_next()
                raise
        return self._items.popleft()

    def _wake_next(self) -> None:
        while self._getters:
            getter = self._getters.popleft()
            if not getter.done():
                getter.set_result(None)
                return
