"""The expert table: where every routed expert's bytes live in a GGUF model file.

Routed-expert tensors (``blk.N.ffn_{gate,up,down}_exps.weight`` or the fused
``ffn_gate_up_exps``) are 3-D with the expert dimension outermost, so expert ``e`` of a
tensor is one contiguous slice at ``offset + e * bytes_per_expert``. The table records, per
MoE layer, the three slices of each expert; everything the streaming pipeline reads is
described by it. The file is opened with gguf's reader (a memory map; nothing is read until
touched) and validated here, so every later stage may trust the offsets.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
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


def _field_int(reader: GGUFReader, suffix: str) -> int | None:
    for name, field in reader.fields.items():
        if name.endswith(suffix) and field.types and len(field.data) == 1:
            try:
                return int(field.parts[field.data[0]][0])
            except (TypeError, ValueError, IndexError):
                return None
    return None


def _read_digests(reader: GGUFReader, n_moe: int, n_experts: int) -> np.ndarray | None:
    field = reader.fields.get("moestream.expert_digests")
    if field is None:
        return None
    values = np.array([int(field.parts[i][0]) for i in field.data], dtype=np.uint64)
    if values.size != n_moe * n_experts * 3:
        return None
    return values.reshape(n_moe, n_experts, 3)


def _open_reader(path: Path) -> GGUFReader:
    """gguf's reader, with its errors (and a short header) mapped to ours."""
    try:
        with path.open("rb") as f:
            head = f.read(8)
    except FileNotFoundError:
        raise ModelFileError(path, "no such file") from None
    except IsADirectoryError:
        raise ModelFileError(path, "is a directory, not a GGUF file") from None
    except OSError as exc:
        raise ModelFileError(path, f"cannot open: {exc.strerror}") from None
    if len(head) < 8:
        if head == _GGUF_MAGIC[: len(head)] and head:
            raise TruncatedFileError(path, f"truncated GGUF header ({len(head)} bytes)")
        raise NotGGUFError(path, "not a GGUF file (too short for a header)")
    if head[:4] != _GGUF_MAGIC:
        raise NotGGUFError(path, f"not a GGUF file (magic {head[:4]!r}, expected b'GGUF')")
    version = int.from_bytes(head[4:8], "little")
    if version not in (2, 3):
        raise NotGGUFError(path, f"unsupported GGUF version {version} (expected 2 or 3)")
    try:
        return GGUFReader(path)
    except (ValueError, IndexError, KeyError, OverflowError, TypeError) as exc:
        # gguf's reader fails with these on a header cut short or with bad fields.
        reason = str(exc) or type(exc).__name__
        if "broadcast" in reason or "index" in reason.lower() or isinstance(exc, IndexError):
            raise TruncatedFileError(path, f"truncated or corrupt GGUF header ({reason})") from None
        raise NotGGUFError(path, f"unreadable GGUF header ({reason})") from None


def open_table(path: str | os.PathLike[str]) -> ExpertTable:
    """Open ``path`` with gguf's reader, validate it, and build its expert table.

    Raises:
        NotGGUFError, TruncatedFileError, ExpertLayoutError: with the path and the problem.
    """
    path = Path(path)
    reader = _open_reader(path)
    file_bytes = path.stat().st_size

    by_layer: dict[int, dict[str, ReaderTensor]] = {}
    non_routed: list[TensorInfo] = []
    routers: dict[int, TensorInfo] = {}
    n_blocks = 0
    for t in reader.tensors:
        info = TensorInfo(t.name, t.tensor_type.name, int(t.data_offset), int(t.n_bytes))
        if info.offset + info.nbytes > file_bytes:
            raise TruncatedFileError(
                path,
                f"tensor {t.name} data ends at byte {info.offset + info.nbytes}, "
                f"past the end of the file ({file_bytes} bytes)",
            )
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
    n_experts = counts.pop()
    top_k = _field_int(reader, ".expert_used_count") or min(6, n_experts)
    if not 0 < top_k <= n_experts:
        raise ExpertLayoutError(path, f"expert_used_count {top_k} outside 1..{n_experts}")
    hash_routed = _field_int(reader, "moestream.hash_routed_layer_count") or 0
    hidden = next(iter(layers.values())).shape[0]
    return ExpertTable(
        path=path,
        file_bytes=file_bytes,
        n_layers=max(n_blocks, _field_int(reader, ".block_count") or 0),
        layers=layers,
        top_k=top_k,
        hash_routed=hash_routed,
        hidden=hidden,
        non_routed=tuple(non_routed),
        digests=_read_digests(reader, len(layers), n_experts),
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
        if stride % 2:
            raise ExpertLayoutError(path, f"layer {index}: fused gate_up slice of odd size")
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
        if gate_bytes != up_bytes:
            raise ExpertLayoutError(path, f"layer {index}: gate and up experts differ in size")
        stride = gate_bytes
        gate_offset, up_offset = int(gate.data_offset), int(up.data_offset)
        gate_up_type = gate.tensor_type
        hidden, ffn = int(gate.shape[0]), int(gate.shape[1])
    block, type_size = GGML_QUANT_SIZES[gate_up_type]
    if hidden * ffn * type_size // block != gate_bytes:
        raise ExpertLayoutError(path, f"layer {index}: gate slice size does not match its shape")
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
