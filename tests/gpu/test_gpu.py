"""The CuPy backend end to end (marked ``gpu``; skipped where no CUDA device answers)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from moestream.gpu.cuda import unavailable_reason
from moestream.pipeline.cli.run import run
from moestream.pipeline.foundation.config import Budget, ComputeSpec
from moestream.pipeline.foundation.digest import digest_bytes
from moestream.pipeline.proxy.config import RunConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason())),
]


class TestKernels:
    """The device digest equals the host digest, tail bytes included."""

    @pytest.mark.parametrize("row", [0, 5])
    @pytest.mark.parametrize("nbytes", [4, 4096, 2162688, 2162690, 7077887])
    def test_digest3(self, nbytes: int, row: int) -> None:
        from moestream.gpu.cuda import CudaDeviceBuffer, CudaStream
        from moestream.gpu.kernels import CudaKernels

        data = np.random.default_rng(nbytes).integers(0, 256, 3 * nbytes + 1024, np.uint8)
        buf = CudaDeviceBuffer(data.size)
        import cupy

        cupy.cuda.runtime.memcpy(buf.ptr, data.ctypes.data, data.size,
                                 cupy.cuda.runtime.memcpyHostToDevice)
        k = CudaKernels()
        results = k.new_results(row + 3)  # rows of a later expert: addressed, not sliced
        # device buffers hold each matrix 256-aligned (the kernel reads 4-byte words)
        second = (nbytes + 255) // 256 * 256
        third = (second + nbytes + 255) // 256 * 256
        ranges = [(0, nbytes), (second, nbytes), (third, nbytes - 1)]
        stream = CudaStream()
        k.digest3(buf, ranges, results, row, stream)
        stream.synchronize()
        got = k.read_results(results, row + 3)[row:].tolist()
        assert k.read_results(results, row).tolist() == [0] * row  # the rows before: untouched
        want = [digest_bytes(data[o : o + n]) for o, n in ranges]
        assert got == want


@pytest.mark.parametrize("batched", [True, False])
def test_batched_copy_from_registered_windows(tmp_path: Path, batched: bool) -> None:
    """A layer's copies from a mapping registered in windows, cut at the windows, as one
    ``cuMemcpyBatchAsync`` (and, with the driver's call taken away, one copy a piece as on
    a driver before 12.8): the device holds exactly the file's bytes, at odd offsets."""
    import cupy

    from moestream.gpu.cuda import CupyBackend
    from moestream.stages.mapping import ModelMapping

    data = np.random.default_rng(7).integers(0, 256, 4 << 20, dtype=np.uint8)
    path = tmp_path / "blob.bin"
    path.write_bytes(data.tobytes())
    backend = CupyBackend(0)
    if not batched:
        backend._batch = None
    ranges = [(1001, 700_001), (1_048_000, 1_200_003), (3_000_017, 1_000_000)]
    with ModelMapping(path, backend, window_bytes=1 << 20) as mapping:
        mapping.register_resident_windows()
        assert all(mapping.is_registered(off, n) for off, n in ranges)
        dst = backend.alloc_device(sum(n for _, n in ranges))
        srcs, dsts, sizes, at = [], [], [], 0
        for off, n in ranges:
            for piece_at, piece_n in mapping.spans(off, n):
                srcs.append(mapping.address(off + piece_at))
                dsts.append(dst.ptr + at + piece_at)
                sizes.append(piece_n)
            at += n
        assert len(sizes) > len(ranges)  # some range crosses a window
        stream = backend.new_stream()
        with backend.activate():
            backend.copy_h2d_batch(np.array((srcs, dsts, sizes), dtype=np.uint64), stream)
            stream.synchronize()
            got = cupy.asnumpy(backend.device_bytes(dst, 0, dst.nbytes))
        dst.close()
    want = np.concatenate([data[off : off + n] for off, n in ranges])
    assert np.array_equal(got, want)


class TestEndToEnd:
    """Every mode and compute kind verifies on the GPU."""

    @pytest.mark.parametrize("mode", ["direct", "resident"])
    @pytest.mark.parametrize("compute", ["real", "digest", "fixed"])
    @pytest.mark.parametrize("prefetch", ["none", "oracle"])
    def test_run(self, tiny_model: Path, mode: str, compute: str, prefetch: str) -> None:
        cfg = RunConfig(model=tiny_model, tokens=8, mode=mode,  # type: ignore[arg-type]
                        compute=ComputeSpec(compute, 0.2 if compute == "fixed" else 0.0),  # type: ignore[arg-type]
                        budget=Budget(experts=14), backend="cupy", prefetch=prefetch,
                        lookahead=2)
        summary = asyncio.run(run(cfg))
        assert summary.mismatches == 0 and summary.verified >= summary.misses > 0
        assert summary.peak_device_bytes <= summary.budget_bytes
        assert summary.allocations == summary.frees

    @pytest.mark.parametrize("compute", ["real", "fixed"])
    @pytest.mark.parametrize("prefetch", ["none", "oracle"])
    def test_resident_on_the_copy_engines(self, tiny_model: Path, compute: str,
                                          prefetch: str) -> None:
        """``--no-gather``: a layer's misses as one batched copy on one stream, their
        install digests in one launch after them (``Uploader.upload_layer``)."""
        cfg = RunConfig(model=tiny_model, tokens=8, mode="resident", gather=False,
                        compute=ComputeSpec(compute, 0.2 if compute == "fixed" else 0.0),  # type: ignore[arg-type]
                        budget=Budget(experts=14), backend="cupy", prefetch=prefetch,
                        lookahead=2)
        summary = asyncio.run(run(cfg))
        assert summary.mismatches == 0 and summary.verified >= summary.misses > 0
        assert summary.allocations == summary.frees
