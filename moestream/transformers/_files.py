"""A checkpoint's small files (config, generation config, tokenizer), read once and bounded.

transformers reads these by path, as often as it likes, with no bound on their size or
nesting; for a model type it does not know it offers, on stdout, to run Python from the
checkpoint's directory and reads the answer from stdin. Here each file is read once, as a
regular file within a size limit, a JSON file checked for nesting and duplicate keys
(``moestream.pipeline.foundation.inputs``), and written into a private directory (``mkdtemp``: 0700,
removed on exit) that holds nothing else. transformers is then pointed at that directory with
``trust_remote_code=False``: no Python file of the checkpoint is ever there to run, no
prompt is shown, and a file renamed over the checkpoint's afterwards changes nothing of
what was built. ``config.json`` is not read here at all: the session's table read it once,
checked against the tensors (``ModelInfo.config``), and those values are written.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from moestream.pipeline.foundation.errors import ModelFileError
from moestream.pipeline.foundation.inputs import (
    InputTooLargeError,
    JSONDepthError,
    load_json_bounded,
    read_input,
)

__all__ = ["CONFIG", "GENERATION_FILES", "TOKENIZER_FILES", "snapshot"]

CONFIG = "config.json"
_MiB = 1 << 20
GENERATION_FILES: Mapping[str, int] = {"generation_config.json": 16 * _MiB}
"""What the model's loading reads beside the config, with the largest size accepted."""
TOKENIZER_FILES: Mapping[str, int] = {
    "tokenizer.json": 256 * _MiB,  # the largest vocabularies' are tens of MiB
    "tokenizer_config.json": 16 * _MiB,
    "special_tokens_map.json": 16 * _MiB,
    "added_tokens.json": 64 * _MiB,
    "vocab.json": 128 * _MiB,
    "merges.txt": 128 * _MiB,
    "vocab.txt": 64 * _MiB,
    "tokenizer.model": 64 * _MiB,
    "spiece.model": 64 * _MiB,
    "chat_template.jinja": 4 * _MiB,
    "chat_template.json": 16 * _MiB,
}
"""The files transformers' tokenizers read, with the largest size accepted."""


@contextmanager
def snapshot(root: Path, files: Mapping[str, int],
             config: Mapping[str, Any] | None = None) -> Iterator[Path]:
    """A private directory holding ``config`` as ``config.json`` (when given) and each of
    ``files`` the checkpoint at ``root`` has, read once within its limit; removed on exit.

    Raises:
        ModelFileError: a file that is not a regular file, over its limit, unreadable, or
            (JSON) malformed, nested too deeply or naming a key twice; one line.
    """
    with tempfile.TemporaryDirectory(prefix="moestream-checkpoint-") as made:
        private = Path(made)
        if config is not None:
            (private / CONFIG).write_text(json.dumps(config), encoding="utf-8")
        for name, limit in files.items():
            data = _read(root / name, limit)
            if data is not None:
                (private / name).write_bytes(data)
        yield private


def _read(path: Path, limit: int) -> bytes | None:
    """The file's bytes, None when the checkpoint has no such file."""
    if not os.path.lexists(path):
        return None
    try:
        data = read_input(path, limit)
    except InputTooLargeError:
        raise ModelFileError(path, f"is larger than the {limit >> 20} MiB such a file may "
                             "be") from None
    except OSError as exc:  # not a regular file, unreadable
        raise ModelFileError(path, f"cannot be read: {exc.strerror or exc}") from None
    if path.suffix == ".json":
        _check_json(path, data)
    return data


def _check_json(path: Path, data: bytes) -> None:
    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise ModelFileError(path, f"names {key[:80]!r} twice")
            out[key] = value
        return out

    try:
        doc = load_json_bounded(data, path.name, object_pairs_hook=no_duplicates)
    except JSONDepthError as exc:
        raise ModelFileError(path, f"nests too deeply ({exc})") from None
    except ValueError as exc:  # not JSON, or not UTF-8
        raise ModelFileError(path, f"is not JSON ({str(exc)[:80]})") from None
    if not isinstance(doc, dict):
        raise ModelFileError(path, "is not a JSON object")
