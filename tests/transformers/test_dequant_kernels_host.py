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
from tests.cuda_on_host import WALK, build  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ to build the "
                                "kernels' source for the host")

_WALK = WALK + r"""
extern "C" void walk_fp8(int which, const i64* table, int kinds, int n, int bm, int bn,
                         int blocks, int threads) {
    if (which == 0) { WALK(kinds, fp8_experts_bf16(table, kinds, n, bm, bn)) }
    if (which == 1) { WALK(kinds, fp8_experts_f16(table, kinds, n, bm, bn)) }
    if (which == 2) { WALK(kinds, fp8_experts_f32(table, kinds, n, bm, bn)) }
}
extern "C" void walk_fp4(int size, const i64* table, int kinds, int n, const void* lut,
                         int blocks, int threads) {
    if (size == 2) { WALK(kinds, fp4_experts_2(table, kinds, n, (const u16*)lut)) }
    else { WALK(kinds, fp4_experts_4(table, kinds, n, (const u32*)lut)) }
}
"""
_FP8 = {"fp8_experts_bf16": 0, "fp8_experts_f16": 1, "fp8_experts_f32": 2}
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.fixture(scope="module")
def host_kernels(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The kernels built for the host; ``_dequant_cuda``'s launch walks them instead."""
    library = build(SOURCE + _WALK, Path(tmp_path_factory.mktemp("kernels")))
    if isinstance(library, str):
        pytest.skip(f"g++ cannot build the source here: {library[:200]}")

    def launch(name: str, out: Any, table: Any, kinds: int, chunks: int, *tail: Any) -> None:
        values = np.array(table, dtype=np.int64)
        pointer = values.ctypes.data_as(ctypes.c_void_p)
        if name in _FP8:
            n, bm, bn = (int(v) for v in tail)
            library.walk_fp8(_FP8[name], pointer, kinds, n, bm, bn, 3, 7)
        else:
            library.walk_fp4(int(name[-1]), pointer, kinds, int(tail[0]),
                             ctypes.c_void_p(int(tail[1])), 3, 7)

    saved = dc._launch
    dc._launch = launch
    yield library
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
