"""``python -m bench.launch_cost``: the host time of the whole-layer path's gather launch,
beside torch's own launch of the same job in the resident model.

A held-whole decode is bound by the host's launches, and ``bench.held_cost`` puts the
gather launch of each experts call at ~60 us of host time on an H100 whose host was slow:
more than the two weight selections (``gate_up_proj[ids]``, ``down_proj[ids]``) that
transformers' ``batched_mm`` launches in the resident model for the same copy. This times,
in one process, each part of the launch and the in-run references, host time only (the
device's work is a few kilobytes a call, so no launch waits for a full queue):

- ``torch_index``: ``weights[ids]`` on a stacked (experts, ...) tensor, as the resident
  model selects a projection's weights (torch's dispatcher and launch);
- ``torch_empty``: ``torch.empty`` of a slot's shape (the whole-layer path makes two a call);
- ``stream_object``: ``torch.cuda.current_stream(index).cuda_stream`` (a ``Stream`` made);
- ``stream_raw``: ``_launch.raw_stream`` (torch's raw accessor);
- ``gather``: ``LayerTable.fill`` as the whole-layer path calls it (the stream asked, then
  the kernel launched by ``cuLaunchKernel`` from its argument block).

    python -m bench.launch_cost --out launch_cost.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.kit import exit_with, require_gpu
from bench.record import provenance

__all__ = ["main"]


def _us(call: Callable[[], Any], sync: Callable[[], Any], calls: int) -> float:
    """Host microseconds a call: ``calls`` calls timed back to back, the device drained
    before and after (untimed)."""
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        call()
    elapsed = time.perf_counter() - t0
    sync()
    return round(elapsed / calls * 1e6, 3)


def _parts(experts: int, slots: int, rows: int, cols: int) -> dict[str, Callable[[], Any]]:
    """Each timed call, on experts of ``rows x cols`` BF16 gate, up and down matrices."""
    import torch

    from moestream.transformers._launch import raw_stream
    from moestream.transformers._table import LayerTable

    device = torch.device("cuda", torch.cuda.current_device())
    stacked = torch.randn(experts, 3, rows, cols, device=device).to(torch.bfloat16)
    nbytes = rows * cols * 2
    addresses = torch.tensor([[stacked[e, m].data_ptr() for m in range(3)]
                              for e in range(experts)], dtype=torch.int64, device=device)
    table = LayerTable(addresses, (nbytes, nbytes, nbytes))
    ids = torch.arange(slots, device=device) % experts
    first = torch.empty(slots, 2 * rows, cols, dtype=torch.bfloat16, device=device)
    down = torch.empty(slots, rows, cols, dtype=torch.bfloat16, device=device)
    table.fill(device, ids, first, down)
    torch.testing.assert_close(first[:, :rows], stacked[ids, 0], rtol=0, atol=0)
    index = device.index
    return {
        "torch_index": lambda: stacked[ids],
        "torch_empty": lambda: torch.empty((slots, 2 * rows, cols), dtype=torch.bfloat16,
                                           device=device),
        "stream_object": lambda: torch.cuda.current_stream(index).cuda_stream,
        "stream_raw": lambda: raw_stream(device),
        "gather": lambda: table.fill(device, ids, first, down),
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.launch_cost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=2000, help="calls a round")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    require_gpu("bench.launch_cost")
    import torch

    parts = _parts(experts=16, slots=8, rows=32, cols=64)
    # alternated rounds: a slow spell of the host falls on every part alike
    sync = torch.cuda.synchronize
    runs: dict[str, list[float]] = {name: [] for name in parts}
    for _ in range(args.rounds):
        for name, call in parts.items():
            runs[name].append(_us(call, sync, args.calls))
    us = {name: round(statistics.median(values), 3) for name, values in runs.items()}
    result = {**provenance("bench.launch_cost", argv, gpu=torch.cuda.get_device_name(),
                           torch=torch.__version__),
              "us": us, "gather_x_index": round(us["gather"] / us["torch_index"], 2),
              "rounds": runs}
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    exit_with("python -m bench.launch_cost", main)
