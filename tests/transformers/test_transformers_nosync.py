"""A model held whole on a GPU computes its experts with no host read of the routing.

On the host: the arithmetic that numbers the call's distinct experts on the device
(``slotted_grouped``) gives transformers' ``grouped_mm_experts_forward``'s bits, for
routings with repeated experts, over gated, transposed-with-biases and gate-less experts.
On a GPU (``gpu`` marker): a model whose every expert is cached gives the resident
model's logits and tokens through the whole-layer path, its experts calls synchronize
nothing (``torch.cuda.set_sync_debug_mode("error")``), and its hits are still counted.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
hf_moe = pytest.importorskip("transformers.integrations.moe")

from moestream import transformers as mt  # noqa: E402
from moestream.transformers import _routing  # noqa: E402
from moestream.transformers._layout import first_projection  # noqa: E402

ATTENTION = dict(num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
                 max_position_embeddings=128, head_dim=16)
ARCHS: dict[str, dict[str, Any]] = {
    "qwen3_moe": dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                      num_experts=8, num_experts_per_tok=2, num_hidden_layers=2, **ATTENTION),
    # transposed gate_up, per-expert biases, its own clamped gate
    "gpt_oss": dict(hidden_size=64, intermediate_size=32, num_local_experts=8,
                    num_experts_per_tok=2, num_hidden_layers=2, swiglu_limit=0.001,
                    layer_types=["sliding_attention", "full_attention"], **ATTENTION),
}
PROMPT = [[3, 17, 42, 5, 9, 11]]


def _model(kind: str, dtype: Any = torch.bfloat16) -> Any:
    config = transformers.AutoConfig.for_model(kind, **ARCHS[kind])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype,
                                                          experts_implementation="grouped_mm")
    with torch.no_grad():  # gpt-oss's experts' biases start at zero: make them count
        for name, param in model.named_parameters():
            if ".experts." in name and name.endswith("_bias"):
                param.normal_(0.0, 0.02)
    return model


def _experts(model: Any) -> list[Any]:
    return [m for m in model.modules() if hasattr(m, "has_gate") and hasattr(m, "down_proj")]


def _routing_of(tokens: int, experts: int, top_k: int, seed: int) -> tuple[Any, Any]:
    """A router's choice: ``top_k`` distinct experts a token, few experts so that tokens
    share them (groups of several rows)."""
    g = torch.Generator().manual_seed(seed)
    index = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, top_k, generator=g), dim=-1)
    return index, weights


class TestSlottedArithmetic:
    """The device-numbered grouped product is transformers' grouped product, bit for bit."""

    @pytest.mark.parametrize("tokens", [1, 3, 8, 40])
    @pytest.mark.parametrize("kind", list(ARCHS))
    def test_equals_grouped_mm(self, kind: str, tokens: int) -> None:
        module = _experts(_model(kind))[0]
        first, down = first_projection(module), module.down_proj

        def gather(slots: Any, first_out: Any, down_out: Any) -> None:
            held = slots >= 0  # the empty slots are left as they are (garbage)
            first_out[held] = first.detach()[slots[held]]
            down_out[held] = down.detach()[slots[held]]

        hidden = torch.randn(tokens, ARCHS[kind]["hidden_size"],
                             generator=torch.Generator().manual_seed(tokens),
                             dtype=torch.bfloat16)
        index, weights = _routing_of(tokens, module.num_experts, 2, seed=tokens)
        with torch.no_grad():
            expected = hf_moe.grouped_mm_experts_forward(module, hidden, index, weights)
            got = _routing.slotted_grouped(module, hidden, index, weights, module.num_experts,
                                           gather, tuple(first.shape[1:]),
                                           tuple(down.shape[1:]))
        assert torch.equal(expected, got)


_CUDA = torch.cuda.is_available()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("nosync")
    out = {}
    for kind in ARCHS:
        _model(kind).save_pretrained(root / kind)
        out[kind] = root / kind
    return out


def _held_whole(path: Path) -> Any:
    """The model through moestream on CUDA with every expert fetched once (held whole)."""
    model = mt.from_pretrained(path, device="cuda", budget=None)
    session = model.moestream.session
    for layer in session.model.moe_layers:
        with session.fetch(layer, list(range(session.model.layers[layer].n_experts))) as lease:
            lease.gather()
    session.end_token()
    return model


@pytest.mark.gpu
@pytest.mark.skipif(not _CUDA, reason="torch sees no CUDA device")
class TestGpuWholeLayers:
    """Every expert cached on the GPU: the whole-layer path, exact, with no host sync."""

    @pytest.mark.parametrize("kind", list(ARCHS))
    def test_logits_tokens_and_hits(self, checkpoints: dict[str, Path], kind: str,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
        whole = transformers.AutoModelForCausalLM.from_pretrained(
            checkpoints[kind], experts_implementation="grouped_mm").to("cuda")
        served = []
        grouped = _routing.WholeLayers.grouped

        def counted(self: Any, layer: int, *args: Any) -> Any:
            served.append(layer)
            return grouped(self, layer, *args)

        monkeypatch.setattr(_routing.WholeLayers, "grouped", counted)
        model = _held_whole(checkpoints[kind])
        try:
            ids = torch.tensor(PROMPT, device="cuda")
            before = model.moestream.session.counters()
            with torch.no_grad():
                assert torch.equal(whole(ids).logits, model(ids).logits)
                args = dict(attention_mask=torch.ones_like(ids), max_new_tokens=8,
                            min_new_tokens=8, do_sample=False)
                assert torch.equal(whole.generate(ids, **args).cpu(),
                                   model.generate(ids, **args).cpu())
            after = model.moestream.session.counters()
            layers = len(model.moestream.session.model.moe_layers)
            assert len(served) >= 9 * layers  # the prompt's forward and 8 decode steps
            assert after.misses == before.misses and after.hits - before.hits >= len(served)
        finally:
            model.moestream.close()

    def test_experts_call_synchronizes_nothing(self, checkpoints: dict[str, Path]) -> None:
        model = _held_whole(checkpoints["qwen3_moe"])
        try:
            experts = _experts(model)
            index, weights = _routing_of(4, experts[0].num_experts, 2, seed=1)
            index, weights = index.cuda(), weights.cuda().to(torch.bfloat16)
            hidden = torch.randn(4, 64, device="cuda", dtype=torch.bfloat16)
            with torch.no_grad():
                for module in experts:  # the first call of a layer makes its table
                    module(hidden, index, weights)
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
                try:
                    outs = [module(hidden, index, weights) for module in experts]
                finally:
                    torch.cuda.set_sync_debug_mode(0)
            assert all(o.shape == hidden.shape and torch.isfinite(o).all() for o in outs)
        finally:
            model.moestream.close()
