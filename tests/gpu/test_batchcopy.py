"""``gpu.batchcopy``: the driver's batched copy as the uploader hands it a layer, and what a
refused batch leaves behind.

The driver call itself needs a GPU (the pipeline's GPU tests run every copy-engine miss
through it); here its arguments are checked on a stand-in for the driver function, and
``Uploader.upload_layer``'s failure path on the host backend.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import pytest

from moestream.gpu.batchcopy import BatchCopy, open_batch_copy
from moestream.gpu.host import HostBackend
from moestream.pipeline.foundation.errors import UploadError
from moestream.stages.upload import Uploader
from tests.stages.test_upload import SIZE, _Layer


class _Driver:
    """Records what ``cuMemcpyBatchAsync`` would have been given, and answers ``status``."""

    def __init__(self, status: int = 0) -> None:
        self.status = status
        self.calls: list[dict[str, Any]] = []

    def __call__(self, dsts: int, srcs: int, sizes: int, n: int, attrs: Any, first: Any,
                 n_attrs: int, *rest: Any) -> int:
        def read(address: int) -> list[int]:
            return list((ctypes.c_uint64 * n).from_address(address))

        self.calls.append({"dsts": read(dsts), "srcs": read(srcs), "sizes": read(sizes),
                           "n_attrs": n_attrs, "stream": rest[-1], "rest": len(rest)})
        return self.status


def _error_name(status: int, out: Any) -> int:
    ctypes.cast(out, ctypes.POINTER(ctypes.c_char_p))[0] = b"CUDA_ERROR_INVALID_VALUE"
    return 0


class TestBatchCopy:
    @pytest.mark.parametrize("fail_index", [False, True])
    def test_rows_reach_the_driver(self, fail_index: bool) -> None:
        """Host addresses, device addresses and sizes as three arrays of n, one set of
        attributes for all, the stream last (CUDA 12.8's form has a failure index)."""
        driver = _Driver()
        copy = BatchCopy(driver, None, fail_index, device=0)
        rows = np.array(((0x1000, 0x2000, 0x3000), (0xA000, 0xB000, 0xC000), (16, 32, 48)),
                        dtype=np.uint64)
        copy(rows, 77)
        (call,) = driver.calls
        assert call["srcs"] == [0x1000, 0x2000, 0x3000]
        assert call["dsts"] == [0xA000, 0xB000, 0xC000]
        assert call["sizes"] == [16, 32, 48]
        assert call["n_attrs"] == 1 and call["stream"] == 77
        assert call["rest"] == (2 if fail_index else 1)

    def test_a_strided_view_is_made_contiguous(self) -> None:
        driver = _Driver()
        wide = np.arange(12, dtype=np.uint64).reshape(3, 4)
        BatchCopy(driver, None, False, device=0)(wide[:, ::2], 0)
        assert driver.calls[0]["srcs"] == [0, 2]
        assert driver.calls[0]["sizes"] == [8, 10]

    def test_refusal_names_the_error(self) -> None:
        copy = BatchCopy(_Driver(status=1), _error_name, False, device=0)
        with pytest.raises(UploadError, match="batched host-to-device copy of 1 pieces "
                                              "failed: CUDA_ERROR_INVALID_VALUE"):
            copy(np.zeros((3, 1), dtype=np.uint64), 0)
        bare = BatchCopy(_Driver(status=700), None, False, device=0)
        with pytest.raises(UploadError, match="CUresult 700"):
            bare(np.zeros((3, 1), dtype=np.uint64), 0)

    def test_no_driver_no_batch(self) -> None:
        try:
            ctypes.CDLL("libcuda.so.1")
        except OSError:
            assert open_batch_copy(0) is None
        else:  # a CUDA machine: the 12.8+ driver has it
            assert open_batch_copy(0) is not None


class _Refusing(HostBackend):
    def copy_h2d_batch(self, copies: Any, stream: Any) -> None:
        raise UploadError("refused (test)")


def test_a_refused_batch_fails_the_layer_and_installs_nothing() -> None:
    layer = _Layer(3)
    try:
        layer.uploader = Uploader(_Refusing(), 2)
        for entry in layer.entries:
            layer.backend.device_bytes(entry.buffer, 0, SIZE)[:] = 0xA5
        out = layer.uploader.upload_layer(layer.kernels, layer.items((100, 5000)))
        assert all(isinstance(e, UploadError) and "refused (test)" in str(e) for e in out)
        assert all(entry.upload is None for entry in layer.entries)
        assert not layer.results.any()  # no digest launch after a refused copy
        assert layer.uploader.copies == 0 and layer.uploader.bytes_uploaded == 0
        for entry in layer.entries:  # nothing was written into the buffers
            assert (layer.backend.device_bytes(entry.buffer, 0, SIZE) == 0xA5).all()
    finally:
        layer.close()


def test_host_backend_batch_copies_bytes() -> None:
    """The host backend's batch is real copies by address (the deferred test backends run
    it in stream order)."""
    src = np.arange(64, dtype=np.uint8)
    dst = np.zeros(64, dtype=np.uint8)
    rows = np.array(((src.ctypes.data, src.ctypes.data + 40), (dst.ctypes.data + 8,
                     dst.ctypes.data), (16, 8)), dtype=np.uint64)
    HostBackend().copy_h2d_batch(rows, HostBackend().new_stream())
    assert dst[8:24].tolist() == list(range(16)) and dst[:8].tolist() == list(range(40, 48))
    assert not dst[24:].any()
