"""moestream.transformers: the models whose experts it reaches by a module swap (Llama 4's
text model, JetMoE) or by their own namings (Gemma 4's MoE block, Aria's fc1/fc2,
Inkling2's interleaved w13).

Tiny random-init checkpoints of ``pipeline.makers.arch_configs``' sizes, written by
transformers' ``save_pretrained``, run on the host backend and CPU torch (and, marked
``gpu``, on CuPy) against the same checkpoint loaded whole by transformers: logits
``torch.equal`` and greedy tokens identical, with every expert loaded and at a budget of two
layers' top-k (the cache evicts), in both of moestream's arithmetics.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.integrations.moe")

import moestream  # noqa: E402
from moestream import transformers as mt  # noqa: E402
from moestream.pipeline.makers.arch_configs import MODEL_TYPES, overrides  # noqa: E402
from moestream.transformers._swap import JetMoeExperts, Llama4Experts  # noqa: E402

SWAPPED = {"llama4": Llama4Experts, "jetmoe": JetMoeExperts}
"""Kinds whose experts module moestream swaps, and the module it swaps in."""
NAMED = ("gemma4", "aria", "inkling2", "inkling2_loop")
"""Kinds behind transformers' experts registry whose checkpoint namings the table reads
(Inkling2's ``w13_weight`` with gate and up rows interleaved, its own eager summing in
float32)."""
REFERENCE = {"grouped": "grouped_mm", "eager": "eager"}
PROMPTS = [[3, 17, 42, 5, 9, 11], [7, 8, 9, 10, 11, 12]]


def _config(kind: str, **changes: Any) -> Any:
    model_type = MODEL_TYPES.get(kind, kind)
    defaults = transformers.AutoConfig.for_model(model_type).to_dict()
    return transformers.AutoConfig.for_model(model_type,
                                             **{**overrides(kind, defaults), **changes})


def _missing(kind: str) -> str | None:
    model_type = MODEL_TYPES.get(kind, kind)
    if model_type not in transformers.CONFIG_MAPPING:
        return f"transformers {transformers.__version__} has no {model_type}"
    return None


def _save(kind: str, where: Path, **changes: Any) -> Path:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(kind, **changes),
                                                          dtype=torch.bfloat16)
    model.save_pretrained(where)
    return where


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("swap-checkpoints")
    return {kind: _save(kind, root / kind) for kind in (*SWAPPED, *NAMED)
            if _missing(kind) is None}


def _path(checkpoints: dict[str, Path], kind: str) -> Path:
    if kind not in checkpoints:
        pytest.skip(_missing(kind) or f"no checkpoint of {kind}")
    return checkpoints[kind]


def _whole(path: Path, kind: str, compute: str) -> Any:
    """transformers' own model: a swapped kind takes no experts implementation (its module
    computes one way); the others the one ``compute`` must equal."""
    lm = transformers.AutoModelForCausalLM
    if kind in SWAPPED:
        return lm.from_pretrained(path)
    try:
        whole = lm.from_pretrained(path, experts_implementation=REFERENCE[compute])
    except ValueError as exc:  # an older transformers' model without the experts registry
        if "experts implementation" not in str(exc):
            raise
        whole = None
    if whole is None or not getattr(whole, "_can_set_experts_implementation", bool)():
        pytest.skip(f"transformers {transformers.__version__}'s {kind} keeps its experts "
                    "outside the experts registry (moestream refuses it there, in one line)")
    return whole


def _generate(model: Any, tokens: int = 6) -> Any:
    ids = torch.tensor(PROMPTS, device=model.device)
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                          min_new_tokens=tokens, do_sample=False)


def _check_exact(path: Path, kind: str, compute: str, budget: str | None,
                 device: str) -> Any:
    """moestream's model of ``path`` gives the whole model's logits and tokens on
    ``device``; returns its counters."""
    whole = _whole(path, kind, compute).to(device)
    ids = torch.tensor(PROMPTS, device=device)
    with torch.no_grad():
        expected = whole(ids).logits
    model = mt.from_pretrained(path, device=device, compute=compute, budget=budget)
    try:
        with torch.no_grad():
            assert torch.equal(expected, model(ids).logits)
        assert torch.equal(_generate(whole, 8).cpu(), _generate(model, 8).cpu())
        return model.moestream.session.counters()
    finally:
        model.moestream.close()


class TestExactness:
    """Swapped and newly named experts compute what the whole model computes."""

    @pytest.mark.parametrize("budget", [None, "4"])
    @pytest.mark.parametrize("compute", ["grouped", "eager"])
    @pytest.mark.parametrize("kind", [*SWAPPED, *NAMED])
    def test_logits_and_tokens(self, checkpoints: dict[str, Path], kind: str, compute: str,
                               budget: str | None) -> None:
        """Every expert held, or a budget of two layers' top-k experts: the prefill's
        experts come in groups, the cache evicts, and nothing changes."""
        counters = _check_exact(_path(checkpoints, kind), kind, compute, budget, "cpu")
        assert counters.misses > 0
        if budget is not None:
            assert counters.evictions > 0
            assert counters.peak_device_bytes <= counters.budget_bytes


class TestLlama4Checkpoint:
    """Llama 4 as Scout and Maverick ship: the multimodal checkpoint
    (``Llama4ForConditionalGeneration``, ``language_model.model.layers...``), whose text
    model transformers' AutoModelForCausalLM builds."""

    def test_text_model_exact(self, tmp_path: Path) -> None:
        if _missing("llama4"):
            pytest.skip(str(_missing("llama4")))
        vision = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                      intermediate_size=32, image_size=28, patch_size=14,
                      vision_output_dim=32, projector_input_dim=32, projector_output_dim=32)
        config = transformers.Llama4Config(text_config=_config("llama4").to_dict(),
                                           vision_config=vision)
        torch.manual_seed(0)
        transformers.Llama4ForConditionalGeneration(config).to(torch.bfloat16) \
            .save_pretrained(tmp_path / "llama4")
        # the top-k sits in text_config: the least budget is two layers of it, not of the
        # default top-8 a reading of the top level alone would give
        least = 2 * config.get_text_config().num_experts_per_tok
        with pytest.raises(moestream.UsageError, match=f"give budget={least} or more"):
            mt.from_pretrained(tmp_path / "llama4", device="cpu", budget=0)
        counters = _check_exact(tmp_path / "llama4", "llama4", "grouped", str(least), "cpu")
        assert counters.evictions > 0


class TestErgo:
    """Ergo: experts without a gate stored as ``feed_forward.up_proj``/``down_proj``, a
    norm per expert that transformers applies around its registry call."""

    @pytest.mark.parametrize("budget", [None, "4"])
    def test_eager_exact(self, tmp_path: Path, budget: str | None) -> None:
        if _missing("ergo"):
            pytest.skip(str(_missing("ergo")))
        counters = _check_exact(_save("ergo", tmp_path / "ergo"), "ergo", "eager", budget,
                                "cpu")
        assert counters.misses > 0

    def test_grouped_tokens(self, tmp_path: Path) -> None:
        """Its model computes in float32 (the checkpoint's norms and router are), where
        transformers' grouped product over every expert and moestream's over the arrived
        ones round the last bit apart: greedy tokens identical, logits within float32's
        rounding."""
        if _missing("ergo"):
            pytest.skip(str(_missing("ergo")))
        path = _save("ergo", tmp_path / "ergo")
        whole = _whole(path, "ergo", "grouped")
        model = mt.from_pretrained(path, device="cpu", compute="grouped", budget="4")
        try:
            ids = torch.tensor(PROMPTS)
            with torch.no_grad():
                expected, got = whole(ids).logits, model(ids).logits
            assert expected.dtype == torch.float32
            assert torch.allclose(expected, got, rtol=0, atol=8 * torch.finfo(got.dtype).eps)
            assert torch.equal(_generate(whole, 8), _generate(model, 8))
        finally:
            model.moestream.close()


class TestSwap:
    """What the swap puts in the model, and what it leaves as it was."""

    @pytest.mark.parametrize("kind", list(SWAPPED))
    def test_swapped_module_holds_no_expert_bytes(self, checkpoints: dict[str, Path],
                                                  kind: str) -> None:
        """Each MoE layer's experts module is moestream's; its weights stay meta, while
        what it took over from the replaced module (JetMoE's router and bias) is loaded."""
        model = mt.from_pretrained(_path(checkpoints, kind), device="cpu")
        try:
            swapped = [m for m in model.modules() if isinstance(m, SWAPPED[kind])]
            assert sorted(m.moestream_layer for m in swapped) == \
                sorted(model.moestream.session.model.moe_layers)
            for module in swapped:
                assert module.gate_up_proj.is_meta and module.down_proj.is_meta
                dense = [p for n, p in module.named_parameters()
                         if n not in ("gate_up_proj", "down_proj")]
                assert not any(p.is_meta for p in dense)
        finally:
            model.moestream.close()

    def test_outside_a_moestream_model(self, checkpoints: dict[str, Path]) -> None:
        """A swapped module not set up by the loader says so in one line."""
        config = _config("llama4")
        with torch.device("meta"):
            original = transformers.AutoModelForCausalLM.from_config(config)
        experts = Llama4Experts(original.model.layers[0].feed_forward.experts)
        with pytest.raises(moestream.UsageError, match="from_pretrained"):
            experts(torch.zeros(8 * 2, 64))


class TestRefused:
    """Models whose routed experts moestream does not stream: one line."""

    def test_doge_product_key_experts(self, tmp_path: Path) -> None:
        """Doge's routed experts are rows of two embedding tables: no FFN experts to read."""
        if _missing("doge"):
            pytest.skip(str(_missing("doge")))
        path = _save("doge", tmp_path / "doge")
        with pytest.raises(moestream.ModelFileError, match="model type doge, whose routed "
                           "experts are rows of two embedding tables"):
            mt.from_pretrained(path, device="cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")
class TestGpu:
    """On a GPU (CuPy backend, torch's stream waiting on the uploads): the same equalities."""

    @pytest.mark.parametrize("budget", [None, "4"])
    @pytest.mark.parametrize("compute", ["grouped", "eager"])
    @pytest.mark.parametrize("kind", [*SWAPPED, *NAMED])
    def test_logits_and_tokens(self, checkpoints: dict[str, Path], kind: str, compute: str,
                               budget: str | None) -> None:
        counters = _check_exact(_path(checkpoints, kind), kind, compute, budget, "cuda")
        assert counters.misses > 0
