"""The CUDA driver's batched copy (``cuMemcpyBatchAsync``, CUDA 12.8+), through ctypes.

Why: the copy engines pay a fixed cost per copy beside its bytes (~2.7 us on the H200), and
a GGUF file keeps an expert as one slice in each of its layer's three expert tensors, so a
layer's misses are three copies each, all small: one ``cudaMemcpyAsync`` a slice moved
0.5 MiB slices at 40.9 GB/s and 2 MiB ones at 49.3, against 55 for one GiB. Ten experts'
slices in one batched call moved 52.5 and 52.6 GB/s (``bench.strided`` on the H200,
``bench/results/batched-h200-33f25da/23e342e/``), and the host makes one call a layer
instead of one a slice. A strided copy (``cudaMemcpy2DAsync``, the three slices as rows)
would do as well but may not span two registrations, and the mapping is registered in
windows.

CuPy does not bind it; the driver library is there wherever CUDA is. CUDA 13 dropped the
failure index argument (``cuMemcpyBatchAsync_v2``); both forms are looked up.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import numpy.typing as npt

from moestream.pipeline.foundation.errors import UploadError

__all__ = ["BatchCopy", "open_batch_copy"]

_ORDER_STREAM = 1  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM: the source is read in stream order
_LOCATION_DEVICE, _LOCATION_HOST = 1, 2  # CUmemLocationType


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _Attributes(ctypes.Structure):
    """``CUmemcpyAttributes``: the source's access order, source and destination hints,
    flags."""

    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", _Location),
                ("dstLocHint", _Location), ("flags", ctypes.c_uint)]


class BatchCopy:
    """Host-to-device copies of one device as one driver call on a stream."""

    def __init__(self, fn: Any, error_name: Any, fail_index: bool, device: int) -> None:
        self._fn = fn
        self._error_name = error_name
        self._fail_index = fail_index
        # one set of attributes for every copy: pageable-or-registered host to this device
        self._attrs = _Attributes(_ORDER_STREAM, _Location(_LOCATION_HOST, 0),
                                  _Location(_LOCATION_DEVICE, device), 0)
        self._first = (ctypes.c_size_t * 1)(0)

    def __call__(self, copies: npt.NDArray[np.uint64], stream: int) -> None:
        """Queue ``copies`` ((3, n) uint64, C order: host addresses, device addresses,
        bytes) on ``stream`` (a ``CUstream``). The caller made the device current.

        Raises:
            UploadError: the driver refused the batch (nothing of it was queued).
        """
        n = copies.shape[1]
        rows = np.ascontiguousarray(copies, dtype=np.uint64)  # as given, from the uploader
        base = rows.ctypes.data  # ``rows`` stays referenced until the call returns
        args: list[object] = [base + 8 * n, base, base + 16 * n, n,
                              ctypes.byref(self._attrs), self._first, 1]
        if self._fail_index:
            args.append(ctypes.byref(ctypes.c_size_t(0)))
        args.append(stream)
        status = self._fn(*args)
        if status:
            raise UploadError(f"batched host-to-device copy of {n} pieces failed: "
                              f"{self._name(status)}")

    def _name(self, status: int) -> str:
        text = ctypes.c_char_p()
        if self._error_name is not None and not self._error_name(status, ctypes.byref(text)):
            return (text.value or b"").decode() or f"CUresult {status}"
        return f"CUresult {status}"


def open_batch_copy(device: int) -> BatchCopy | None:
    """The driver's batched copy for ``device``, or None where the driver has none (before
    CUDA 12.8, or no driver library)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    error_name = getattr(lib, "cuGetErrorName", None)
    if error_name is not None:
        error_name.restype = ctypes.c_int
        error_name.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    for name, fail_index in (("cuMemcpyBatchAsync_v2", False), ("cuMemcpyBatchAsync", True)):
        fn = getattr(lib, name, None)
        if fn is None:
            continue
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                       ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                       *([ctypes.c_void_p] if fail_index else []), ctypes.c_void_p]
        return BatchCopy(fn, error_name, fail_index, device)
    return None
