"""Position-sensitive 64-bit digest of a byte range, identical on host and device.

Why not a cryptographic hash: the decoder must check every expert it installs at device
memory speed, with a kernel that reads every byte once. This digest is a weighted word sum
(Fletcher-like): it catches flipped, zeroed, shifted and swapped words, and the CuPy kernel
in ``gpu.kernels`` computes the same value on the device. Bytes are read as little-endian
uint32 words, the tail zero-padded to a whole word.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

__all__ = ["GOLDEN", "digest_bytes", "mix_digest"]

GOLDEN = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1


def mix_digest(s1: int, s2: int) -> int:
    """Combine the plain word sum ``s1`` and the index-weighted sum ``s2`` into one value."""
    return (s2 + s1 * GOLDEN) & _MASK


def digest_bytes(data: npt.NDArray[np.uint8] | bytes | memoryview) -> int:
    """Digest of ``data``: sum(w) and sum(w * (i + 1)) over its uint32 words, mixed.

    Args:
        data: the bytes, as a contiguous uint8 array or a bytes-like object.
    """
    raw = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data
    tail = raw.size % 4
    if tail:
        raw = np.concatenate([raw, np.zeros(4 - tail, dtype=np.uint8)])
    words = raw.view("<u4").astype(np.uint64)
    weights = np.arange(1, words.size + 1, dtype=np.uint64)
    s1 = int(words.sum(dtype=np.uint64))
    s2 = int((words * weights).sum(dtype=np.uint64))
    return mix_digest(s1, s2)
