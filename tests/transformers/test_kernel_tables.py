"""``_kernel_tables`` on the host: where a kernel's table goes on its way to the device.

Plain tensors stand in for the pinned rows and their device twins, and a tensor copy for
the queued one (a ``FakeRing`` for the device's ring): within a capture (``keeping``) each
table takes a kept slot of its own, never the ring's and never one a live graph copies; the
slots run out or a table outgrows one with a ``RuntimeError`` (its capture fails); ``reset``
waits for the device once a slot was used. ``DecodeGraphs`` captures within its kept tables
and resets them with its graphs. The real copies run in the GPU tests
(``test_dequant_batch_cuda.py``: a captured slot launch replayed after laps of the ring).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from moestream.transformers import _graphs  # noqa: E402
from moestream.transformers import _kernel_tables as kt  # noqa: E402
from tests.transformers.test_graphs import FakeGraph  # noqa: E402


class FakeRing:
    def __init__(self) -> None:
        self.tables: list[list[int]] = []

    def put(self, values: Any, stream: Any) -> int:
        self.tables.append(list(values))
        return -len(self.tables)


class FakeStream:
    device_index = 0

    def wait_stream(self, other: Any) -> None:
        pass


@pytest.fixture
def kept(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, FakeRing, list[Any]]]:
    """Kept tables of 4 slots over host tensors, the ring's stand-in, the device waits."""
    ring, waits = FakeRing(), []

    def copy(host: Any, device: Any, m: int, stream: Any) -> int:
        device[:m].copy_(host[:m])
        return int(device.data_ptr())

    monkeypatch.setattr(kt, "_copy", copy)
    monkeypatch.setattr(kt, "_ring", lambda device: ring)
    monkeypatch.setattr(kt, "KEPT_SLOTS", 4)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waits.append(device))
    tables = kt.KeptTables("cpu")
    tables._host = torch.zeros((4, kt.KEPT_SLOT), dtype=torch.int64)
    tables._twin = torch.full((4, kt.KEPT_SLOT), -1, dtype=torch.int64)
    yield tables, ring, waits


def test_a_capture_takes_slots_of_its_own_and_never_the_ring(
        kept: tuple[Any, FakeRing, list[Any]]) -> None:
    tables, ring, _ = kept
    with kt.keeping(tables):
        first = kt.table_on_device([1, 2, 3], FakeStream())
        second = kt.table_on_device([4, 5], FakeStream())
    assert first != second and tables.used == 2 and not ring.tables
    assert tables._twin[0, :3].tolist() == [1, 2, 3] and tables._twin[1, :2].tolist() == [4, 5]
    assert first == tables._twin[0].data_ptr() and second == tables._twin[1].data_ptr()
    assert kt.table_on_device([6], FakeStream()) == -1  # outside a capture: the ring's
    assert ring.tables == [[6]] and tables.used == 2


def test_slots_run_out_and_a_table_can_outgrow_one(
        kept: tuple[Any, FakeRing, list[Any]]) -> None:
    tables, _, _ = kept
    with pytest.raises(RuntimeError, match="no kept table slot"):
        tables.put(list(range(kt.KEPT_SLOT + 1)), FakeStream())
    for value in range(4):
        tables.put([value], FakeStream())
    with pytest.raises(RuntimeError, match="4 of 4 used"):
        tables.put([9], FakeStream())
    assert tables._twin[:, 0].tolist() == [0, 1, 2, 3]  # nothing rewritten


def test_reset_frees_the_slots_once_the_device_is_past_them(
        kept: tuple[Any, FakeRing, list[Any]]) -> None:
    tables, _, waits = kept
    tables.reset()
    assert not waits  # nothing used: nothing to wait for
    address = tables.put([7], FakeStream())
    tables.reset()
    assert len(waits) == 1 and tables.used == 0
    assert tables.put([8], FakeStream()) == address  # its slot reused after the wait


def test_no_slots_on_the_host() -> None:
    """A host device launches no kernel: nothing is allocated, and a put finds no slot."""
    tables = kt.KeptTables("cpu")
    tables.allocate()
    with pytest.raises(RuntimeError, match="no kept table slot"):
        tables.put([1], FakeStream())


def test_decode_graphs_capture_within_their_tables_and_reset_them(
        kept: tuple[Any, FakeRing, list[Any]], monkeypatch: pytest.MonkeyPatch) -> None:
    """A captured call's tables are the graphs' kept ones; clearing the graphs frees them."""
    tables, ring, waits = kept
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(_graphs, "current_stream", lambda device: FakeStream())
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    graphs = _graphs.DecodeGraphs("cpu")
    graphs.on, graphs._tables = True, tables

    def launching(hidden: Any, index: Any, weights: Any) -> Any:
        kt.table_on_device([int(hidden.shape[0])], FakeStream())
        return hidden * 2

    hidden = torch.ones(3, 4)
    index, weights = torch.zeros(3, 2, dtype=torch.int64), torch.ones(3, 2)
    for _ in range(3):  # as it is (the ring); captured (a kept slot), replayed; replayed
        graphs.call("layer 0", 7, launching, hidden, index, weights)
    assert ring.tables == [[3]] and tables.used == 1 and graphs.replays == 2
    graphs.clear()
    assert tables.used == 0 and len(waits) == 1

