"""The transformers path's GGUF kernels (``_dequant_source.gguf_source``) built for the host
and walked block by block, thread by thread, through ``_dequant_cuda``'s own table building
(its launch swapped for the walk), so CI without a GPU checks their arithmetic and indexing
bitwise against the contract: gguf-py's float32 values rounded once to the output type (what
``_gguf_dequant.dequantize`` gives, and transformers' GGUF loading). Every type and output
type, random blocks with extreme float16 scales, experts at a stride, aligned and unaligned
outputs, and a layer's three kinds in one launch or (two types) two. A small grid (3 blocks of
7 threads) exercises the grid-stride loop. ``test_gguf_cuda.py`` runs the same on a device."""

from __future__ import annotations

import ctypes
import shutil
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

torch = pytest.importorskip("torch")

from moestream.transformers import _dequant_cuda as dc  # noqa: E402
from moestream.transformers._dequant_source import GGUF_KERNELS, gguf_source  # noqa: E402
from moestream.transformers._gguf_experts import GgufExperts  # noqa: E402
from tests.cuda_on_host import WALK, build  # noqa: E402
from tests.gguf_blocks import random_blocks  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}
TYPES = sorted(Q(t) for t in GGUF_KERNELS)

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ to build the "
                                "kernels' source for the host")

def _walk_source() -> str:
    names = [f"{name}_{suffix}" for name in GGUF_KERNELS.values() for suffix in DTYPES]
    cases = "".join(f"    if (which == {i}) {{ WALK(kinds, {name}(table, kinds, n, slots, at)) }}\n"
                    for i, name in enumerate(names))
    return WALK + r"""
extern "C" void walk(int which, const i64* table, int kinds, int n, const i64* slots,
                     const i64* at, int blocks, int threads) {
""" + cases + "}\n"


def walker(where: Path, names: list[str]) -> Any:
    """The kernels built for the host under ``where``, and a stand-in for
    ``_dequant_cuda._launch`` that walks them (each name launched appended to ``names``)."""
    library = build(gguf_source() + _walk_source(), where)
    if isinstance(library, str):
        pytest.fail(f"g++ cannot build the kernels' source: {library}")
    which = {f"{name}_{suffix}": i for i, (name, suffix) in enumerate(
        (name, suffix) for name in GGUF_KERNELS.values() for suffix in DTYPES)}

    def launch(name: str, out: Any, table: Any, kinds: int, chunks: int, *tail: Any) -> None:
        values = np.array(table, dtype=np.int64)
        names.append(name)
        library.walk(which[name], values.ctypes.data_as(ctypes.c_void_p), kinds,
                     int(tail[0]), ctypes.c_void_p(int(tail[1])), ctypes.c_void_p(int(tail[2])),
                     3, 7)

    return launch


@pytest.fixture(scope="module")
def launches(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``_dequant_cuda``'s launch walks the kernels built for the host. Yields the names
    launched, in order."""
    names: list[str] = []
    saved = dc._launch
    dc._launch = walker(Path(tmp_path_factory.mktemp("gguf")), names)
    yield names
    dc._launch = saved


def _reference(raw: np.ndarray, qtype: Q, dtype: Any) -> Any:
    with np.errstate(over="ignore", invalid="ignore"):  # extreme scales: inf, and inf - inf
        values = gguf.quants.dequantize(raw, qtype)
    return torch.from_numpy(values.reshape(-1)).to(dtype)


def _same(a: Any, b: Any) -> bool:
    """Bit for bit, every NaN a NaN (its payload aside)."""
    ints = {2: torch.int16, 4: torch.int32}[a.element_size()]
    nan = a.isnan()
    return bool(torch.equal(nan, b.isnan())
                and torch.equal(a[~nan].view(ints), b[~nan].view(ints)))


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=list(DTYPES))
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "unaligned"])
@pytest.mark.parametrize("warps", [False, True], ids=["5-blocks", "2048-values"])
def test_one_kind_bitwise(launches: list[str], qtype: Q, dtype: Any, aligned: bool,
                          warps: bool) -> None:
    """Three experts' matrices (5 blocks each, or 2048 values: whole warps' of 1024, which
    a warp reads into shared memory first; the middle one read from an odd address) into
    rows of a wider output: every value the reference's, nothing written beside them."""
    count = 2048 // gguf.GGML_QUANT_SIZES[qtype][0] if warps else 5
    blocks = [random_blocks(qtype, count, seed) for seed in range(3)]
    flat = np.zeros(sum(b.nbytes for b in blocks) + 1, dtype=np.uint8)
    at, addresses = 0, []
    for i, b in enumerate(blocks):
        at += i == 1  # the middle expert's blocks start at an odd address
        flat[at : at + b.nbytes] = b.reshape(-1)
        addresses.append(flat.ctypes.data + at)
        at += b.nbytes
    values = count * gguf.GGML_QUANT_SIZES[qtype][0]
    lead = 0 if aligned else 1
    wide = torch.full((3, values + 16), 7.0, dtype=dtype)
    out = wide[:, lead : lead + values]
    dc.gguf_kinds_cuda(int(qtype), [dc.Kind(addresses, None, out)])
    suffix = next(name for name, d in DTYPES.items() if d == dtype)
    assert launches[-1] == f"{GGUF_KERNELS[int(qtype)]}_{suffix}"
    for k, b in enumerate(blocks):
        assert _same(out[k], _reference(b, qtype, dtype)), (qtype.name, k)
    rest = torch.cat((wide[:, :lead], wide[:, lead + values :]), dim=1)
    assert bool((rest == 7.0).all())


@pytest.mark.parametrize("types", [(Q.IQ2_XXS, Q.Q2_K), (Q.Q4_K, Q.Q4_K), (Q.Q8_0, Q.Q6_K)],
                         ids=lambda t: "+".join(q.name for q in t))
def test_layer_into_the_modules_layout(launches: list[str], types: tuple[Q, Q]) -> None:
    """A layer's gate, up and down of 3 experts into the stacked ``gate_up`` (gate rows
    first) and ``down``: one launch for one type, two for two."""
    gate_up_type, down_type = types
    ffn = hidden = 256
    elems, size = gguf.GGML_QUANT_SIZES[gate_up_type]
    matrices = [[random_blocks(t, rows * cols // gguf.GGML_QUANT_SIZES[t][0], seed * 3 + at,
                               extreme=False)
                 for at, (t, rows, cols) in enumerate(
                     [(gate_up_type, ffn, hidden), (gate_up_type, ffn, hidden),
                      (down_type, hidden, ffn)])] for seed in range(3)]
    assert elems and size
    gate_up = torch.empty((3, 2 * ffn, hidden), dtype=torch.bfloat16)
    down = torch.empty((3, hidden, ffn), dtype=torch.bfloat16)
    before = len(launches)
    addresses = [[m[at].ctypes.data for m in matrices] for at in range(3)]
    dc.gguf_layer_cuda(GgufExperts(int(gate_up_type), int(down_type)), addresses, gate_up, down)
    assert len(launches) - before == (1 if gate_up_type == down_type else 2)
    for k, (gate, up, d) in enumerate(matrices):
        want_gate_up = torch.cat((_reference(gate, gate_up_type, torch.bfloat16),
                                  _reference(up, gate_up_type, torch.bfloat16)))
        assert _same(gate_up[k].reshape(-1), want_gate_up)
        assert _same(down[k].reshape(-1), _reference(d, down_type, torch.bfloat16))


@pytest.mark.parametrize("types", [(Q.IQ2_XXS, Q.Q2_K), (Q.Q4_K, Q.Q4_K)],
                         ids=lambda t: "+".join(q.name for q in t))
def test_slots_by_a_layer_table(launches: list[str], types: tuple[Q, Q]) -> None:
    """``layer_slots_cuda`` on a GGUF layer: slot ``j`` dequantized from the row of a
    layer table its expert id names (repeats, an empty slot of -1 left as it was), down
    from the table's third column in a launch of its own where its type differs."""
    gate_up_type, down_type = types
    ffn = hidden = 256
    matrices = [[random_blocks(t, rows * cols // gguf.GGML_QUANT_SIZES[t][0], seed * 3 + at,
                               extreme=False)
                 for at, (t, rows, cols) in enumerate(
                     [(gate_up_type, ffn, hidden), (gate_up_type, ffn, hidden),
                      (down_type, hidden, ffn)])] for seed in range(4)]
    table = torch.tensor([[m.ctypes.data for m in row] for row in matrices], dtype=torch.int64)
    slots = torch.tensor([2, -1, 0, 2], dtype=torch.int64)
    gate_up = torch.zeros((4, 2 * ffn, hidden), dtype=torch.bfloat16)
    down = torch.zeros((4, hidden, ffn), dtype=torch.bfloat16)
    before = len(launches)
    dc.layer_slots_cuda(GgufExperts(int(gate_up_type), int(down_type)), table.data_ptr(),
                        slots, gate_up, down)
    assert len(launches) - before == (1 if gate_up_type == down_type else 2)
    for j, expert in enumerate(slots.tolist()):
        if expert < 0:
            assert not gate_up[j].any() and not down[j].any()
            continue
        gate, up, d = matrices[expert]
        want_gate_up = torch.cat((_reference(gate, gate_up_type, torch.bfloat16),
                                  _reference(up, gate_up_type, torch.bfloat16)))
        assert _same(gate_up[j].reshape(-1), want_gate_up)
        assert _same(down[j].reshape(-1), _reference(d, down_type, torch.bfloat16))


def test_refuses_outputs_it_cannot_address() -> None:
    with pytest.raises(ValueError, match="groups of 32"):
        dc.gguf_kinds_cuda(int(Q.Q8_0), [dc.Kind([0], None, torch.empty((1, 32, 2)))])


def test_one_expert_through_the_batch_kernel(launches: list[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The eager arithmetic's one expert on a GPU goes through the batch kernel (one launch
    for its three matrices), its gate, up and down the halves of the stacked result: the
    torch path's values (here the source walked on the host as the device would run it)."""
    from types import SimpleNamespace

    from moestream.transformers import _expert_weights as ew

    ffn = hidden = 256
    types = (Q.IQ2_XXS, Q.Q2_K)
    blocks = [random_blocks(t, rows * cols // 256, seed, extreme=False)
              for seed, (t, rows, cols) in enumerate(
                  [(types[0], ffn, hidden), (types[0], ffn, hidden), (types[1], hidden, ffn)])]
    matrices = [SimpleNamespace(ptr=b.ctypes.data) for b in blocks]
    handle = SimpleNamespace(layer=3, expert=5, matrices=matrices)
    module = SimpleNamespace(gate_up_proj=torch.empty(8, 2 * ffn, hidden, dtype=torch.bfloat16),
                             down_proj=torch.empty(8, hidden, ffn, dtype=torch.bfloat16))
    weights = ew.ExpertWeights(torch.device("cpu"), {3: GgufExperts(int(types[0]),
                                                                     int(types[1]))})
    monkeypatch.setattr(weights, "_cuda", True)
    monkeypatch.setattr(ew, "cuda_kernel", lambda: True)
    before = len(launches)
    gate, up, down = weights.expert(module, handle)  # type: ignore[arg-type]
    assert len(launches) - before == 2  # ds4's mix: gate and up in one, down in another
    for got, raw, qtype in zip((gate, up, down), blocks, (types[0], types[0], types[1]),
                               strict=True):
        assert _same(got.reshape(-1), _reference(raw, qtype, torch.bfloat16))
    assert gate.shape == up.shape == (ffn, hidden) and down.shape == (hidden, ffn)
