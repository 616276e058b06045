"""``stages.upload.Installer``: uploaded entries become ready once their events complete."""

from __future__ import annotations

import pytest

from moestream.gpu.cache.store import DeviceCache, Entry
from moestream.gpu.host import HostBackend
from moestream.stages.upload import Installer


class _Event:
    """An upload event the test completes by hand, counting the queries."""

    def __init__(self) -> None:
        self.complete = False
        self.queries = 0

    def done(self) -> bool:
        self.queries += 1
        return self.complete

    def synchronize(self) -> None:
        self.complete = True


def _layer(cache: DeviceCache, layer: int, event: _Event) -> list[Entry]:
    plan = cache.plan_layer([(layer, e) for e in range(3)], [64] * 3)
    for entry in plan.misses:
        entry.upload = event
    cache.release(plan.misses, None)
    return plan.misses


def test_groups_install_in_order_one_query_an_event() -> None:
    cache = DeviceCache(HostBackend(), 64 * 64, "lru", min_bytes=3 * 64)
    first, second = _Event(), _Event()
    installer = Installer(cache)
    a, b = _layer(cache, 0, first), _layer(cache, 1, second)
    installer.submit(a)
    installer.submit(b)
    second.complete = True  # finished out of order: waits behind the first
    assert installer.poll() == 0 and len(installer.pending) == 2
    assert first.queries == 1 and second.queries == 0
    first.complete = True
    assert installer.poll() == 6 and len(installer.pending) == 0
    assert all(e.ready for e in (*a, *b))
    assert first.queries == 2 and second.queries == 1  # a layer's shared event: once


def test_dropped_entries_are_not_marked_and_drain_waits() -> None:
    cache = DeviceCache(HostBackend(), 64 * 64, "lru", min_bytes=3 * 64)
    event = _Event()
    installer = Installer(cache)
    group = _layer(cache, 0, event)
    installer.submit(group)
    cache.drop(group[0].key)  # a failed load: its key may be reloaded by another entry
    installer.drain()  # synchronizes, then installs
    assert event.complete and installer.installed == 2
    assert not group[0].ready and group[1].ready and group[2].ready


def test_an_entry_without_an_upload_is_refused() -> None:
    cache = DeviceCache(HostBackend(), 64 * 64, "lru", min_bytes=3 * 64)
    plan = cache.plan_layer([(0, 1)], [64])
    with pytest.raises(ValueError, match="no upload event"):
        Installer(cache).submit(plan.misses)
