"""The gather kernel: experts' matrices copied from the cache into stacked weights by a
device table of their addresses, in one launch on torch's stream.

A grouped or batched product takes its experts' weights stacked, as an experts module
keeps its own; the cache holds each expert in buffers of its own. Copying them one
``cudaMemcpyAsync`` a matrix costs host time a matrix; this kernel costs one launch a call,
whatever the number of experts (``WholeLayers``' slot tables, the lease path's stacking).
"""

from __future__ import annotations

import functools

from moestream.transformers._launch import RawLaunch

__all__ = ["THREADS", "blocks", "launch"]

THREADS = 256
_SOURCE = r"""
// slot j of the call gets expert slots[j]'s gate and up (in order, its first projection)
// and its down, copied from the cache by the layer's table of addresses (gate, up, down a
// row); a slot of -1 (fewer distinct experts than slots) is an empty group, left unwritten
__device__ void copy_bytes(unsigned char* dst, const unsigned char* src, long long n,
                           long long start, long long step) {
  unsigned long long bits = (unsigned long long)dst | (unsigned long long)src
                           | (unsigned long long)n;
  if ((bits & 15) == 0) {
    const uint4* s = (const uint4*)src;
    uint4* d = (uint4*)dst;
    for (long long i = start; i < n / 16; i += step) d[i] = s[i];
  } else if ((bits & 7) == 0) {  // a file mapping's tensors: safetensors pads to 8 bytes
    const uint2* s = (const uint2*)src;
    uint2* d = (uint2*)dst;
    for (long long i = start; i < n / 8; i += step) d[i] = s[i];
  } else {
    for (long long i = start; i < n; i += step) dst[i] = src[i];
  }
}

extern "C" __global__ void gather_experts(const long long* table, const long long* slots,
                                          unsigned char* first, unsigned char* down,
                                          long long gate_bytes, long long up_bytes,
                                          long long down_bytes) {
  long long expert = slots[blockIdx.y];
  if (expert < 0) return;
  const long long* row = table + 3 * expert;
  long long start = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  long long step = (long long)gridDim.x * blockDim.x;
  unsigned char* to = first + blockIdx.y * (gate_bytes + up_bytes);
  copy_bytes(to, (const unsigned char*)row[0], gate_bytes, start, step);
  copy_bytes(to + gate_bytes, (const unsigned char*)row[1], up_bytes, start, step);
  copy_bytes(down + blockIdx.y * down_bytes, (const unsigned char*)row[2], down_bytes, start,
             step);
}
"""


@functools.cache
def _kernel(device: int) -> RawLaunch:
    import cupy

    with cupy.cuda.Device(device):
        function = cupy.RawModule(code=_SOURCE).get_function("gather_experts")
    return RawLaunch(function, device, 7)


def launch(device: int, grid: tuple[int, int], stream: int, table: int, slots: int,
           first: int, down: int, sizes: tuple[int, int, int]) -> None:
    """The gather kernel on ``stream`` (torch's, a raw pointer): slot ``j`` of ``first``
    and ``down`` gets the matrices of row ``slots[j]`` of ``table`` (``sizes``: the gate,
    up and down bytes)."""
    _kernel(device)(stream, grid, THREADS, table, slots, first, down, *sizes)


def blocks(largest: int) -> int:
    """The grid's width for matrices of at most ``largest`` bytes: a 16-byte word a thread,
    at most 128 blocks a slot (the copies of several slots run side by side)."""
    return max(1, min(-(-largest // (16 * THREADS)), 128))
