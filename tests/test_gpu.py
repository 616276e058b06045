"""The CuPy backend end to end (marked ``gpu``; skipped where no CUDA device answers)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from gpu.cuda import unavailable_reason
from pipeline.foundation.config import Budget, ComputeSpec, RunConfig
from pipeline.foundation.digest import digest_bytes
from pipeline.run import run

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason())),
]


class TestKernels:
    """The device digest equals the host digest, tail bytes included."""

    @pytest.mark.parametrize("row", [0, 5])
    @pytest.mark.parametrize("nbytes", [4, 4096, 2162688, 2162690, 7077887])
    def test_digest3(self, nbytes: int, row: int) -> None:
        from gpu.cuda import CudaDeviceBuffer, CudaStream
        from gpu.kernels import CudaKernels

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
