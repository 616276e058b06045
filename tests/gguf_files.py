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
