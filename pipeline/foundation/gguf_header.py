"""The bounded GGUF header walk: a structural check of a model file before gguf's reader.

Split out of ``pipeline.foundation.table`` so the expert table keeps to building the table; this
module only decides whether a file's header is safe to hand to ``GGUFReader``.

Why a walk before gguf's reader: GGUFReader trusts every count and length in the file. It
loops ``for idx in range(alen)`` over an array's length, and an element read past the end
of its memory map comes back empty and advances 0 bytes, so a corrupt length of 2**60 spins
forever while its lists grow; an array of arrays loops the same way; n_dims of 2**32-1 makes
the rest of the file a list of dims; and it builds a numpy view per item (~20 us and ~800
bytes each, measured with gguf 0.19), so even a length that fits the file can cost minutes
and gigabytes. Instead of a GGUF parser of our own, one linear pass reads only the header's
structure (counts, type codes, lengths, each tensor's dims, type and offset) with every read
checked against the file size, and applies llama.cpp's limits (no nested arrays, tensor
names under 64 bytes, at most 4 dims, tensor data laid out in order). It allocates nothing
in proportion to a length and its loops are bounded by the file size, by
``_MAX_HEADER_ITEMS`` and by ``_MAX_TENSORS``; after it, gguf's reader parses the values of
a header whose every loop is known to be short, and a cross-check of the two (in
``moestream.pipeline.foundation.table``) keeps them from drifting apart.

``check_magic`` refuses a file without a GGUF magic and version; ``walk_header`` then checks
the rest of the header and returns its ``HeaderLayout``.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

from gguf import (
    GGML_QUANT_SIZES,
    GGUF_DEFAULT_ALIGNMENT,
    GGMLQuantizationType,
    GGUFReader,
    GGUFValueType,
)

from moestream.pipeline.foundation.errors import (
    ExpertLayoutError,
    NotGGUFError,
    TruncatedFileError,
)

__all__ = ["SCALAR_BYTES", "HeaderLayout", "check_magic", "metadata_int", "walk_header"]

_GGUF_MAGIC = b"GGUF"

SCALAR_BYTES: dict[int, int] = {
    GGUFValueType.UINT8: 1, GGUFValueType.INT8: 1, GGUFValueType.BOOL: 1,
    GGUFValueType.UINT16: 2, GGUFValueType.INT16: 2,
    GGUFValueType.UINT32: 4, GGUFValueType.INT32: 4, GGUFValueType.FLOAT32: 4,
    GGUFValueType.UINT64: 8, GGUFValueType.INT64: 8, GGUFValueType.FLOAT64: 8,
}
_INTEGER_TYPES = frozenset(SCALAR_BYTES) - {
    GGUFValueType.BOOL, GGUFValueType.FLOAT32, GGUFValueType.FLOAT64}
_MIN_KV_BYTES = 8 + 4 + 1  # empty key, value type, a one-byte value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8  # empty name, n_dims 0, type, offset
_MAX_KEY_BYTES = 65535  # the GGUF spec: a key is at most 2**16 - 1 bytes
_MAX_NAME_BYTES = 63  # llama.cpp: GGML_MAX_NAME is 64 with the terminating NUL
_MAX_DIMS = 4  # llama.cpp: GGML_MAX_DIMS
# KV pairs + array items + tensors. Real models stay under 1M (a 262k vocabulary with scores
# and types is 0.8M); at gguf's reader cost this cap is ~40 s and ~1.7 GB at worst.
_MAX_HEADER_ITEMS = 1 << 21
# Tensors cost gguf's reader more than array items: about 70 us and 5 KB of numpy views each
# (measured with gguf 0.19: 100,000 tensors take 7 s and 540 MB). A GGUF model fuses its
# experts three tensors a layer, so real ones hold a few thousand at most (DeepSeek-V3: 1,025).
_MAX_TENSORS = 1 << 16


def _pad(offset: int, alignment: int) -> int:
    return offset + (-offset % alignment)


@dataclass(frozen=True, slots=True)
class HeaderLayout:
    """What the header walk found: where tensor data starts and how many tensors there are."""

    data_offset: int
    n_tensors: int


class _HeaderWalk:
    """A cursor over the mapped file; every read is checked against the file size."""

    __slots__ = ("buf", "items", "path", "pos", "size")

    def __init__(self, path: Path, buf: mmap.mmap) -> None:
        self.path = path
        self.buf = buf
        self.size = len(buf)
        self.pos = 0
        self.items = 0

    def take(self, nbytes: int, what: str) -> int:
        """Step over ``nbytes`` bytes of ``what`` and return where they start."""
        start = self.pos
        if nbytes > self.size - start:
            raise TruncatedFileError(
                self.path,
                f"{what} at byte {start} needs {nbytes} bytes, past the end of the file "
                f"({self.size} bytes)",
            )
        self.pos = start + nbytes
        return start

    def u32(self, what: str) -> int:
        value: int = struct.unpack_from("<I", self.buf, self.take(4, what))[0]
        return value

    def u64(self, what: str) -> int:
        value: int = struct.unpack_from("<Q", self.buf, self.take(8, what))[0]
        return value

    def short_string(self, what: str, limit: int) -> bytes:
        """A key or name: its bytes, refused when longer than ``limit``."""
        at = self.pos
        nbytes = self.u64(f"{what} length")
        if nbytes > limit:
            raise NotGGUFError(self.path, f"{what} at byte {at} is {nbytes} bytes long "
                                          f"(the limit is {limit})")
        start = self.take(nbytes, what)
        return bytes(self.buf[start : start + nbytes])

    def count(self, n: int, what: str) -> None:
        """Count ``n`` items gguf's reader will build, refusing more than it can afford."""
        self.items += n
        if self.items > _MAX_HEADER_ITEMS:
            raise NotGGUFError(self.path, f"{what} brings the header to {self.items} items, "
                                          f"over the limit of {_MAX_HEADER_ITEMS} (corrupt?)")

    def values(self, value_type: int, n: int, what: str) -> None:
        """Step over ``n`` values of ``value_type`` (strings or scalars, not arrays)."""
        width = SCALAR_BYTES.get(value_type)
        if width is not None:
            self.take(n * width, what)
        elif value_type == GGUFValueType.STRING:
            if n * 8 > self.size - self.pos:
                raise TruncatedFileError(self.path, f"{what}: {n} strings at byte {self.pos} "
                                                    f"cannot fit in the file ({self.size} bytes)")
            for _ in range(n):
                self.take(self.u64(what), what)
        elif value_type == GGUFValueType.ARRAY:
            raise NotGGUFError(self.path, f"{what} is an array of arrays (llama.cpp refuses "
                                          f"them too)")
        else:
            raise NotGGUFError(self.path, f"{what} has value type {value_type}, not a GGUF type")


def walk_header(path: Path, buf: mmap.mmap) -> HeaderLayout:
    """Check the structure of the header in ``buf`` (see the module docstring).

    Raises:
        TruncatedFileError: a field, length or tensor runs past the end of the file.
        NotGGUFError: a type code, count or limit no GGUF reader accepts.
    """
    walk = _HeaderWalk(path, buf)
    walk.take(8, "magic and version")  # checked by the caller
    n_tensors = walk.u64("tensor count")
    n_kv = walk.u64("metadata count")
    if n_kv * _MIN_KV_BYTES + n_tensors * _MIN_TENSOR_INFO_BYTES > walk.size - walk.pos:
        raise TruncatedFileError(path, f"the header counts {n_kv} metadata entries and "
                                       f"{n_tensors} tensors, more than the file can hold")
    if n_tensors > _MAX_TENSORS:
        raise NotGGUFError(path, f"the header counts {n_tensors} tensors, over the limit of "
                                 f"{_MAX_TENSORS} for a model (real ones have a few thousand)")
    walk.count(n_kv + n_tensors, "the metadata and tensor counts")
    alignment = _walk_metadata(walk, n_kv)
    extents = [_walk_tensor_info(walk, index) for index in range(n_tensors)]
    data_offset = _pad(walk.pos, alignment)
    _check_extents(walk, data_offset, extents, alignment)
    return HeaderLayout(data_offset, n_tensors)


def _walk_metadata(walk: _HeaderWalk, n_kv: int) -> int:
    """Walk the ``n_kv`` metadata entries; the data's alignment (``general.alignment``, a
    power of two, or the default)."""
    alignment = GGUF_DEFAULT_ALIGNMENT
    for _ in range(n_kv):
        key = walk.short_string("metadata key", _MAX_KEY_BYTES)
        what = f"metadata {key.decode('utf-8', 'replace')[:80]!r}"
        value_type = walk.u32(f"{what} type")
        if value_type == GGUFValueType.ARRAY:
            item_type = walk.u32(f"{what} item type")
            n_items = walk.u64(f"{what} length")
            walk.values(item_type, n_items, what)
            walk.count(n_items, what)
        elif key == b"general.alignment":
            if value_type != GGUFValueType.UINT32:
                raise NotGGUFError(walk.path, f"general.alignment has type {value_type}, "
                                              f"not UINT32")
            alignment = walk.u32(what)
            if alignment == 0 or alignment & (alignment - 1):
                raise NotGGUFError(walk.path, f"general.alignment {alignment} is not a power "
                                              f"of two")
        else:
            walk.values(value_type, 1, what)
    return alignment


def _walk_tensor_info(walk: _HeaderWalk, index: int) -> tuple[str, int, int]:
    """Walk tensor ``index``'s info: its name (quoted), data offset and bytes."""
    path = walk.path
    name = repr(walk.short_string(f"tensor {index} name", _MAX_NAME_BYTES)
                .decode("utf-8", "replace"))
    n_dims = walk.u32(f"tensor {name} n_dims")
    if n_dims > _MAX_DIMS:
        raise NotGGUFError(path, f"tensor {name} has {n_dims} dimensions (at most {_MAX_DIMS})")
    dims = [walk.u64(f"tensor {name} dimensions") for _ in range(n_dims)]
    ggml_type = walk.u32(f"tensor {name} type")
    offset = walk.u64(f"tensor {name} data offset")
    n_elements = math.prod(dims)
    if n_elements >= 2**63 or any(d >= 2**63 for d in dims):
        raise NotGGUFError(path, f"tensor {name} has shape {dims}, too large for int64")
    try:
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError) as exc:
        problem = f"tensor {name} has type {ggml_type}, not a ggml type"
        raise NotGGUFError(path, problem) from exc
    if (dims[0] if dims else 1) % block:
        raise NotGGUFError(path, f"tensor {name} has rows of {dims[0]} elements, not a "
                                 f"multiple of its type's block of {block}")
    return name, offset, n_elements * type_size // block


def _check_extents(walk: _HeaderWalk, data_offset: int, extents: list[tuple[str, int, int]],
                   alignment: int) -> None:
    """The tensors' data lies in the file, in order, each padded to ``alignment``."""
    expected = 0
    for name, offset, nbytes in extents:
        end = data_offset + offset + nbytes
        if end > walk.size:
            raise TruncatedFileError(walk.path, f"tensor {name} data ends at byte {end}, past "
                                                f"the end of the file ({walk.size} bytes)")
        if offset != expected:
            raise NotGGUFError(walk.path, f"tensor {name} has data offset {offset}, expected "
                                          f"{expected} (tensors lie in order, padded to "
                                          f"{alignment})")
        expected = _pad(offset + nbytes, alignment)


def check_magic(path: Path, head: bytes) -> None:
    """Refuse a file that does not start with a GGUF magic and a version gguf reads."""
    if len(head) < 8:
        if not head:
            raise NotGGUFError(path, "empty file, not a GGUF model")
        if head == _GGUF_MAGIC[: len(head)] or head.startswith(_GGUF_MAGIC):
            raise TruncatedFileError(path, f"truncated GGUF header ({len(head)} bytes)")
        raise NotGGUFError(path, "not a GGUF file (too short for a header)")
    if head[:4] != _GGUF_MAGIC:
        raise NotGGUFError(path, f"not a GGUF file (magic {head[:4]!r}, expected b'GGUF')")
    version = int.from_bytes(head[4:8], "little")
    if version not in (2, 3):
        swapped = int.from_bytes(head[4:8], "big")
        hint = " (a big-endian file; only little-endian is read)" if swapped in (2, 3) else ""
        raise NotGGUFError(path, f"unsupported GGUF version {version} (expected 2 or 3){hint}")


def metadata_int(path: Path, reader: GGUFReader, key: str) -> int | None:
    """The integer value of metadata ``key`` in a walked header; None when it is absent.

    Raises:
        ExpertLayoutError: the key holds something other than one integer.
    """
    field = reader.fields.get(key)
    if field is None:
        return None
    if len(field.types) != 1 or field.types[0] not in _INTEGER_TYPES:
        kinds = "/".join(t.name for t in field.types)
        raise ExpertLayoutError(path, f"metadata {key!r} is {kinds}, not an integer")
    return int(field.parts[field.data[0]][0])
