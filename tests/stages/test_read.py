"""Tests for the read stage: aligned covers (stages.layout), O_DIRECT reads and their fallback
(moestream.stages.reader), the mapping (moestream.stages.mapping)."""

from __future__ import annotations

import itertools
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from structlog.testing import capture_logs

from moestream.gpu.backend import aligned_host_array
from moestream.gpu.host import HostBackend
from moestream.pipeline.foundation.errors import ReadError
from moestream.pipeline.foundation.faults import parse_faults
from moestream.pipeline.foundation.table import ByteRange, ExpertTable
from moestream.stages.layout import DEVICE_ALIGN, aligned_cover, iter_chunks, plan_expert
from moestream.stages.mapping import ModelMapping
from moestream.stages.reader import ModelReader
from moestream.stages.residency import evict, libc


class TestAlignment:
    """Covers are aligned, contain the range and are no larger than needed."""

    @given(st.integers(0, 1 << 40), st.integers(1, 1 << 26), st.sampled_from([512, 4096]))
    def test_cover(self, offset: int, nbytes: int, align: int) -> None:
        start, length = aligned_cover(offset, nbytes, align)
        assert start % align == 0 and length % align == 0
        assert start <= offset and offset + nbytes <= start + length
        assert offset - start < align and start + length - (offset + nbytes) < align

    @given(st.integers(0, 1 << 30), st.integers(1, 1 << 24), st.integers(4096, 1 << 22))
    def test_chunks_tile_the_range(self, start: int, length: int, chunk: int) -> None:
        pieces = list(iter_chunks(start, length, chunk))
        assert pieces[0][0] == start
        assert sum(n for _, n in pieces) == length
        assert all(n <= chunk for _, n in pieces)
        assert all(a + n == b for (a, n), (b, _) in itertools.pairwise(pieces))

    def test_expert_layout(self, tiny_table: ExpertTable) -> None:
        layout = plan_expert(tiny_table.slices((1, 3)))
        for staged in layout.ranges:
            assert staged.slot_offset % 4096 == 0
            assert staged.device_offset % DEVICE_ALIGN == 0
            assert 0 <= staged.skip < 4096
        assert layout.device_bytes >= tiny_table.slices((1, 3)).nbytes


def _read(path: Path, offset: int, nbytes: int) -> bytes:
    with path.open("rb") as f:
        f.seek(offset)
        return f.read(nbytes)


class TestModelReader:
    """Direct and buffered reads return the file's bytes; refusals fall back once."""

    @pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
    def test_reads_file_bytes(self, tiny_model: Path, tiny_table: ExpertTable,
                              direct: bool) -> None:
        r = tiny_table.slices((2, 5)).down
        start, length = aligned_cover(r.offset, r.nbytes)
        buf = aligned_host_array(length)
        with ModelReader(tiny_model, direct=direct) as reader:
            reader.read_into(buf, start, direct=direct)
        skip = r.offset - start
        assert buf[skip : skip + r.nbytes].tobytes() == _read(tiny_model, r.offset, r.nbytes)

    def test_short_file_end_is_fine_but_past_end_fails(self, tmp_path: Path) -> None:
        path = tmp_path / "f.bin"
        path.write_bytes(os.urandom(10000))
        buf = aligned_host_array(8192)
        with ModelReader(path, direct=False) as reader:
            assert reader.read_into(buf, 4096, direct=False) == 10000 - 4096
            with pytest.raises(ReadError):
                reader.read_range(9000, 2000)

    def test_refused_o_direct_falls_back_once(self, tiny_model: Path) -> None:
        # tmpfs refuses O_DIRECT on older kernels only; the refusal is injected (EINVAL)
        with capture_logs() as logs:
            reader = ModelReader(tiny_model, direct=True,
                                 faults=parse_faults("odirect_einval@1"))
            buf = aligned_host_array(8192)
            reader.read_into(buf, 0, direct=True)
            reader.read_into(buf, 8192, direct=True)
            assert not reader.direct
            reader.close()
        fallbacks = [e for e in logs if e["event"] == "o_direct_fallback"]
        assert len(fallbacks) == 1
        assert "O_DIRECT read refused" in fallbacks[0]["reason"]
        assert buf.tobytes() == _read(tiny_model, 8192, 8192)

    @pytest.mark.parametrize("fault", ["read_eio@1+", "short@1+"])
    def test_read_faults_raise_read_error(self, tiny_model: Path, fault: str) -> None:
        """Persistent faults outlive the retries (transient ones: tests/test_faults.py)."""
        buf = aligned_host_array(8192)
        with ModelReader(tiny_model, direct=True, faults=parse_faults(fault),
                         backoff_ms=0.1) as reader, pytest.raises(ReadError, match=str(tiny_model)):
            reader.read_into(buf, 0, direct=True)


class TestModelMapping:
    """The mapping's window pieces concatenate to the range's bytes."""

    @given(st.integers(0, 600_000), st.integers(1, 300_000))
    def test_pieces(self, offset: int, nbytes: int) -> None:
        path = Path(os.environ.get("MOESTREAM_TEST_MAP", "/proc/self/exe")).resolve()
        size = path.stat().st_size
        offset, nbytes = min(offset, size - 1), min(nbytes, size - min(offset, size - 1))
        with ModelMapping(path, HostBackend(), window_bytes=65536) as mapping:
            pieces = mapping.pieces(offset, nbytes)
            data = b"".join(view.tobytes() for _, view in pieces)
            assert all(v.size <= 65536 for _, v in pieces)
            assert pieces[0][0] == 0
        assert data == _read(path, offset, nbytes)

    def test_only_resident_windows_are_registered(
        self, tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        class Registering(HostBackend):
            registers_host = True

            def register_host(self, array: np.ndarray) -> bool:
                return True

        # a copy of its own: the shared model's pages are evicted by other tests' cold reads
        model = Path(shutil.copyfile(tiny_model, tmp_path / "tiny.gguf"))
        model.read_bytes()  # every page resident
        evict(model, [ByteRange(3 << 20, 1 << 20)])  # but window 3
        with ModelMapping(model, Registering(), window_bytes=1 << 20) as mapping:
            added = mapping.register_resident_windows()
            assert mapping.is_registered(0, 3 << 20)
            assert not mapping.is_registered(3 << 20, 10)
            assert added >= 3 and mapping.registered_bytes == mapping.file_bytes - (1 << 20)
            _read(model, 3 << 20, 1 << 20)  # window 3 resident again
            assert mapping.register_resident_windows() == 1
            assert mapping.registered_bytes == mapping.file_bytes

            def no_check(*_: object) -> bool:
                raise AssertionError("a registered window was checked again")

            monkeypatch.setattr(libc, "all_resident", no_check)
            assert mapping.register_resident_windows() == 0
        assert mapping.registered_bytes == 0
