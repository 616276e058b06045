"""The CUDA dequantization kernels over a whole batch (gpu mark): the FP4 formats' kernel
``torch.equal`` to torch's path for every E2M1 code under every E8M0 scale byte, gpt-oss's
transposed layout, strided scales and targets, unaligned bytes; the three matrix kinds of
a batch in one launch (FP8 and FP4); the pinned table ring reused past a lap and across
streams; a slot launch captured in a CUDA graph keeping its table past the ring's laps."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("cupy")

from moestream.transformers._dequant import (  # noqa: E402
    e2m1_pairs,
    fp4_blocks,
    fp8_blocks,
    mxfp4_blocks,
    mxfp4_exponents,
)
from moestream.transformers._dequant_cuda import (  # noqa: E402
    Kind,
    fp4_experts_cuda,
    fp8_kinds_cuda,
    layer_experts_cuda,
    layer_slots_cuda,
)
from moestream.transformers._kernel_tables import KEPT_SLOT, KeptTables, keeping  # noqa: E402
from moestream.transformers._quantized import LayerScales  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")]

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
METHODS = ["fp4", "mxfp4"]


def _same(a: Any, b: Any) -> bool:
    return bool(torch.equal(a.isnan(), b.isnan())
                and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0)))


def _torch_path(method: str, raw: Any, scales: Any, dtype: Any) -> Any:
    pairs = e2m1_pairs(raw.device)
    if method == "mxfp4":
        return mxfp4_blocks(raw, mxfp4_exponents(scales), dtype, pairs)
    return fp4_blocks(raw, scales.view(torch.float8_e8m0fnu), dtype, pairs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("method", METHODS)
def test_every_code_under_every_scale(method: str, dtype: Any) -> None:
    """256 rows, one a scale byte (0 and 255 included), each holding all 16 codes."""
    raw = torch.arange(256, dtype=torch.uint8, device="cuda").view(1, 16, 16).repeat(1, 16, 1)
    scales = torch.arange(256, dtype=torch.int32, device="cuda").to(torch.uint8).view(1, 256, 1)
    ours = torch.empty((1, 256, 32), dtype=dtype, device="cuda")
    fp4_experts_cuda([Kind([raw[0].data_ptr()], scales, ours)], [0], method, False)
    assert _same(ours, _torch_path(method, raw, scales, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("rows, groups, offset", [
    (16, 2, 0), (7, 3, 0), (33, 4, 1), (2880, 90, 0), (512, 64, 3)])
def test_random_blocks(method: str, transposed: bool, rows: int, groups: int, offset: int,
                       dtype: Any) -> None:
    """Random bytes and scales, experts in any order, the scales a strided slice (gpt-oss's
    up rows), the target one half of a stacked gate_up; ``offset`` unaligns the bytes."""
    gen = torch.Generator(device="cuda").manual_seed(rows * groups + offset)
    experts, n, cols = 6, 4, groups * 32
    flat = torch.randint(0, 256, (experts * rows * cols // 2 + 16,), dtype=torch.uint8,
                         device="cuda", generator=gen)
    raw = flat[offset:offset + experts * rows * cols // 2].view(experts, rows, cols // 2)
    both = torch.randint(0, 256, (experts, 2 * rows, groups), dtype=torch.uint8,
                         device="cuda", generator=gen)
    scales = both[:, rows:]
    order = [5, 1, 3, 0]
    if transposed:
        stacked = torch.zeros((n, cols, 2 * rows), dtype=dtype, device="cuda")
        target, rest = stacked[..., rows:], stacked[..., :rows]
    else:
        stacked = torch.zeros((n, 2 * rows, cols), dtype=dtype, device="cuda")
        target, rest = stacked[:, rows:], stacked[:, :rows]
    fp4_experts_cuda([Kind([raw[e].data_ptr() for e in order], scales, target)], order,
                     method, transposed)
    got = target.transpose(-1, -2) if transposed else target
    assert _same(got, _torch_path(method, raw[order], scales[order], dtype))
    assert not rest.any()


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("transposed", [False, True])
def test_a_layers_batch_in_one_launch(method: str, transposed: bool) -> None:
    """gate, up and down of a batch through ``layer_experts_cuda``, equal to the torch
    path's ``LayerScales.fill`` (gpt-oss's transposed layout and DeepSeek-V4's)."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    experts, hidden, ffn = 8, 96, 64
    raws = [torch.randint(0, 256, (experts, rows, cols // 2), dtype=torch.uint8,
                          device="cuda", generator=gen)
            for rows, cols in ((ffn, hidden), (ffn, hidden), (hidden, ffn))]
    gate_up_scales = torch.randint(100, 140, (experts, 2 * ffn, hidden // 32),
                                   dtype=torch.uint8, device="cuda", generator=gen)
    down_scales = torch.randint(100, 140, (experts, hidden, ffn // 32), dtype=torch.uint8,
                                device="cuda", generator=gen)
    scales = LayerScales(method, (1, 32), gate_up_scales[:, :ffn], gate_up_scales[:, ffn:],
                         down_scales, pairs=e2m1_pairs("cuda"), transposed=transposed)
    batch = [6, 2, 7]
    shapes = ((hidden, 2 * ffn), (ffn, hidden)) if transposed else ((2 * ffn, hidden),
                                                                    (hidden, ffn))
    ours = [torch.empty((len(batch), *s), dtype=torch.bfloat16, device="cuda") for s in shapes]
    theirs = [torch.empty_like(t) for t in ours]
    layer_experts_cuda(scales, [[r[e].data_ptr() for e in batch] for r in raws], batch,
                       ours[0], ours[1])
    scales.fill(batch, tuple(r[batch] for r in raws), theirs[0], theirs[1])
    assert all(_same(a, b) for a, b in zip(ours, theirs, strict=True))


def test_fp8_kinds_in_one_launch() -> None:
    gen = torch.Generator(device="cuda").manual_seed(5)
    experts, hidden, ffn, block = 5, 256, 96, (32, 32)
    gate = torch.randint(0, 256, (experts, ffn, hidden), dtype=torch.uint8, device="cuda",
                         generator=gen)
    down = torch.randint(0, 256, (experts, hidden, ffn), dtype=torch.uint8, device="cuda",
                         generator=gen)
    gate_scales = torch.rand((experts, 3, 8), device="cuda", generator=gen)
    down_scales = torch.rand((experts, 8, 3), device="cuda", generator=gen) * 1e-3
    batch = [4, 0, 3]
    gate_up = torch.empty((3, 2 * ffn, hidden), dtype=torch.bfloat16, device="cuda")
    out_down = torch.empty((3, hidden, ffn), dtype=torch.bfloat16, device="cuda")
    fp8_kinds_cuda([Kind([gate[e].data_ptr() for e in batch], gate_scales, gate_up[:, :ffn]),
                    Kind([gate[e].data_ptr() for e in batch], gate_scales, gate_up[:, ffn:]),
                    Kind([down[e].data_ptr() for e in batch], down_scales, out_down)],
                   batch, block)
    want = fp8_blocks(gate[batch], gate_scales[batch], block, torch.bfloat16)
    assert _same(gate_up[:, :ffn], want) and _same(gate_up[:, ffn:], want)
    assert _same(out_down, fp8_blocks(down[batch], down_scales[batch], block, torch.bfloat16))


def test_the_table_ring_wraps_and_follows_streams() -> None:
    """Three laps of the ring, the last on another stream, every result kept and checked
    at the end: no table is overwritten before its kernel read it."""
    gen = torch.Generator(device="cuda").manual_seed(9)
    raw = torch.randint(0, 256, (4, 64, 64), dtype=torch.uint8, device="cuda", generator=gen)
    scales = torch.randint(110, 140, (4, 64, 4), dtype=torch.uint8, device="cuda",
                           generator=gen)
    side = torch.cuda.Stream()
    outs, orders = [], []
    for call in range(200):
        order = [call % 4, (call + 1) % 4]
        out = torch.empty((2, 64, 128), dtype=torch.bfloat16, device="cuda")
        with torch.cuda.stream(side if call >= 130 else torch.cuda.current_stream()):
            fp4_experts_cuda([Kind([raw[e].data_ptr() for e in order], scales, out)], order,
                             "fp4", False)
        outs.append(out)
        orders.append(order)
    torch.cuda.synchronize()
    for out, order in zip(outs, orders, strict=True):
        assert _same(out, _torch_path("fp4", raw[order], scales[order], torch.bfloat16))


def test_a_captured_slot_launch_keeps_its_table() -> None:
    """A layer's slot launch captured in a CUDA graph takes its table from a kept slot, not
    the ring: replayed after laps of the ring (whose slots the eager launches rewrite), with
    other experts' ids copied into its slots, each replay gives the torch path's experts."""
    gen = torch.Generator(device="cuda").manual_seed(11)
    experts, hidden, ffn = 4, 64, 64
    shapes = [(ffn, hidden // 2), (ffn, hidden // 2), (hidden, ffn // 2)]
    raws = [[torch.randint(0, 256, s, dtype=torch.uint8, device="cuda", generator=gen)
             for s in shapes] for _ in range(experts)]
    stacks = [torch.randint(110, 140, (experts, r, 2 * c // 32), dtype=torch.uint8,
                            device="cuda", generator=gen) for r, c in shapes]
    scales = LayerScales("fp4", (1, 32), *stacks, pairs=e2m1_pairs("cuda"))
    table = torch.tensor([[m.data_ptr() for m in row] for row in raws], dtype=torch.int64,
                         device="cuda")
    slots = torch.tensor([0, 1], dtype=torch.int64, device="cuda")
    gate_up = torch.empty((2, 2 * ffn, hidden), dtype=torch.bfloat16, device="cuda")
    down = torch.empty((2, hidden, ffn), dtype=torch.bfloat16, device="cuda")
    side, tables, graph = torch.cuda.Stream(), KeptTables("cuda"), torch.cuda.CUDAGraph()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compiled and its lookup table made outside the capture
        layer_slots_cuda(scales, table.data_ptr(), slots, gate_up, down)
    with torch.cuda.stream(side), keeping(tables):
        graph.capture_begin(capture_error_mode="thread_local")
        layer_slots_cuda(scales, table.data_ptr(), slots, gate_up, down)
        graph.capture_end()
    torch.cuda.current_stream().wait_stream(side)
    assert tables.used == 1
    scratch = torch.empty((2, ffn, hidden), dtype=torch.bfloat16, device="cuda")
    for lap in range(3):
        for call in range(70):  # more than the ring's 64 slots
            order = [call % experts, (call + lap) % experts]
            fp4_experts_cuda([Kind([raws[e][0].data_ptr() for e in order], stacks[0], scratch)],
                             order, "fp4", False)
        picked = [lap % experts, (lap + 2) % experts]
        slots.copy_(torch.tensor(picked))
        graph.replay()
        for j, expert in enumerate(picked):
            gate, up, want_down = scales.expert(expert, tuple(raws[expert]), torch.bfloat16)
            assert _same(gate_up[j], torch.cat((gate, up))) and _same(down[j], want_down)
    with pytest.raises(RuntimeError, match="no kept table slot"):
        tables.put(list(range(KEPT_SLOT + 1)), torch.cuda.current_stream())
    tables.reset()
    assert tables.used == 0
