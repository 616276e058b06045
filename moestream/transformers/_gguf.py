"""A GGUF file as a transformers model: its config, tokenizer and dense weights by
transformers' own GGUF mapping, its routed experts left in the file for the session.

transformers reads a GGUF file by dequantizing all of it to float at load
(``from_pretrained(dir, gguf_file=...)``: ``load_gguf_checkpoint``, gguf-py's numpy
dequantization, then its per-architecture ``TensorProcessor`` renames ggml names to its own
and reshapes or permutes where an architecture needs it). Here the same pieces build the
same model with the routed experts left out:

- the config and tokenizer come from transformers' own ``AutoConfig`` / ``AutoTokenizer``
  with ``gguf_file=``, pointed at a private directory whose one entry is a copy of the
  file's header read through the session (``read_header``: the file the session
  identified, its identity checked before and after the read), the tensor data a hole:
  nothing transformers parses comes from a second open of the path, which may name another
  file by then; the copy's tensor table is checked against the session's too;
- every non-routed tensor's bytes come through the session (``read_tensor``: the file as
  the session identified it), are dequantized by gguf-py as transformers does, and are
  renamed and processed by transformers' ``get_gguf_hf_weights_map`` and the
  architecture's ``TensorProcessor``; the dtype is transformers' (float32 unless given);
- the routed experts (``ffn_{gate,up,down}_exps``) never leave the session: they stream
  quantized and ``_gguf_experts`` dequantizes them per use.

Served: the architectures transformers' legacy GGUF loader maps whose experts it stacks
into ``gate_up_proj`` / ``down_proj`` (``TENSOR_PROCESSORS`` with a ``HF_MOE_W13_PATTERN``:
qwen2moe, qwen3moe and minimax-m2 in transformers 5.17 to 5.25), and those it loads
through its newer GGUF conversion ops (``integrations/gguf``: qwen35moe), whose dense
tensors ``_gguf_ops`` builds by those ops. Refused in one line: an architecture
transformers maps no model from, gpt-oss (transformers' GGUF loader splits its experts from
tensors named otherwise than llama.cpp names them: no reference of transformers' to match),
and a transformers without GGUF loading.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import re
import struct
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch  # type: ignore[import-not-found, unused-ignore]
import transformers  # type: ignore[import-not-found, unused-ignore]
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter

import moestream
from moestream.pipeline.foundation.errors import ModelFileError, UsageError
from moestream.pipeline.foundation.gguf_split import split_of
from moestream.transformers._arguments import first_line
from moestream.transformers._gguf_ds4 import ds4_dense_tensors
from moestream.transformers._gguf_ds4_config import ARCHITECTURE as DS4
from moestream.transformers._gguf_ds4_config import ds4_config
from moestream.transformers._gguf_ops import (
    conversion_header,
    converted_tensors,
    uses_conversion_ops,
)
from moestream.transformers._gguf_tensors import dequantized

__all__ = ["GgufSource", "dense_tensors", "gguf_model", "gguf_tokenizer", "is_gguf"]

_ROUTED = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down|gate_up)_exps\.weight$")
"""A routed-experts tensor's name, as the session's table reads it."""
_LINK = "model.gguf"
"""The private directory's one entry: the copy of the session's header."""
_FFN_KEYS = (("expert_feed_forward_length", "moe_intermediate_size"),
             ("expert_shared_feed_forward_length", "shared_expert_intermediate_size"))
"""What the file states of the experts' widths and transformers' legacy mapping drops
(it leaves the config class's defaults): set from the file where the config has them."""


def is_gguf(path: Path) -> bool:
    """Whether ``from_pretrained`` reads ``path`` as a GGUF file (a file, not safetensors)."""
    return path.suffix == ".gguf" or (path.is_file() and path.suffix != ".safetensors")


def _legacy() -> Any:
    """transformers' GGUF loader module, or a one-line refusal naming the version."""
    version = importlib.metadata.version("transformers")
    try:  # by its full name: a module already bound on the package is looked up again
        legacy = importlib.import_module("transformers.modeling_gguf_pytorch_utils")
    except ImportError as exc:
        raise UsageError(f"transformers {version} reads no GGUF ({first_line(exc)}); "
                         "moestream.transformers builds GGUF models with transformers' "
                         "own GGUF mapping (transformers >= 5 with gguf installed)") from exc
    if not all(hasattr(legacy, name) for name in ("load_gguf_checkpoint", "TENSOR_PROCESSORS",
                                                  "get_gguf_hf_weights_map")):
        raise UsageError(f"transformers {version} has no GGUF loader moestream can follow "
                         "(load_gguf_checkpoint, TENSOR_PROCESSORS, get_gguf_hf_weights_map)")
    return legacy


def _served_archs(legacy: Any) -> list[str]:
    """The architectures whose experts transformers stacks as gate_up_proj / down_proj."""
    return sorted(arch for arch, processor in legacy.TENSOR_PROCESSORS.items()
                  if hasattr(processor, "HF_MOE_W13_PATTERN"))


def _check_arch(path: Path, arch: str, legacy: Any) -> None:
    """Refuse, in one line naming it, an architecture moestream cannot serve from GGUF."""
    served = _served_archs(legacy)
    if arch in served or uses_conversion_ops(arch):
        return
    version = importlib.metadata.version("transformers")
    if arch in ("gpt-oss", "gpt_oss"):
        why = (f"transformers {version} splits gpt-oss experts from tensors named "
               "ffn_*_projs, not llama.cpp's ffn_*_exps: moestream has no reference of "
               "transformers' to match")
    else:
        why = f"transformers {version} maps no MoE model from it"
    raise ModelFileError(path, f"GGUF architecture {arch[:40]!r}: {why} (served: "
                         f"{', '.join(served)}, and those transformers loads through its "
                         "GGUF conversion ops)")


@contextmanager
def _pinned(session: moestream.SyncSession) -> Iterator[tuple[Path, GGUFReader]]:
    """A private directory whose one entry is a copy of the session's GGUF header, and
    gguf's reader of that copy; both gone on exit.

    The header is read through the session (``read_header``: the file as it identified it,
    the identity checked before and after the read), never by opening the path again; the
    copy is the header and a hole up to the file's size (a sparse file: the tensor data is
    neither read nor written, and transformers' config and tokenizer read none of it).
    """
    path = session.model.path
    header = session.read_header()
    with tempfile.TemporaryDirectory(prefix="moestream-gguf-") as made:
        private = Path(made)
        copy = private / _LINK
        with open(copy, "xb") as out:
            out.write(header)
            out.truncate(max(session.model.file_bytes, len(header)))
        reader = _read_copy(path, copy)
        if split_of(path, reader) is not None:
            _whole_header(copy, reader, session)
            reader = _read_copy(path, copy)
        yield private, reader


def _read_copy(path: Path, copy: Path) -> GGUFReader:
    try:
        return GGUFReader(copy)
    except (ValueError, IndexError, KeyError, OverflowError, TypeError, struct.error,
            OSError) as exc:  # what gguf's reader raises on a malformed header
        raise ModelFileError(path, f"gguf cannot read it: {first_line(exc)}") from exc


def _whole_header(copy: Path, first: GGUFReader, session: moestream.SyncSession) -> None:
    """Rewrite ``copy``, the first shard's header of a split model, as one file's header:
    its metadata (the split's keys left out) and its tensors, then the dense tensors the
    other shards hold, as the session's table has them. transformers reads a config from
    the tensor table too (no ``output.weight``: tied embeddings) and reads no split file."""
    whole = copy.with_name(copy.name + ".whole")  # written beside: ``first`` maps ``copy``
    writer = GGUFWriter(whole, "")
    writer.kv_data[0].clear()
    for name, field in first.fields.items():
        if not name.startswith(("GGUF.", "split.")):
            sub = field.types[1] if len(field.types) > 1 else None
            writer.add_key_value(name, field.contents(), field.types[0], sub_type=sub)
    listed = set()
    for t in first.tensors:
        listed.add(t.name)
        writer.add_tensor_info(t.name, [int(n) for n in reversed(t.shape)], np.dtype(np.float32),
                               int(t.n_bytes), raw_dtype=t.tensor_type)
    for spec in session.model.tensors.values():
        if spec.name not in listed:
            writer.add_tensor_info(spec.name, spec.shape, np.dtype(np.float32), spec.nbytes,
                                   raw_dtype=GGMLQuantizationType[spec.dtype])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    with open(whole, "r+b") as out:  # the tensor data a hole, as in the first shard's copy
        out.truncate(out.seek(0, 2) + session.model.file_bytes)
    os.replace(whole, copy)


def _check_same(path: Path, reader: GGUFReader, session: moestream.SyncSession) -> None:
    """The header transformers reads (``reader``) has the session's tensor table: the same
    dense tensors (names, types, shapes) and the same routed experts (layers, types, expert
    counts). Both come from the file the session identified, so this holds unless the
    header and the table drift apart; it is checked before anything is built from it."""
    info = session.model
    ours = {t.name: (t.tensor_type.name, tuple(int(n) for n in reversed(t.shape)))
            for t in reader.tensors}
    same = all(ours.get(name) == (spec.dtype, spec.shape) for name, spec in info.tensors.items())
    for name, (kind, shape) in ours.items():
        if name in info.tensors:
            continue
        routed = _ROUTED.match(name)
        layer = info.layers.get(int(routed.group(1))) if routed else None
        want = None if layer is None else (
            layer.down_type if routed and routed.group(2) == "down" else layer.gate_up_type)
        same = same and layer is not None and want is not None and kind == want.name \
            and shape[0] == layer.n_experts
    if not same or len(ours) < len(info.tensors):
        raise ModelFileError(path, "its header's tensor table is not the one the session "
                             "read")


@dataclass(frozen=True)
class GgufSource:
    """What building the model from a GGUF file found: its architecture and transformers'
    tensor processor for it (the dense weights' renaming and reshaping)."""

    path: Path
    arch: str
    processor: Any
    legacy: Any
    header: Any = None
    """transformers' ``GgufHeader`` where it loads the architecture through its conversion
    ops (``_gguf_ops``; then no processor)."""


def gguf_model(session: moestream.SyncSession,
               build: Callable[[Path, Any], Any]) -> tuple[Any, Any, GgufSource]:
    """The model of the GGUF file of ``session``, its config (transformers' own, from the
    file) and its source: ``build(files, config)`` builds the model, ``files`` a private
    directory with no generation or tokenizer file.

    Raises:
        UsageError: transformers reads no GGUF.
        ModelFileError: an architecture moestream does not serve (named), a file transformers
            cannot parse, or one that is not the session's.
    """
    path = session.model.path
    legacy = _legacy()
    with _pinned(session) as (private, reader):
        _check_same(path, reader, session)
        field = legacy.read_field(reader, "general.architecture")
        arch = str(field[0]) if field else "(none)"
        if arch == DS4:  # ds4's DeepSeek V4 Flash: transformers maps no GGUF of it
            config = ds4_config(path, reader)
            with tempfile.TemporaryDirectory(prefix="moestream-gguf-build-") as files:
                return build(Path(files), config), config, GgufSource(path, arch, None, legacy)
        _check_arch(path, arch, legacy)
        header = conversion_header(path, arch, reader) if uses_conversion_ops(arch) else None
        try:
            config = transformers.AutoConfig.from_pretrained(private, gguf_file=_LINK,
                                                             trust_remote_code=False)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ModelFileError(path, f"transformers' GGUF config: {first_line(exc)}") from exc
        if header is not None:  # the dtype transformers loads such a file in
            config.dtype = config.dtype or header.dtype or torch.float32
            processor = None
        else:
            for key, attribute in _FFN_KEYS:
                stated = legacy.read_field(reader, f"{arch}.{key}")
                if stated and hasattr(config, attribute):
                    setattr(config, attribute, int(stated[0]))
            processor = legacy.TENSOR_PROCESSORS[arch](config=config.to_dict())
        with tempfile.TemporaryDirectory(prefix="moestream-gguf-build-") as files:
            model = build(Path(files), config)
    return model, config, GgufSource(path, arch, processor, legacy, header)


def gguf_tokenizer(session: moestream.SyncSession) -> Any:
    """transformers' tokenizer of the session's GGUF file (``AutoTokenizer`` with
    ``gguf_file=``, from the header the session read: the file it identified).

    Raises:
        UsageError: transformers reads no GGUF, or builds no tokenizer from this file.
        ModelChangedError: the file changed since the session opened it.
    """
    _legacy()
    path = session.model.path
    with _pinned(session) as (private, _):
        try:
            return transformers.AutoTokenizer.from_pretrained(private, gguf_file=_LINK,
                                                              trust_remote_code=False)
        except (OSError, ValueError, KeyError, TypeError, AttributeError,
                NotImplementedError) as exc:
            raise UsageError(f"{path}: transformers builds no tokenizer from this GGUF "
                             f"({first_line(exc)[:200]}); pass --prompt-ids") from exc


def dense_tensors(model: Any, session: moestream.SyncSession,
                  source: GgufSource) -> Iterator[tuple[str, str | None, Any]]:
    """Each non-routed tensor as transformers loads it: (file name, model name, tensor on
    the CPU), read through the session, dequantized by gguf-py to float32 and processed by
    transformers' tensor processor (or, for an architecture transformers loads by its
    conversion ops, by those: ``_gguf_ops``); tensors the model has no place for come with
    the model name None."""
    if source.arch == DS4:
        yield from ds4_dense_tensors(model, session)
        return
    if source.header is not None:
        yield from converted_tensors(model, session, source.arch, source.header)
        return
    mapping = source.legacy.get_gguf_hf_weights_map(model, source.processor)
    for spec in session.model.tensors.values():
        weights = dequantized(source.path, spec, session.read_tensor(spec.name))
        result = source.processor.process(weights=weights, name=spec.name,
                                          tensor_key_mapping=mapping,
                                          parsed_parameters={"tensors": {}})
        target = mapping.get(result.name) if result.name is not None else None
        yield spec.name, target, torch.from_numpy(np.array(result.weights, dtype=np.float32))
