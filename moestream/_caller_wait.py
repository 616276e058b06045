"""A sync caller's wait for a lease's experts, charged as a stall from end to end.

The lease measures its waits on the loop; a caller of the sync face blocked on the loop
waited longer, by the hops to the loop and back. ``CallerWait`` keeps the waits seen on the
loop and charges them, stretched to the caller's whole wait, once the caller is back;
``WaitRelay`` routes a lease's waits to the blocked call whose work they are part of.
"""

from __future__ import annotations

import time
from contextvars import ContextVar
from typing import Any

from moestream._lease import WaitCharge

__all__ = ["CALLER_WAIT", "CallerWait", "WaitRelay"]


class CallerWait:
    """One call of an engine's thread blocked on the loop for a lease's experts (iterating
    one still loading, ``gather``).

    The lease measures its waits on the loop, from when the call's work started there to
    when the expert was delivered there; the caller was blocked longer, by the hop to the
    loop (while the load went on) and the hop back. The waits seen on the loop are kept
    here (``saw``, on the loop's thread) and charged once the caller is back (``settle``,
    on the caller's thread), the first from when the caller blocked, the last to when it
    was back: the session splits each by what the load was doing, as for an async engine
    whose wait is its own. Both run under the session's lock.
    """

    __slots__ = ("settled", "started", "waits")

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.waits: list[tuple[WaitCharge, Any, Any, float, float]] = []
        self.settled = False

    def saw(self, charge: WaitCharge, entry: Any, load: Any, start: float,
            end: float) -> None:
        if self.settled:  # the caller left (interrupted): nothing more to stretch
            charge(entry, load, start, end)
        else:
            self.waits.append((charge, entry, load, start, end))

    def settle(self, ended: float) -> None:
        self.settled = True
        last = len(self.waits) - 1
        for i, (charge, entry, load, start, end) in enumerate(self.waits):
            charge(entry, load, min(start, self.started) if i == 0 else start,
                   max(end, ended) if i == last else end)
        self.waits.clear()


CALLER_WAIT: ContextVar[CallerWait | None] = ContextVar("moestream_caller_wait", default=None)
"""The blocked call whose work runs in this task on the loop (None: an async caller)."""


class WaitRelay:
    """A lease's ``on_wait`` once a sync caller waited on it: a wait seen in the work of a
    blocked call goes to that call's ``CallerWait``, any other straight on."""

    __slots__ = ("charge",)

    def __init__(self, charge: WaitCharge) -> None:
        self.charge = charge

    def __call__(self, entry: Any, load: Any, start: float, end: float) -> None:
        wait = CALLER_WAIT.get()
        if wait is None:
            self.charge(entry, load, start, end)
        else:
            wait.saw(self.charge, entry, load, start, end)
