"""What every benchmark result carries: the commit and machine it measured, written atomically."""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import psutil

from moestream.pipeline.foundation.errors import MoestreamError
from moestream.pipeline.foundation.outputs import write_atomic

__all__ = ["git_commit", "machine", "provenance", "report", "write_result"]

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


def machine() -> dict[str, Any]:
    """The host a benchmark ran on: name, platform, Python, CPUs and RAM."""
    memory = psutil.virtual_memory()
    return {
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "cpu_count": os.cpu_count(),
        "ram_total_bytes": int(memory.total),
        "ram_available_bytes": int(memory.available),
    }


def provenance(module: str, argv: Sequence[str] | None, **facts: Any) -> dict[str, Any]:
    """A result's first keys: the machine (with the bench's own ``facts`` about it, such
    as its device), the commit and the command that made it (``module`` as run with
    ``-m``; ``argv`` None: this process's arguments)."""
    args = sys.argv[1:] if argv is None else list(argv)
    return {"machine": {**machine(), **facts}, "commit": git_commit(),
            "command": " ".join(["python -m " + module, *args])}


def report(path: Path, result: dict[str, Any]) -> None:
    """Print a probe's result a key a line, then write it (``write_result``)."""
    for key, value in result.items():
        print(f"{key}: {value}")
    write_result(path, result)


def write_result(path: Path, result: dict[str, Any]) -> None:
    """Write a benchmark result as indented JSON, atomically."""
    write_atomic(path, json.dumps(result, indent=2, default=float) + "\n", make_parents=True)


def report_main(prog: str, bench: Callable[[], dict[str, Any]], out: Path | None,
                held: Callable[[dict[str, Any]], bool]) -> int:
    """A JSON-report bench's command: run ``bench``, print its report (and write it to
    ``out``); exit 0 when ``held`` says its tokens held, else 1; bad input (a
    ``MoestreamError``) is one line on stderr and its exit code, not a traceback."""
    try:
        report = bench()
    except MoestreamError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    print(json.dumps(report, indent=2, default=float))
    if out is not None:
        write_result(out, report)
    return 0 if held(report) else 1
