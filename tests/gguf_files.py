"""Writing small hand-made GGUF files for the table tests and the fuzz (gguf's writer)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from gguf import GGUFValueType, GGUFWriter


def finish_gguf(writer: GGUFWriter, path: Path, tensors: Mapping[str, np.ndarray],
                digests: Sequence[int] | None = None) -> Path:
    """Add ``moestream.expert_digests`` (if given) and ``tensors``, write, close."""
    if digests is not None:
        writer.add_key_value("moestream.expert_digests", list(digests), GGUFValueType.ARRAY,
                             sub_type=GGUFValueType.UINT64)
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_plain_moe(path: Path, *, layers: int = 3, experts: int = 16, hidden: int = 64,
                    ffn: int = 96, top_k: int = 4, pad_elems: int = 333, seed: int = 0,
                    arch: str = "qwen3moe", split_max_tensors: int = 0) -> Path:
    """A MoE model as other tools write them: gguf's writer directly, F16 experts after a
    ``pad_elems``-value tensor (so slices sit at any offset), no moestream metadata; with
    ``split_max_tensors``, split into shards of that many tensors by gguf's writer (the
    first shard's path is returned)."""
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(path, arch, split_max_tensors=split_max_tensors)
    writer.add_uint32(f"{arch}.block_count", layers)
    writer.add_uint32(f"{arch}.expert_used_count", top_k)
    tensors = {"token_embd.weight": rng.standard_normal(pad_elems).astype(np.float16)}
    for layer in range(layers):
        for matrix, shape in (("gate", (ffn, hidden)), ("up", (ffn, hidden)),
                              ("down", (hidden, ffn))):
            values = rng.standard_normal((experts, *shape)) * 0.05
            tensors[f"blk.{layer}.ffn_{matrix}_exps.weight"] = values.astype(np.float16)
    finish_gguf(writer, path, tensors)
    return writer.format_shard_names(path)[0]
