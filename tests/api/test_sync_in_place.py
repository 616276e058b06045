"""``SyncSession.in_place``, ``in_place_current`` and ``used_in_place`` as an engine calls
them, over a file gguf's own writer made (expert slices at odd offsets, no moestream
metadata): the addresses hold the experts' bytes, they are given only in resident mode and
stop being current when the mapping goes, and reads in place count as misses of their
bytes, once a token, with nothing loaded, pinned or evicted."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest

import moestream
from tests.gguf_files import write_plain_moe


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_plain_moe(tmp_path_factory.mktemp("in-place") / "plain.gguf", pad_elems=333)


def test_the_addresses_hold_the_experts_bytes(plain: Path) -> None:
    with moestream.open_sync(plain, backend="host", mode="resident", budget="16") as ms:
        layer = ms.model.moe_layers[1]
        view = ms.in_place(layer, [3, 9])
        assert view is not None and view.layer == layer and ms.in_place_current(view)
        for expert, row, sizes in zip((3, 9), view.addresses, view.sizes, strict=True):
            with ms.fetch(layer, [expert]) as lease:
                matrices = lease.gather()[0].matrices
                assert sizes == tuple(m.nbytes for m in matrices)
                for m, at, n in zip(matrices, row, sizes, strict=True):
                    assert ctypes.string_at(at, n) == ctypes.string_at(m.ptr, n)


def test_none_in_direct_mode_and_bad_experts_refused(plain: Path) -> None:
    with moestream.open_sync(plain, backend="host", mode="direct") as ms:
        layer = ms.model.moe_layers[0]
        assert ms.in_place(layer, [0]) is None
        with pytest.raises(moestream.UsageError):
            ms.in_place(layer, [99])
        with pytest.raises(moestream.UsageError):
            ms.used_in_place([(layer, [0, 0])])


def test_reads_in_place_count_as_misses_once_a_token(plain: Path) -> None:
    with moestream.open_sync(plain, backend="host", mode="resident", budget="16") as ms:
        first, second = ms.model.moe_layers[:2]
        with ms.fetch(first, [0]) as lease:  # a hit next token
            lease.gather()
        ms.end_token()
        before = ms.counters()
        ms.used([(first, [0])])
        ms.used_in_place([(first, [5]), (second, [1, 2])])
        ms.used_in_place([(second, [2])])  # the same expert again in the token
        stats = ms.end_token(compute_ms=0.0)
        expert_bytes = {layer: ms.model.layers[layer].expert_bytes for layer in (first, second)}
        assert (stats.hits, stats.misses) == (1, 3)
        assert stats.file_bytes == expert_bytes[first] + 2 * expert_bytes[second]
        assert stats.experts[:2] == ((0, 5), (1, 2))
        after = ms.counters()
        assert after.evictions == before.evictions and after.open_leases == 0
        assert not ms.ready(first, [5]) and not ms.ready(second, [1])


def test_not_current_once_the_mapping_is_released(plain: Path) -> None:
    with moestream.open_sync(plain, backend="host", mode="resident") as ms:
        view = ms.in_place(ms.model.moe_layers[0], [1])
        assert view is not None
        streamer = ms._session._streaming.streamers[0]
        ms._thread.run(streamer.set_mode("direct"))  # as the controller switches
        assert not ms.in_place_current(view)
        assert ms.in_place(ms.model.moe_layers[0], [1]) is None
