"""A GGUF model split into shards: ``NAME-00001-of-0000N.gguf`` and its siblings.

Why: the large MoE GGUFs ship split (the Hugging Face Hub takes files of at most 50 GB, so a
Q2_K DeepSeek or a Q4_K_M Qwen3-235B comes as several files), written by llama.cpp's
``gguf-split`` or gguf-py's ``GGUFWriter(split_max_size=...)``. Each shard is a whole GGUF
file holding some of the tensors; the first holds the model's metadata, and every one says
``split.no`` (0-based), ``split.count`` and ``split.tensors.count`` (the tensors of all
shards). The shards are named by the format gguf-py and llama.cpp share, so the others are
found from any one of them; they are laid end to end in the model's address space as a
checkpoint's safetensors shards are (``pipeline.foundation.files``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from gguf import GGUFReader
from gguf.constants import Keys

from moestream.pipeline.foundation.errors import ExpertLayoutError, ModelFileError
from moestream.pipeline.foundation.gguf_header import metadata_int

__all__ = ["check_shards", "shard_name", "shard_paths", "split_of"]

_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
"""gguf-py's ``SHARD_NAME_FORMAT`` (llama.cpp's ``llama_split_path``), read back."""


def shard_name(stem: str, no: int, count: int) -> str:
    """The file name of shard ``no`` (1-based) of ``count``, as gguf-py and llama.cpp name it."""
    return f"{stem}-{no:05d}-of-{count:05d}.gguf"


def split_of(path: Path, reader: GGUFReader) -> tuple[int, int] | None:
    """(``split.no``, ``split.count``) of a shard of a split model; None for a whole file
    (no ``split.count``, or a split into one).

    Raises:
        ExpertLayoutError: the split keys are not integers, or the shard's number lies outside
            its split.
    """
    count = metadata_int(path, reader, Keys.Split.LLM_KV_SPLIT_COUNT)
    if count is None or count == 1:
        return None
    no = metadata_int(path, reader, Keys.Split.LLM_KV_SPLIT_NO)
    if no is None or not 0 <= no < count:
        raise ExpertLayoutError(path, f"split.no {no} is not a shard of a split into {count}")
    return no, count


def shard_paths(path: Path, no: int, count: int) -> list[Path]:
    """Every shard's path, in order, from shard ``no`` (0-based) of ``count`` at ``path``.

    Raises:
        ModelFileError: the name is not the shard's name, so its siblings cannot be found.
    """
    match = _NAME.match(path.name)
    if match is None or (int(match["no"]), int(match["count"])) != (no + 1, count):
        raise ModelFileError(path, f"shard {no + 1} of a GGUF split into {count}, but not named "
                             f"{shard_name('NAME', no + 1, count)}: its other shards cannot "
                             "be found")
    return [path.with_name(shard_name(match["prefix"], i, count)) for i in range(1, count + 1)]


def check_shards(paths: Sequence[Path], readers: Sequence[GGUFReader]) -> None:
    """Each shard says it is the shard its name says, of the same split, and together they
    hold the tensors the split counts.

    Raises:
        ExpertLayoutError: a shard of another split, out of place, or a tensor count that
            differs from ``split.tensors.count``.
    """
    count = len(paths)
    total = metadata_int(paths[0], readers[0], Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT)
    for i, (path, reader) in enumerate(zip(paths, readers, strict=True)):
        said_split = split_of(path, reader)
        if said_split != (i, count):
            raise ExpertLayoutError(path, f"not shard {i + 1} of {count}: its split keys say "
                                          f"{said_split} (split.no, split.count)")
        said = metadata_int(path, reader, Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT)
        if said != total:
            raise ExpertLayoutError(path, f"split.tensors.count {said}, the first shard's {total}")
    held = sum(len(r.tensors) for r in readers)
    if total is not None and held != total:
        raise ExpertLayoutError(paths[0], f"the {count} shards hold {held} tensors, "
                                          f"split.tensors.count says {total}")
