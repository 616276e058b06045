"""A hub id as transformers takes it, found in the local hub cache; never downloaded.

``from_pretrained("Qwen/Qwen3-30B-A3B")`` works in transformers by downloading; moestream
reads only local files (a run never waits on a network nor reads a file it did not
identify), so a hub id is looked up where ``huggingface_hub`` keeps what was downloaded
before (``HF_HUB_CACHE``, ``~/.cache/huggingface/hub``, or ``cache_dir``), at ``revision``
(a branch, tag or commit), by huggingface_hub's own ``snapshot_download`` with
``local_files_only=True``: the snapshot's directory, or one line saying how to fetch it.
"""

from __future__ import annotations

import os
from pathlib import Path

from moestream.pipeline.foundation.errors import ModelFileError, UsageError

__all__ = ["local_checkpoint"]


def local_checkpoint(path: str | os.PathLike[str], revision: str | None = None,
                     cache_dir: str | None = None) -> Path:
    """``path`` if it exists (``revision`` must then be None), else the hub cache's snapshot
    of the hub id ``path`` at ``revision``.

    Raises:
        UsageError: a revision of a local directory.
        ModelFileError: neither a local path nor a hub id in the hub cache.
    """
    given = Path(path)
    if given.exists():
        if revision is not None:
            raise UsageError(f"revision {revision[:60]!r}: {given} is a local directory, "
                             "which has no revisions (revision= picks one of a hub id's)")
        return given
    name = os.fspath(path)
    if (not isinstance(name, str) or name.count("/") > 1 or name.startswith((".", "/", "~"))
            or given.suffix in (".safetensors", ".gguf", ".json")):
        raise ModelFileError(given, "no such checkpoint directory or file")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(name, revision=revision, cache_dir=cache_dir,
                                      local_files_only=True))
    except HFValidationError as exc:
        raise ModelFileError(given, "no such checkpoint directory or file") from exc
    except (LocalEntryNotFoundError, FileNotFoundError) as exc:
        at = f" at revision {revision[:60]!r}" if revision is not None else ""
        raise ModelFileError(given, f"no such directory, and no hub snapshot{at} in the local "
                             "hub cache: moestream downloads nothing; fetch it first "
                             f"(huggingface_hub.snapshot_download({name[:80]!r}"
                             f"{', revision=...' if revision else ''})) or pass its local "
                             "path") from exc
