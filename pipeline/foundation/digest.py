"""Position-sensitive 64-bit digest of a byte range, identical on host and device.

Why not a cryptographic hash: the decoder must check every expert it installs at device
memory speed, with a kernel that reads every byte once. This digest is a weighted word sum
(Fletcher-like): it catches flipped, zeroed, shifted and swapped words, and the CuPy kernel
in ``moestream.gpu.kernels`` computes the same value on the device. Bytes are read as little-endian
uint32 words, the tail zero-padded to a whole word.

``RunningDigest`` computes the same value over a range fed in pieces of any size (the
digest manifest of a file streams its experts through fixed buffers); ``digest_bytes`` is
one whole range fed at once.
"""

from __future__ import annotations

import functools

import numpy as np
import numpy.typing as npt

__all__ = ["GOLDEN", "RunningDigest", "digest_bytes", "mix_digest", "mix_digests"]

GOLDEN = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1
_BLOCK_WORDS = 1 << 20  # words summed per numpy call: bounds the temporaries at 8 MiB


@functools.cache
def _weights() -> npt.NDArray[np.uint64]:
    """1..``_BLOCK_WORDS``, made on first use (8 MiB: not in every process that imports this),
    read-only and shared by every thread."""
    weights = np.arange(1, _BLOCK_WORDS + 1, dtype=np.uint64)
    weights.setflags(write=False)
    return weights


def mix_digest(s1: int, s2: int) -> int:
    """Combine the plain word sum ``s1`` and the index-weighted sum ``s2`` into one value."""
    return (s2 + s1 * GOLDEN) & _MASK


def mix_digests(sums: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """``mix_digest`` of every (s1, s2) row of an (n, 2) uint64 array, in one numpy pass
    (uint64 arithmetic wraps modulo 2**64, as the mask does): a token's read-back costs
    microseconds, not one Python call per matrix."""
    with np.errstate(over="ignore"):
        mixed: npt.NDArray[np.uint64] = sums[:, 1] + sums[:, 0] * np.uint64(GOLDEN)
    return mixed


Bytes = npt.NDArray[np.uint8] | bytes | bytearray | memoryview


class RunningDigest:
    """``digest_bytes`` of a range fed in consecutive pieces of any length.

    Words are counted from the first byte fed: sum(w) and sum(w * (i + 1)) modulo 2**64,
    where a block of words starting at word ``k`` adds ``sum(w_j * (j + 1)) + k * sum(w_j)``
    to the weighted sum. Up to three bytes that do not yet make a word wait for the next
    piece; ``value`` pads them with zeros, as ``digest_bytes`` pads a tail. numpy releases
    the GIL in the sums, so threads digest in parallel.
    """

    __slots__ = ("_carry", "_s1", "_s2", "_words")

    def __init__(self) -> None:
        self._s1 = 0
        self._s2 = 0
        self._words = 0
        self._carry = b""

    def update(self, data: Bytes) -> RunningDigest:
        """Feed the next bytes of the range; returns self."""
        raw = data if isinstance(data, np.ndarray) else np.frombuffer(data, dtype=np.uint8)
        if self._carry:
            need = 4 - len(self._carry)
            head = self._carry + raw[:need].tobytes()
            raw = raw[need:]
            if len(head) < 4:
                self._carry = head
                return self
            self._carry = b""
            self._add_word(int.from_bytes(head, "little"))
        whole = raw.size - raw.size % 4
        if whole < raw.size:
            self._carry = raw[whole:].tobytes()
        words = raw[:whole].view("<u4")
        for start in range(0, words.size, _BLOCK_WORDS):
            self._add_block(words[start : start + _BLOCK_WORDS])
        return self

    def _add_word(self, word: int) -> None:
        self._words += 1
        self._s1 = (self._s1 + word) & _MASK
        self._s2 = (self._s2 + word * self._words) & _MASK

    def _add_block(self, words: npt.NDArray[np.uint32]) -> None:
        wide = words.astype(np.uint64)
        s1 = int(wide.sum(dtype=np.uint64))
        s2 = int(np.dot(wide, _weights()[: wide.size]))  # wraps modulo 2**64, as the kernel
        self._s2 = (self._s2 + s2 + self._words * s1) & _MASK
        self._s1 = (self._s1 + s1) & _MASK
        self._words += int(wide.size)

    def value(self) -> int:
        """The digest of everything fed so far (a partial word counts zero-padded)."""
        s1, s2 = self._s1, self._s2
        if self._carry:
            word = int.from_bytes(self._carry, "little")
            s1 = (s1 + word) & _MASK
            s2 = (s2 + word * (self._words + 1)) & _MASK
        return mix_digest(s1, s2)


def digest_bytes(data: Bytes) -> int:
    """Digest of ``data``: sum(w) and sum(w * (i + 1)) over its uint32 words, mixed.

    Args:
        data: the bytes, as a contiguous uint8 array or a bytes-like object.
    """
    return RunningDigest().update(data).value()
