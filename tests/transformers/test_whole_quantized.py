"""Quantized layers on the whole-layer path: a call's experts named on the device (its
slots) and dequantized by the slot kernels from a layer table of their addresses, the
cache's or, in place, the page-cache mapping's (``WholeLayers``, ``layer_slots_cuda``).

On the host the kernels' source runs compiled for the host (``walked``), the tables over a
host session: logits of each call equal transformers' own grouped and batched products on
its dequantized model (FP8 blocks, gpt-oss's transposed MXFP4, a GGUF file of three type
pairs, ds4's IQ2_XXS/Q2_K among them), held whole and in place, the hits and in-place
misses counted. On a GPU (``gpu`` marker): a generate held whole and one in place give the
dequantized model's tokens, the decode steps served here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
hf_moe = pytest.importorskip("transformers.integrations.moe")
pytest.importorskip("accelerate")  # transformers' quantized loading asks for it

from gguf import GGMLQuantizationType as Q  # noqa: E402

from moestream import transformers as mt  # noqa: E402
from moestream.transformers import _dequant_cuda as dc  # noqa: E402
from moestream.transformers import _routing  # noqa: E402
from tests.quantized import dequantized, fp8_checkpoint, mxfp4_checkpoint  # noqa: E402
from tests.transformers import test_dequant_kernels_host as quantized_walk  # noqa: E402
from tests.transformers import test_gguf_kernels_host as gguf_walk  # noqa: E402
from tests.transformers.test_transformers_fp8 import FP8  # noqa: E402
from tests.transformers.test_transformers_fp8 import _float as fp8_float  # noqa: E402
from tests.transformers.test_transformers_gguf import _gguf  # noqa: E402
from tests.transformers.test_transformers_in_place import batched_calls  # noqa: E402
from tests.transformers.test_transformers_mxfp4 import MXFP4  # noqa: E402
from tests.transformers.test_transformers_mxfp4 import _float as gpt_oss_float  # noqa: E402
from tests.transformers.test_transformers_nosync import (  # noqa: E402
    _CUDA,
    _experts,
    _routing_of,
)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

KINDS = {"fp8": 6, "mxfp4": 12, "gguf": 9}
"""Each format's budget in place, in experts of its largest: about 3 a MoE layer."""
GGUF_TYPES = [(Q.Q8_0, Q.Q4_0), (Q.Q4_K, Q.Q6_K), (Q.IQ2_XXS, Q.Q2_K)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("whole-quantized")
    return {"fp8": fp8_checkpoint(fp8_float("qwen3_moe", root / "qwen3-bf16"), root / "fp8"),
            "mxfp4": mxfp4_checkpoint(gpt_oss_float(root / "gpt-oss-bf16"), root / "mxfp4"),
            "gguf": _gguf(root, "qwen3_moe", GGUF_TYPES,
                          num_hidden_layers=len(GGUF_TYPES)).path}


def _reference(path: Path, kind: str, device: str = "cpu") -> Any:
    """transformers' own model of the checkpoint, dequantized at load (a GGUF file's
    rounded once to bfloat16, as moestream's model of it computes)."""
    if kind == "gguf":
        return transformers.AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, experts_implementation="grouped_mm",
            dtype=torch.bfloat16).to(device)
    return dequantized(path, FP8 if kind == "fp8" else MXFP4, "grouped_mm").to(device)


@pytest.fixture(scope="module")
def walked(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``_dequant_cuda``'s launch walks the kernels built for the host: the FP8/FP4 ones
    and the GGUF ones, by the kernel's name."""
    quantized = quantized_walk.walker(tmp_path_factory.mktemp("quantized"))
    gguf = gguf_walk.walker(tmp_path_factory.mktemp("gguf"), [])

    def launch(name: str, *args: Any) -> None:
        (gguf if name.startswith("gguf_") else quantized)(name, *args)

    saved = dc._launch
    dc._launch = launch
    yield
    dc._launch = saved


def _loaded(path: Path, budget: int | None, device: str = "cpu", in_place: bool = False,
            mode: str = "resident") -> Any:
    """The model in ``mode`` with its cache full: held whole (no budget) or, below the
    experts, experts fetched a layer at a time (the first of each, then the second...)
    until no other fits (a GGUF file's layers differ in bytes an expert)."""
    model = mt.from_pretrained(path, device=device, budget=None if budget is None
                               else str(budget), mode=mode, dtype=torch.bfloat16,
                               in_place=in_place)
    session = model.moestream.session
    info = session.model
    largest = max(info.layers[layer].expert_bytes for layer in info.moe_layers)
    for expert in range(max(info.layers[layer].n_experts for layer in info.moe_layers)):
        for layer in info.moe_layers:
            counters = session.counters()
            if budget is not None and counters.budget_bytes - counters.live_bytes < largest + 768:
                break
            with session.fetch(layer, [expert]) as lease:
                lease.gather()
        session.end_token()
    return model


@pytest.mark.usefixtures("walked")
class TestOnTheHost:

    @pytest.mark.parametrize("in_place, mode", [(False, "resident"), (False, "direct"),
                                                (True, "resident")])
    @pytest.mark.parametrize("batched", [False, True])
    @pytest.mark.parametrize("kind", list(KINDS))
    def test_equals_transformers_dequantized(self, checkpoints: dict[str, Path], kind: str,
                                             batched: bool, in_place: bool, mode: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
        """Each call of two tokens through the slot kernels: transformers' product on its
        dequantized weights, bit for bit; held whole (loaded by O_DIRECT reads or from the
        page cache) every expert a hit, in place the uncached ones misses of their file
        bytes, nothing loaded or evicted."""
        monkeypatch.setattr(_routing, "cuda_kernel", lambda: True)  # the kernels walked here
        reference = (hf_moe.batched_mm_experts_forward if batched
                     else hf_moe.grouped_mm_experts_forward)
        theirs = _reference(checkpoints[kind], kind)
        model = _loaded(checkpoints[kind], KINDS[kind] if in_place else None, mode=mode)
        try:
            session = model.moestream.session
            whole = _routing.WholeLayers(session, "cpu", scales=model.moestream.scales,
                                         in_place=in_place)
            cached = {layer: {e for e in range(session.model.layers[layer].n_experts)
                              if session.ready(layer, [e])} for layer in session.model.moe_layers}
            pairs = list(zip(_experts(model), _experts(theirs), strict=True))
            width = model.config.hidden_size
            for rounds in range(2):  # the first token makes the tables
                before = session.counters()
                hits = misses = 0
                for i, (ours, ref) in enumerate(pairs):
                    layer = ours.moestream_layer
                    index, weights = _routing_of(3, ours.num_experts, 2, seed=i + rounds)
                    hidden = torch.randn(3, width, dtype=torch.bfloat16,
                                         generator=torch.Generator().manual_seed(i))
                    with torch.no_grad():
                        got = whole.forward(layer, ours, hidden, index, weights,
                                            batched=batched)
                        expected = reference(ref, hidden, index, weights)
                    assert got is not None and torch.equal(got, expected)
                    distinct = set(index.flatten().tolist())
                    hits += len(distinct & cached[layer])
                    misses += len(distinct - cached[layer])
                whole.settle(whole.take())
                session.end_token()
            after = session.counters()
            assert (after.hits - before.hits, after.misses - before.misses) == (hits, misses)
            assert after.evictions == before.evictions
            assert bool(misses) == in_place
        finally:
            model.moestream.close()

    def test_a_format_the_kernels_do_not_serve_takes_the_lease_path(
            self, checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
        """Where the slot kernels do not serve a layer's format (``kernels_serve``), no table:
        the lease path, and in-place mode off for the session."""
        monkeypatch.setattr(_routing, "cuda_kernel", lambda: True)
        monkeypatch.setattr(_routing, "kernels_serve", lambda scales, dtype: False)
        model = _loaded(checkpoints["fp8"], 6)
        try:
            whole = _routing.WholeLayers(model.moestream.session, "cpu",
                                         scales=model.moestream.scales, in_place=True)
            module = _experts(model)[0]
            index, weights = _routing_of(1, 8, 2, seed=0)
            hidden = torch.zeros(1, 64, dtype=torch.bfloat16)
            assert whole.forward(module.moestream_layer, module, hidden, index, weights) is None
            assert not whole.in_place
        finally:
            model.moestream.close()


@pytest.mark.gpu
@pytest.mark.skipif(not _CUDA, reason="torch sees no CUDA device")
@pytest.mark.parametrize("in_place, graphs", [(False, False), (False, True), (True, False)])
@pytest.mark.parametrize("kind", list(KINDS))
def test_gpu_generate_gives_the_dequantized_tokens(checkpoints: dict[str, Path], kind: str,
                                                   in_place: bool, graphs: bool) -> None:
    """Decode steps served by the slot kernels, held whole (launched as they are or
    replayed as CUDA graphs, their kernels' tables kept) or in place: transformers'
    dequantized model's greedy tokens."""
    theirs = _reference(checkpoints[kind], kind, "cuda")
    prompt = torch.tensor([[3, 17, 42, 5, 9, 11]], device="cuda")
    expected = theirs.generate(prompt, max_new_tokens=12, do_sample=False)
    model = _loaded(checkpoints[kind], KINDS[kind] if in_place else None, "cuda",
                    in_place=in_place)
    model.moestream.graphs.on = graphs
    try:
        torch.cuda.synchronize()  # every upload done: the next token finds the cache full
        with batched_calls() as served:
            got = model.generate(prompt, max_new_tokens=12, do_sample=False)
        assert torch.equal(got, expected)
        assert served  # the decode steps took the slot kernels
        assert model.moestream.graphs.on == graphs  # no capture failed
        assert bool(model.moestream.graphs.replays) == graphs
    finally:
        model.moestream.close()
