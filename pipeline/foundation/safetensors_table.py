"""The expert table of a Hugging Face checkpoint: safetensors shards, read by header alone.

A checkpoint is a directory with ``config.json``, one or more ``*.safetensors`` shards and,
when sharded, ``model.safetensors.index.json``; or a single ``.safetensors`` file (with the
``config.json`` beside it, if there is one). A shard is an 8-byte little-endian header
length, a JSON header (per tensor: dtype, shape, data offsets relative to the data start),
then the data; each tensor is one contiguous range. Only the headers are read here.

Routed experts are found by name, in the layouts transformers writes, under a layer's MoE
block ``B`` (``mlp``; ``block_sparse_moe`` in Mixtral and Granite, ``ffn`` in DeepSeek-V4,
``feed_forward`` in Jamba, ``mixer`` in Nemotron-H):

- per expert (Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V2/V3, Jamba): ``...layers.L.B.experts.E.
  {gate_proj,up_proj,down_proj}.weight``, gate and up ``[F, D]``, down ``[D, F]``; Mixtral
  and DeepSeek-V4 name them ``{w1,w3,w2}`` (gate, up, down); Nemotron-H's experts have no
  gate (``MoeLayer.gated`` false: the up projection's row halves stand as gate and up);
- fused: ``...layers.L.B.experts.gate_up_proj`` ``[E, 2F, D]`` (gate the first F rows) and
  ``...B.experts.down_proj`` ``[E, D, F]``, an expert one slice along the first axis;
  Granite-MoE's ``block_sparse_moe.input_linear.weight`` and ``output_linear.weight`` are
  the same two; gpt-oss's are transposed, ``[E, D, 2F]`` (gate and up interleaved by
  column) and ``[E, F, D]`` (``MoeLayer.transposed``), their biases non-routed tensors.

Shared experts (``mlp.shared_expert(s)``), dense layers and everything else are non-routed
tensors (``is_routed`` tells which). The router of layer L is ``...layers.L.B.gate.weight``
(``router.weight`` in Jamba, ``router.layer.weight`` in Granite; ``[E, D]``). Experts in
BF16, F16 or F32 are accepted; any other expert dtype (FP8, integer, quantized) is refused
in one line. A hostile file is refused before anything past its header is trusted: every
offset, size and name is checked against the file and the dtype x shape it claims.
"""

from __future__ import annotations

import itertools
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf import GGMLQuantizationType

from pipeline.foundation.errors import ExpertLayoutError, ModelFileError
from pipeline.foundation.experts import ExpertTable, MoeLayer, TensorInfo
from pipeline.foundation.files import ModelFile, check_identity, lay_out, open_identified
from pipeline.foundation.inputs import JSONDepthError, load_json_bounded, read_input

__all__ = ["HEADER_LIMIT_BYTES", "SAFETENSORS_TYPES", "is_routed", "open_checkpoint"]

HEADER_LIMIT_BYTES = 100 << 20
"""The largest shard header read (safetensors' own limit)."""
_CONFIG_LIMIT_BYTES = 16 << 20
_INDEX_NAME = "model.safetensors.index.json"

SAFETENSORS_TYPES = {
    "BF16": GGMLQuantizationType.BF16,
    "F16": GGMLQuantizationType.F16,
    "F32": GGMLQuantizationType.F32,
}
"""Expert dtypes the table accepts, as the GGUF types the rest of moestream speaks."""
_ITEM_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
               "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4,
               "I64": 8, "U64": 8, "F64": 8}
# re.ASCII: \d would also take other scripts' digits, which int() reads ("\u0663" is 3)
_MOE = r"(?:mlp|block_sparse_moe|ffn|feed_forward|mixer)"
"""A MoE block's name in a layer: Qwen/DeepSeek-V2/V3, Mixtral/Granite, DeepSeek-V4, Jamba,
Nemotron-H."""
_EXPERT = re.compile(rf"^(?:.*\.)?layers\.(\d+)\.{_MOE}\.experts\.(\d+)\."
                     r"(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$", re.ASCII)
_FUSED = re.compile(rf"^(?:.*\.)?layers\.(\d+)\.(?:{_MOE}\.experts\.(gate_up_proj|down_proj)"
                    r"(?:\.weight)?|block_sparse_moe\.(input_linear|output_linear)\.weight)$",
                    re.ASCII)
_ROUTER = re.compile(rf"^(?:.*\.)?layers\.(\d+)\.{_MOE}\.(?:gate|router|router\.layer)"
                     r"\.weight$", re.ASCII)
_BLOCK = re.compile(r"(?:^|\.)layers\.(\d+)\.", re.ASCII)
_MATRIX = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up",
           "down_proj": "down", "w2": "down"}
_GRANITE = {"input_linear": "gate_up_proj", "output_linear": "down_proj"}
"""Granite-MoE's fused expert names (``block_sparse_moe.input_linear`` [E, 2F, D], gate the
first F rows, and ``output_linear`` [E, D, F]), as the fused form's."""
_PARTS = ("gate", "up", "down")


def is_routed(name: str) -> bool:
    """Whether the checkpoint tensor ``name`` holds routed experts (read by moestream, not
    loaded with the dense weights)."""
    return _EXPERT.match(name) is not None or _FUSED.match(name) is not None


@dataclass(frozen=True, slots=True)
class _Tensor:
    """One tensor of a shard, its offset already in the model's address space."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    file: ModelFile


def open_checkpoint(path: Path) -> ExpertTable:
    """The expert table of the checkpoint at ``path`` (a directory or a ``.safetensors`` file).

    Raises:
        ModelFileError: missing, unreadable or not a checkpoint; ExpertLayoutError for
            experts that are missing, inconsistent, of an unsupported dtype or at odds with
            ``config.json``; ModelChangedError for a shard written while its header was read.
    """
    directory = path if path.is_dir() else path.parent
    if path.is_dir():
        shard_paths = _shard_paths(path)
    elif path.exists():
        shard_paths = [path]
    else:
        raise ModelFileError(path, "no such file")
    config = _read_config(directory, required=path.is_dir())
    tensors: dict[str, _Tensor] = {}
    opened: list[tuple[Path, int]] = []
    try:
        identified = []
        for p in shard_paths:
            fd, identity = open_identified(p, "safetensors shard")
            opened.append((p, fd))
            identified.append((p, identity))
        files = lay_out(identified)
        for (p, fd), f in zip(opened, files, strict=True):
            for t in _read_header(p, fd, f):
                if t.name in tensors:
                    raise ExpertLayoutError(p, f"tensor {t.name!r} is also in "
                                               f"{tensors[t.name].file.path.name}")
                tensors[t.name] = t
            check_identity(f, fd)
    finally:
        for _, fd in opened:
            os.close(fd)
    if path.is_dir():
        _check_index(path, tensors)
    return _build(path, files, tensors, config)


def _shard_paths(directory: Path) -> list[Path]:
    """The shards the index names (each once, in order), else every ``*.safetensors``."""
    index = directory / _INDEX_NAME
    if not index.exists():
        found = sorted(p for p in directory.glob("*.safetensors"))
        if not found:
            raise ModelFileError(directory, "is a directory with no .safetensors file "
                                            "(neither a GGUF file nor a checkpoint)")
        return found
    weight_map = _index_map(index)
    names = list(dict.fromkeys(weight_map.values()))
    out = []
    for name in names:
        if not name or "/" in name or name in (".", "..") or "\x00" in name:
            raise ModelFileError(index, f"names shard {name!r} outside the checkpoint directory")
        shard = directory / name
        if not shard.exists():
            raise ModelFileError(index, f"names shard {name!r}, which is missing")
        out.append(shard)
    return out


def _index_map(index: Path) -> dict[str, str]:
    """The index's ``weight_map`` (tensor name -> shard file name)."""
    doc = _read_json(index, _CONFIG_LIMIT_BYTES)
    weight_map = doc.get("weight_map")
    if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise ModelFileError(index, "has no weight_map of tensor names to shard files")
    return weight_map


def _check_index(directory: Path, tensors: dict[str, _Tensor]) -> None:
    """Every tensor the index names is in the shard it names."""
    index = directory / _INDEX_NAME
    if not index.exists():
        return
    for name, shard in _index_map(index).items():
        t = tensors.get(name)
        if t is None or t.file.path.name != shard:
            where = "no shard" if t is None else t.file.path.name
            raise ModelFileError(index, f"names {name!r} in {shard}, but it is in {where}")


def _read_json(path: Path, limit: int) -> dict[str, Any]:
    """A JSON object from a small regular file, refused in one line when it is not one."""
    try:
        data = read_input(path, limit)
    except OSError as exc:
        raise ModelFileError(path, f"cannot read: {exc.strerror or exc}") from exc
    return _parse_object(path, data, "file")


def _parse_object(path: Path, data: bytes, what: str) -> dict[str, Any]:
    """``data`` as a JSON object without duplicate keys, its nesting bounded; refused in one
    line otherwise."""

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in pairs:
            if k in out:
                raise ModelFileError(path, f"its {what} names {k!r} twice")
            out[k] = v
        return out

    try:
        doc = load_json_bounded(data, f"its {what}", object_pairs_hook=no_duplicates)
    except JSONDepthError as exc:
        raise ModelFileError(path, f"its {what} nests too deeply ({exc})") from None
    except ValueError as exc:  # not JSON, or not UTF-8
        raise ModelFileError(path, f"its {what} is not JSON ({str(exc)[:80]})") from None
    if not isinstance(doc, dict):
        raise ModelFileError(path, f"its {what} is not a JSON object")
    return doc


def _read_config(directory: Path, *, required: bool) -> dict[str, Any]:
    config = directory / "config.json"
    if not config.exists():
        if required:
            raise ModelFileError(directory, "is a directory with no config.json (not a checkpoint)")
        return {}
    return _read_json(config, _CONFIG_LIMIT_BYTES)


def _read_header(path: Path, fd: int, file: ModelFile) -> list[_Tensor]:
    """Every tensor a shard's header declares, checked against the file."""
    size = file.nbytes
    head = os.pread(fd, 8, 0)
    if len(head) < 8:
        raise ModelFileError(path, f"is {size} bytes, too short for a safetensors header")
    n = int.from_bytes(head, "little")
    if n > HEADER_LIMIT_BYTES:
        raise ModelFileError(path, f"declares a {n}-byte header, over the "
                                   f"{HEADER_LIMIT_BYTES}-byte limit")
    if 8 + n > size:
        raise ModelFileError(path, f"declares a {n}-byte header past its end ({size} bytes)")
    raw = os.pread(fd, n, 8)
    if len(raw) != n:
        raise ModelFileError(path, "was cut short while its header was read")
    header = _parse_object(path, raw, "header")
    data_start, data_bytes = 8 + n, size - 8 - n
    out = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, begin, end = _entry(path, name, entry)
        if not 0 <= begin <= end <= data_bytes:
            raise ModelFileError(path, f"tensor {name!r} lies at bytes {begin}..{end}, outside "
                                       f"its {data_bytes} bytes of data")
        item = _ITEM_BYTES.get(dtype)
        if item is not None and math.prod(shape) * item != end - begin:
            raise ModelFileError(path, f"tensor {name!r} is {dtype} {list(shape)} "
                                       f"({math.prod(shape) * item} bytes) but spans "
                                       f"{end - begin}")
        out.append(_Tensor(name, dtype, shape, file.base + data_start + begin, end - begin, file))
    spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in out if t.nbytes)
    for (_, a_end, a), (b_start, _, b) in itertools.pairwise(spans):
        if b_start < a_end:
            raise ModelFileError(path, f"tensors {a!r} and {b!r} overlap")
    return out


def _entry(path: Path, name: str, entry: object) -> tuple[str, tuple[int, ...], int, int]:
    """(dtype, shape, begin, end) of one header entry, refused unless well formed."""
    if not isinstance(entry, dict):
        raise ModelFileError(path, f"header entry {name!r} is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or not isinstance(shape, list) or not isinstance(offsets, list):
        raise ModelFileError(path, f"header entry {name!r} lacks dtype, shape or data_offsets")
    ints = [*shape, *offsets]
    if len(offsets) != 2 or not all(type(v) is int and v >= 0 for v in ints):
        raise ModelFileError(path, f"header entry {name!r} has a bad shape or data_offsets")
    return dtype, tuple(shape), offsets[0], offsets[1]


def _config_int(config: dict[str, Any], *names: str) -> int | None:
    for name in names:
        value = config.get(name)
        if type(value) is int:
            return value
    return None


def _build(path: Path, files: tuple[ModelFile, ...], tensors: dict[str, _Tensor],
           config: dict[str, Any]) -> ExpertTable:
    per_expert: dict[int, dict[int, dict[str, _Tensor]]] = {}
    fused: dict[int, dict[str, _Tensor]] = {}
    routers: dict[int, TensorInfo] = {}
    non_routed: list[TensorInfo] = []
    n_blocks = 0
    for t in sorted(tensors.values(), key=lambda t: t.offset):
        info = TensorInfo(t.name, t.dtype, t.offset, t.nbytes, t.shape)
        block = _BLOCK.search(t.name)
        if block:
            if len(block.group(1)) > 6:  # a million layers: no model, a name to refuse
                raise ExpertLayoutError(path, f"tensor {t.name[:120]!r} names layer "
                                              f"{block.group(1)[:12]}...: no model has that many")
            n_blocks = max(n_blocks, int(block.group(1)) + 1)
        if (m := _EXPERT.match(t.name)) is not None:
            layer, expert = int(m.group(1)), int(m.group(2))
            parts = per_expert.setdefault(layer, {}).setdefault(expert, {})
            _claim(path, parts, _MATRIX[m.group(3)], t, f"layer {layer} expert {expert}'s")
        elif (m := _FUSED.match(t.name)) is not None:
            layer = int(m.group(1))
            slot = m.group(2) or _GRANITE[m.group(3)]
            _claim(path, fused.setdefault(layer, {}), slot, t, f"layer {layer}'s")
        else:
            non_routed.append(info)
            if (m := _ROUTER.match(t.name)) is not None:
                layer = int(m.group(1))
                if layer in routers:
                    raise ExpertLayoutError(path, f"tensors {routers[layer].name!r} and "
                                                  f"{t.name!r} are both layer {layer}'s router")
                routers[layer] = info
    both = sorted(set(per_expert) & set(fused))
    if both:
        raise ExpertLayoutError(path, f"layer {both[0]} has both per-expert and fused experts")
    if not per_expert and not fused:
        raise ExpertLayoutError(path, "no routed expert tensors (layers.L.mlp.experts.*, or "
                                      "a layout the module docstring lists)")

    n_experts = _config_int(config, "num_experts", "num_local_experts", "n_routed_experts")
    hidden = _config_int(config, "moe_latent_size", "hidden_size")  # Nemotron's latent MoE
    ffn = _config_int(config, "moe_intermediate_size")
    if ffn is None and "num_local_experts" in config:  # Mixtral names its expert FFN so
        ffn = _config_int(config, "intermediate_size")
    layers: dict[int, MoeLayer] = {}
    for index in sorted({*per_expert, *fused}):
        if index in fused:
            moe = _fused_layer(path, index, fused[index], routers.get(index))
        else:
            moe = _per_expert_layer(path, index, per_expert[index], routers.get(index))
        layers[index] = moe
        want = {"experts": n_experts, "hidden_size": hidden, "expert FFN": ffn}
        have = {"experts": moe.n_experts, "hidden_size": moe.shape[0],
                "expert FFN": moe.shape[1]}
        for what, value in want.items():
            if value is not None and value != have[what]:
                raise ExpertLayoutError(path, f"config.json says {what} {value}, but layer "
                                              f"{index}'s tensors have {have[what]}")
    for what, values in (("expert count", {m.n_experts for m in layers.values()}),
                         ("hidden size", {m.shape[0] for m in layers.values()})):
        if len(values) != 1:
            raise ExpertLayoutError(path, f"MoE layers disagree on the {what}: {sorted(values)}")
    count = next(iter(layers.values())).n_experts
    top_k = _config_int(config, "num_experts_per_tok")
    if top_k is None:
        top_k = min(8, count)
    elif not 0 < top_k <= count:
        raise ExpertLayoutError(path, f"config.json's num_experts_per_tok {top_k} is outside "
                                      f"1..{count}")
    n_layers = _config_int(config, "num_hidden_layers")
    if n_layers is not None and n_layers < n_blocks:
        raise ExpertLayoutError(path, f"config.json says {n_layers} layers, but the tensors "
                                      f"name layers 0..{n_blocks - 1}")
    return ExpertTable(
        path=path,
        file_bytes=files[-1].span_end,
        n_layers=n_layers or n_blocks,
        layers=layers,
        top_k=top_k,
        hash_routed=0,
        hidden=next(iter(layers.values())).shape[0],
        non_routed=tuple(non_routed),
        digests=None,
        files=files,
        format="safetensors",
        config=config,
    )


def _claim(path: Path, slots: dict[str, _Tensor], slot: str, t: _Tensor, whose: str) -> None:
    """Put ``t`` in ``slots[slot]``, refusing a second tensor for it (``experts.01`` beside
    ``experts.1``, ``w1`` beside ``gate_proj``, two prefixes): never a silent pick."""
    if slot in slots:
        raise ExpertLayoutError(path, f"tensors {slots[slot].name!r} and {t.name!r} are both "
                                      f"{whose} {slot}")
    slots[slot] = t


def _expert_type(path: Path, index: int, t: _Tensor) -> GGMLQuantizationType:
    kind = SAFETENSORS_TYPES.get(t.dtype)
    if kind is None:
        raise ExpertLayoutError(path, f"layer {index}: {t.name} is {t.dtype}; experts must be "
                                      f"{', '.join(SAFETENSORS_TYPES)}")
    return kind


def _per_expert_layer(path: Path, index: int, experts: dict[int, dict[str, _Tensor]],
                      router: TensorInfo | None) -> MoeLayer:
    """A layer whose every expert matrix is a tensor of its own; with no gate at all
    (Nemotron-H: up and down only), the up projection's two row halves stand as the
    expert's "gate" and "up" slices (``MoeLayer.gated`` false)."""
    n = max(experts) + 1
    if len(experts) != n:  # the first gap lies within len(experts): never walk a huge n
        missing = next(e for e in range(n) if e not in experts)
        raise ExpertLayoutError(path, f"layer {index}: expert {missing} is missing "
                                      f"(experts 0..{n - 1} are named)")
    first = experts[0]
    gated = any("gate" in parts for parts in experts.values())
    parts = _PARTS if gated else ("up", "down")
    for e in range(n):
        absent = [p for p in parts if p not in experts[e]]
        if absent:
            raise ExpertLayoutError(path, f"layer {index}: expert {e} has no {absent[0]} matrix")
    lead = first[parts[0]]  # gate, or up when there is none
    if len(lead.shape) != 2:
        raise ExpertLayoutError(path, f"layer {index}: {lead.name} is {len(lead.shape)}-D, "
                                      f"expected [ffn, hidden]")
    ffn, hidden = lead.shape
    want = {"gate": (ffn, hidden), "up": (ffn, hidden), "down": (hidden, ffn)}
    types = {p: _expert_type(path, index, first[p]) for p in parts}
    if gated and types["gate"] != types["up"]:
        raise ExpertLayoutError(path, f"layer {index}: gate is {types['gate'].name} but up is "
                                      f"{types['up'].name}; they must share a type")
    for e in range(n):
        for p in parts:
            t = experts[e][p]
            if t.shape != want[p] or t.dtype != first[p].dtype:
                raise ExpertLayoutError(path, f"layer {index}: {t.name} is {t.dtype} "
                                              f"{list(t.shape)}, expected {first[p].dtype} "
                                              f"{list(want[p])}")
    if ffn == 0 or hidden == 0:
        raise ExpertLayoutError(path, f"layer {index}: empty expert matrices {(hidden, ffn)}")
    if not gated and ffn % 2:
        raise ExpertLayoutError(path, f"layer {index}: gate-less experts with an odd FFN size "
                                      f"{ffn} (their up projection goes in two halves)")
    if gated:
        gate_bytes, up_bytes = lead.nbytes, first["up"].nbytes
        offsets = tuple((experts[e]["gate"].offset, experts[e]["up"].offset,
                         experts[e]["down"].offset) for e in range(n))
    else:
        gate_bytes = up_bytes = lead.nbytes // 2
        offsets = tuple((experts[e]["up"].offset, experts[e]["up"].offset + gate_bytes,
                         experts[e]["down"].offset) for e in range(n))
    return MoeLayer(
        index=index, n_experts=n, gate_up_type=types[parts[0]], down_type=types["down"],
        gate_offset=offsets[0][0], up_offset=offsets[0][1], down_offset=offsets[0][2],
        gate_bytes=gate_bytes, up_bytes=up_bytes, down_bytes=first["down"].nbytes,
        gate_up_stride=gate_bytes, fused_gate_up=False, router=router, shape=(hidden, ffn),
        expert_offsets=offsets, gated=gated,
    )


def _fused_layer(path: Path, index: int, parts: dict[str, _Tensor],
                 router: TensorInfo | None) -> MoeLayer:
    """A layer of the fused form: ``gate_up_proj`` [E, 2F, D] and ``down_proj`` [E, D, F],
    or transposed (gpt-oss) [E, D, 2F] and [E, F, D]; the shapes tell which (both at once
    only when empty)."""
    gate_up, down = parts.get("gate_up_proj"), parts.get("down_proj")
    if gate_up is None or down is None:
        missing = "gate_up_proj" if gate_up is None else "down_proj"
        raise ExpertLayoutError(path, f"layer {index}: fused experts lack {missing}")
    if len(gate_up.shape) != 3 or len(down.shape) != 3:
        raise ExpertLayoutError(path, f"layer {index}: fused experts must be 3-D, got "
                                      f"{list(gate_up.shape)} and {list(down.shape)}")
    n, rows, cols = gate_up.shape
    transposed = cols % 2 == 0 and down.shape == (n, cols // 2, rows) and rows % 2 == 0
    hidden, ffn = (rows, cols // 2) if transposed else (cols, rows // 2)
    if (not transposed and (rows % 2 or down.shape != (n, hidden, ffn))) or 0 in (n, ffn, hidden):
        raise ExpertLayoutError(path, f"layer {index}: gate_up_proj {list(gate_up.shape)} and "
                                      f"down_proj {list(down.shape)} are not [E, 2F, D] and "
                                      f"[E, D, F] (nor [E, D, 2F] and [E, F, D] with D even)")
    gate_up_type = _expert_type(path, index, gate_up)
    down_type = _expert_type(path, index, down)
    stride = gate_up.nbytes // n
    return MoeLayer(
        index=index, n_experts=n, gate_up_type=gate_up_type, down_type=down_type,
        gate_offset=gate_up.offset, up_offset=gate_up.offset + stride // 2,
        down_offset=down.offset, gate_bytes=stride // 2, up_bytes=stride // 2,
        down_bytes=down.nbytes // n, gate_up_stride=stride, fused_gate_up=True,
        router=router, shape=(hidden, ffn), transposed=transposed,
    )
