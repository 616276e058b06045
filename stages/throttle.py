"""How background reads stay polite: a pause that decode can take, and a byte rate.

The warm-up engine (``moestream.stages.warm``) and the digest manifest's builder
(``moestream.stages.manifest_build``) read the model beside decode. Decode's own reads must
go first, so both yield through ``Pausable`` (``pause()``/``resume()`` that nest, held while
a layer's misses load, and for a quiet time after: the warm-up a run starts waits until
decode has loaded nothing for that long, so it does not start pieces between a token's
layers); the warm-up can also be held to a byte rate (``TokenBucket``), so it leaves the
disk some room when it runs during a run.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterator

from moestream.pipeline.foundation.errors import UsageError

__all__ = ["Pausable", "TokenBucket"]


class Pausable:
    """Background reads that yield to decode: ``pause()``/``resume()`` that nest.

    The warm-up engine and the digest manifest's builder share it. Call ``pause``/``resume``
    (or ``with x.paused():``) from the event loop's thread. The loop side waits on
    ``_resumed`` before it submits more work; a worker thread that should stop between
    pieces waits on ``_running`` (both are set whenever no pause is held).
    """

    def __init__(self, quiet_s: float = 0.0) -> None:
        self._pause_depth = 0
        self._quiet_s = quiet_s
        self._quiet: asyncio.TimerHandle | None = None
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._running = threading.Event()
        self._running.set()

    def pause(self) -> None:
        """Stop reading until the matching ``resume()`` (calls nest)."""
        self._pause_depth += 1
        if self._quiet is not None:  # decode read again within the quiet time
            self._quiet.cancel()
            self._quiet = None
        self._resumed.clear()
        self._running.clear()

    def resume(self) -> None:
        """Undo one ``pause()``; the last one lets reads go on after ``quiet_s`` with no
        new pause (at once for 0, or off the event loop): decode's loads come a layer
        apart, a few milliseconds, and a background read started in such a gap holds
        the disk when the next layer's misses come."""
        if self._pause_depth == 0:
            raise UsageError("resume() without a matching pause()")
        self._pause_depth -= 1
        if self._pause_depth:
            return
        try:
            loop = asyncio.get_running_loop() if self._quiet_s > 0 else None
        except RuntimeError:
            loop = None
        if loop is None:
            self._go_on()
        else:
            self._quiet = loop.call_later(self._quiet_s, self._go_on)

    def _go_on(self) -> None:
        self._quiet = None
        if self._pause_depth == 0:
            self._resumed.set()
            self._running.set()

    @property
    def paused_now(self) -> bool:
        """A pause is held, or its quiet time runs."""
        return self._pause_depth > 0 or self._quiet is not None

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Pause for the body of a ``with`` block (decode reads go first)."""
        self.pause()
        try:
            yield
        finally:
            self.resume()

    async def _wait_resumed(self) -> None:
        """Loop side: return once no pause is held and its quiet time is over."""
        if not self._resumed.is_set():
            await self._resumed.wait()


class TokenBucket:
    """A byte-rate limiter that lets a request run into debt and makes the next one wait.

    ``delay_for(n)`` takes ``n`` bytes now and says how long to wait before they may go, so a
    stream of requests averages ``rate_bytes_per_s`` with bursts of at most ``burst_bytes``.
    The clock is injectable for tests.
    """

    __slots__ = ("_burst", "_clock", "_last", "_rate", "_tokens")

    def __init__(
        self,
        rate_bytes_per_s: float,
        *,
        burst_bytes: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if rate_bytes_per_s <= 0:
            raise UsageError(f"byte rate must be positive, not {rate_bytes_per_s}")
        if burst_bytes < 0:
            raise UsageError(f"burst must be >= 0, not {burst_bytes}")
        self._rate = float(rate_bytes_per_s)
        self._burst = float(burst_bytes)
        self._clock = clock
        self._tokens = self._burst
        self._last = clock()

    @property
    def rate_bytes_per_s(self) -> float:
        return self._rate

    @rate_bytes_per_s.setter
    def rate_bytes_per_s(self, rate: float) -> None:
        if rate <= 0:
            raise UsageError(f"byte rate must be positive, not {rate}")
        self._refill()
        self._rate = float(rate)

    def _refill(self) -> None:
        now = self._clock()
        self._tokens = min(self._burst, self._tokens + (now - self._last) * self._rate)
        self._last = now

    def delay_for(self, nbytes: int) -> float:
        """Take ``nbytes`` and return the seconds to wait before using them."""
        self._refill()
        self._tokens -= nbytes
        return 0.0 if self._tokens >= 0 else -self._tokens / self._rate

    async def take(self, nbytes: int) -> None:
        """Take ``nbytes`` and sleep until they may be used."""
        delay = self.delay_for(nbytes)
        if delay > 0:
            await asyncio.sleep(delay)

    def __repr__(self) -> str:
        return f"TokenBucket(rate_bytes_per_s={self._rate:.0f}, burst_bytes={self._burst:.0f})"
