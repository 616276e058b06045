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
BF16, F16 or F32 are accepted, and the quantized formats ``pipeline.foundation.quantization``
lists (FP8 blocks, DeepSeek-V4's FP4, gpt-oss's MXFP4 ``*_blocks``) with their
``quantization_config``; any other expert dtype is refused in one line.

A hostile file is refused in one line before anything past its header is trusted, and a
shard is refused whenever safetensors' own reader (``safe_open``, 0.8) refuses it: a header
over 100,000,000 bytes, not UTF-8 or with a byte order mark, not a JSON object, with a
``__metadata__`` that is not an object of strings or a name with an unpaired surrogate; a
tensor of a dtype safetensors does not know, whose shape or size overflows 64 bits, whose
bytes are not its dtype x shape (sub-byte dtypes ending mid-byte included); tensors that
overlap, leave a gap in the data or do not cover it to its end. A name twice in a header
(which safetensors would read as its last entry) is refused too, and a layer or expert index
must be a canonical decimal of at most six digits (``layers.01`` and ``experts.007`` are
refused, never read as 1 and 7).

What headers may cost is bounded per model, not per shard: ``MODEL_HEADER_LIMIT_BYTES``
(100 MiB) of headers and ``MODEL_TENSOR_LIMIT`` (1,000,000) tensors over all shards. The
largest real checkpoints stay well under both: DeepSeek-V3 in FP8 has about 92,000 tensors
(each weight with its scale) and some 20 MB of headers, a 4-bit GPTQ of a 384-expert model
about 280,000 tensors. The byte limit is checked before any shard's header is read, the
tensor limit while they are parsed (the count stops the parse): a checkpoint over the first
is refused having read only each shard's first 8 bytes, one over the second after one parse
of what remains of it. A header is parsed once, each entry made a small tuple as the JSON
parser builds it (never a dict per tensor kept), and its tensors are sorted once, by
offset, for both the layout check and the table's order.

``config.json`` is checked against the tensors: each of the integers it may hold (the expert
count ``num_experts``/``num_local_experts``/``n_routed_experts``, the hidden size
``moe_latent_size`` or ``hidden_size``, the expert FFN ``moe_intermediate_size`` or, in
Mixtral's configs, ``intermediate_size``, the top-k under any name transformers gives it
(``num_experts_per_tok``, ``moe_topk``, ``moe_k``, ``num_experts_per_token``, ``moe_top_k``),
``num_hidden_layers`` and ``num_nextn_predict_layers``) must be an integer where present
(``null`` counts as absent, as transformers writes an unset value; a per-layer list of top-k
as absent too), and must agree: the expert count, hidden size and FFN with every MoE layer,
the top-k within 1..experts, ``num_hidden_layers`` with the layers the tensors name (or,
with DeepSeek's multi-token-prediction layers in the checkpoint, that plus
``num_nextn_predict_layers``).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from operator import itemgetter
from pathlib import Path
from typing import Any, TypeAlias

from gguf import GGMLQuantizationType

from moestream.pipeline.foundation.errors import ExpertLayoutError, ModelFileError
from moestream.pipeline.foundation.experts import ExpertTable, MoeLayer, TensorInfo
from moestream.pipeline.foundation.files import ModelFile, check_identity, lay_out, open_identified
from moestream.pipeline.foundation.inputs import JSONDepthError, load_json_bounded, read_input
from moestream.pipeline.foundation.quantization import (
    CARRIER,
    QuantConfig,
    Spec,
    carried,
    element_shape,
    expert_layer_quant,
    mxfp4_layer_quant,
    quant_config,
)

__all__ = ["HEADER_LIMIT_BYTES", "MODEL_HEADER_LIMIT_BYTES", "MODEL_TENSOR_LIMIT",
           "SAFETENSORS_DTYPE_BITS", "SAFETENSORS_TYPES", "is_routed", "open_checkpoint"]

HEADER_LIMIT_BYTES = 100_000_000
"""The largest shard header read (safetensors' own limit)."""
MODEL_HEADER_LIMIT_BYTES = 100 << 20
"""The most header bytes read for one model, its shards' headers summed."""
MODEL_TENSOR_LIMIT = 1_000_000
"""The most tensors one model may have, over all its shards."""
_CONFIG_LIMIT_BYTES = 16 << 20
_INDEX_NAME = "model.safetensors.index.json"
_INDEX_DIGITS = 6  # a layer or expert index of more: no model has that many

SAFETENSORS_TYPES = {
    "BF16": GGMLQuantizationType.BF16,
    "F16": GGMLQuantizationType.F16,
    "F32": GGMLQuantizationType.F32,
}
"""Expert dtypes the table accepts, as the GGUF types the rest of moestream speaks."""
SAFETENSORS_DTYPE_BITS = {
    "BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8,
    "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16,
    "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64,
    "U64": 64}
"""Every dtype safetensors 0.8 reads, with its bits an element; a header naming another is
refused."""
_DTYPE_NAMES = {name: name for name in SAFETENSORS_DTYPE_BITS}
"""Each dtype's one string: an entry keeps it, not the copy its header parsed."""
_U64 = 1 << 64  # safetensors reads shapes and offsets as usize: nothing reaches 2**64
_Entry: TypeAlias = tuple[int, int, str, tuple[int, ...]]
"""One header entry, checked: (begin, end, dtype, shape), offsets relative to the data."""
_SPAN = itemgetter(1)  # of a (name, entry) pair: sorts by (begin, end), as safetensors does

# re.ASCII: \d would also take other scripts' digits, which int() reads ("\u0663" is 3)
_MOE = r"(?:mlp|block_sparse_moe|ffn|feed_forward|mixer)"
"""A MoE block's name in a layer: Qwen/DeepSeek-V2/V3, Mixtral/Granite, DeepSeek-V4, Jamba,
Nemotron-H."""
_EXPERT = re.compile(rf"^(?:.*\.)?layers\.(\d+)\.{_MOE}\.experts\.(\d+)\."
                     r"(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$", re.ASCII)
_FUSED = re.compile(rf"^(?:.*\.)?layers\.(\d+)\.(?:{_MOE}\.experts\.(gate_up_proj|down_proj)"
                    r"(?:\.weight|_blocks)?|block_sparse_moe\.(input_linear|output_linear)"
                    r"\.weight)$", re.ASCII)
_ROUTER = re.compile(rf"^(?:.*\.)?layers\.(\d+)\.{_MOE}\.(?:gate|router|router\.layer)"
                     r"\.weight$", re.ASCII)
_BLOCK = re.compile(r"(?:^|\.)layers\.(\d+)\.", re.ASCII)
_MATRIX = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up",
           "down_proj": "down", "w2": "down"}
_GRANITE = {"input_linear": "gate_up_proj", "output_linear": "down_proj"}
"""Granite-MoE's fused expert names (``block_sparse_moe.input_linear`` [E, 2F, D], gate the
first F rows, and ``output_linear`` [E, D, F]), as the fused form's."""
_PARTS = ("gate", "up", "down")

_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
_TOP_K_KEYS = ("num_experts_per_tok", "moe_topk", "moe_k", "num_experts_per_token",
               "moe_top_k")
"""The top-k's names in config.json: transformers' own and those its config classes map to
it (Hunyuan and LongCat-Flash, ERNIE-4.5, Kimi-Linear and Bailing, Step)."""
_INT_KEYS = (*_EXPERT_KEYS, "moe_latent_size", "hidden_size", "moe_intermediate_size",
             "intermediate_size", "num_hidden_layers", "num_nextn_predict_layers", *_TOP_K_KEYS)


def is_routed(name: str) -> bool:
    """Whether the checkpoint tensor ``name`` holds routed experts (read by moestream, not
    loaded with the dense weights)."""
    return _EXPERT.match(name) is not None or _FUSED.match(name) is not None


@dataclass(frozen=True, slots=True)
class _Tensor:
    """One routed tensor, its offset already in the model's address space."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class _Shard:
    """A shard's tensors as its header declares them, in data order."""

    file: ModelFile
    data_start: int  # where its data begins in the file: after the length and the header
    entries: list[tuple[str, _Entry]]


def _short(value: object, limit: int = 40) -> str:
    """``repr(value)``, cut to about ``limit`` characters: a value echoed from a file (a
    4000-digit number, a shape of 10,000 axes) never makes a long message."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


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
    config = _read_config(directory, required=path.is_dir())
    ints = _config_ints(path, config)  # before any shard: a bad config costs no header
    shards: list[_Shard] = []
    where: dict[str, int] = {}  # tensor name -> its shard's number
    opened: list[tuple[Path, int]] = []
    try:
        identified = []
        for p in shard_paths:
            fd, identity = open_identified(p, "safetensors shard")
            opened.append((p, fd))
            identified.append((p, identity))
        files = lay_out(identified)
        budget = _Budget()
        lengths = [budget.take_header(p, _header_length(p, fd, f))  # all before any parse
                   for (p, fd), f in zip(opened, files, strict=True)]
        for number, ((p, fd), f, n) in enumerate(zip(opened, files, lengths, strict=True)):
            shard = _read_header(p, fd, f, n, budget)
            for name, _ in shard.entries:
                first = where.setdefault(name, number)
                if first != number:
                    raise ExpertLayoutError(p, f"tensor {_short(name, 120)} is also in "
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
            raise ModelFileError(index, f"names shard {_short(name)} outside the checkpoint "
                                        f"directory")
        shard = directory / name
        if not shard.exists():
            raise ModelFileError(index, f"names shard {_short(name)}, which is missing")
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


def _check_index(index: Path, weight_map: dict[str, str], where: dict[str, int],
                 files: tuple[ModelFile, ...]) -> None:
    """Every tensor the index names is in the shard it names."""
    for name, shard in weight_map.items():
        number = where.get(name)
        if number is None or files[number].path.name != shard:
            found = "no shard" if number is None else files[number].path.name
            raise ModelFileError(index, f"names {_short(name, 120)} in {_short(shard)}, but "
                                        f"it is in {found}")


def _read_json(path: Path, limit: int) -> dict[str, Any]:
    """A JSON object from a small regular file, refused in one line when it is not one."""
    try:
        data = read_input(path, limit)
    except OSError as exc:
        raise ModelFileError(path, f"cannot read: {exc.strerror or exc}") from exc
    return _parse_object(path, data, "file")


def _refuse_duplicate(path: Path, pairs: list[tuple[str, Any]], what: str) -> None:
    seen: set[str] = set()
    for k, _ in pairs:
        if k in seen:
            raise ModelFileError(path, f"its {what} names {_short(k, 120)} twice")
        seen.add(k)


def _parse_object(path: Path, data: bytes, what: str,
                  hook: Callable[[list[tuple[str, Any]]], Any] | None = None) -> dict[str, Any]:
    """``data`` as a JSON object without duplicate keys, its nesting bounded; refused in one
    line otherwise. The bytes must be UTF-8, with no byte order mark: ``json.loads`` would
    guess UTF-16 or skip a mark where safetensors and transformers refuse the file. ``hook``
    replaces the duplicate-refusing ``object_pairs_hook`` (and must refuse them too)."""

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out = dict(pairs)
        if len(out) != len(pairs):
            _refuse_duplicate(path, pairs, what)
        return out

    if data.startswith(b"\xef\xbb\xbf"):
        raise ModelFileError(path, f"its {what} starts with a UTF-8 byte order mark "
                                   f"(safetensors and transformers refuse one)")
    if b"\x00" in data[:4]:  # json.loads would read it as UTF-16 or UTF-32; no JSON has NULs
        raise ModelFileError(path, f"its {what} is not JSON (NUL bytes: UTF-16 or UTF-32?)")
    try:
        data.decode("utf-8")  # strict: json.loads lets encoded surrogates pass
        doc = load_json_bounded(data, f"its {what}", object_pairs_hook=hook or no_duplicates)
    except JSONDepthError as exc:
        raise ModelFileError(path, f"its {what} nests too deeply ({exc})") from None
    except ValueError as exc:  # not JSON, or not UTF-8
        raise ModelFileError(path, f"its {what} is not JSON ({str(exc)[:80]})") from None
    if isinstance(doc, tuple):  # the hook made the whole header one entry
        raise ModelFileError(path, f"its {what} is one tensor entry, not an object of them")
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


class _Budget:
    """What the model's headers may still cost: bytes and tensors, over all its shards."""

    __slots__ = ("header_bytes", "tensors")

    def __init__(self) -> None:
        self.header_bytes = 0
        self.tensors = 0

    def take_header(self, path: Path, nbytes: int) -> int:
        """Count a header of ``nbytes`` before it is read (and return it); refuse one past
        the limit."""
        self.header_bytes += nbytes
        if self.header_bytes > MODEL_HEADER_LIMIT_BYTES:
            raise ModelFileError(path, f"brings the checkpoint's headers to "
                                       f"{self.header_bytes} bytes, over the "
                                       f"{MODEL_HEADER_LIMIT_BYTES}-byte limit for a model")
        return nbytes


class _EntryHook:
    """The JSON parser's ``object_pairs_hook`` for a shard header: refuses duplicate keys,
    turns each object shaped like a tensor entry (a ``data_offsets`` array) into its checked
    ``_Entry`` as soon as it is parsed, and counts them against the model's tensor limit,
    stopping the parse once past it. A malformed entry stays a dict, refused by name once
    the header is parsed."""

    __slots__ = ("budget", "data_bytes", "path")

    def __init__(self, path: Path, data_bytes: int, budget: _Budget) -> None:
        self.path, self.data_bytes, self.budget = path, data_bytes, budget

    def __call__(self, pairs: list[tuple[str, Any]]) -> dict[str, Any] | _Entry:
        obj = dict(pairs)
        if len(obj) != len(pairs):
            _refuse_duplicate(self.path, pairs, "header")
        if obj.get("data_offsets").__class__ is not list:
            return obj
        self.budget.tensors += 1
        if self.budget.tensors > MODEL_TENSOR_LIMIT:
            raise ModelFileError(self.path, f"brings the checkpoint to more than "
                                            f"{MODEL_TENSOR_LIMIT} tensors, the limit for a "
                                            f"model")
        entry = _entry(obj, self.data_bytes)
        return obj if isinstance(entry, str) else entry


def _header_length(path: Path, fd: int, file: ModelFile) -> int:
    """The length a shard declares for its header, refused past its end or the limit."""
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
    return n


def _read_header(path: Path, fd: int, file: ModelFile, n: int, budget: _Budget) -> _Shard:
    """Every tensor the shard's header of ``n`` bytes declares, checked against the file as
    safetensors checks it (see the module docstring), in data order."""
    raw = os.pread(fd, n, 8)
    if len(raw) != n:
        raise ModelFileError(path, "was cut short while its header was read")
    data_bytes = file.nbytes - 8 - n
    header = _parse_object(path, raw, "header", _EntryHook(path, data_bytes, budget))
    del raw
    entries: list[tuple[str, _Entry]] = []
    for name, value in header.items():
        if name == "__metadata__":
            _check_metadata(path, value)
            continue
        if value.__class__ is not tuple:  # the hook left it a dict, or it is no object
            problem = _entry(value, data_bytes) if isinstance(value, dict) else None
            raise ModelFileError(path, f"header entry {_short(name, 120)} "
                                       f"{problem or 'is not an object'}")
        if not name.isascii():
            _check_text(path, name)
        entries.append((name, value))
    del header
    entries.sort(key=_SPAN)
    _check_contiguous(path, entries, data_bytes)
    return _Shard(file, 8 + n, entries)


def _entry(obj: dict[str, Any], data_bytes: int) -> _Entry | str:
    """One header entry as an ``_Entry``, or what is wrong with it in words (its checks are
    safetensors', and that it lies within the shard's ``data_bytes``)."""
    dtype, shape, offsets = obj.get("dtype"), obj.get("shape"), obj.get("data_offsets")
    if dtype.__class__ is not str or shape.__class__ is not list or offsets.__class__ is not list:
        return "lacks dtype, shape or data_offsets"
    bits = SAFETENSORS_DTYPE_BITS.get(dtype)
    if bits is None:
        return f"has dtype {_short(dtype)}, which safetensors does not know"
    if len(offsets) != 2 or offsets[0].__class__ is not int or offsets[1].__class__ is not int:
        return "has a bad shape or data_offsets"
    begin, end = offsets
    elements = 1
    for n in shape:
        if n.__class__ is not int or not 0 <= n < _U64:
            return "has a bad shape or data_offsets"
        elements *= n  # checked step by step, left to right, as safetensors multiplies
        if elements >= _U64:
            return f"has shape {_short(shape)}: its element count overflows 64 bits"
    if not 0 <= begin <= end:
        return f"has data_offsets {_short(offsets)}, not a begin and an end after it"
    if end > data_bytes:
        return f"lies at bytes {begin}..{end}, outside its {data_bytes} bytes of data"
    nbits = elements * bits
    if nbits >= _U64:
        return f"is {dtype} {_short(shape)}: its size in bits overflows 64 bits"
    if nbits % 8:
        return f"is {dtype} {_short(shape)}: {nbits} bits, which end mid-byte"
    if nbits // 8 != end - begin:
        return (f"is {dtype} {_short(shape)} ({nbits // 8} bytes) but spans {end - begin}")
    return begin, end, _DTYPE_NAMES[dtype], tuple(shape)


def _check_metadata(path: Path, value: object) -> None:
    """``__metadata__``: absent (null) or an object of strings, as safetensors reads it."""
    if value is None:
        return
    if not isinstance(value, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise ModelFileError(path, "its header's __metadata__ is not an object of strings")
    for k, v in value.items():
        _check_text(path, k)
        _check_text(path, v)


def _check_text(path: Path, text: str) -> None:
    """Refuse a name with a lone surrogate (an escape ``\\ud800`` unpaired): not Unicode text,
    refused by safetensors, and a string no UTF-8 log or terminal could print."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ModelFileError(path, f"its header names {_short(text, 120)}, with an unpaired "
                                   f"surrogate escape (not text)") from None


def _check_contiguous(path: Path, entries: list[tuple[str, _Entry]], data_bytes: int) -> None:
    """The tensors, sorted by their data offsets, lie end to end from the data's first byte
    to its last: safetensors refuses an overlap, a gap or bytes after the last tensor."""
    at, before = 0, None
    for name, (begin, end, _, _) in entries:
        if begin != at:
            if before is None:
                raise ModelFileError(path, f"its data starts with {begin} bytes that are no "
                                           f"tensor's, before {_short(name, 120)}")
            if begin < at:
                raise ModelFileError(path, f"tensors {_short(before, 120)} and "
                                           f"{_short(name, 120)} overlap")
            raise ModelFileError(path, f"its data has a gap of {begin - at} bytes (no tensor's) "
                                       f"between {_short(before, 120)} and {_short(name, 120)}")
        at, before = end, name
    if at != data_bytes:
        raise ModelFileError(path, f"its tensors cover {at} of its {data_bytes} bytes of data; "
                                   f"the rest is no tensor's")


def _config_ints(path: Path, config: dict[str, Any]) -> dict[str, int]:
    """The integers the table reads from ``config.json``, by key (see the module docstring);
    a value of another type (a bool, a float, a string...) is refused, never ignored."""
    out: dict[str, int] = {}
    for key in _INT_KEYS:
        value = config.get(key)
        if value is None:
            continue
        if value.__class__ is int:
            out[key] = value
        elif not (key in _TOP_K_KEYS and isinstance(value, list)):  # per layer (Hunyuan)
            kind = {bool: "a boolean", float: "a float", str: "a string", list: "a list",
                    dict: "an object"}.get(type(value), type(value).__name__)
            shown = json.dumps(value)  # as the file has it: true, "2", 16.0
            if len(shown) > 40:
                shown = f"{shown[:40]}... ({len(shown)} characters)"
            raise ExpertLayoutError(path, f"config.json's {key} is {kind} ({shown}), "
                                          f"not an integer")
    return out


def _index(path: Path, name: str, digits: str, what: str) -> int:
    """A layer or expert index from a tensor name: a canonical decimal of at most
    ``_INDEX_DIGITS`` digits (``experts.01`` beside ``experts.1`` would name one expert
    twice; ``layers.999999999999`` would be a model of 10^12 layers)."""
    if len(digits) > _INDEX_DIGITS:
        raise ExpertLayoutError(path, f"tensor {_short(name, 120)} names {what} "
                                      f"{digits[:12]}...: no model has that many")
    if digits[0] == "0" and len(digits) > 1:
        raise ExpertLayoutError(path, f"tensor {_short(name, 120)} names {what} {digits!r}, "
                                      f"with a leading zero: not a canonical index")
    return int(digits)


def _sort_tensors(path: Path, shards: list[_Shard]) -> tuple[
        dict[int, dict[int, dict[str, _Tensor]]], dict[int, dict[str, _Tensor]],
        dict[int, TensorInfo], list[TensorInfo], int]:
    """The tensors by kind, in the model's address order: per-expert matrices by layer and
    expert, fused ones by layer, routers by layer, the non-routed ones; and how many layers
    the tensors name."""
    per_expert: dict[int, dict[int, dict[str, _Tensor]]] = {}
    fused: dict[int, dict[str, _Tensor]] = {}
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
                t = _Tensor(name, dtype, shape, base + begin, end - begin)
                _claim(path, parts, _MATRIX[m.group(3)], t, f"layer {layer} expert {expert}'s")
            elif (m := _FUSED.match(name)) is not None:
                layer = _index(path, name, m.group(1), "layer")
                slot = m.group(2) or _GRANITE[m.group(3)]
                t = _Tensor(name, dtype, shape, base + begin, end - begin)
                _claim(path, fused.setdefault(layer, {}), slot, t, f"layer {layer}'s")
            else:
                info = TensorInfo(name, dtype, base + begin, end - begin, shape)
                non_routed.append(info)
                if (m := _ROUTER.match(name)) is not None:
                    layer = _index(path, name, m.group(1), "layer")
                    if layer in routers:
                        raise ExpertLayoutError(path, f"tensors {_short(routers[layer].name)} "
                                                      f"and {_short(name)} are both layer "
                                                      f"{layer}'s router")
                    routers[layer] = info
    n_blocks = max([n_blocks, *(i + 1 for i in (*per_expert, *fused, *routers))])
    return per_expert, fused, routers, non_routed, n_blocks


def _build(path: Path, files: tuple[ModelFile, ...], shards: list[_Shard],
           config: dict[str, Any], ints: dict[str, int]) -> ExpertTable:
    per_expert, fused, routers, non_routed, n_blocks = _sort_tensors(path, shards)
    both = sorted(set(per_expert) & set(fused))
    if both:
        raise ExpertLayoutError(path, f"layer {both[0]} has both per-expert and fused experts")
    if not per_expert and not fused:
        raise ExpertLayoutError(path, "no routed expert tensors (read under a layer's mlp, "
                                      "block_sparse_moe, ffn, feed_forward or mixer block: "
                                      "experts.E.{gate,up,down}_proj.weight, "
                                      "experts.E.{w1,w3,w2}.weight, or fused "
                                      "experts.gate_up_proj/down_proj or input_linear/"
                                      "output_linear; docs/TRANSFORMERS.md, "
                                      "Supported models)")
    hidden = ints.get("moe_latent_size", ints.get("hidden_size"))  # Nemotron's latent MoE
    ffn = ints.get("moe_intermediate_size")
    if ffn is None and "num_local_experts" in config:  # Mixtral names its expert FFN so
        ffn = ints.get("intermediate_size")
    want = [(f"experts {_short(ints[k], 20)} ({k})", ints[k], 0)
            for k in _EXPERT_KEYS if k in ints]
    want += [(f"hidden_size {_short(hidden, 20)}", hidden, 1)] if hidden is not None else []
    want += [(f"expert FFN {_short(ffn, 20)}", ffn, 2)] if ffn is not None else []
    quant = quant_config(path, config)
    specs = {t.name: (t.name, t.type_name, t.shape) for t in non_routed} if quant else None
    layers: dict[int, MoeLayer] = {}
    for index in sorted({*per_expert, *fused}):
        if index in fused:
            moe = _fused_layer(path, index, fused[index], routers.get(index), quant, specs)
        else:
            moe = _per_expert_layer(path, index, per_expert[index], routers.get(index),
                                    quant, specs)
        layers[index] = moe
        have = (moe.n_experts, moe.shape[0], moe.shape[1])
        for said, value, at in want:
            if value != have[at]:
                raise ExpertLayoutError(path, f"config.json says {said}, but layer "
                                              f"{index}'s tensors have {have[at]}")
    for what, values in (("expert count", {m.n_experts for m in layers.values()}),
                         ("hidden size", {m.shape[0] for m in layers.values()})):
        if len(values) != 1:
            listed = sorted(values)
            raise ExpertLayoutError(path, f"MoE layers disagree on the {what}: "
                                          f"{_short(listed, 60)}")
    count = next(iter(layers.values())).n_experts
    return ExpertTable(
        path=path,
        file_bytes=files[-1].span_end,
        n_layers=_layer_count(path, ints, n_blocks),
        layers=layers,
        top_k=_top_k(path, ints, count),
        hash_routed=0,
        hidden=next(iter(layers.values())).shape[0],
        non_routed=tuple(non_routed),
        digests=None,
        files=files,
        format="safetensors",
        config=config,
    )


def _top_k(path: Path, ints: dict[str, int], count: int) -> int:
    """config.json's top-k, under whichever of its names it has; ``min(8, count)`` when it
    has none (or a per-layer list)."""
    named = {k: ints[k] for k in _TOP_K_KEYS if k in ints}
    if len(set(named.values())) > 1:
        said = ", ".join(f"{k} {_short(v, 20)}" for k, v in named.items())
        raise ExpertLayoutError(path, f"config.json names two top-k: {said}")
    if not named:
        return min(8, count)
    key, top_k = next(iter(named.items()))
    if not 0 < top_k <= count:
        raise ExpertLayoutError(path, f"config.json's {key} {_short(top_k, 20)} is outside "
                                      f"1..{count}")
    return top_k


def _layer_count(path: Path, ints: dict[str, int], n_blocks: int) -> int:
    """The model's layer count: those the tensors name, which ``num_hidden_layers`` must
    equal (dense layers have tensors too), or exceed by DeepSeek's
    ``num_nextn_predict_layers`` when the checkpoint holds those."""
    n_layers = ints.get("num_hidden_layers")
    if n_layers is None:
        return n_blocks
    extra = ints.get("num_nextn_predict_layers", 0)
    if n_blocks not in (n_layers, n_layers + extra):
        plus = f" (and {_short(extra, 20)} multi-token prediction)" if extra else ""
        raise ExpertLayoutError(path, f"config.json says {_short(n_layers, 20)} layers{plus}, "
                                      f"but the tensors name layers 0..{n_blocks - 1}")
    return n_blocks


def _claim(path: Path, slots: dict[str, _Tensor], slot: str, t: _Tensor, whose: str) -> None:
    """Put ``t`` in ``slots[slot]``, refusing a second tensor for it (``w1`` beside
    ``gate_proj``, two prefixes): never a silent pick."""
    if slot in slots:
        raise ExpertLayoutError(path, f"tensors {slots[slot].name!r} and {t.name!r} are both "
                                      f"{whose} {slot}")
    slots[slot] = t


def _expert_type(path: Path, index: int, t: _Tensor,
                 quant: QuantConfig | None = None) -> GGMLQuantizationType:
    if carried(quant, t.dtype):
        return CARRIER
    kind = SAFETENSORS_TYPES.get(t.dtype)
    if kind is None:
        said = f" (quantization_config: {quant.experts} experts)" if quant is not None else ""
        raise ExpertLayoutError(path, f"layer {index}: {_short(t.name, 120)} is {t.dtype}"
                                      f"{said}; experts must be {', '.join(SAFETENSORS_TYPES)}, "
                                      "or F8_E4M3 with quant_method fp8, I8 (FP4) with "
                                      "expert_dtype fp4, MXFP4 blocks with quant_method mxfp4")
    return kind


def _per_expert_layer(path: Path, index: int, experts: dict[int, dict[str, _Tensor]],
                      router: TensorInfo | None, quant: QuantConfig | None = None,
                      tensors: Mapping[str, Spec] | None = None) -> MoeLayer:
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
        raise ExpertLayoutError(path, f"layer {index}: {_short(lead.name, 120)} is "
                                      f"{len(lead.shape)}-D, expected [ffn, hidden]")
    ffn, hidden = element_shape(quant, lead.dtype, lead.shape)
    want = {"gate": (ffn, hidden), "up": (ffn, hidden), "down": (hidden, ffn)}
    types = {p: _expert_type(path, index, first[p], quant) for p in parts}
    if gated and types["gate"] != types["up"]:
        raise ExpertLayoutError(path, f"layer {index}: gate is {types['gate'].name} but up is "
                                      f"{types['up'].name}; they must share a type")
    for e in range(n):
        for p in parts:
            t = experts[e][p]
            shape = element_shape(quant, t.dtype, t.shape)  # FP4: two values a byte
            if shape != want[p] or t.dtype != first[p].dtype:
                raise ExpertLayoutError(path, f"layer {index}: {_short(t.name, 120)} is "
                                              f"{t.dtype} {_short(list(shape))} (elements), "
                                              f"expected {first[p].dtype} {list(want[p])}")
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
    scales = None
    if CARRIER in types.values():
        if not gated or len(set(types.values())) != 1:
            raise ExpertLayoutError(path, f"layer {index}: quantized experts are read with a "
                                          "gate and every matrix quantized")
        assert quant is not None and tensors is not None
        def spec(t: _Tensor) -> Spec:
            return (t.name, t.dtype, t.shape)

        scales = expert_layer_quant(path, index, quant, [
            (spec(experts[e]["gate"]), spec(experts[e]["up"]), spec(experts[e]["down"]))
            for e in range(n)], tensors)
    return MoeLayer(
        index=index, n_experts=n, gate_up_type=types[parts[0]], down_type=types["down"],
        gate_offset=offsets[0][0], up_offset=offsets[0][1], down_offset=offsets[0][2],
        gate_bytes=gate_bytes, up_bytes=up_bytes, down_bytes=first["down"].nbytes,
        gate_up_stride=gate_bytes, fused_gate_up=False, router=router, shape=(hidden, ffn),
        expert_offsets=offsets, gated=gated, quant=scales,
    )


def _fused_layer(path: Path, index: int, parts: dict[str, _Tensor],
                 router: TensorInfo | None, quant: QuantConfig | None = None,
                 tensors: Mapping[str, Spec] | None = None) -> MoeLayer:
    """A layer of the fused form: ``gate_up_proj`` [E, 2F, D] and ``down_proj`` [E, D, F],
    or transposed (gpt-oss) [E, D, 2F] and [E, F, D]; the shapes tell which (both at once
    only when empty). gpt-oss's MXFP4 blocks are the transposed form, quantized."""
    gate_up, down = parts.get("gate_up_proj"), parts.get("down_proj")
    if gate_up is None or down is None:
        missing = "gate_up_proj" if gate_up is None else "down_proj"
        raise ExpertLayoutError(path, f"layer {index}: fused experts lack {missing}")
    blocks = [t for t in (gate_up, down) if t.name.endswith("_blocks")]
    if blocks:
        if quant is None or quant.experts != "mxfp4" or tensors is None:
            raise ExpertLayoutError(path, f"layer {index}: {_short(blocks[0].name, 120)} is "
                                          "MXFP4 blocks, but quantization_config is "
                                          f"{quant.method if quant else 'absent'}; moestream "
                                          "reads them with quant_method mxfp4")
        return _mxfp4_layer(path, index, gate_up, down, router, tensors)
    if len(gate_up.shape) != 3 or len(down.shape) != 3:
        raise ExpertLayoutError(path, f"layer {index}: fused experts must be 3-D, got "
                                      f"{_short(list(gate_up.shape))} and "
                                      f"{_short(list(down.shape))}")
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


def _mxfp4_layer(path: Path, index: int, gate_up: _Tensor, down: _Tensor,
                 router: TensorInfo | None, tensors: Mapping[str, Spec]) -> MoeLayer:
    """gpt-oss's MXFP4 experts: an expert is its slice of each blocks tensor, its gate and
    up the two row halves of its gate_up blocks (``ExpertQuant.shapes``)."""
    n, hidden, ffn, scales = mxfp4_layer_quant(path, index, (gate_up.name, gate_up.dtype,
                                                        gate_up.shape),
                                          (down.name, down.dtype, down.shape), tensors)
    stride = gate_up.nbytes // n
    return MoeLayer(
        index=index, n_experts=n, gate_up_type=CARRIER, down_type=CARRIER,
        gate_offset=gate_up.offset, up_offset=gate_up.offset + stride // 2,
        down_offset=down.offset, gate_bytes=stride // 2, up_bytes=stride // 2,
        down_bytes=down.nbytes // n, gate_up_stride=stride, fused_gate_up=True,
        router=router, shape=(hidden, ffn), transposed=True, quant=scales,
    )
