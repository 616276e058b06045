"""Tests of stages.upload on the host backend: ``Uploader.upload_layer`` (a layer's copies as
one batched copy on one stream, their install digests in one in-place ``gather`` launch, one
event) and ``Installer`` (uploaded entries become ready once their events complete)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moestream.gpu.cache.store import DeviceCache, Entry
from moestream.gpu.cuda import unavailable_reason
from moestream.gpu.host import HostBackend
from moestream.gpu.kernels import HostKernels
from moestream.pipeline.foundation.errors import UploadError
from moestream.pipeline.foundation.faults import parse_faults
from moestream.stages.upload import Installer, Uploader

SIZE = 8192


def _sums(data: bytes) -> tuple[int, int]:
    """The digest's two sums, written out plainly: little-endian 32-bit words (the last
    zero-padded), their sum and their sum weighted by position from 1, modulo 2**64."""
    padded = data + bytes(-len(data) % 4)
    words = [int.from_bytes(padded[i:i + 4], "little") for i in range(0, len(padded), 4)]
    return (sum(words) % (1 << 64),
            sum((i + 1) * w for i, w in enumerate(words)) % (1 << 64))


class _Layer:
    """``n`` experts of one layer in a host cache, their bytes and a results array."""

    def __init__(self, n: int, faults: str = "", seed: int = 0, *, gpu: bool = False) -> None:
        self.backend: Any = HostBackend()
        self.kernels: Any = HostKernels()
        if gpu:
            from moestream.gpu.cuda import CupyBackend
            from moestream.gpu.kernels import CudaKernels

            self.backend, self.kernels = CupyBackend(0), CudaKernels()
        self.cache = DeviceCache(self.backend, 1 << 20)
        self.entries: list[Entry] = self.cache.plan_layer(
            [(0, e) for e in range(n)], [SIZE] * n).misses
        self.results = self.kernels.new_results(3 * n)
        rng = np.random.default_rng(seed)
        self.data = [rng.integers(0, 256, SIZE, dtype=np.uint8) for _ in range(n)]
        self._pinned = []
        if gpu:  # copies come from pinned (or registered) memory, as upload_layer asks
            self._pinned = [self.backend.alloc_host(SIZE) for _ in range(n)]
            for pinned, data in zip(self._pinned, self.data, strict=True):
                pinned.array[:] = data
            self.data = [pinned.array for pinned in self._pinned]
        self.uploader = Uploader(self.backend, 2, parse_faults(faults) if faults else None)

    def items(self, cuts: tuple[int, int]) -> list[tuple[Entry, list[tuple[int, int, int]],
                                                         list[tuple[int, int, int]]]]:
        """Per expert: two copies split at ``cuts[0]``, three digest ranges split at
        ``cuts`` (odd offsets and sizes: the word-by-byte paths too)."""
        a, b = cuts
        out = []
        for i, (entry, data) in enumerate(zip(self.entries, self.data, strict=True)):
            row = self.kernels.results_address(self.results, 3 * i)
            at = data.ctypes.data
            out.append((entry, [(0, at, a), (a, at + a, SIZE - a)],
                        [(0, a, row), (a, b - a, row + 16), (b, SIZE - b, row + 32)]))
        return out

    def close(self) -> None:
        self.cache.close()
        for pinned in self._pinned:
            pinned.close()


class TestUploadLayer:
    @settings(max_examples=25, deadline=None)
    @given(a=st.integers(1, SIZE - 2), width=st.integers(1, SIZE - 2))
    def test_digests_are_the_copied_bytes(self, a: int, width: int) -> None:
        b = min(SIZE - 1, a + width)
        layer = _Layer(3)
        try:
            out = layer.uploader.upload_layer(layer.kernels, layer.items((a, b)))
            assert all(not isinstance(e, Exception) for e in out)
            assert out[0] is out[1] is out[2]  # one event for the layer
            assert all(entry.upload is out[0] for entry in layer.entries)
            for i, (entry, data) in enumerate(zip(layer.entries, layer.data, strict=True)):
                copied = layer.backend.device_bytes(entry.buffer, 0, SIZE)
                assert np.array_equal(copied, data)  # the in-place pass left the bytes
                raw = data.tobytes()
                expected = [_sums(raw[:a]), _sums(raw[a:b]), _sums(raw[b:])]
                assert [tuple(int(v) for v in layer.results[3 * i + m]) for m in range(3)] \
                    == expected
            assert layer.uploader.copies == 6 and layer.uploader.bytes_uploaded == 3 * SIZE
        finally:
            layer.close()

    def test_a_failed_expert_fails_alone(self) -> None:
        layer = _Layer(3, faults="upload@2")
        try:
            out = layer.uploader.upload_layer(layer.kernels, layer.items((100, 5000)))
            assert isinstance(out[1], UploadError) and "injected" in str(out[1])
            assert out[0] is out[2] and not isinstance(out[0], Exception)
            assert layer.entries[1].upload is None
            assert not layer.results[3:6].any()  # its rows were never digested
            assert layer.results[:3].all() and layer.results[6:].all()
        finally:
            layer.close()

    def test_corrupt_copy_changes_its_digest(self) -> None:
        """The ``corrupt`` fault inverts a byte after the copies, before the digests."""
        layer = _Layer(2, faults="corrupt@2")
        try:
            layer.uploader.upload_layer(layer.kernels, layer.items((4096, 6000)))
            clean = layer.data[0].tobytes()
            assert tuple(int(v) for v in layer.results[0]) == _sums(clean[:4096])
            bad = layer.data[1].tobytes()
            assert tuple(int(v) for v in layer.results[3]) != _sums(bad[:4096])
            assert tuple(int(v) for v in layer.results[4]) == _sums(bad[4096:6000])
        finally:
            layer.close()

    def test_nothing_queued(self) -> None:
        layer = _Layer(1, faults="upload@1")
        try:
            (out,) = layer.uploader.upload_layer(layer.kernels, layer.items((10, 20)))
            assert isinstance(out, UploadError)
        finally:
            layer.close()

    def test_empty_layer(self) -> None:
        layer = _Layer(1)
        try:
            assert layer.uploader.upload_layer(layer.kernels, []) == []
        finally:
            layer.close()


@pytest.mark.gpu
@pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))
@pytest.mark.parametrize("cuts", [(4096, 6144), (1001, 5003)])
def test_on_the_gpu(cuts: tuple[int, int]) -> None:
    """The same on CUDA streams and the gather kernel: aligned rows take its 16-byte
    loads, odd ones its byte path; the second expert's copy corrupted."""
    import cupy

    layer = _Layer(3, faults="corrupt@2", gpu=True)
    try:
        with layer.backend.activate():
            out = layer.uploader.upload_layer(layer.kernels, layer.items(cuts))
            event = out[0]
            assert out[1] is event and out[2] is event and not isinstance(event, Exception)
            event.synchronize()
            sums = cupy.asnumpy(layer.results)
            a, b = cuts
            for i, data in enumerate(layer.data):
                raw = bytearray(data.tobytes())
                if i == 1:
                    raw[a // 2] ^= 0xFF  # ``corrupt`` inverts the first piece's middle byte
                got = cupy.asnumpy(layer.backend.device_bytes(layer.entries[i].buffer, 0, SIZE))
                assert got.tobytes() == bytes(raw)
                expected = [_sums(bytes(raw[:a])), _sums(bytes(raw[a:b])), _sums(bytes(raw[b:]))]
                assert [tuple(int(v) for v in sums[3 * i + m]) for m in range(3)] == expected
    finally:
        layer.uploader.close()
        layer.close()


# -- Installer: uploaded entries become ready once their events complete ---------------

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
