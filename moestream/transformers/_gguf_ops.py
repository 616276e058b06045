"""GGUF architectures transformers loads through its conversion ops (``integrations/gguf``:
Qwen3.5-MoE's ``qwen35moe`` from 5.18 on), their dense weights as that loading makes them.

transformers' newer GGUF path does not rename tensors by a per-architecture tensor
processor: ``from_pretrained(dir, gguf_file=...)`` hands the file's tensors (blocks left as
bytes) to its general loader with the architecture's weight conversions
(``get_gguf_conversion_mapping``: renamings, then a converter a tensor that undoes what
llama.cpp's converter did: norms stored as ``w + 1``, ``-exp(A_log)``, tiled value heads, a
squeezed convolution), a ``Dequantize`` first and a ``Cast`` to the model's dtype last
(``add_gguf_load_ops``). Here the same mapping and the same ops build each non-routed
tensor from its bytes read through the session, so the dense weights are transformers'
own, bit for bit; the routed experts stay in the file and stream quantized
(``_gguf_experts``), as they do on the legacy path.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch  # type: ignore[import-not-found, unused-ignore]
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

import moestream
from moestream.pipeline.foundation.errors import ModelFileError
from moestream.transformers._layout import TORCH_DTYPES
from moestream.transformers._renaming import converted

__all__ = ["conversion_header", "converted_tensors", "uses_conversion_ops"]


def uses_conversion_ops(arch: str) -> bool:
    """Whether the installed transformers loads ``arch`` through its conversion ops (which
    it prefers to its legacy mapping)."""
    try:
        from transformers.integrations.gguf import utils
    except ImportError:
        return False
    return bool(getattr(utils, "is_gguf_arch_supported", lambda _: False)(arch))


def conversion_header(path: Path, arch: str, reader: GGUFReader) -> Any:
    """transformers' ``GgufHeader`` of the file, from gguf's reader of the session's header
    (no second parse of the path): what its plan and load ops read (each tensor's ggml
    type) and the dtype it loads an all-float file in."""
    from transformers.integrations.gguf.reader import GgufHeader, TensorInfo

    tensors = tuple(
        TensorInfo(t.name, tuple(int(n) for n in reversed(t.shape)), int(t.tensor_type),
                   int(t.data_offset), int(t.n_bytes))
        for t in reader.tensors)
    return GgufHeader(str(path), arch, tensors, 0)


def converted_tensors(model: Any, session: moestream.SyncSession, arch: str,
                      header: Any) -> Iterator[tuple[str, str | None, Any]]:
    """Each non-routed tensor as transformers' conversion ops load it: (file name, model
    name, tensor on the CPU in the model's dtype), read through the session; a tensor the
    model has no place for (llama.cpp's multi-token-prediction block, which transformers
    drops) comes with the model name None.

    Raises:
        ModelFileError: a tensor in a type transformers' conversion does not read, or one
            its ops refuse (each named).
    """
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    from transformers.integrations.gguf.utils import (
        add_gguf_load_ops,
        get_gguf_conversion_mapping,
        get_gguf_plan,
    )

    path = session.model.path
    mapping = get_gguf_conversion_mapping(arch, model.config)
    quantized, _, _ = get_gguf_plan(header, mapping)  # every block tensor is unpacked
    mapping = add_gguf_load_ops(mapping, quantized, header, model.dtype)
    renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
    converters = [t for t in mapping if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    meta_state = model.state_dict()
    prefix = getattr(model, "base_model_prefix", None)
    for spec in session.model.tensors.values():
        target, pattern = rename_source_key(spec.name, renamings, converters, prefix, meta_state)
        if target not in meta_state or pattern is None:
            yield spec.name, None, None
            continue
        converter = copy.deepcopy(by_pattern[pattern])
        converter.add_tensor(target, spec.name, pattern, _raw(path, spec,
                                                              session.read_tensor(spec.name)))
        for name, tensor in converted(converter, target, model, path, spec.name).items():
            yield spec.name, name, tensor


def _raw(path: Path, spec: moestream.TensorSpec, data: bytearray) -> Any:
    """A tensor's bytes as transformers' GGUF reader hands them to the ops: a float type's
    values in that type, a block type's blocks as ``uint8`` rows."""
    from transformers.integrations.gguf.dequant import GGML_BLOCK

    kind = GGMLQuantizationType[spec.dtype]
    raw = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    if kind.name in TORCH_DTYPES:
        return raw.view(TORCH_DTYPES[kind.name]).reshape(spec.shape)
    if int(kind) not in GGML_BLOCK:
        raise ModelFileError(path, f"{spec.name[:120]}: a {kind.name} tensor, a type "
                             "transformers' GGUF conversion does not read")
    block, nbytes = GGML_QUANT_SIZES[kind]
    return raw.reshape(*spec.shape[:-1], spec.shape[-1] // block * nbytes)
