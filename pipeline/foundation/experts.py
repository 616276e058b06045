"""The expert table's types: where every routed expert's bytes lie in the model's files.

Both sources of a table fill these: GGUF files (``moestream.pipeline.foundation.table``) and Hugging
Face checkpoints (``moestream.pipeline.foundation.safetensors_table``). Offsets are offsets of the
model's address space (``moestream.pipeline.foundation.files``): a GGUF file's own offsets, or a
checkpoint's shards laid end to end.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeAlias

import numpy as np
from gguf import GGMLQuantizationType

from moestream.pipeline.foundation.errors import ModelFileError
from moestream.pipeline.foundation.files import ModelFile, check_identity, locate, open_checked
from moestream.pipeline.foundation.quantization import ExpertQuant

__all__ = ["ByteRange", "ExpertKey", "ExpertSlices", "ExpertTable", "MoeLayer", "TensorInfo"]

ExpertKey: TypeAlias = tuple[int, int]
"""(layer index in the model, expert index in that layer)."""


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

_READ_PIECE = 1 << 30


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """A tensor of the file that is not a routed expert (embeddings, attention, router...)."""

    name: str
    type_name: str
    offset: int
    nbytes: int
    shape: tuple[int, ...] = ()
    """Its elements along each axis, outermost first (row-major, as numpy and torch)."""


@dataclass(frozen=True, slots=True)
class MoeLayer:
    """One MoE layer: where its expert tensors start and how large one expert's slices are.

    ``gate_offset``/``up_offset``/``down_offset`` are the file offsets of expert 0; expert
    ``e`` starts ``e * <matrix>_bytes`` later. For the fused form, gate and up share one
    tensor and ``up_offset = gate_offset + gate_bytes`` with a stride of both. A checkpoint
    that stores every expert's matrices as tensors of their own (anywhere, in any shard)
    lists them in ``expert_offsets``: per expert, the (gate, up, down) offsets.

    ``transposed`` (gpt-oss): an expert's fused gate_up is ``[hidden, 2 * ffn]`` with gate
    and up interleaved by column, and down ``[ffn, hidden]``; its "gate" and "up" slices
    are then the two row halves of that gate_up (``[hidden / 2, 2 * ffn]`` each), which the
    engine puts back together (its bytes are the two slices in order). ``gated`` false
    (Nemotron-H): the experts have no gate; the up projection ``[ffn, hidden]`` is handed
    out as its two row halves in the "gate" and "up" slices. ``interleaved`` (Inkling2's
    ``w13_weight``): an expert's gate_up ``[2 * ffn, hidden]`` has gate and up rows
    alternating (gate rows 0, 2, 4...); its "gate" and "up" slices are the two row halves
    of that gate_up, as stored, which an engine de-interleaves.
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
    expert_offsets: tuple[tuple[int, int, int], ...] | None = None
    transposed: bool = False
    gated: bool = True
    quant: ExpertQuant | None = None
    """Quantized experts (FP8 blocks, FP4, MXFP4): what their bytes mean and where their
    scales are; None for float and GGUF experts (a GGUF type says it all)."""
    interleaved: bool = False

    @property
    def expert_bytes(self) -> int:
        return self.gate_bytes + self.up_bytes + self.down_bytes

    def slices(self, expert: int) -> ExpertSlices:
        """The byte ranges of ``expert`` in this layer."""
        if not 0 <= expert < self.n_experts:
            raise IndexError(f"layer {self.index} has {self.n_experts} experts, not {expert}")
        if self.expert_offsets is not None:
            gate, up, down = self.expert_offsets[expert]
            return ExpertSlices(key=(self.index, expert), gate=ByteRange(gate, self.gate_bytes),
                                up=ByteRange(up, self.up_bytes),
                                down=ByteRange(down, self.down_bytes))
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
        path: the model as the user named it (a GGUF file, a checkpoint directory or file).
        file_bytes: the end of the model's address space (a GGUF file's size).
        n_layers: all blocks of the model, dense and MoE.
        layers: the MoE layers by model layer index, ascending.
        top_k: experts selected per token per layer (from metadata; 6 when absent).
        hash_routed: how many of the first MoE layers route by token id (no router tensor).
        non_routed: every other tensor.
        digests: per (MoE layer position, expert, matrix) the expected digest, when the file
            carries ``moestream.expert_digests``; else None.
        files: the model's files in its address space, with the identity the table's open
            saw (one for a GGUF file).
        format: ``gguf`` or ``safetensors``.
        config: a checkpoint's ``config.json`` as the table's one read parsed it (empty for
            a GGUF file): whoever builds a model from it uses these values, never a second
            read of the path, which may name another file by then.
        header_bytes: a GGUF file's header (magic, metadata, tensor table and padding: every
            byte before its tensor data), as the table's one read walked it; 0 for a
            checkpoint. Its config and tokenizer are built from these bytes, read again
            through ``read_bytes`` (never a second open of the path).
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
    files: tuple[ModelFile, ...]
    format: str = "gguf"
    config: Mapping[str, Any] = field(default_factory=dict)
    header_bytes: int = 0

    @property
    def data_bytes(self) -> int:
        """Bytes of all the model's files (without the padding between them)."""
        return sum(f.nbytes for f in self.files)

    def file_of(self, offset: int) -> ModelFile:
        """The file holding ``offset`` of the model's address space."""
        return locate(self.files, offset)

    def read_bytes(self, offset: int, nbytes: int) -> bytearray:
        """A plain buffered read of one range (a router, an embedding row, a dense weight),
        from a checked open of its file, its identity checked again after the read: never
        from a file other than the table's, never bytes written meanwhile.

        Raises:
            ModelChangedError: the file changed since the table was read.
            ModelFileError: it was cut short.
        """
        f = self.file_of(offset)
        out = bytearray(nbytes)
        view, done = memoryview(out), 0
        fd = open_checked(f)
        try:
            while done < nbytes:  # one pread moves at most ~2 GiB
                got = os.preadv(fd, [view[done:done + _READ_PIECE]], offset - f.base + done)
                if got == 0:
                    break
                done += got
            check_identity(f, fd)
        finally:
            view.release()
            os.close(fd)
        if done != nbytes:
            raise ModelFileError(f.path, f"cut short at byte {offset - f.base + done}")
        return out

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
            "file_bytes": self.data_bytes,
            "format": self.format,
            "files": len(self.files),
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


