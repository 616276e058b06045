"""Cleanup that a cancellation cannot stop half-way."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

__all__ = ["finish"]


async def finish(work: Coroutine[Any, Any, None]) -> None:
    """Await ``work`` to its end even if cancelled meanwhile, however often, then raise the
    cancellation (``work``'s own error first). ``work`` runs as its own task behind a
    shield, so a cancel never stops it half-way."""
    task = asyncio.ensure_future(work)
    cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            cancelled = True
    task.result()
    if cancelled:
        raise asyncio.CancelledError
