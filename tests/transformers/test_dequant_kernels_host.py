"""The CUDA dequantization kernels' source run on the host: the same C++ compiled by the
system's C++ compiler behind a few lines standing in for CUDA's built-ins, its grid walked
block by block and thread by thread, through ``_dequant_cuda``'s own table building (its
launch swapped for the walk). So CI, without a GPU, checks the kernels' arithmetic and
indexing bitwise against torch's path: FP8 (16 bytes a thread and one), FP4 and MXFP4 (every
code under every scale byte, transposed, strided scales, unaligned bytes), three kinds in
one launch. A deliberately small grid (3 blocks of 7 threads) exercises the grid-stride
loops. The GPU tests (``test_dequant_batch_cuda.py``) run the same cases on a device."""

from __future__ import annotations

import ctypes
import itertools
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from moestream.transformers import _dequant_cuda as dc  # noqa: E402
from moestream.transformers._dequant import (  # noqa: E402
    e2m1_pairs,
    fp4_blocks,
    fp8_blocks,
    mxfp4_blocks,
    mxfp4_exponents,
)
from moestream.transformers._dequant_source import SOURCE  # noqa: E402
from moestream.transformers._quantized import LayerScales  # noqa: E402
from tests.cuda_on_host import WALK, build  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ to build the "
                                "kernels' source for the host")

_WALK = WALK + r"""
extern "C" void walk_fp8(int which, const i64* table, int kinds, int n, const i64* slots,
                         const i64* at, int bm, int bn, int blocks, int threads) {
    if (which == 0) { WALK(kinds, fp8_experts_bf16(table, kinds, n, slots, at, bm, bn)) }
    if (which == 1) { WALK(kinds, fp8_experts_f16(table, kinds, n, slots, at, bm, bn)) }
    if (which == 2) { WALK(kinds, fp8_experts_f32(table, kinds, n, slots, at, bm, bn)) }
}
extern "C" void walk_fp4(int size, const i64* table, int kinds, int n, const i64* slots,
                         const i64* at, const void* lut, int blocks, int threads) {
    if (size == 2) { WALK(kinds, fp4_experts_2(table, kinds, n, slots, at, (const u16*)lut)) }
    else { WALK(kinds, fp4_experts_4(table, kinds, n, slots, at, (const u32*)lut)) }
}
"""
_FP8 = {"fp8_experts_bf16": 0, "fp8_experts_f16": 1, "fp8_experts_f32": 2}
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def walker(where: Path) -> Any:
    """The kernels built for the host under ``where``, and a stand-in for
    ``_dequant_cuda._launch`` that walks them."""
    library = build(SOURCE + _WALK, where)
    if isinstance(library, str):
        pytest.fail(f"g++ cannot build the kernels' source: {library}")

    def launch(name: str, out: Any, table: Any, kinds: int, chunks: int, *tail: Any) -> None:
        values = np.array(table, dtype=np.int64)
        pointer = values.ctypes.data_as(ctypes.c_void_p)
        n, slots, rows = int(tail[0]), ctypes.c_void_p(int(tail[1])), ctypes.c_void_p(int(tail[2]))
        if name in _FP8:
            bm, bn = (int(v) for v in tail[3:])
            library.walk_fp8(_FP8[name], pointer, kinds, n, slots, rows, bm, bn, 3, 7)
        else:
            library.walk_fp4(int(name[-1]), pointer, kinds, n, slots, rows,
                             ctypes.c_void_p(int(tail[3])), 3, 7)

    return launch


@pytest.fixture(scope="module")
def host_kernels(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``_dequant_cuda``'s launch walks the kernels built for the host."""
    saved = dc._launch
    dc._launch = walker(Path(tmp_path_factory.mktemp("kernels")))
    yield
    dc._launch = saved


def _same(a: Any, b: Any) -> bool:
    return bool(torch.equal(a.isnan(), b.isnan())
                and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0)))


def _torch_path(method: str, raw: Any, scales: Any, dtype: Any) -> Any:
    pairs = e2m1_pairs("cpu")
    if method == "mxfp4":
        return mxfp4_blocks(raw, mxfp4_exponents(scales), dtype, pairs)
    return fp4_blocks(raw, scales.view(torch.float8_e8m0fnu), dtype, pairs)


@pytest.mark.usefixtures("host_kernels")
class TestOnTheHost:
    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("rows, cols, block, offset", [
        (64, 48, (16, 16), 0), (100, 70, (32, 16), 0), (32, 64, (16, 32), 1),
        (20, 32, (8, 8), 0), (48, 128, (128, 128), 0)])
    def test_fp8_three_kinds_in_one_launch(self, rows: int, cols: int,
                                           block: tuple[int, int], offset: int,
                                           dtype: Any) -> None:
        gen = torch.Generator().manual_seed(rows * cols)
        experts = 5
        flat = torch.randint(0, 256, (experts * rows * cols + 16,), dtype=torch.uint8,
                             generator=gen)
        codes = flat[offset:offset + experts * rows * cols].view(experts, rows, cols)
        down = torch.randint(0, 256, (experts, cols, rows), dtype=torch.uint8, generator=gen)
        shape = (experts, -(-rows // block[0]), -(-cols // block[1]))
        scales = torch.rand(shape, generator=gen) * torch.exp2(
            torch.randint(-60, 60, shape, generator=gen).float())
        down_scales = torch.rand((experts, -(-cols // block[0]), -(-rows // block[1])),
                                 generator=gen)
        order = [4, 0, 2]
        gate_up = torch.zeros((3, 2 * rows, cols), dtype=dtype)
        out_down = torch.empty((3, cols, rows), dtype=dtype)
        dc.fp8_kinds_cuda([dc.Kind([codes[e].data_ptr() for e in order], scales,
                                   gate_up[:, :rows]),
                           dc.Kind([codes[e].data_ptr() for e in order], scales,
                                   gate_up[:, rows:]),
                           dc.Kind([down[e].data_ptr() for e in order], down_scales,
                                   out_down)], order, block)
        want = fp8_blocks(codes[order], scales[order], block, dtype)
        assert _same(gate_up[:, :rows], want) and _same(gate_up[:, rows:], want)
        assert _same(out_down, fp8_blocks(down[order], down_scales[order], block, dtype))

    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("method", ["fp4", "mxfp4"])
    def test_every_code_under_every_scale(self, method: str, dtype: Any) -> None:
        raw = torch.arange(256, dtype=torch.uint8).view(1, 16, 16).repeat(1, 16, 1)
        scales = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(1, 256, 1)
        ours = torch.empty((1, 256, 32), dtype=dtype)
        dc.fp4_experts_cuda([dc.Kind([raw[0].data_ptr()], scales, ours)], [0], method, False)
        assert _same(ours, _torch_path(method, raw, scales, dtype))

    @pytest.mark.parametrize("dtype, method, transposed, shape", list(itertools.product(
        DTYPES, ["fp4", "mxfp4"], [False, True], [(16, 2, 0), (7, 3, 0), (33, 4, 1)])))
    def test_fp4_random_blocks(self, dtype: Any, method: str, transposed: bool,
                               shape: tuple[int, int, int]) -> None:
        rows, groups, offset = shape
        gen = torch.Generator().manual_seed(rows * groups + offset)
        experts, n, cols = 6, 4, groups * 32
        flat = torch.randint(0, 256, (experts * rows * cols // 2 + 16,), dtype=torch.uint8,
                             generator=gen)
        raw = flat[offset:offset + experts * rows * cols // 2].view(experts, rows, cols // 2)
        scales = torch.randint(0, 256, (experts, 2 * rows, groups), dtype=torch.uint8,
                               generator=gen)[:, rows:]
        order = [5, 1, 3, 0]
        if transposed:
            stacked = torch.zeros((n, cols, 2 * rows), dtype=dtype)
            target, rest = stacked[..., rows:], stacked[..., :rows]
        else:
            stacked = torch.zeros((n, 2 * rows, cols), dtype=dtype)
            target, rest = stacked[:, rows:], stacked[:, :rows]
        dc.fp4_experts_cuda([dc.Kind([raw[e].data_ptr() for e in order], scales, target)],
                            order, method, transposed)
        got = target.transpose(-1, -2) if transposed else target
        assert _same(got, _torch_path(method, raw[order], scales[order], dtype))
        assert not rest.any()


def _raw(gen: Any, shape: tuple[int, ...], offset: int) -> Any:
    """Random bytes of ``shape`` starting ``offset`` bytes past an aligned buffer's start:
    the kernels take the widest load the address allows (a mapping's 8-aligned tensors)."""
    n = int(np.prod(shape))
    flat = torch.randint(0, 256, (n + 32,), dtype=torch.uint8, generator=gen)
    return flat[offset:offset + n].view(shape)


@pytest.mark.usefixtures("host_kernels")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("method, transposed, offset", [
    ("fp8", False, 0), ("fp8", False, 8), ("fp8", False, 3), ("fp4", False, 8),
    ("mxfp4", True, 0), ("mxfp4", True, 5)])
def test_slots_by_a_layer_table(method: str, transposed: bool, offset: int,
                                dtype: Any) -> None:
    """``layer_slots_cuda``: each slot dequantized from the layer table's row its expert id
    names (repeats, any order), an empty slot (-1) left as it was; equal to the torch
    path's expert (``LayerScales.expert``)."""
    gen = torch.Generator().manual_seed(len(method) * 31 + offset)
    experts, ffn, hidden = 5, 64, 96
    if method == "fp8":
        block = (16, 32)
        shapes = [(ffn, hidden), (ffn, hidden), (hidden, ffn)]
        stacks = [torch.rand((experts, -(-r // 16), -(-c // 32)), generator=gen)
                  * torch.exp2(torch.randint(-30, 30, (experts, -(-r // 16), -(-c // 32)),
                                             generator=gen).float()) for r, c in shapes]
    else:
        block = (1, 32)
        shapes = [(ffn, hidden // 2), (ffn, hidden // 2), (hidden, ffn // 2)]
        stacks = [torch.randint(0, 256, (experts, r, 2 * c // 32), dtype=torch.uint8,
                                generator=gen) for r, c in shapes]
    scales = LayerScales(method, block, *stacks, pairs=None if method == "fp8"
                         else e2m1_pairs("cpu"), transposed=transposed)
    raws = [[_raw(gen, shape, offset) for shape in shapes] for _ in range(experts)]
    table = torch.tensor([[m.data_ptr() for m in row] for row in raws], dtype=torch.int64)
    slots = torch.tensor([3, 0, -1, 3, 4], dtype=torch.int64)
    n = slots.numel()
    first = (n, hidden, 2 * ffn) if transposed else (n, 2 * ffn, hidden)
    gate_up = torch.zeros(first, dtype=dtype)
    down = torch.zeros((n, ffn, hidden) if transposed else (n, hidden, ffn), dtype=dtype)
    dc.layer_slots_cuda(scales, table.data_ptr(), slots, gate_up, down)
    for j, expert in enumerate(slots.tolist()):
        if expert < 0:
            assert not gate_up[j].any() and not down[j].any()
            continue
        gate, up, want_down = scales.expert(expert, tuple(raws[expert]), dtype)
        assert _same(gate_up[j], torch.cat((gate, up)))
        assert _same(down[j], want_down)
