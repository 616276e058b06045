"""Atomic file writes: a file appears under its name only once complete.

Temporary file in the same directory, fsync, rename; on any error the temporary file is
removed and the destination is untouched. Traces, analysis outputs and benchmark results
all go through here.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

__all__ = ["atomic_output", "write_atomic"]


@contextlib.contextmanager
def atomic_output(
    path: str | os.PathLike[str], *, make_parents: bool = False
) -> Iterator[BinaryIO]:
    """A binary file to write; it replaces ``path`` when the block ends without error.

    The parent directory must exist unless ``make_parents``.
    """
    target = Path(path)
    if make_parents:
        target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            yield out
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_atomic(
    path: str | os.PathLike[str], data: bytes | str, *, make_parents: bool = False
) -> None:
    """Write ``data`` (text is UTF-8 encoded) to ``path`` atomically."""
    with atomic_output(path, make_parents=make_parents) as out:
        out.write(data.encode("utf-8") if isinstance(data, str) else data)
