"""The proxy engine's dequantizers (``moestream.gpu.dequant``) against gguf-py's
``gguf.quants.dequantize``, float32, bit for bit, on random valid blocks: every byte random
but the float16 scales, which take every finite value (subnormals, zero, both signs, 65504).

The CUDA kernels' source is also built for the host here (g++ behind a few lines standing in
for CUDA's built-ins) and its grid walked block by block and thread by thread, with a small
grid (3 blocks of 7 threads) so the grid-stride loop runs: CI checks the kernels' arithmetic
and indexing without a GPU. ``test_proxy_dequant_cuda.py`` runs them on a device."""

from __future__ import annotations

import ctypes
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from moestream.gpu.dequant import HostDequantizer, values_of
from moestream.gpu.dequantsource import KERNELS, dequant_source
from moestream.gpu.host import HostStream
from moestream.pipeline.foundation.compute import DEQUANTIZED
from moestream.pipeline.foundation.errors import UsageError
from tests.cuda_on_host import WALK, build
from tests.gguf_blocks import every_pattern, random_blocks, reference, same_bits

TYPES = sorted(DEQUANTIZED, key=lambda q: q.name)
PATTERNED = [Q.IQ2_XXS, Q.IQ2_XS, Q.IQ3_XXS, Q.MXFP4]


class TestTypes:
    """The kernels, the compute rule and the dequantizer's refusal name one set of types."""

    def test_one_kernel_a_type(self) -> None:
        assert set(KERNELS) == DEQUANTIZED

    def test_ds4s_and_the_common_types(self) -> None:
        assert {Q.IQ2_XXS, Q.Q2_K, Q.Q8_0, Q.Q4_0, Q.Q4_K, Q.Q5_K, Q.Q6_K} <= DEQUANTIZED

    @pytest.mark.parametrize("qtype", [Q.TQ1_0, Q.TQ2_0, Q.F32])
    def test_other_types_refused_in_one_line(self, qtype: Q) -> None:
        with pytest.raises(UsageError, match=f"cannot dequantize {qtype.name} experts") as e:
            HostDequantizer().dequantize(qtype, [np.zeros(64, np.uint8)],
                                         np.zeros(4096, np.float32), HostStream())
        assert "\n" not in str(e.value) and "--compute digest" in str(e.value)

    def test_partial_blocks_refused(self) -> None:
        with pytest.raises(UsageError, match="not whole Q8_0 blocks"):
            values_of(Q.Q8_0, 35)


class TestHost:
    """The host dequantizer is gguf-py's, several matrices one after another in ``out``."""

    @pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
    def test_bitwise_gguf(self, qtype: Q) -> None:
        mats = [random_blocks(qtype, n, seed) for seed, n in enumerate((5, 1, 3))]
        total = sum(values_of(qtype, m.nbytes) for m in mats)
        out = np.full(total + 7, np.nan, np.float32)
        views = HostDequantizer().dequantize(qtype, [m.reshape(-1) for m in mats], out,
                                             HostStream())
        for m, view in zip(mats, views, strict=True):
            assert same_bits(view, reference(qtype, m))
        assert np.isnan(out[total:]).all()  # nothing past the values


def _walk_source() -> str:
    cases = "".join(f"    if (which == {i}) {{ WALK(n, {name}(rows)) }}\n"
                    for i, name in enumerate(KERNELS.values()))
    return WALK + r"""
extern "C" void walk(int which, const Row* rows, int n, int blocks, int threads) {
    unsigned csr = flush_begin();  // subnormals flushed in and out, as a device build may do
""" + cases + "    flush_end(csr);\n}\n"


@pytest.fixture(scope="module")
def walk(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Q, list[np.ndarray]], Any]:
    """The kernels built for the host: ``walk(qtype, sources)`` -> their values, one launch."""
    if shutil.which("g++") is None:
        pytest.skip("no g++ to build the kernels' source for the host")
    library = build(dequant_source() + _walk_source(), Path(tmp_path_factory.mktemp("dequant")))
    if isinstance(library, str):
        pytest.fail(f"g++ cannot build the kernels' source: {library}")
    which = {q: i for i, q in enumerate(KERNELS)}

    def run(qtype: Q, sources: list[np.ndarray]) -> list[np.ndarray]:
        outs = [np.full(values_of(qtype, s.nbytes), np.nan, np.float32) for s in sources]
        elems = GGML_QUANT_SIZES[qtype][0]
        rows = np.array([(s.ctypes.data, o.ctypes.data, o.size // elems)
                         for s, o in zip(sources, outs, strict=True)], dtype=np.uint64)
        library.walk(which[qtype], rows.ctypes.data_as(ctypes.c_void_p), len(rows), 3, 7)
        return outs

    return run


class TestKernelSourceOnTheHost:
    """The CUDA source, built for the host, is bitwise gguf-py: several matrices a launch."""

    @pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
    @pytest.mark.parametrize("extreme", [True, False], ids=["extreme", "small"])
    def test_bitwise_gguf(self, walk: Callable[..., Any], qtype: Q, extreme: bool) -> None:
        mats = [random_blocks(qtype, n, seed, extreme) for seed, n in enumerate((9, 1, 4))]
        for m, values in zip(mats, walk(qtype, [m.reshape(-1) for m in mats]), strict=True):
            assert same_bits(values, reference(qtype, m))

    @pytest.mark.parametrize("qtype", PATTERNED, ids=lambda q: q.name)
    def test_every_code(self, walk: Callable[..., Any], qtype: Q) -> None:
        """Every grid point and sign pattern (IQ types), every scale and code (MXFP4)."""
        blocks = every_pattern(qtype)
        (values,) = walk(qtype, [blocks.reshape(-1)])
        assert same_bits(values, reference(qtype, blocks))
