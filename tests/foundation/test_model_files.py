"""A model of several files: one address space, page-aligned bases, reads split per file."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moestream.gpu.backend import aligned_host_array
from moestream.gpu.host import HostBackend
from moestream.pipeline.foundation.files import (
    PAGE_BYTES,
    FileIdentity,
    ModelFile,
    lay_out,
    locate,
    open_identified,
    pieces,
)
from moestream.stages.layout import aligned_cover
from moestream.stages.mapping import ModelMapping
from moestream.stages.reader import ModelReader
from moestream.stages.residency import Residency

SIZES = (5000, 8192, 12345, 1, 3 * PAGE_BYTES + 17)


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> tuple[tuple[ModelFile, ...], bytes]:
    """Files of odd sizes, and the model's address space as bytes (zeros in the padding)."""
    d = tmp_path_factory.mktemp("shards")
    rng = np.random.default_rng(3)
    found = []
    for i, size in enumerate(SIZES):
        path = d / f"s{i}.bin"
        path.write_bytes(rng.integers(0, 256, size, dtype=np.uint8).tobytes())
        fd, identity = open_identified(path)
        os.close(fd)
        found.append((path, identity))
    files = lay_out(found)
    space = bytearray(files[-1].span_end)
    for f in files:
        space[f.base : f.end] = f.path.read_bytes()
    return files, bytes(space[: files[-1].end])


def _identity(size: int) -> FileIdentity:
    return FileIdentity(0, 0, size, 0, 0)


class TestLayout:
    """Bases are page-aligned and follow each other's page-rounded ends."""

    @given(st.lists(st.integers(0, 5 * PAGE_BYTES), min_size=1, max_size=6))
    def test_bases(self, sizes: list[int]) -> None:
        files = lay_out([(Path(f"f{i}"), _identity(n)) for i, n in enumerate(sizes)])
        assert files[0].base == 0
        for a, b in itertools.pairwise(files):
            assert b.base % PAGE_BYTES == 0 and b.base == a.span_end >= a.end

    @settings(max_examples=60)
    @given(st.lists(st.integers(1, 5 * PAGE_BYTES), min_size=1, max_size=6),
           st.data())
    def test_pieces_cover_each_file_once(self, sizes: list[int], data: st.DataObject) -> None:
        files = lay_out([(Path(f"f{i}"), _identity(n)) for i, n in enumerate(sizes)])
        start = data.draw(st.integers(0, files[-1].end - 1))
        nbytes = data.draw(st.integers(1, files[-1].end - start))
        parts = list(pieces(files, start, nbytes))
        for p in parts:
            assert p.local >= 0 and p.local + p.nbytes <= p.file.nbytes
            assert p.file.base + p.local == start + p.at
            assert locate(files, start + p.at) is p.file
        data_bytes = sum(max(0, min(f.end, start + nbytes) - max(f.base, start)) for f in files)
        assert sum(p.nbytes for p in parts) == data_bytes


class TestReads:
    """Reads of any range of the space give the files' bytes, direct or buffered."""

    @pytest.mark.parametrize("direct", [True, False])
    def test_whole_space_in_chunks(self, shards: tuple[tuple[ModelFile, ...], bytes],
                                   direct: bool) -> None:
        files, space = shards
        with ModelReader(files, direct=direct) as reader:
            for chunk in (PAGE_BYTES, 3 * PAGE_BYTES, 1 << 20):
                got = bytearray()
                for at in range(0, files[-1].span_end, chunk):
                    buf = aligned_host_array(chunk)
                    n = reader.read_into(buf, at, direct=direct)
                    got += buf[:n].tobytes()
                assert bytes(got) == space
            assert reader.direct_refused is None or not direct

    def test_aligned_covers_of_ranges(self, shards: tuple[tuple[ModelFile, ...], bytes]) -> None:
        files, space = shards
        rng = np.random.default_rng(5)
        with ModelReader(files, direct=True) as reader:
            for f in files:
                for _ in range(20):
                    off = f.base + int(rng.integers(0, f.nbytes))
                    n = int(rng.integers(1, f.end - off + 1))
                    start, length = aligned_cover(off, n)
                    buf = aligned_host_array(length)
                    reader.read_into(buf, start, direct=True)
                    assert buf[off - start : off - start + n].tobytes() == space[off : off + n]
                    assert reader.read_range(off, n) == space[off : off + n]

    def test_mapping_places_each_file_at_its_base(
            self, shards: tuple[tuple[ModelFile, ...], bytes]) -> None:
        files, space = shards
        with ModelMapping(files, HostBackend(), window_bytes=2 * PAGE_BYTES) as mapping:
            assert mapping.array[: len(space)].tobytes() == space
            for f in files:
                for at, view in mapping.pieces(f.base, f.nbytes):
                    assert view.tobytes() == space[f.base + at : f.base + at + view.size]

    def test_residency_counts_data_only(self, shards: tuple[tuple[ModelFile, ...], bytes]) -> None:
        files, _ = shards
        for f in files:
            f.path.read_bytes()  # every page resident
        residency = Residency.of_files(files)
        assert residency.file_resident_bytes == sum(f.nbytes for f in files)
