"""A moestream model under ``torch.compile``, as ``generate`` compiles a model on its own
(a GPU model with a static cache: transformers' auto-compile, ``mode="reduce-overhead"``).

Dynamo traced into moestream's experts call and failed there (``wrap_numpy_ndarray``, on
the host path's cache views); the call, the token's hooks and the swapped modules' forwards
are now never traced (``_experts.uncompiled``): the compiled model breaks its graph there.
Forced on the host here (``_compile_all_devices``, the eager backend: dynamo's tracing and
graph breaks, without a C++ build), beside the resident model compiled the same way; on a
GPU as ``generate`` does it on its own (inductor, the compiled parts replayed as CUDA
graphs, which write their outputs into the same memory at each replay).
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.integrations.moe")
configuration = pytest.importorskip("transformers.generation.configuration_utils")

from moestream import transformers as mt  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

CONFIG = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_experts=16,
              num_experts_per_tok=2, num_hidden_layers=2, head_dim=16, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=96, max_position_embeddings=64)
PROMPT = [[3, 17, 42, 5]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = tmp_path_factory.mktemp("compile") / "qwen3_moe"
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model("qwen3_moe", **CONFIG)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(where)
    return where


def _compiled() -> object:
    """``generate``'s compile options, applied on the host too, with dynamo's eager
    backend."""
    compile_config = configuration.CompileConfig(backend="eager")
    compile_config._compile_all_devices = True
    return compile_config


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="torch sees no CUDA device")])])
@pytest.mark.parametrize("budget", [None, "4"], ids=["held", "evicting"])
def test_static_cache_generate_compiled_as_transformers_does(checkpoint: Path, device: str,
                                                             budget: str | None) -> None:
    """The compiled static-cache generate runs through moestream (held whole, and at a
    budget that evicts) with the tokens of the resident model compiled the same way, and
    each forward ends one token."""
    torch._dynamo.reset()
    args = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False,
                cache_implementation="static")
    if device == "cpu":
        args["compile_config"] = _compiled()
    ids = torch.tensor(PROMPT, device=device)
    resident = transformers.AutoModelForCausalLM.from_pretrained(
        checkpoint, experts_implementation="grouped_mm").to(device)
    want = resident.generate(ids, **args)
    model = mt.from_pretrained(checkpoint, device=device, budget=budget)
    try:
        model.generate(ids, **args)  # held whole from here on (a budget that holds all)
        tokens = model.moestream.tokens
        got = model.generate(ids, **args)
        assert torch.equal(got, want)
        assert model.moestream.tokens - tokens == 12
    finally:
        model.moestream.close()
