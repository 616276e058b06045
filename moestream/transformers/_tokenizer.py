"""The tokenizer of a checkpoint or of a model moestream loaded, read as safely as its config.

transformers' ``AutoTokenizer.from_pretrained(path)`` reads the checkpoint's files by path,
unbounded, and may offer to run its code. An application that tokenizes a prompt for a model
it loaded through :func:`moestream.transformers.from_pretrained` should not reopen the
checkpoint that way, so the tokenizer is built here as the model was: a checkpoint's
tokenizer files read once, bounded, into a private directory (``_files.snapshot``); a GGUF
file's from the header the model's session read (the file it identified, whatever the path
names by now), never from a second open of the path. ``trust_remote_code=False`` always.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from moestream.pipeline.foundation.errors import UsageError
from moestream.transformers._files import CONFIG, TOKENIZER_FILES, snapshot

__all__ = ["held_scale_bytes", "tokenizer"]

_WORTH_TRYING = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
"""Any of these makes a checkpoint's tokenizer worth trying."""


def tokenizer(source: str | os.PathLike[str] | Any) -> Any:
    """transformers' tokenizer of ``source``: a model made by ``from_pretrained`` (a GGUF
    file's from the header its session read, a checkpoint's from its tokenizer files), or a
    checkpoint directory (or a file in one, or a hub id in the local hub cache) before any
    model is loaded, so a prompt can be refused before the load's cost.

    Raises:
        UsageError: the checkpoint has no tokenizer or transformers builds none from it; a
            GGUF path (its tokenizer comes from the model: pass the model).
        ModelFileError: no such checkpoint; a tokenizer file that is not a regular file,
            over its limit, or malformed.
        ModelChangedError: the model's GGUF file changed since its session opened it.
    """
    if isinstance(source, (str, os.PathLike)):
        from moestream.transformers._gguf import is_gguf
        from moestream.transformers._hub import local_checkpoint

        path = local_checkpoint(source)  # a hub id: its snapshot in the local hub cache

        if is_gguf(path):
            raise UsageError(f"{path}: a GGUF file's tokenizer is read from the header its "
                             "session read: pass the model from_pretrained made of it")
        return _checkpoint_tokenizer(path)
    from moestream.transformers._experts import stream_of
    from moestream.transformers._gguf import gguf_tokenizer, is_gguf

    session = stream_of(source).session
    if is_gguf(session.model.path):
        return gguf_tokenizer(session)
    return _checkpoint_tokenizer(session.model.path)


def _checkpoint_tokenizer(root: Path) -> Any:
    """The tokenizer of the checkpoint at ``root`` (a directory, or a file in it)."""
    import transformers  # type: ignore[import-not-found, unused-ignore]

    root = root.parent if root.is_file() else root
    if not any((root / name).is_file() for name in _WORTH_TRYING):
        raise UsageError(f"{root}: the checkpoint has no tokenizer for --prompt; "
                         "pass --prompt-ids")
    # the tokenizer's files read once, bounded, into a private directory: transformers
    # never reads the checkpoint's own by path nor runs its code
    with snapshot(root, {CONFIG: 16 << 20, **TOKENIZER_FILES}) as files:
        try:
            return transformers.AutoTokenizer.from_pretrained(files, trust_remote_code=False)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise UsageError(f"{root}: no usable tokenizer for --prompt "
                             f"({str(exc).strip().splitlines()[0][:200]}); pass "
                             "--prompt-ids") from exc


def held_scale_bytes(model: Any) -> int:
    """The device bytes of the quantized experts' scales ``model`` holds (0 when none are):
    they count in the experts' budget beside the cache (``_scale_budget``), so a summary of
    the device's use names them.

    Raises:
        UsageError: the model was not loaded by moestream.
    """
    from moestream.transformers._experts import stream_of
    from moestream.transformers._scale_budget import held_bytes

    return held_bytes(stream_of(model).scales)
