"""``python -m bench.dispatch``: whether an open moestream session slows the torch calls of
the process that holds it.

A transformers model held whole by moestream is bound by the host's launches, as the
resident model is; profiled on an H100, every torch call of transformers' own code (linear,
``to``, ``mean``, ...) took ~1.3x its time in the resident model's process once moestream's
model was loaded.

At each stage of one process (the resident model loaded; on a GPU, CuPy imported and a
kernel of its own launched, ``--buffers`` device allocations as the cache's experts are
made, then freed, host memory registered with CUDA as the page-cache mapping is, then
unregistered; moestream's model loaded and held whole, every expert fetched once; after its
generates; its session closed) this times one loop of small torch calls (host-bound: no
call waits for the device), the resident model's generate (the best of two), and each
thread's CPU time while the loop ran (whether another thread of the process runs meanwhile):
the stage after which the resident model slows is what slows the process.

    python -m bench.dispatch -m CHECKPOINT --device cuda --out dispatch.json
"""

from __future__ import annotations

import argparse
import json
import mmap
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import psutil

from bench.transformers import _fill_cache, _generate

__all__ = ["main"]


def _loop_us(device: Any, calls: int = 2000, rounds: int = 5) -> float:
    """Microseconds a torch call over a loop of small element-wise calls, median of
    ``rounds`` (the device's work is a few microseconds a call: the host's dispatch sets
    the pace)."""
    import torch

    x = torch.ones(64, device=device)
    times = []
    for _ in range(rounds):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(calls // 4):
            y = x + 1.0
            y = y * x
            y = y.to(torch.bfloat16)
            x = y.float()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return round(statistics.median(times), 3)


def _thread_cpu() -> dict[int, float]:
    """Each thread's CPU seconds so far, by native id."""
    return {t.id: t.user_time + t.system_time for t in psutil.Process().threads()}


def _meanwhile(work: Callable[[], Any]) -> tuple[Any, dict[str, float]]:
    """``work``'s result, and each thread's CPU seconds while it ran (the threads that ran)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    before = _thread_cpu()
    result = work()
    after = _thread_cpu()
    ran = {f"{names.get(tid, '?')}:{tid}": round(cpu - before.get(tid, 0.0), 4)
           for tid, cpu in after.items() if cpu - before.get(tid, 0.0) > 0}
    return result, ran


def _busy_threads(device: Any) -> dict[str, Any]:
    """The loop timed while each thread's CPU time is taken before and after: which threads
    but the caller's ran meanwhile, and for how long."""
    t0 = time.perf_counter()
    us, ran = _meanwhile(lambda: _loop_us(device))
    wall = time.perf_counter() - t0
    return {"us_a_call": us, "wall_s": round(wall, 3), "thread_cpu_s": ran,
            "threads": len(psutil.Process().threads())}


def _device_stages(stage: Callable[[], dict[str, Any]], buffers: int, nbytes: int,
                   registered: int) -> dict[str, Any]:
    """What a moestream session brings into a CUDA process, one at a time: CuPy and a
    kernel of its own; ``buffers`` device allocations of ``nbytes`` each (the cache's
    experts, one ``cudaMalloc`` each), then freed; ``registered`` bytes of host memory
    registered with CUDA as the page-cache mapping is (``CupyBackend.register_host``'s
    flags), then unregistered."""
    import cupy
    import numpy as np

    from moestream.gpu.cuda import _HOST_REGISTER_FLAGS

    cupy.arange(4).sum()
    out = {"cupy_launched": stage()}
    held = [cupy.cuda.Memory(nbytes) for _ in range(buffers)]
    out["device_buffers"] = {**stage(), "buffers": buffers, "bytes_each": nbytes}
    del held
    with mmap.mmap(-1, registered) as area:
        host = np.frombuffer(area, dtype=np.uint8)
        cupy.cuda.runtime.hostRegister(host.ctypes.data, registered, _HOST_REGISTER_FLAGS)
        try:
            out["host_registered"] = {**stage(), "bytes": registered}
        finally:
            cupy.cuda.runtime.hostUnregister(host.ctypes.data)
            del host
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.dispatch",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", type=Path, required=True, help="checkpoint directory")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--mode", choices=["auto", "direct", "resident"], default="auto",
                   help="moestream's I/O mode")
    p.add_argument("--buffers", type=int, default=1024,
                   help="device allocations of the device_buffers stage (a GPU's)")
    p.add_argument("--buffer-mib", type=int, default=9, help="each one's MiB")
    p.add_argument("--register-gib", type=int, default=8,
                   help="host memory registered with CUDA in the host_registered stage")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    import torch
    import transformers

    from moestream.transformers import from_pretrained

    device: Any = torch.device(args.device)
    prompt = torch.tensor([[1, 2, 3, 4]])
    bare = _loop_us(device)
    resident: Any = transformers.AutoModelForCausalLM.from_pretrained(
        args.model, experts_implementation="grouped_mm").to(device)
    _generate(resident, prompt, args.tokens, device)  # the process's first generate: slow

    def stage() -> dict[str, Any]:
        """The loop and the threads now, and the resident model's best of two generates."""
        rates, ran = _meanwhile(lambda: [
            args.tokens / _generate(resident, prompt, args.tokens, device)[1]
            for _ in range(2)])
        return {**_busy_threads(device), "resident_tok_s": round(max(rates), 2),
                "generate_thread_cpu_s": ran}

    stages: dict[str, Any] = {
        "cpus": {"logical": psutil.cpu_count(), "physical": psutil.cpu_count(logical=False),
                 "affinity": len(psutil.Process().cpu_affinity() or [])},
        "bare_us_a_call": bare, "resident": stage()}
    if device.type == "cuda":
        stages.update(_device_stages(stage, args.buffers, args.buffer_mib << 20,
                                     args.register_gib << 30))
    model = from_pretrained(args.model, device=device, mode=args.mode)
    _fill_cache(model.moestream)
    stages["moestream_loaded"] = stage()
    rates, ran = _meanwhile(lambda: [
        args.tokens / _generate(model, prompt, args.tokens, device)[1] for _ in range(3)])
    stages["moestream_tok_s"] = [round(r, 2) for r in rates]
    stages["moestream_generate_thread_cpu_s"] = ran
    stages["after_moestream_generate"] = stage()
    model.moestream.close()
    stages["moestream_closed"] = stage()
    text = json.dumps(stages, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
