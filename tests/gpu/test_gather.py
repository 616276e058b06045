"""``Kernels.gather``: a layer's copies from registered host memory in one launch, each
range digested as it is written.

The host kernels are checked over any sizes and alignments (hypothesis); the CUDA kernel
(marked ``gpu``) against the same bytes and digests, from a registered read-only mapping
as resident mode gives it, at aligned and odd offsets, the ``corrupt`` byte included.
"""

from __future__ import annotations

import mmap
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moestream.gpu.cuda import unavailable_reason
from moestream.gpu.host import HostStream
from moestream.gpu.kernels import NO_FLIP, HostKernels, copy_rows
from moestream.pipeline.foundation.digest import digest_bytes, mix_digests

_NO_CUDA = unavailable_reason()


def _case(seed: int, sizes: list[int], skews: list[int]) -> tuple[npt.NDArray[np.uint8],
                                                                  list[tuple[int, int]]]:
    """Random source bytes and (offset, nbytes) ranges in it at the given skews."""
    rng = np.random.default_rng(seed)
    ranges, at = [], 0
    for n, skew in zip(sizes, skews, strict=True):
        ranges.append((at + skew, n))
        at += skew + n + 64
    return rng.integers(0, 256, at + 64, dtype=np.uint8), ranges


def _expected(src: npt.NDArray[np.uint8], ranges: list[tuple[int, int]],
              flip: int | None) -> tuple[list[bytes], list[int]]:
    """The bytes each range must land as, and their digests (the first range's middle byte
    inverted when ``flip``)."""
    out = []
    for i, (off, n) in enumerate(ranges):
        data = src[off : off + n].copy()
        if i == 0 and flip is not None:
            data[flip] ^= 0xFF
        out.append(data)
    return [d.tobytes() for d in out], [digest_bytes(d) for d in out]


class TestHostGather:
    @settings(max_examples=60, deadline=None)
    @given(sizes=st.lists(st.integers(1, 5000), min_size=1, max_size=6),
           skew=st.integers(0, 31), dst_skew=st.integers(0, 15), corrupt=st.booleans(),
           seed=st.integers(0, 2**16))
    def test_bytes_and_digests(self, sizes: list[int], skew: int, dst_skew: int,
                               corrupt: bool, seed: int) -> None:
        src, ranges = _case(seed, sizes, [skew] * len(sizes))
        dst = np.zeros(sum(sizes) + 64 * len(sizes) + dst_skew, dtype=np.uint8)
        k = HostKernels()
        results = k.new_results(len(ranges))
        flip = sizes[0] // 2 if corrupt else None
        rows, at = [], dst_skew
        for i, (off, n) in enumerate(ranges):
            rows.append((src.ctypes.data + off, dst.ctypes.data + at, n,
                         k.results_address(results, i),
                         flip if i == 0 and flip is not None else NO_FLIP))
            at += n + 64
        k.gather(copy_rows([f for row in rows for f in row]), HostStream())
        want, digests = _expected(src, ranges, flip)
        at = dst_skew
        for (_, n), data in zip(ranges, want, strict=True):
            assert dst[at : at + n].tobytes() == data
            at += n + 64
        assert mix_digests(results).tolist() == digests

    def test_no_digest_row_writes_none(self) -> None:
        src = np.arange(1000, dtype=np.uint8)
        dst = np.zeros(1000, dtype=np.uint8)
        k = HostKernels()
        results = k.new_results(1)
        k.gather(copy_rows([src.ctypes.data, dst.ctypes.data, 1000, 0, NO_FLIP]),
                 HostStream())
        assert (dst == src).all()
        assert not results.any()


@pytest.mark.gpu
@pytest.mark.skipif(_NO_CUDA is not None, reason=str(_NO_CUDA))
class TestCudaGather:
    """From a read-only file mapping registered as ``ModelMapping`` registers it."""

    @pytest.mark.parametrize(("sizes", "skew"), [
        ([884736, 884736, 884736], 0),      # Qwen3-30B-A3B Q4_K matrices, 16-byte aligned
        ([2162688, 2162688, 2162688], 32),  # ds4-flash-q2, GGUF-aligned
        ([4096, 13, 70001], 4),             # word-aligned, odd sizes
        ([1, 4095, 65537], 7),              # byte-aligned: the slow path, still exact
    ])
    @pytest.mark.parametrize("corrupt", [False, True])
    def test_matches_host(self, tmp_path: Path, sizes: list[int], skew: int,
                          corrupt: bool) -> None:
        import cupy

        from moestream.gpu.cuda import CudaDeviceBuffer, CudaStream, CupyBackend
        from moestream.gpu.kernels import CudaKernels

        src, ranges = _case(sum(sizes), sizes, [skew] * len(sizes))
        path = tmp_path / "model.bin"
        path.write_bytes(src.tobytes())
        backend = CupyBackend(0)
        assert backend.maps_host, "the H200 maps registered memory (the gather path)"
        with path.open("rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mapped:
            view: Any = np.frombuffer(mapped, dtype=np.uint8)
            assert backend.register_host(view)
            try:
                k = CudaKernels()
                stream = CudaStream()
                results = k.new_results(len(ranges))
                dst = CudaDeviceBuffer(sum(sizes) + 256 * len(sizes))
                flip = sizes[0] // 2 if corrupt else None
                rows, at, places = [], 0, []
                for i, (off, n) in enumerate(ranges):
                    rows.append((view.ctypes.data + off, dst.ptr + at, n,
                                 k.results_address(results, i),
                                 flip if i == 0 and flip is not None else NO_FLIP))
                    places.append(at)
                    at += (n + 255) // 256 * 256
                k.gather(copy_rows([f for row in rows for f in row]), stream)
                stream.synchronize()
                got = cupy.asnumpy(backend.device_bytes(dst, 0, dst.nbytes))
                want, digests = _expected(src, ranges, flip)
                for p, (_, n), data in zip(places, ranges, want, strict=True):
                    assert got[p : p + n].tobytes() == data
                assert k.read_results(results, len(ranges)).tolist() == digests
                del got
            finally:
                backend.unregister_host(view)
                del view
