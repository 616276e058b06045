"""The expert table: where every routed expert's bytes live in the model's files.

Routed-expert tensors (``blk.N.ffn_{gate,up,down}_exps.weight`` or the fused
``ffn_gate_up_exps``) are 3-D with the expert dimension outermost, so expert ``e`` of a
tensor is one contiguous slice at ``offset + e * bytes_per_expert``. The table records, per
MoE layer, the three slices of each expert; everything the streaming pipeline reads is
described by it. The file is opened with gguf's reader (a memory map; nothing is read until
touched) and validated here, so every later stage may trust the offsets; before the reader,
``pipeline.foundation.gguf_header`` checks the header's structure within the file's bounds.

A Hugging Face checkpoint (a directory of safetensors shards, or one ``.safetensors`` file)
is the second source of the same table (``moestream.pipeline.foundation.safetensors_table``);
``open_table`` picks by the path. Either way the table's offsets are offsets of the model's
address space (``moestream.pipeline.foundation.files``), and the files it lists carry the identity
their one open saw: every later open is checked against it.
"""

from __future__ import annotations

import mmap
import os
import re
import struct
from pathlib import Path
from typing import NamedTuple

import numpy as np
from gguf import (
    GGML_QUANT_SIZES,
    GGMLQuantizationType,
    GGUFReader,
    GGUFValueType,
)
from gguf.gguf_reader import ReaderTensor

from moestream.pipeline.foundation.errors import (
    ExpertLayoutError,
    ModelChangedError,
    ModelFileError,
    NotGGUFError,
)
from moestream.pipeline.foundation.experts import (
    ByteRange,
    ExpertKey,
    ExpertSlices,
    ExpertTable,
    MoeLayer,
    TensorInfo,
)
from moestream.pipeline.foundation.files import (
    ModelFile,
    check_identity,
    lay_out,
    open_identified,
)
from moestream.pipeline.foundation.gguf_header import check_magic, metadata_int, walk_header
from moestream.pipeline.foundation.gguf_split import check_shards, shard_paths, split_of
from moestream.pipeline.foundation.safetensors_table import open_checkpoint

__all__ = ["ByteRange", "ExpertKey", "ExpertSlices", "ExpertTable", "MoeLayer", "TensorInfo",
           "open_gguf_table", "open_table"]

_EXPERT_TENSOR = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down|gate_up)_exps\.weight$")

_DIGESTS_KEY = "moestream.expert_digests"


def _one_line(text: str, limit: int = 160) -> str:
    """``text`` cut to ``limit`` characters with control characters escaped."""
    cut = text[:limit] + ("..." if len(text) > limit else "")
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in cut)


# What gguf's reader may still raise after the walk: invalid UTF-8 in a key or tensor name
# (UnicodeDecodeError is a ValueError), a duplicate key (KeyError) or tensor name (ValueError),
# and, should the walk ever miss a case, its index and numpy errors.
_READER_ERRORS = (ValueError, IndexError, KeyError, OverflowError, TypeError, struct.error)


def _open_reader(path: Path, fd: int, file: ModelFile) -> GGUFReader:
    """gguf's reader on the open ``fd`` of ``path``, after the header walk.

    The reader maps the descriptor's own file (``/proc/self/fd``), never the path again: a
    file renamed over ``path`` meanwhile is not the one parsed. The identity is checked once
    more after parsing, so a header written in place while it was read is caught.

    Raises:
        ModelFileError: unreadable; or one of its subclasses for a file that is not GGUF,
            is cut short, is corrupt, or changed while its header was read.
    """
    try:
        check_magic(path, os.pread(fd, 8, 0))
        with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as buf:
            layout = walk_header(path, buf)
        reader = GGUFReader(f"/proc/self/fd/{fd}")
    except OSError as exc:
        raise ModelFileError(path, f"cannot read: {exc.strerror or exc}") from exc
    except _READER_ERRORS as exc:
        reason = _one_line(str(exc) or type(exc).__name__)
        raise NotGGUFError(path, f"corrupt GGUF header ({reason})") from exc
    check_identity(file, fd)
    if reader.data_offset != layout.data_offset or len(reader.tensors) != layout.n_tensors:
        raise NotGGUFError(path, f"gguf's reader sees {len(reader.tensors)} tensors from byte "
                                 f"{reader.data_offset}, the header walk {layout.n_tensors} "
                                 f"from byte {layout.data_offset}")
    if int(reader.data.shape[0]) != file.nbytes:
        raise ModelChangedError(path, "resized while its header was read")
    return reader


def _metadata_int(path: Path, reader: GGUFReader, suffix: str) -> int | None:
    """The integer value of the first key ending in ``suffix``; None when there is none."""
    name = next((name for name in reader.fields if name.endswith(suffix)), None)
    return None if name is None else metadata_int(path, reader, name)


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
    """The expert table of a GGUF file, a checkpoint directory or one ``.safetensors`` file.

    Raises:
        ModelFileError: the path is missing, unreadable or of the wrong kind; its subclasses
            NotGGUFError, TruncatedFileError, ExpertLayoutError and ModelChangedError name
            the file's problem.
    """
    path = Path(path)
    if path.is_dir() or path.suffix == ".safetensors":
        return open_checkpoint(path)
    return open_gguf_table(path)


def open_gguf_table(path: Path) -> ExpertTable:
    """Open ``path`` with gguf's reader, validate it, and build its expert table. A shard of
    a split model (``NAME-0000K-of-0000N.gguf``) opens the whole split, its shards laid end
    to end in the model's address space (``pipeline.foundation.gguf_split``).

    Raises:
        ModelFileError: the path (or a shard of its split) is missing, a directory or
            unreadable; its subclasses NotGGUFError, TruncatedFileError and
            ExpertLayoutError name the file's problem.
    """
    fds: list[int] = []
    try:
        fd, identity = open_identified(path, "GGUF file")
        fds.append(fd)
        alone = lay_out([(path, identity)])
        reader = _open_reader(path, fd, alone[0])
        split = split_of(path, reader)
        if split is None:
            return _gguf_table(path, alone, [reader])
        paths = shard_paths(path, *split)
        opened = {path: (fd, identity)}
        for shard in paths:
            if shard not in opened:
                opened[shard] = open_identified(shard, "GGUF shard")
                fds.append(opened[shard][0])
        files = lay_out([(shard, opened[shard][1]) for shard in paths])
        readers = [reader if f.path == path else _open_reader(f.path, opened[f.path][0], f)
                   for f in files]
        check_shards(paths, readers)
        return _gguf_table(paths[0], files, readers)
    finally:
        for fd in fds:
            os.close(fd)


def _gguf_table(path: Path, files: tuple[ModelFile, ...],
                readers: list[GGUFReader]) -> ExpertTable:
    """The table of a parsed GGUF model: one file, or a split's shards (the first holds the
    metadata)."""
    placed = [t._replace(data_offset=f.base + int(t.data_offset))
              for f, r in zip(files, readers, strict=True) for t in r.tensors]
    by_layer, non_routed, routers, n_blocks = _sort_tensors(path, placed)
    if not by_layer:
        raise ExpertLayoutError(path, "no routed expert tensors (blk.N.ffn_*_exps.weight)")
    reader = readers[0]

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
    top_k, hash_routed = _routing(path, reader, n_experts, len(layers))
    block_count = _metadata_int(path, reader, ".block_count")
    if block_count is not None and block_count != n_blocks:
        raise ExpertLayoutError(path, f"block_count is {block_count}, but the tensors name "
                                      f"blocks 0..{n_blocks - 1}")
    return ExpertTable(
        path=path,
        file_bytes=files[-1].end,
        n_layers=n_blocks,
        layers=layers,
        top_k=top_k,
        hash_routed=hash_routed,
        hidden=hiddens.pop(),
        non_routed=tuple(non_routed),
        digests=_read_digests(path, reader, len(layers), n_experts),
        files=files,
        header_bytes=int(reader.data_offset),
    )


def _sort_tensors(path: Path, tensors: list[ReaderTensor]) -> tuple[
        dict[int, dict[str, ReaderTensor]], list[TensorInfo], dict[int, TensorInfo], int]:
    """The tensors by kind: routed ones by layer and part (gate, up, down, gate_up), the
    non-routed ones, routers by layer; and how many blocks the tensors name."""
    by_layer: dict[int, dict[str, ReaderTensor]] = {}
    non_routed: list[TensorInfo] = []
    routers: dict[int, TensorInfo] = {}
    n_blocks = 0
    names: set[str] = set()
    for t in tensors:
        if t.name in names:  # two shards of a split
            raise ExpertLayoutError(path, f"tensor {_one_line(t.name, 80)!r} is stored twice")
        names.add(t.name)
        # The header walk has checked that every tensor's data lies inside the file.
        info = TensorInfo(t.name, t.tensor_type.name, int(t.data_offset), int(t.n_bytes),
                          tuple(int(n) for n in reversed(t.shape)))
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
    return by_layer, non_routed, routers, n_blocks


def _routing(path: Path, reader: GGUFReader, n_experts: int, n_moe: int) -> tuple[int, int]:
    """The top-k (``expert_used_count``, else ``min(6, n_experts)``) and how many of the
    ``n_moe`` MoE layers are hash-routed, each checked against the layers."""
    top_k = _metadata_int(path, reader, ".expert_used_count")
    if top_k is None:
        top_k = min(6, n_experts)
    elif not 0 < top_k <= n_experts:
        raise ExpertLayoutError(path, f"expert_used_count {top_k} outside 1..{n_experts}")
    # ds4's files say it as deepseek4.hash_layer_count (its layers route by tid2eid)
    key = "moestream.hash_routed_layer_count"
    hash_routed = _metadata_int(path, reader, key)
    if hash_routed is None:
        key = "deepseek4.hash_layer_count"
        hash_routed = _metadata_int(path, reader, key) or 0
    if not 0 <= hash_routed <= n_moe:
        raise ExpertLayoutError(path, f"{key} {hash_routed} outside 0..{n_moe} (the MoE "
                                      f"layer count)")
    return top_k, hash_routed


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


class _GateUp(NamedTuple):
    """Where one expert's gate and up slices lie, and what they are."""

    gate_bytes: int
    up_bytes: int
    stride: int  # bytes from one expert's gate slice to the next's
    gate_offset: int
    up_offset: int
    type: GGMLQuantizationType
    hidden: int
    ffn: int


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
    g = (_separate_gate_up(path, index, parts, n_experts) if fused is None
         else _fused_gate_up(path, index, parts, fused, n_experts))
    hidden, ffn = g.hidden, g.ffn
    block, type_size = GGML_QUANT_SIZES[g.type]
    if hidden * ffn * type_size // block != g.gate_bytes:
        raise ExpertLayoutError(path, f"layer {index}: gate slice size does not match its shape")
    # down maps ffn back to hidden: ne0 = ffn, ne1 = hidden, the transpose of gate and up.
    if _matrix_shape(down) != (ffn, hidden):
        raise ExpertLayoutError(path, f"layer {index}: down experts are {_matrix_shape(down)}, "
                                      f"expected {(ffn, hidden)} for gate/up of {(hidden, ffn)}")
    if g.gate_bytes == 0 or down_bytes == 0:
        raise ExpertLayoutError(path, f"layer {index}: empty expert matrices {(hidden, ffn)}")
    return MoeLayer(
        index=index,
        n_experts=n_experts,
        gate_up_type=g.type,
        down_type=down.tensor_type,
        gate_offset=g.gate_offset,
        up_offset=g.up_offset,
        down_offset=int(down.data_offset),
        gate_bytes=g.gate_bytes,
        up_bytes=g.up_bytes,
        down_bytes=down_bytes,
        gate_up_stride=g.stride,
        fused_gate_up=fused is not None,
        router=router,
        shape=(hidden, ffn),
    )


def _fused_gate_up(path: Path, index: int, parts: dict[str, ReaderTensor],
                   fused: ReaderTensor, n_experts: int) -> _GateUp:
    """Gate and up as the two row halves of each expert's ``ffn_gate_up_exps`` slice."""
    if "gate" in parts or "up" in parts:
        raise ExpertLayoutError(path, f"layer {index}: both fused and separate gate/up")
    stride = _experts_of(path, index, fused, "ffn_gate_up_exps", n_experts)
    if stride % 2 or int(fused.shape[1]) % 2:
        raise ExpertLayoutError(path, f"layer {index}: fused gate_up has an odd row count")
    gate_offset = int(fused.data_offset)
    return _GateUp(stride // 2, stride // 2, stride, gate_offset, gate_offset + stride // 2,
                   fused.tensor_type, int(fused.shape[0]), int(fused.shape[1]) // 2)


def _separate_gate_up(path: Path, index: int, parts: dict[str, ReaderTensor],
                      n_experts: int) -> _GateUp:
    """Gate and up as slices of ``ffn_gate_exps`` and ``ffn_up_exps``, of one type and
    shape."""
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
    return _GateUp(gate_bytes, up_bytes, gate_bytes, int(gate.data_offset),
                   int(up.data_offset), gate.tensor_type, int(gate.shape[0]),
                   int(gate.shape[1]))
