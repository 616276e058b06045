"""The CUDA C source of ``moestream.gpu.dequant``'s kernels: GGUF quantized blocks to float32,
bitwise what gguf-py's ``gguf.quants.dequantize`` computes.

One kernel a type, ``dequant_<TYPE>(const Row* rows)``: ``blockIdx.y`` picks a row (a
matrix's blocks and where its values go), the grid strides over the row's values, one thread
a value. The values are the foundation's routines (``ggml_values``: gguf-py's float32
operations in its order, tables from gguf-py), so the source also builds as host C++ for the
tests that check it without a GPU.
"""

from __future__ import annotations

from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from moestream.pipeline.foundation.compute import DEQUANTIZED
from moestream.pipeline.foundation.ggml_values import value_source

__all__ = ["KERNELS", "dequant_source"]

KERNELS: dict[Q, str] = {q: f"dequant_{q.name.lower()}" for q in sorted(DEQUANTIZED)}
"""Each type's kernel name (``Row``: source address, destination address, blocks)."""

_ROW = r"""
struct Row {
    unsigned long long src;     // the matrix's blocks (device address)
    unsigned long long dst;     // its float32 values (device address)
    unsigned long long blocks;  // how many blocks
};

"""

_KERNEL = r"""
extern "C" __global__ void dequant_{name}(const Row* rows) {{
    const Row row = rows[blockIdx.y];
    const unsigned char* src = (const unsigned char*)row.src;
    float* dst = (float*)row.dst;
    const unsigned long long n = row.blocks * {elems}ull;
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
         i < n; i += stride)
        dst[i] = {name}(src + (i / {elems}ull) * {size}ull, (int)(i % {elems}ull));
}}
"""


def dequant_source() -> str:
    """The kernels' CUDA C: the tables and value routines, the row, a kernel a type."""
    kernels = "".join(
        _KERNEL.format(name=name.removeprefix("dequant_"), elems=GGML_QUANT_SIZES[q][0],
                       size=GGML_QUANT_SIZES[q][1])
        for q, name in KERNELS.items())
    return value_source() + _ROW + kernels
