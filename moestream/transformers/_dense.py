"""The dense weights: every tensor but the routed experts, read through the session.

Each is read from the files the session identified when it opened (``read_tensor``), renamed
as transformers' own loading renames it (those it builds from several by its converter),
moved to the device and assigned to the meta model; non-persistent buffers are made by the
model's ``_init_weights``; tied weights are tied.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import structlog
import torch  # type: ignore[import-not-found, unused-ignore]
from transformers.quantizers.base import HfQuantizer  # type: ignore[import-not-found, unused-ignore]

import moestream
from moestream.pipeline.foundation.errors import ExpertLayoutError, ModelFileError
from moestream.transformers._gguf import GgufSource, dense_tensors
from moestream.transformers._quantized import DenseScales
from moestream.transformers._renaming import converted, renamer

__all__ = ["load_dense", "load_gguf_dense", "tensor_reader"]

_log = structlog.get_logger("moestream.transformers")

_FILE_DTYPES: dict[str, Any] = {
    name: getattr(torch, attr) for name, attr in (
        ("BOOL", "bool"), ("U8", "uint8"), ("I8", "int8"), ("I16", "int16"),
        ("U16", "uint16"), ("I32", "int32"), ("U32", "uint32"), ("I64", "int64"),
        ("U64", "uint64"), ("F16", "float16"), ("BF16", "bfloat16"), ("F32", "float32"),
        ("F64", "float64"), ("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"),
        ("F8_E8M0", "float8_e8m0fnu"))
    if hasattr(torch, attr)
}
"""safetensors' type names, as torch loads them (as safetensors' own torch loader maps
them)."""

_FLOATS = frozenset({"F16", "BF16", "F32", "F64"})

_RENAMED_IN_FILE_DTYPE = not hasattr(HfQuantizer, "get_new_dtype")
"""Whether this transformers loads a pre-quantized checkpoint's renamed float tensors in the
file's dtype, not the model's: versions before ``HfQuantizer.get_new_dtype`` (5.17 among
them) take a renamed key as one being deserialized and skip the cast, the dtype plan
included (DeepSeek-V4's norms stay bf16 while its float32 plan names them). Matched here,
so that a quantized checkpoint's model is the reference's under either."""


def load_dense(model: Any, session: moestream.SyncSession, device: Any,
               progress: bool | None) -> None:
    """Read every non-expert tensor through the session (the files it identified) onto
    ``device`` and assign it (those transformers builds from several, such as Kimi-Linear's
    stacked convolutions, by its own converter); make the buffers; tie."""
    root = session.model.path
    loaded = _Loaded(model, root)
    merged = _read_dense(model, session, device, progress, loaded)
    _convert(model, root, merged, loaded)
    _finish(model, root, device, loaded)


def load_gguf_dense(model: Any, session: moestream.SyncSession, device: Any,
                    progress: bool | None, source: GgufSource) -> None:
    """Read every non-routed tensor of a GGUF file through the session, as transformers'
    GGUF loading makes it (gguf-py's float32, transformers' names and processing), onto
    ``device`` in the model's dtypes, and assign it; make the buffers; tie."""
    root = session.model.path
    loaded = _Loaded(model, root)
    from tqdm import tqdm

    with tqdm(total=len(session.model.tensors), unit="tensor", desc="loading dense weights",
              disable=not (sys.stderr.isatty() if progress is None else progress), leave=False,
              file=sys.stderr) as bar:
        for name, target, tensor in dense_tensors(model, session, source):
            bar.update(1)
            if target is None or target not in loaded.expected:
                loaded.unexpected.append(name)
                continue
            loaded.assign(name, target, tensor.to(device))
    _finish(model, root, device, loaded)


def _finish(model: Any, root: Path, device: Any, loaded: _Loaded) -> None:
    """Assign what was loaded; tie; refuse a model left with a parameter no tensor gave
    (the routed experts aside); make the buffers."""
    if loaded.unexpected:
        _log.warning("checkpoint_tensors_unused", count=len(loaded.unexpected),
                     first=loaded.unexpected[:4], path=str(root))
    model.load_state_dict(loaded.tensors, strict=False, assign=True)
    model.tie_weights()
    routed = {f"{name}.{p}" for name, m in model.named_modules()
              if getattr(m, "moestream_layer", None) is not None or hasattr(m, "has_gate")
              for p in ("gate_up_proj", "up_proj", "down_proj")}
    missing = [n for n, p in model.named_parameters()
               if p.is_meta and n not in routed]
    if missing:
        raise ModelFileError(root, f"the checkpoint lacks {len(missing)} tensors the model "
                             f"needs, first {missing[0]}")
    _make_buffers(root, model, device)


class _Loaded:
    """The dense tensors loaded so far, by model name, each checked against the meta
    model's own shape and cast to its dtype; the checkpoint's names the model lacks."""

    def __init__(self, model: Any, root: Path) -> None:
        self.model = model
        self.root = root
        self.params = dict(model.named_parameters())
        self.expected = set(model.state_dict())
        self.tensors: dict[str, Any] = {}
        self.unexpected: list[str] = []

    def assign(self, name: str, target: str, tensor: Any, *, cast: bool = True) -> None:
        """Check ``tensor`` against ``target``'s shape and keep it, cast to the model's
        dtype of it unless ``cast`` is False."""
        like = self.params.get(target)
        if like is None:
            like = self.model.get_buffer(target)
        if tuple(tensor.shape) != tuple(like.shape):
            raise ExpertLayoutError(self.root, f"{name} has shape {list(tensor.shape)[:8]}, "
                                    f"the config makes {target} {list(like.shape)}")
        self.tensors[target] = tensor.to(like.dtype) if cast else tensor


def _read_dense(model: Any, session: moestream.SyncSession, device: Any,
                progress: bool | None, loaded: _Loaded) -> dict[str, Any]:
    """Read each dense tensor onto ``device`` and assign it; those a converter builds from
    several are collected by a copy of it instead, returned by the model name it makes."""
    rename = renamer(model)
    dense = list(session.model.tensors.values())
    read = tensor_reader(session)
    quantized = DenseScales(session, session.model.path)
    in_file_dtype = _RENAMED_IN_FILE_DTYPE and "quantization_config" in session.model.config
    merged: dict[str, Any] = {}  # model name -> its converter, collecting its sources
    if progress is None:
        progress = sys.stderr.isatty()
    from tqdm import tqdm

    with tqdm(total=len(dense), unit="tensor", desc="loading dense weights",
              disable=not progress, leave=False, file=sys.stderr) as bar:
        for spec in dense:
            bar.update(1)
            if quantized.is_scale(spec.name):
                continue
            target, converter = rename(spec.name)
            if target not in loaded.expected:
                loaded.unexpected.append(spec.name)
                continue
            like = loaded.params.get(target)
            dtype = like.dtype if like is not None else model.dtype
            tensor = quantized.weight(spec, read(spec).to(device), dtype, read)
            if converter is not None:
                into = merged.setdefault(target, copy.deepcopy(converter[0]))
                into.add_tensor(target, spec.name, converter[1], tensor)
            else:
                loaded.assign(spec.name, target, tensor, cast=not (
                    in_file_dtype and target != spec.name and spec.dtype in _FLOATS))
    return merged


def _convert(model: Any, root: Path, merged: dict[str, Any], loaded: _Loaded) -> None:
    """Build the tensors of ``merged`` by their converters (transformers' own) and assign
    them."""
    for target, converter in merged.items():
        for name, tensor in converted(converter, target, model, root, target).items():
            if name not in loaded.expected:
                loaded.unexpected.append(name)
                continue
            loaded.assign(target, name, tensor)


def tensor_reader(session: moestream.SyncSession) -> Any:
    """A function reading a non-routed tensor through the session as a CPU tensor over its
    bytes (no copy), typed as the file declares it."""
    root = session.model.path

    def read(spec: moestream.TensorSpec) -> Any:
        dtype = _FILE_DTYPES.get(spec.dtype)
        if dtype is None:
            raise ModelFileError(root, f"{spec.name[:120]}: a {spec.dtype[:20]} tensor, a "
                                 "type torch does not load")
        data = session.read_tensor(spec.name)
        if not data:
            return torch.empty(spec.shape, dtype=dtype)
        return torch.frombuffer(data, dtype=dtype).reshape(spec.shape)

    return read


def _make_buffers(root: Path, model: Any, device: Any) -> None:
    """Non-persistent buffers (rotary frequencies) as ``from_pretrained`` makes them: on
    the device, filled by the model's ``_init_weights``."""
    owners = {}
    made: set[int] = set()
    for name, buffer in model.named_buffers():
        if not buffer.is_meta:
            continue
        owner_name, _, leaf = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        owner._buffers[leaf] = torch.empty_like(buffer, device=device)
        made.add(id(owner._buffers[leaf]))
        owners[owner_name] = owner
    with torch.no_grad():
        for owner in owners.values():
            # what was loaded stays as loaded: transformers' init functions skip a tensor
            # marked so, as from_pretrained marks it (Gemma's embedding owns a buffer too)
            for tensor in (*owner.parameters(recurse=False), *owner.buffers(recurse=False)):
                if id(tensor) not in made and not tensor.is_meta:
                    tensor._is_hf_initialized = True
            model._init_weights(owner)
    left = [name for name, b in model.named_buffers() if b.is_meta]
    if left:
        raise ModelFileError(root, f"the model's buffer {left[0]} could not be made")
