"""The expert table of a Hugging Face checkpoint: safetensors shards, read by header alone.

A checkpoint is a directory with ``config.json``, one or more ``*.safetensors`` shards and,
when sharded, ``model.safetensors.index.json``; or a single ``.safetensors`` file (with the
``config.json`` beside it, if there is one). A shard is an 8-byte little-endian header
length, a JSON header (per tensor: dtype, shape, data offsets relative to the data start),
then the data; each tensor is one contiguous range. Only the headers are read here.

Routed experts are found by name, in the layouts transformers writes, under a layer's MoE
block ``B`` (``mlp``; ``block_sparse_moe`` in Mixtral and Granite, ``ffn`` in DeepSeek-V4,
``feed_forward`` in Jamba and Llama 4, ``mixer`` in Nemotron-H; none in Gemma 4, whose
``layers.L.experts`` sit beside its dense MLP):

- per expert (Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V2/V3, Jamba): ``...layers.L.B.experts.E.
  {gate_proj,up_proj,down_proj}.weight``, gate and up ``[F, D]``, down ``[D, F]``; Mixtral
  and DeepSeek-V4 name them ``{w1,w3,w2}`` (gate, up, down); Nemotron-H's experts have no
  gate (``MoeLayer.gated`` false: the up projection's row halves stand as gate and up);
- fused: ``...layers.L.B.experts.gate_up_proj`` ``[E, 2F, D]`` (gate the first F rows) and
  ``...B.experts.down_proj`` ``[E, D, F]``, an expert one slice along the first axis;
  Granite-MoE's ``block_sparse_moe.input_linear.weight`` and ``output_linear.weight`` (and
  JetMoE's under ``mlp``) are the same two; gpt-oss's are transposed, ``[E, D, 2F]`` (gate
  and up interleaved by column) and ``[E, F, D]`` (``MoeLayer.transposed``), their biases
  non-routed tensors; Llama 4's and Aria's (``experts.fc1.weight``/``fc2.weight``) are
  transposed too, gate the first F columns; Inkling2's ``experts.w13_weight`` ``[E, 2F, D]``
  has gate and up rows interleaved (``MoeLayer.interleaved``), its ``w2_weight`` is the down
  ``[E, D, F]``; Ergo's have no gate, ``B.up_proj`` ``[E, D, F]``
  and ``B.down_proj`` ``[E, F, D]`` (no ``experts.``, no ``.weight``: what tells them from a
  dense MLP's).

Shared experts (``mlp.shared_expert(s)``), dense layers and everything else are non-routed
tensors (``is_routed`` tells which). The router of layer L is ``...layers.L.B.gate.weight``
(``router.weight`` in Jamba, ``router.layer.weight`` in Granite; ``[E, D]``). Experts in
BF16, F16 or F32 are accepted, and the quantized formats ``pipeline.foundation.quantization``
lists (FP8 blocks, DeepSeek-V4's FP4, gpt-oss's MXFP4 ``*_blocks``) with their
``quantization_config``; any other expert dtype is refused in one line.

A shard's header is read and checked as safetensors checks it
(``pipeline.foundation.safetensors_header``), its ``config.json`` read and checked against
the tensors (``pipeline.foundation.safetensors_config``), and each MoE layer built from its
tensors by layout (``pipeline.foundation.safetensors_layers``). A layer or expert index must
be a canonical decimal of at most six digits (``layers.01`` and ``experts.007`` are refused,
never read as 1 and 7).

What headers may cost is bounded per model, not per shard: ``MODEL_HEADER_LIMIT_BYTES``
(100 MiB) of headers and ``MODEL_TENSOR_LIMIT`` (1,000,000) tensors over all shards. The
largest real checkpoints stay well under both: DeepSeek-V3 in FP8 has about 92,000 tensors
(each weight with its scale) and some 20 MB of headers, a 4-bit GPTQ of a 384-expert model
about 280,000 tensors. The byte limit is checked before any shard's header is read, the
tensor limit while they are parsed (the count stops the parse): a checkpoint over the first
is refused having read only each shard's first 8 bytes, one over the second after one parse
of what remains of it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from moestream.pipeline.foundation.errors import ExpertLayoutError, ModelFileError
from moestream.pipeline.foundation.experts import ExpertTable, MoeLayer, TensorInfo
from moestream.pipeline.foundation.files import ModelFile, check_identity, lay_out, open_identified
from moestream.pipeline.foundation.quantization import quant_config
from moestream.pipeline.foundation.safetensors_config import (
    CONFIG_LIMIT_BYTES,
    check_layer_sizes,
    config_ints,
    layer_count,
    layer_sizes,
    read_config,
    top_k,
)
from moestream.pipeline.foundation.safetensors_header import (
    HEADER_LIMIT_BYTES,
    SAFETENSORS_DTYPE_BITS,
    Budget,
    Shard,
    header_length,
    read_header,
    read_json,
    short,
)
from moestream.pipeline.foundation.safetensors_layers import (
    SAFETENSORS_TYPES,
    Tensor,
    fused_layer,
    per_expert_layer,
)

__all__ = ["HEADER_LIMIT_BYTES", "MODEL_HEADER_LIMIT_BYTES", "MODEL_TENSOR_LIMIT",
           "SAFETENSORS_DTYPE_BITS", "SAFETENSORS_TYPES", "is_routed", "open_checkpoint"]

MODEL_HEADER_LIMIT_BYTES = 100 << 20
"""The most header bytes read for one model, its shards' headers summed."""
MODEL_TENSOR_LIMIT = 1_000_000
"""The most tensors one model may have, over all its shards."""
_INDEX_NAME = "model.safetensors.index.json"
_INDEX_DIGITS = 6  # a layer or expert index of more: no model has that many

# re.ASCII: \d would also take other scripts' digits, which int() reads ("\u0663" is 3)
_MOE = r"(?:mlp|block_sparse_moe|ffn|feed_forward|mixer)"
"""A MoE block's name in a layer: Qwen/DeepSeek-V2/V3, Mixtral/Granite, DeepSeek-V4, Jamba,
Nemotron-H."""
# Gemma 4 keeps its experts beside the dense MLP, under the layer itself (layers.L.experts)
_EXPERT = re.compile(rf"^(?:.*\.)?layers\.(\d+)\.(?:{_MOE}\.)?experts\.(\d+)\."
                     r"(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$", re.ASCII)
_FUSED = re.compile(rf"^(?:.*\.)?layers\.(\d+)\.(?:(?:{_MOE}\.)?experts\."
                    r"(?:(gate_up_proj|down_proj)(?:\.weight|_blocks)?|(fc1|fc2)\.weight"
                    r"|(w13_weight|w2_weight))"
                    r"|(?:block_sparse_moe|mlp)\.(input_linear|output_linear)\.weight"
                    rf"|{_MOE}\.(up_proj|down_proj))$", re.ASCII)
_ROUTER = re.compile(rf"^(?:.*\.)?layers\.(\d+)\.{_MOE}\.(?:gate|router|router\.layer)"
                     r"\.weight$", re.ASCII)
_BLOCK = re.compile(r"(?:^|\.)layers\.(\d+)\.", re.ASCII)
_MATRIX = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up",
           "down_proj": "down", "w2": "down"}
_FUSED_NAMES = {"input_linear": "gate_up_proj", "output_linear": "down_proj",
                "fc1": "gate_up_proj", "fc2": "down_proj",
                "w13_weight": "gate_up_proj", "w2_weight": "down_proj"}
"""Other fused expert names, as the fused form's: Granite-MoE's and JetMoE's
``input_linear`` [E, 2F, D] (gate the first F rows) and ``output_linear`` [E, D, F]; Aria's
``experts.fc1`` [E, D, 2F] and ``fc2`` [E, F, D] (transposed, gate the first F columns);
Inkling2's ``experts.w13_weight`` [E, 2F, D] (gate and up rows interleaved:
``MoeLayer.interleaved``) and ``w2_weight`` [E, D, F]."""

_NOT_STREAMED = {
    "dbrx": "whose experts (ffn.experts.mlp.w1/v1/w2: every expert's rows in one [E*F, D] "
            "tensor, w2 stored [F, D]) are not read yet",
    "doge": "whose routed experts are rows of two embedding tables picked by product keys "
            "(one vector each, read by an embedding lookup): no expert matrices to stream",
}
"""Model types whose routed experts the table does not read, and why (said instead of the
namings it reads)."""


def is_routed(name: str) -> bool:
    """Whether the checkpoint tensor ``name`` holds routed experts (read by moestream, not
    loaded with the dense weights)."""
    return _EXPERT.match(name) is not None or _FUSED.match(name) is not None


def open_checkpoint(path: Path) -> ExpertTable:
    """The expert table of the checkpoint at ``path`` (a directory or a ``.safetensors`` file).

    Raises:
        ModelFileError: missing, unreadable or not a checkpoint, or over the per-model
            limits; ExpertLayoutError for experts that are missing, inconsistent, of an
            unsupported dtype or at odds with ``config.json``; ModelChangedError for a shard
            written while its header was read.
    """
    directory = path if path.is_dir() else path.parent
    weight_map: dict[str, str] | None = None
    if path.is_dir():
        if (directory / _INDEX_NAME).exists():
            weight_map = _index_map(directory / _INDEX_NAME)
        shard_paths = _shard_paths(path, weight_map)
    elif path.exists():
        shard_paths = [path]
    else:
        raise ModelFileError(path, "no such file")
    config = read_config(directory, required=path.is_dir())
    ints = config_ints(path, config)  # before any shard: a bad config costs no header
    shards: list[Shard] = []
    where: dict[str, int] = {}  # tensor name -> its shard's number
    opened: list[tuple[Path, int]] = []
    try:
        identified = []
        for p in shard_paths:
            fd, identity = open_identified(p, "safetensors shard")
            opened.append((p, fd))
            identified.append((p, identity))
        files = lay_out(identified)
        budget = Budget(MODEL_HEADER_LIMIT_BYTES, MODEL_TENSOR_LIMIT)
        lengths = [budget.take_header(p, header_length(p, fd, f))  # all before any parse
                   for (p, fd), f in zip(opened, files, strict=True)]
        for number, ((p, fd), f, n) in enumerate(zip(opened, files, lengths, strict=True)):
            shard = read_header(p, fd, f, n, budget)
            for name, _ in shard.entries:
                first = where.setdefault(name, number)
                if first != number:
                    raise ExpertLayoutError(p, f"tensor {short(name, 120)} is also in "
                                               f"{files[first].path.name}")
            check_identity(f, fd)
            shards.append(shard)
    finally:
        for _, fd in opened:
            os.close(fd)
    if weight_map is not None:
        _check_index(directory / _INDEX_NAME, weight_map, where, files)
    return _build(path, files, shards, config, ints)


def _shard_paths(directory: Path, weight_map: dict[str, str] | None) -> list[Path]:
    """The shards the index names (each once, in order), else every ``*.safetensors``."""
    if weight_map is None:
        found = sorted(p for p in directory.glob("*.safetensors"))
        if not found:
            raise ModelFileError(directory, "is a directory with no .safetensors file "
                                            "(neither a GGUF file nor a checkpoint)")
        return found
    index = directory / _INDEX_NAME
    out = []
    for name in dict.fromkeys(weight_map.values()):
        if not name or "/" in name or name in (".", "..") or "\x00" in name:
            raise ModelFileError(index, f"names shard {short(name)} outside the checkpoint "
                                        f"directory")
        shard = directory / name
        if not shard.exists():
            raise ModelFileError(index, f"names shard {short(name)}, which is missing")
        out.append(shard)
    return out


def _index_map(index: Path) -> dict[str, str]:
    """The index's ``weight_map`` (tensor name -> shard file name)."""
    doc = read_json(index, CONFIG_LIMIT_BYTES)
    weight_map = doc.get("weight_map")
    if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise ModelFileError(index, "has no weight_map of tensor names to shard files")
    return weight_map


def _check_index(index: Path, weight_map: dict[str, str], where: dict[str, int],
                 files: tuple[ModelFile, ...]) -> None:
    """Every tensor the index names is in the shard it names."""
    for name, shard in weight_map.items():
        number = where.get(name)
        if number is None or files[number].path.name != shard:
            found = "no shard" if number is None else files[number].path.name
            raise ModelFileError(index, f"names {short(name, 120)} in {short(shard)}, but "
                                        f"it is in {found}")



def _index(path: Path, name: str, digits: str, what: str) -> int:
    """A layer or expert index from a tensor name: a canonical decimal of at most
    ``_INDEX_DIGITS`` digits (``experts.01`` beside ``experts.1`` would name one expert
    twice; ``layers.999999999999`` would be a model of 10^12 layers)."""
    if len(digits) > _INDEX_DIGITS:
        raise ExpertLayoutError(path, f"tensor {short(name, 120)} names {what} "
                                      f"{digits[:12]}...: no model has that many")
    if digits[0] == "0" and len(digits) > 1:
        raise ExpertLayoutError(path, f"tensor {short(name, 120)} names {what} {digits!r}, "
                                      f"with a leading zero: not a canonical index")
    return int(digits)


def _sort_tensors(path: Path, shards: list[Shard]) -> tuple[
        dict[int, dict[int, dict[str, Tensor]]], dict[int, dict[str, Tensor]],
        dict[int, TensorInfo], list[TensorInfo], int]:
    """The tensors by kind, in the model's address order: per-expert matrices by layer and
    expert, fused ones by layer, routers by layer, the non-routed ones; and how many layers
    the tensors name."""
    per_expert: dict[int, dict[int, dict[str, Tensor]]] = {}
    fused: dict[int, dict[str, Tensor]] = {}
    routers: dict[int, TensorInfo] = {}
    non_routed: list[TensorInfo] = []
    n_blocks = 0
    known: dict[str, int] = {}  # digits already checked by _index, as the index they are
    for shard in shards:
        base = shard.file.base + shard.data_start
        for name, (begin, end, dtype, shape) in shard.entries:
            if "layers." not in name:  # the common case of a dense tensor: no regex
                non_routed.append(TensorInfo(name, dtype, base + begin, end - begin, shape))
                continue
            if (block := _BLOCK.search(name)) is not None:
                digits = block.group(1)
                layer = known.get(digits)
                if layer is None:
                    layer = known[digits] = _index(path, name, digits, "layer")
                if layer >= n_blocks:
                    n_blocks = layer + 1
            if (m := _EXPERT.match(name)) is not None:
                layer_digits, expert_digits = m.group(1, 2)
                layer = known.get(layer_digits)
                if layer is None:
                    layer = known[layer_digits] = _index(path, name, layer_digits, "layer")
                expert = known.get(expert_digits)
                if expert is None:
                    expert = known[expert_digits] = _index(path, name, expert_digits, "expert")
                parts = per_expert.setdefault(layer, {}).setdefault(expert, {})
                t = Tensor(name, dtype, shape, base + begin, end - begin)
                _claim(path, parts, _MATRIX[m.group(3)], t, f"layer {layer} expert {expert}'s")
            elif (m := _FUSED.match(name)) is not None:
                layer = _index(path, name, m.group(1), "layer")
                slot = m.group(2) or m.group(6) or _FUSED_NAMES[
                    m.group(3) or m.group(4) or m.group(5)]
                t = Tensor(name, dtype, shape, base + begin, end - begin)
                _claim(path, fused.setdefault(layer, {}), slot, t, f"layer {layer}'s")
            else:
                info = TensorInfo(name, dtype, base + begin, end - begin, shape)
                non_routed.append(info)
                if (m := _ROUTER.match(name)) is not None:
                    layer = _index(path, name, m.group(1), "layer")
                    if layer in routers:
                        raise ExpertLayoutError(path, f"tensors {short(routers[layer].name)} "
                                                      f"and {short(name)} are both layer "
                                                      f"{layer}'s router")
                    routers[layer] = info
    n_blocks = max([n_blocks, *(i + 1 for i in (*per_expert, *fused, *routers))])
    return per_expert, fused, routers, non_routed, n_blocks


def _build(path: Path, files: tuple[ModelFile, ...], shards: list[Shard],
           config: dict[str, Any], ints: dict[str, int]) -> ExpertTable:
    per_expert, fused, routers, non_routed, n_blocks = _sort_tensors(path, shards)
    both = sorted(set(per_expert) & set(fused))
    if both:
        raise ExpertLayoutError(path, f"layer {both[0]} has both per-expert and fused experts")
    if not per_expert and not fused:
        why = _NOT_STREAMED.get(str(config.get("model_type")))
        if why is not None:
            raise ExpertLayoutError(path, f"no routed expert tensors: model type "
                                          f"{config['model_type']}, {why} "
                                          "(docs/TRANSFORMERS.md, Supported models)")
        raise ExpertLayoutError(path, "no routed expert tensors (read under a layer's mlp, "
                                      "block_sparse_moe, ffn, feed_forward or mixer block: "
                                      "experts.E.{gate,up,down}_proj.weight, "
                                      "experts.E.{w1,w3,w2}.weight, or fused "
                                      "experts.gate_up_proj/down_proj, experts.fc1/fc2 "
                                      "or input_linear/output_linear; "
                                      "docs/TRANSFORMERS.md, "
                                      "Supported models)")
    want = layer_sizes(config, ints)
    quant = quant_config(path, config)
    specs = {t.name: (t.name, t.type_name, t.shape) for t in non_routed} if quant else None
    layers: dict[int, MoeLayer] = {}
    for index in sorted({*per_expert, *fused}):
        if index in fused:
            moe = fused_layer(path, index, fused[index], routers.get(index), quant, specs)
        else:
            moe = per_expert_layer(path, index, per_expert[index], routers.get(index),
                                   quant, specs)
        layers[index] = moe
        check_layer_sizes(path, moe, want)
    for what, values in (("expert count", {m.n_experts for m in layers.values()}),
                         ("hidden size", {m.shape[0] for m in layers.values()})):
        if len(values) != 1:
            listed = sorted(values)
            raise ExpertLayoutError(path, f"MoE layers disagree on the {what}: "
                                          f"{short(listed, 60)}")
    count = next(iter(layers.values())).n_experts
    return ExpertTable(
        path=path,
        file_bytes=files[-1].span_end,
        n_layers=layer_count(path, ints, n_blocks),
        layers=layers,
        top_k=top_k(path, ints, count),
        hash_routed=0,
        hidden=next(iter(layers.values())).shape[0],
        non_routed=tuple(non_routed),
        digests=None,
        files=files,
        format="safetensors",
        config=config,
    )


def _claim(path: Path, slots: dict[str, Tensor], slot: str, t: Tensor, whose: str) -> None:
    """Put ``t`` in ``slots[slot]``, refusing a second tensor for it (``w1`` beside
    ``gate_proj``, two prefixes): never a silent pick."""
    if slot in slots:
        raise ExpertLayoutError(path, f"tensors {slots[slot].name!r} and {t.name!r} are both "
                                      f"{whose} {slot}")
    slots[slot] = t

