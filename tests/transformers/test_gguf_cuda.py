"""The transformers path's GGUF kernels on a CUDA device (gpu mark): every type and output
type bitwise the torch path (``_gguf_dequant.dequantize`` on the device, itself gguf-py's
float32 rounded once), random blocks with extreme float16 scales, experts at a stride,
aligned and unaligned outputs; a layer of two types into the module's layout in two launches;
a batch of more experts than one table part holds. ``test_gguf_kernels_host.py`` walks the
same source on the host in CI."""

from __future__ import annotations

from typing import Any

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

torch = pytest.importorskip("torch")
pytest.importorskip("cupy")

from moestream.transformers import _dequant_cuda as dc  # noqa: E402
from moestream.transformers._dequant_source import GGUF_KERNELS  # noqa: E402
from moestream.transformers._gguf_dequant import dequantize  # noqa: E402
from moestream.transformers._gguf_experts import GgufExperts  # noqa: E402
from tests.gguf_blocks import random_blocks  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")]

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
TYPES = sorted(Q(t) for t in GGUF_KERNELS)


def _same(a: Any, b: Any) -> bool:
    ints = {2: torch.int16, 4: torch.int32}[a.element_size()]
    nan = a.isnan()
    return bool(torch.equal(nan, b.isnan())
                and torch.equal(a[~nan].view(ints), b[~nan].view(ints)))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("lead", [0, 1], ids=["aligned", "unaligned"])
def test_one_kind_bitwise(qtype: Q, dtype: Any, lead: int) -> None:
    experts = [torch.from_numpy(random_blocks(qtype, 64, seed)).cuda() for seed in range(4)]
    values = 64 * gguf.GGML_QUANT_SIZES[qtype][0]
    wide = torch.full((4, values + 16), 7.0, dtype=dtype, device="cuda")
    out = wide[:, lead : lead + values]
    dc.gguf_kinds_cuda(int(qtype), [dc.Kind([e.data_ptr() for e in experts], None, out)])
    for k, e in enumerate(experts):
        assert _same(out[k], dequantize(e, int(qtype), dtype).reshape(-1)), (qtype.name, k)
    assert bool((wide[:, :lead] == 7.0).all() and (wide[:, lead + values:] == 7.0).all())


@pytest.mark.parametrize("experts", [8, 1003])
def test_layer_of_two_types(experts: int) -> None:
    """ds4's mix (IQ2_XXS gate and up, Q2_K down) into gate_up and down; 1003 experts take
    two table parts."""
    ffn, hidden = 256, 512
    gen = np.random.default_rng(experts)
    kinds = [(Q.IQ2_XXS, ffn, hidden), (Q.IQ2_XXS, ffn, hidden), (Q.Q2_K, hidden, ffn)]
    mats = [[torch.from_numpy(random_blocks(t, r * c // 256, int(gen.integers(1 << 30)),
                                            extreme=False)).cuda()
             for t, r, c in kinds] for _ in range(min(experts, 8))]
    order = [i % len(mats) for i in range(experts)]
    gate_up = torch.empty((experts, 2 * ffn, hidden), dtype=torch.bfloat16, device="cuda")
    down = torch.empty((experts, hidden, ffn), dtype=torch.bfloat16, device="cuda")
    addresses = [[mats[i][at].data_ptr() for i in order] for at in range(3)]
    dc.gguf_layer_cuda(GgufExperts(int(Q.IQ2_XXS), int(Q.Q2_K)), addresses, gate_up, down)
    for k, i in enumerate(order):
        gate, up, d = mats[i]
        want = torch.cat((dequantize(gate, int(Q.IQ2_XXS), torch.bfloat16).reshape(-1),
                          dequantize(up, int(Q.IQ2_XXS), torch.bfloat16).reshape(-1)))
        assert _same(gate_up[k].reshape(-1), want)
        assert _same(down[k].reshape(-1), dequantize(d, int(Q.Q2_K), torch.bfloat16).reshape(-1))
