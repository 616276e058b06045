"""``python -m bench.balloon``: another process taking RAM, for memory-pressure experiments.

It allocates and touches ``--gib`` GiB in 1 GiB steps (``--step-s`` apart), holds it for
``--hold-s`` seconds, then frees it and exits, writing one JSON line per step to stdout
(``{"t": unix seconds, "held_bytes": N}``) so an experiment can line its timeline up with a
run's log. It refuses to take more than available RAM minus ``--keep-gib``: the point is to
squeeze the page cache and our pinned pages, never to get anything killed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence

import numpy as np
import psutil

__all__ = ["main"]

GIB = 1 << 30


def _say(held: int) -> None:
    print(json.dumps({"t": time.time(), "held_bytes": held}), flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.balloon", description=__doc__)
    p.add_argument("--gib", type=int, required=True, help="GiB to take")
    p.add_argument("--step-s", type=float, default=0.1, help="pause between 1 GiB steps")
    p.add_argument("--hold-s", type=float, default=10.0, help="how long to hold it all")
    p.add_argument("--keep-gib", type=float, default=2.0, help="never leave less available")
    args = p.parse_args(argv)
    chunks: list[np.ndarray] = []
    _say(0)
    for _ in range(args.gib):
        if psutil.virtual_memory().available - GIB < args.keep_gib * GIB:
            print(json.dumps({"t": time.time(), "stopped": "available RAM at the floor"}),
                  flush=True)
            break
        chunk = np.empty(GIB, dtype=np.uint8)
        chunk[::4096] = 1  # touch every page so it is really resident
        chunks.append(chunk)
        _say(len(chunks) * GIB)
        time.sleep(args.step_s)
    time.sleep(args.hold_s)
    chunks.clear()
    _say(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
