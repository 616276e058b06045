"""One layer's top-k quantized experts dequantized on the device against the upload of
their bytes: the figure a miss is held to (dequantization <= 10% of its upload).

Each format's matrices at a shape (random bytes and scales, the FP4 formats' E8M0 scales in
a realistic range); per run of ``repeats`` batches, CUDA events around:

- ``kernel``: the experts call's path, one launch for the three matrix kinds from each
  expert's address (``layer_experts_cuda``), host work included (its table, the launch);
- ``kernel_device``: the same launches queued back to back, the events' time over their
  count: the device's time with the host's hidden behind it;
- ``torch_ops``: torch's path (``LayerScales.fill``) on the stacked bytes;
- ``upload``: the experts' bytes from pinned memory, as a miss uploads them.

Also the host's time a call (``perf_counter`` around the launches, not synchronized).

    python -m bench.dequant --format fp8 --experts 8 --hidden 2048 --ffn 768 --out fp8.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.kit import median_ms

__all__ = ["dequant_vs_upload"]

_REPEATS = 20
_SKIP = 5


def _layer(method: str, experts: int, hidden: int, ffn: int, device: Any) -> tuple[Any, list[Any]]:
    """``LayerScales`` of ``method`` for ``experts`` experts and their raw bytes per kind
    (gate, up, down), random."""
    import torch

    from moestream.transformers._dequant import e2m1_pairs
    from moestream.transformers._quantized import LayerScales

    gen = torch.Generator(device=device).manual_seed(0)
    shapes = ((ffn, hidden), (ffn, hidden), (hidden, ffn))  # rows of the untransposed
    if method == "fp8":
        raws = [torch.randint(0, 120, (experts, r, c), dtype=torch.uint8, device=device,
                              generator=gen) for r, c in shapes]
        scales = [torch.rand((experts, -(-r // 128), -(-c // 128)), device=device,
                             generator=gen) for r, c in shapes]
        return LayerScales("fp8", (128, 128), scales[0], scales[1], scales[2]), raws
    raws = [torch.randint(0, 256, (experts, r, c // 2), dtype=torch.uint8, device=device,
                          generator=gen) for r, c in shapes]
    scales = [torch.randint(110, 135, (experts, r, c // 32), dtype=torch.uint8, device=device,
                            generator=gen) for r, c in shapes]
    return LayerScales(method, (1, 32), scales[0], scales[1], scales[2],
                       pairs=e2m1_pairs(device), transposed=method == "mxfp4"), raws


def dequant_vs_upload(method: str, experts: int, hidden: int, ffn: int,
                      device: Any) -> dict[str, Any]:
    """The micro-benchmark's figures for ``experts`` experts of ``method`` (``fp8``,
    ``fp4``, ``mxfp4``) at ``hidden`` x ``ffn``, on a CUDA ``device``."""
    import torch

    from moestream.transformers._dequant_cuda import layer_experts_cuda

    if device.type != "cuda":
        return {"skipped": "timed with CUDA events on a GPU"}

    def _timed(work: Callable[[], Any], repeats: int = _REPEATS) -> float:
        return median_ms(work, device, repeats=repeats, skip=_SKIP)

    scales, raws = _layer(method, experts, hidden, ffn, device)
    order = list(range(experts))
    first = (experts, hidden, 2 * ffn) if scales.transposed else (experts, 2 * ffn, hidden)
    second = (experts, ffn, hidden) if scales.transposed else (experts, hidden, ffn)
    gate_up = torch.empty(first, dtype=torch.bfloat16, device=device)
    down = torch.empty(second, dtype=torch.bfloat16, device=device)
    addresses = [[r[e].data_ptr() for e in order] for r in raws]
    pinned = [r.cpu().pin_memory() for r in raws]
    landing = [torch.empty_like(r) for r in raws]

    def kernel() -> None:
        layer_experts_cuda(scales, addresses, order, gate_up, down)

    kernel_ms = _timed(kernel)
    def kernels() -> None:  # queued back to back: the device's time per launch
        for _ in range(_REPEATS):
            kernel()

    back_to_back = _timed(kernels, repeats=5) / _REPEATS
    host_s = []
    for _ in range(_REPEATS):
        started = time.perf_counter()
        kernel()
        host_s.append(time.perf_counter() - started)
    torch.cuda.synchronize(device)
    torch_ms = _timed(lambda: scales.fill(order, tuple(raws), gate_up, down))
    upload_ms = _timed(lambda: [t.copy_(p, non_blocking=True)
                                for t, p in zip(landing, pinned, strict=True)])
    nbytes = sum(r.numel() for r in raws)
    return {"format": method, "experts": experts, "expert_bytes": nbytes // experts,
            "dequant_ms": round(kernel_ms, 4), "dequant_device_ms": round(back_to_back, 4),
            "dequant_host_us": round(statistics.median(host_s) * 1e6, 1),
            "dequant_torch_ops_ms": round(torch_ms, 4), "upload_ms": round(upload_ms, 4),
            "upload_gb_s": round(nbytes / upload_ms / 1e6, 1),
            "dequant_over_upload": round(kernel_ms / upload_ms, 3),
            "dequant_device_over_upload": round(back_to_back / upload_ms, 3)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.dequant",
                                description=__doc__.splitlines()[0])
    p.add_argument("--format", default="fp8", choices=("fp8", "fp4", "mxfp4"))
    p.add_argument("--experts", type=int, default=8, help="experts a layer's batch (8)")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=768)
    p.add_argument("--out", type=Path, help="write the JSON report here")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("python -m bench.dequant: torch sees no CUDA device")
    row = dequant_vs_upload(args.format, args.experts, args.hidden, args.ffn,
                            torch.device("cuda"))
    print(json.dumps(row))
    if args.out is not None:
        args.out.write_text(json.dumps(row, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
