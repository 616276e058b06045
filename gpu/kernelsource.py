"""The CUDA C source of ``moestream.gpu.kernels``' raw kernels, compiled by CuPy.

Kept apart from the Python that launches them (``CudaKernels``) so each side reads on its
own: this is device code, with its own layout rules (a ``Copy`` row is ``COPY_FIELDS``
uint64 fields, in that order; ``digest3`` and ``gather`` produce the two sums of
``moestream.pipeline.foundation.digest``).
"""

from __future__ import annotations

__all__ = ["CUDA_SOURCE"]

CUDA_SOURCE = r"""
extern "C" __global__ void digest3(const unsigned char* base,
                                   unsigned long long off0, unsigned long long n0,
                                   unsigned long long off1, unsigned long long n1,
                                   unsigned long long off2, unsigned long long n2,
                                   unsigned long long* out) {
    // blockIdx.y picks the matrix: out[2*y] += sum(w), out[2*y+1] += sum(w * (i + 1))
    unsigned long long off = blockIdx.y == 0 ? off0 : (blockIdx.y == 1 ? off1 : off2);
    unsigned long long nbytes = blockIdx.y == 0 ? n0 : (blockIdx.y == 1 ? n1 : n2);
    const unsigned char* data = base + off;
    unsigned long long n = nbytes / 4;
    const unsigned int* w = (const unsigned int*)data;
    unsigned long long s1 = 0, s2 = 0;
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
         i < n; i += stride) {
        unsigned long long v = w[i];
        s1 += v;
        s2 += v * (i + 1);
    }
    if (blockIdx.x == 0 && threadIdx.x == 0 && (nbytes & 3)) {
        unsigned long long v = 0;
        for (unsigned long long b = n * 4; b < nbytes; ++b)
            v |= ((unsigned long long)data[b]) << (8 * (b - n * 4));
        s1 += v;
        s2 += v * (n + 1);
    }
    for (int o = 16; o > 0; o >>= 1) {
        s1 += __shfl_down_sync(0xffffffffu, s1, o);
        s2 += __shfl_down_sync(0xffffffffu, s2, o);
    }
    if ((threadIdx.x & 31) == 0) {
        atomicAdd(&out[2 * blockIdx.y], s1);
        atomicAdd(&out[2 * blockIdx.y + 1], s2);
    }
}

// One row per copy: a layer's resident misses in one launch (``CudaKernels.gather``).
struct Copy {
    unsigned long long src;   // device-readable address of registered host memory
    unsigned long long dst;   // device address
    unsigned long long n;     // bytes
    unsigned long long out;   // two uint64 digest sums (digest3's row), 0 for none
    unsigned long long flip;  // byte offset to invert (the ``corrupt`` fault), ~0 for none
};

__device__ __forceinline__ void add_word(unsigned long long v, unsigned long long i,
                                         unsigned long long& s1, unsigned long long& s2) {
    s1 += v;
    s2 += v * (i + 1);
}

extern "C" __global__ void gather(const Copy* copies) {
    // blockIdx.y picks the copy; the row lives in mapped pinned host memory: read it once
    __shared__ Copy c;
    if (threadIdx.x == 0) c = copies[blockIdx.y];
    __syncthreads();
    const unsigned long long n = c.n;
    const unsigned long long first = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    unsigned long long s1 = 0, s2 = 0, done;
    if (((c.src | c.dst) & 15) == 0) {           // 16-byte loads: the common case
        const uint4* src = (const uint4*)c.src;
        uint4* dst = (uint4*)c.dst;
        done = n / 16 * 16;
        for (unsigned long long i = first; i < n / 16; i += stride) {
            uint4 v = src[i];
            if (c.flip - i * 16 < 16) {
                unsigned int b = (unsigned int)(c.flip - i * 16);
                ((unsigned int*)&v)[b >> 2] ^= 0xFFu << (8 * (b & 3));
            }
            dst[i] = v;
            add_word(v.x, 4 * i, s1, s2);
            add_word(v.y, 4 * i + 1, s1, s2);
            add_word(v.z, 4 * i + 2, s1, s2);
            add_word(v.w, 4 * i + 3, s1, s2);
        }
    } else {                                     // any alignment: words of single bytes
        const unsigned char* src = (const unsigned char*)c.src;
        unsigned char* dst = (unsigned char*)c.dst;
        done = n / 4 * 4;
        for (unsigned long long i = first; i < n / 4; i += stride) {
            unsigned long long v = 0;
            for (int k = 0; k < 4; ++k) {
                unsigned char b = src[4 * i + k];
                if (4 * i + k == c.flip) b ^= 0xFF;
                dst[4 * i + k] = b;
                v |= (unsigned long long)b << (8 * k);
            }
            add_word(v, i, s1, s2);
        }
    }
    if (blockIdx.x == 0 && threadIdx.x == 0) {   // the tail: whole words, zero-padded
        const unsigned char* src = (const unsigned char*)c.src;
        unsigned char* dst = (unsigned char*)c.dst;
        for (unsigned long long w = done; w < n; w += 4) {
            unsigned long long v = 0;
            for (unsigned long long b = w; b < w + 4 && b < n; ++b) {
                unsigned char x = src[b];
                if (b == c.flip) x ^= 0xFF;
                dst[b] = x;
                v |= (unsigned long long)x << (8 * (b - w));
            }
            add_word(v, w / 4, s1, s2);
        }
    }
    if (c.out == 0) return;
    for (int o = 16; o > 0; o >>= 1) {
        s1 += __shfl_down_sync(0xffffffffu, s1, o);
        s2 += __shfl_down_sync(0xffffffffu, s2, o);
    }
    if ((threadIdx.x & 31) == 0) {
        unsigned long long* out = (unsigned long long*)c.out;
        atomicAdd(out, s1);
        atomicAdd(out + 1, s2);
    }
}

extern "C" __global__ void busy_ns(unsigned long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < ns);
}
"""
