"""The expert table: where every routed expert's bytes live in a GGUF model file.

Routed-expert tensors (``blk.N.ffn_{gate,up,down}_exps.weight`` or the fused
``ffn_gate_up_exps``) are 3-D with the expert dimension outermost, so expert ``e`` of a
tensor is one contiguous slice at ``offset + e * bytes_per_expert``. The table records, per
MoE layer, the three slices of each expert; everything the streaming pipeline reads is
described by it. The file is opened with gguf's reader (a memory map; nothing is read until
touched) and validated here, so every later stage may trust the offsets.
"""

from __future__ import annotations

import math
import mmap
import os
import re
import stat
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import (
    GGML_QUANT_SIZES,
    GGUF_DEFAULT_ALIGNMENT,
    GGMLQuantizationType,
    GGUFReader,
    GGUFValueType,
)
from gguf.gguf_reader import ReaderTensor

from gpu.policy import ExpertKey
from pipeline.errors import ExpertLayoutError, ModelFileError, NotGGUFError, TruncatedFileError

__all__ = ["ByteRange", "ExpertSlices", "ExpertTable", "MoeLayer", "TensorInfo", "open_table"]

_EXPERT_TENSOR = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down|gate_up)_exps\.weight$")
_GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True, slots=True)
class ByteRange:
    """A contiguous byte range of the model file."""

    offset: int
    nbytes: int

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


@dataclass(frozen=True, slots=True)
class ExpertSlices:
    """The gate, up and down byte ranges of one routed expert."""

    key: ExpertKey
    gate: ByteRange
    up: ByteRange
    down: ByteRange

    @property
    def ranges(self) -> tuple[ByteRange, ByteRange, ByteRange]:
        return (self.gate, self.up, self.down)

    @property
    def nbytes(self) -> int:
        return self.gate.nbytes + self.up.nbytes + self.down.nbytes


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """A tensor of the file that is not a routed expert (embeddings, attention, router...)."""

    name: str
    type_name: str
    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class MoeLayer:
    """One MoE layer: where its expert tensors start and how large one expert's slices are.

    ``gate_offset``/``up_offset``/``down_offset`` are the file offsets of expert 0; expert
    ``e`` starts ``e * <matrix>_bytes`` later. For the fused form, gate and up share one
    tensor and ``up_offset = gate_offset + gate_bytes`` with a stride of both.
    """

    index: int
    n_experts: int
    gate_up_type: GGMLQuantizationType
    down_type: GGMLQuantizationType
    gate_offset: int
    up_offset: int
    down_offset: int
    gate_bytes: int
    up_bytes: int
    down_bytes: int
    gate_up_stride: int
    fused_gate_up: bool
    router: TensorInfo | None
    shape: tuple[int, int]  # (hidden, expert_ffn)

    @property
    def expert_bytes(self) -> int:
        return self.gate_bytes + self.up_bytes + self.down_bytes

    def slices(self, expert: int) -> ExpertSlices:
        """The byte ranges of ``expert`` in this layer."""
        if not 0 <= expert < self.n_experts:
            raise IndexError(f"layer {self.index} has {self.n_experts} experts, not {expert}")
        return ExpertSlices(
            key=(self.index, expert),
            gate=ByteRange(self.gate_offset + expert * self.gate_up_stride, self.gate_bytes),
            up=ByteRange(self.up_offset + expert * self.gate_up_stride, self.up_bytes),
            down=ByteRange(self.down_offset + expert * self.down_bytes, self.down_bytes),
        )


@dataclass(frozen=True)
class ExpertTable:
    """Every routed expert of a model file, and what else the file holds.

    Attributes:
        path: the model file.
        file_bytes: its size.
        n_layers: all blocks of the model, dense and MoE.
        layers: the MoE layers by model layer index, ascending.
        top_k: experts selected per token per layer (from metadata; 6 when absent).
        hash_routed: how many of the first MoE layers route by token id (no router tensor).
        non_routed: every other tensor.
        digests: per (MoE layer position, expert, matrix) the expected digest, when the file
            carries ``moestream.expert_digests``; else None.
    """

    path: Path
    file_bytes: int
    n_layers: int
    layers: dict[int, MoeLayer]
    top_k: int
    hash_routed: int
    hidden: int
    non_routed: tuple[TensorInfo, ...]
    digests: np.ndarray | None

    @property
    def moe_layers(self) -> list[int]:
        return list(self.layers)

    @property
    def n_experts(self) -> int:
        return max(layer.n_experts for layer in self.layers.values())

    @property
    def routed_bytes(self) -> int:
        return sum(layer.n_experts * layer.expert_bytes for layer in self.layers.values())

    @property
    def non_routed_bytes(self) -> int:
        return sum(t.nbytes for t in self.non_routed)

    def slices(self, key: ExpertKey) -> ExpertSlices:
        """The byte ranges of expert ``key = (layer, expert)``."""
        layer, expert = key
        try:
            return self.layers[layer].slices(expert)
        except KeyError:
            raise IndexError(f"layer {layer} is not a MoE layer of {self.path}") from None

    def expert_bytes(self, layer: int) -> int:
        return self.layers[layer].expert_bytes

    def expected_digests(self, key: ExpertKey) -> tuple[int, int, int] | None:
        """The file's recorded digests of the gate, up and down slices of ``key``."""
        if self.digests is None:
            return None
        pos = self.moe_layers.index(key[0])
        row = self.digests[pos, key[1]]
        return (int(row[0]), int(row[1]), int(row[2]))

    def iter_slices(self) -> Iterator[ExpertSlices]:
        for layer in self.layers.values():
            for expert in range(layer.n_experts):
                yield layer.slices(expert)

    def summary(self) -> dict[str, object]:
        """A small JSON-ready description, for logs and the run header."""
        return {
            "path": str(self.path),
            "file_bytes": self.file_bytes,
            "n_layers": self.n_layers,
            "moe_layers": self.moe_layers,
            "n_experts": self.n_experts,
            "top_k": self.top_k,
            "hash_routed": self.hash_routed,
            "expert_bytes": [layer.expert_bytes for layer in self.layers.values()],
            "routed_bytes": self.routed_bytes,
            "non_routed_bytes": self.non_routed_bytes,
            "gate_up_type": next(iter(self.layers.values())).gate_up_type.name,
            "down_type": next(iter(self.layers.values())).down_type.name,
        }


# --- the header walk ---------------------------------------------------------------------
#
# Why a walk before gguf's reader: GGUFReader trusts every count and length in the file. It
# loops ``for idx in range(alen)`` over an array's length, and an element read past the end
# of its memory map comes back empty and advances 0 bytes, so a corrupt length of 2**60 spins
# forever while its lists grow; an array of arrays loops the same way; n_dims of 2**32-1 makes
# the rest of the file a list of dims; and it builds a numpy view per item (~20 us and ~800
# bytes each, measured with gguf 0.19), so even a length that fits the file can cost minutes
# and gigabytes. Instead of a GGUF parser of our own, one linear pass reads only the header's
# structure (counts, type codes, lengths, each tensor's dims, type and offset) with every read
# checked against the file size, and applies llama.cpp's limits (no nested arrays, tensor
# names under 64 bytes, at most 4 dims, tensor data laid out in order). It allocates nothing
# in proportion to a length and its loops are bounded by the file size and by
# ``_MAX_HEADER_ITEMS``; after it, gguf's reader parses the values of a header whose every
# loop is known to be short, and a cross-check of the two keeps them from drifting apart.

_SCALAR_BYTES: dict[int, int] = {
    GGUFValueType.UINT8: 1, GGUFValueType.INT8: 1, GGUFValueType.BOOL: 1,
    GGUFValueType.UINT16: 2, GGUFValueType.INT16: 2,
    GGUFValueType.UINT32: 4, GGUFValueType.INT32: 4, GGUFValueType.FLOAT32: 4,
    GGUFValueType.UINT64: 8, GGUFValueType.INT64: 8, GGUFValueType.FLOAT64: 8,
}
_INTEGER_TYPES = frozenset(_SCALAR_BYTES) - {
    GGUFValueType.BOOL, GGUFValueType.FLOAT32, GGUFValueType.FLOAT64}
_MIN_KV_BYTES = 8 + 4 + 1  # empty key, value type, a one-byte value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8  # empty name, n_dims 0, type, offset
_MAX_KEY_BYTES = 65535  # the GGUF spec: a key is at most 2**16 - 1 bytes
_MAX_NAME_BYTES = 63  # llama.cpp: GGML_MAX_NAME is 64 with the terminating NUL
_MAX_DIMS = 4  # llama.cpp: GGML_MAX_DIMS
# KV pairs + array items + tensors. Real models stay under 1M (a 262k vocabulary with scores
# and types is 0.8M); at gguf's reader cost this cap is ~40 s and ~1.7 GB at worst.
_MAX_HEADER_ITEMS = 1 << 21
_DIGESTS_KEY = "moestream.expert_digests"


def _one_line(text: str, limit: int = 160) -> str:
    """``text`` cut to ``limit`` characters with control characters escaped."""
    cut = text[:limit] + ("..." if len(text) > limit else "")
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in cut)


def _pad(offset: int, alignment: int) -> int:
    return offset + (-offset % alignment)


@dataclass(frozen=True, slots=True)
class _HeaderLayout:
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
        width = _SCALAR_BYTES.get(value_type)
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


def _walk_header(path: Path, buf: mmap.mmap) -> _HeaderLayout:
    """Check the structure of the header in ``buf`` (see the comment above ``_HeaderWalk``).

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
    walk.count(n_kv + n_tensors, "the metadata and tensor counts")
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
                raise NotGGUFError(path, f"general.alignment has type {value_type}, not UINT32")
            alignment = walk.u32(what)
            if alignment == 0 or alignment & (alignment - 1):
                raise NotGGUFError(path, f"general.alignment {alignment} is not a power of two")
        else:
            walk.values(value_type, 1, what)
    extents: list[tuple[str, int, int]] = []
    for index in range(n_tensors):
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
        extents.append((name, offset, n_elements * type_size // block))
    data_offset = _pad(walk.pos, alignment)
    expected = 0
    for name, offset, nbytes in extents:
        end = data_offset + offset + nbytes
        if end > walk.size:
            raise TruncatedFileError(path, f"tensor {name} data ends at byte {end}, past the end "
                                           f"of the file ({walk.size} bytes)")
        if offset != expected:
            raise NotGGUFError(path, f"tensor {name} has data offset {offset}, expected "
                                     f"{expected} (tensors lie in order, padded to {alignment})")
        expected = _pad(offset + nbytes, alignment)
    return _HeaderLayout(data_offset, n_tensors)


def _check_magic(path: Path, head: bytes) -> None:
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


# What gguf's reader may still raise after the walk: invalid UTF-8 in a key or tensor name
# (UnicodeDecodeError is a ValueError), a duplicate key (KeyError) or tensor name (ValueError),
# and, should the walk ever miss a case, its index and numpy errors.
_READER_ERRORS = (ValueError, IndexError, KeyError, OverflowError, TypeError, struct.error)


def _open_reader(path: Path) -> tuple[GGUFReader, int]:
    """gguf's reader on ``path`` and the file's size, after the header walk.

    Raises:
        ModelFileError: missing, a directory, unreadable; or one of its subclasses for a
            file that is not GGUF, is cut short, or is corrupt.
    """
    try:
        info = path.stat()
    except FileNotFoundError as exc:
        raise ModelFileError(path, "no such file") from exc
    except OSError as exc:
        raise ModelFileError(path, f"cannot open: {exc.strerror or exc}") from exc
    if stat.S_ISDIR(info.st_mode):
        raise ModelFileError(path, "is a directory, not a GGUF file")
    if not stat.S_ISREG(info.st_mode):
        raise ModelFileError(path, "is not a regular file")
    try:
        with path.open("rb") as f:
            _check_magic(path, f.read(8))
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                layout = _walk_header(path, buf)
        reader = GGUFReader(path)
    except OSError as exc:
        raise ModelFileError(path, f"cannot read: {exc.strerror or exc}") from exc
    except _READER_ERRORS as exc:
        reason = _one_line(str(exc) or type(exc).__name__)
        raise NotGGUFError(path, f"corrupt GGUF header ({reason})") from exc
    if reader.data_offset != layout.data_offset or len(reader.tensors) != layout.n_tensors:
        raise NotGGUFError(path, f"gguf's reader sees {len(reader.tensors)} tensors from byte "
                                 f"{reader.data_offset}, the header walk {layout.n_tensors} "
                                 f"from byte {layout.data_offset}")
    return reader, int(reader.data.shape[0])


def _metadata_int(path: Path, reader: GGUFReader, suffix: str) -> int | None:
    """The integer value of the first key ending in ``suffix``; None when there is none."""
    for name, field in reader.fields.items():
        if name.endswith(suffix):
            if len(field.types) != 1 or field.types[0] not in _INTEGER_TYPES:
                kinds = "/".join(t.name for t in field.types)
                raise ExpertLayoutError(path, f"metadata {name!r} is {kinds}, not an integer")
            return int(field.parts[field.data[0]][0])
    return None


def _read_digests(path: Path, reader: GGUFReader, n_moe: int, n_experts: int) -> np.ndarray | None:
    """The file's per-expert digests, shaped (MoE layer, expert, matrix); None when absent."""
    field = reader.fields.get(_DIGESTS_KEY)
    if field is None:
        return None
    expected = n_moe * n_experts * 3
    if field.types != [GGUFValueType.ARRAY, GGUFValueType.UINT64] or len(field.data) != expected:
        kinds = "/".join(t.name for t in field.types)
        raise ExpertLayoutError(path, f"{_DIGESTS_KEY} holds {len(field.data)} values ({kinds}), "
                                      f"expected {expected} UINT64: one per MoE layer, expert "
                                      f"and matrix")
    values = np.array([int(field.parts[i][0]) for i in field.data], dtype=np.uint64)
    return values.reshape(n_moe, n_experts, 3)


def open_table(path: str | os.PathLike[str]) -> ExpertTable:
    """Open ``path`` with gguf's reader, validate it, and build its expert table.

    Raises:
        ModelFileError: the path is missing, a directory or unreadable; its subclasses
            NotGGUFError, TruncatedFileError and ExpertLayoutError name the file's problem.
    """
    path = Path(path)
    reader, file_bytes = _open_reader(path)

    by_layer: dict[int, dict[str, ReaderTensor]] = {}
    non_routed: list[TensorInfo] = []
    routers: dict[int, TensorInfo] = {}
    n_blocks = 0
    for t in reader.tensors:
        # The header walk has checked that every tensor's data lies inside the file.
        info = TensorInfo(t.name, t.tensor_type.name, int(t.data_offset), int(t.n_bytes))
        block = re.match(r"^blk\.(\d+)\.", t.name)
        if block:
            n_blocks = max(n_blocks, int(block.group(1)) + 1)
        match = _EXPERT_TENSOR.match(t.name)
        if match is None:
            non_routed.append(info)
            router = re.match(r"^blk\.(\d+)\.ffn_gate_inp\.weight$", t.name)
            if router:
                routers[int(router.group(1))] = info
            continue
        layer, part = int(match.group(1)), match.group(2)
        # gguf order: ne0 (row length), ne1 (rows), ne2 (experts, outermost in memory)
        if len(t.shape) != 3:
            raise ExpertLayoutError(path, f"{t.name} is {len(t.shape)}-D, expected 3-D")
        by_layer.setdefault(layer, {})[part] = t

    if not by_layer:
        raise ExpertLayoutError(path, "no routed expert tensors (blk.N.ffn_*_exps.weight)")

    layers: dict[int, MoeLayer] = {}
    for index in sorted(by_layer):
        layers[index] = _build_layer(path, index, by_layer[index], routers.get(index))

    counts = {layer.n_experts for layer in layers.values()}
    if len(counts) != 1:
        raise ExpertLayoutError(path, f"MoE layers disagree on the expert count: {sorted(counts)}")
    hiddens = {layer.shape[0] for layer in layers.values()}
    if len(hiddens) != 1:
        raise ExpertLayoutError(path, f"MoE layers disagree on the hidden size: {sorted(hiddens)}")
    n_experts = counts.pop()
    top_k = _metadata_int(path, reader, ".expert_used_count")
    if top_k is None:
        top_k = min(6, n_experts)
    elif not 0 < top_k <= n_experts:
        raise ExpertLayoutError(path, f"expert_used_count {top_k} outside 1..{n_experts}")
    hash_routed = _metadata_int(path, reader, "moestream.hash_routed_layer_count") or 0
    if not 0 <= hash_routed <= len(layers):
        raise ExpertLayoutError(path, f"moestream.hash_routed_layer_count {hash_routed} outside "
                                      f"0..{len(layers)} (the MoE layer count)")
    block_count = _metadata_int(path, reader, ".block_count")
    if block_count is not None and block_count != n_blocks:
        raise ExpertLayoutError(path, f"block_count is {block_count}, but the tensors name "
                                      f"blocks 0..{n_blocks - 1}")
    return ExpertTable(
        path=path,
        file_bytes=file_bytes,
        n_layers=n_blocks,
        layers=layers,
        top_k=top_k,
        hash_routed=hash_routed,
        hidden=hiddens.pop(),
        non_routed=tuple(non_routed),
        digests=_read_digests(path, reader, len(layers), n_experts),
    )


def _experts_of(path: Path, index: int, t: ReaderTensor, name: str, n_experts: int) -> int:
    """Bytes of one expert's slice of ``t``, checking its expert count divides evenly."""
    if int(t.shape[2]) != n_experts:
        raise ExpertLayoutError(
            path, f"layer {index}: {name} has {int(t.shape[2])} experts, ffn_down_exps {n_experts}"
        )
    if int(t.n_bytes) % n_experts:
        raise ExpertLayoutError(path, f"layer {index}: {name} size not divisible by experts")
    return int(t.n_bytes) // n_experts


def _matrix_shape(t: ReaderTensor) -> tuple[int, int]:
    """One expert's (ne0, ne1) in gguf order: row length, then rows."""
    return int(t.shape[0]), int(t.shape[1])


def _build_layer(
    path: Path, index: int, parts: dict[str, ReaderTensor], router: TensorInfo | None
) -> MoeLayer:
    """One MoE layer from its expert tensors (``parts`` maps gate/up/down/gate_up)."""
    down = parts.get("down")
    if down is None:
        raise ExpertLayoutError(path, f"layer {index}: blk.{index}.ffn_down_exps.weight missing")
    n_experts = int(down.shape[2])
    if n_experts <= 0:
        raise ExpertLayoutError(path, f"layer {index}: zero experts in ffn_down_exps")
    down_bytes = _experts_of(path, index, down, "ffn_down_exps", n_experts)
    fused = parts.get("gate_up")
    if fused is not None:
        if "gate" in parts or "up" in parts:
            raise ExpertLayoutError(path, f"layer {index}: both fused and separate gate/up")
        stride = _experts_of(path, index, fused, "ffn_gate_up_exps", n_experts)
        if stride % 2 or int(fused.shape[1]) % 2:
            raise ExpertLayoutError(path, f"layer {index}: fused gate_up has an odd row count")
        gate_bytes = up_bytes = stride // 2
        gate_offset = int(fused.data_offset)
        up_offset = gate_offset + gate_bytes
        gate_up_type = fused.tensor_type
        hidden, ffn = int(fused.shape[0]), int(fused.shape[1]) // 2
    else:
        gate, up = parts.get("gate"), parts.get("up")
        if gate is None or up is None:
            missing = "ffn_gate_exps" if gate is None else "ffn_up_exps"
            raise ExpertLayoutError(path, f"layer {index}: blk.{index}.{missing}.weight missing")
        if gate.tensor_type != up.tensor_type:
            raise ExpertLayoutError(
                path,
                f"layer {index}: gate is {gate.tensor_type.name} but up is "
                f"{up.tensor_type.name}; they must share a type",
            )
        gate_bytes = _experts_of(path, index, gate, "ffn_gate_exps", n_experts)
        up_bytes = _experts_of(path, index, up, "ffn_up_exps", n_experts)
        if _matrix_shape(gate) != _matrix_shape(up):
            raise ExpertLayoutError(path, f"layer {index}: gate experts are "
                                          f"{_matrix_shape(gate)}, up experts {_matrix_shape(up)}")
        stride = gate_bytes
        gate_offset, up_offset = int(gate.data_offset), int(up.data_offset)
        gate_up_type = gate.tensor_type
        hidden, ffn = int(gate.shape[0]), int(gate.shape[1])
    block, type_size = GGML_QUANT_SIZES[gate_up_type]
    if hidden * ffn * type_size // block != gate_bytes:
        raise ExpertLayoutError(path, f"layer {index}: gate slice size does not match its shape")
    # down maps ffn back to hidden: ne0 = ffn, ne1 = hidden, the transpose of gate and up.
    if _matrix_shape(down) != (ffn, hidden):
        raise ExpertLayoutError(path, f"layer {index}: down experts are {_matrix_shape(down)}, "
                                      f"expected {(ffn, hidden)} for gate/up of {(hidden, ffn)}")
    if gate_bytes == 0 or down_bytes == 0:
        raise ExpertLayoutError(path, f"layer {index}: empty expert matrices {(hidden, ffn)}")
    return MoeLayer(
        index=index,
        n_experts=n_experts,
        gate_up_type=gate_up_type,
        down_type=down.tensor_type,
        gate_offset=gate_offset,
        up_offset=up_offset,
        down_offset=int(down.data_offset),
        gate_bytes=gate_bytes,
        up_bytes=up_bytes,
        down_bytes=down_bytes,
        gate_up_stride=stride,
        fused_gate_up=fused is not None,
        router=router,
        shape=(hidden, ffn),
    )
