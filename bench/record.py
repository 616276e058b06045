"""What every benchmark result carries: the commit it measured, written atomically."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

from pipeline.foundation.outputs import write_atomic

__all__ = ["git_commit", "write_result"]

_REPO = Path(__file__).resolve().parent.parent


def git_commit() -> str:
    """HEAD of this checkout, ``+dirty`` when tracked files differ.

    Outside a git checkout (the GPU machine receives the tree without ``.git``) the
    ``MOESTREAM_COMMIT`` environment variable names it; else ``unknown``.
    """
    if os.environ.get("MOESTREAM_COMMIT"):
        return os.environ["MOESTREAM_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=_REPO, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=_REPO, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty.stdout.strip() else "")


def write_result(path: Path, result: dict[str, Any]) -> None:
    """Write a benchmark result as indented JSON, atomically."""
    write_atomic(path, json.dumps(result, indent=2, default=float) + "\n", make_parents=True)
