"""moestream.transformers: real transformers MoE models generating through moestream.

Tiny random-init checkpoints written by transformers' own ``save_pretrained`` (Qwen3-MoE,
Qwen2-MoE with its shared expert, Mixtral, DeepSeek-V3 with shared experts and a dense first
layer) run on the host backend and CPU torch, against the same checkpoint loaded whole by
transformers' ``from_pretrained``: logits ``torch.equal`` and greedy tokens identical.
"""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.integrations.moe")

import moestream  # noqa: E402
from moestream import transformers as mt  # noqa: E402
from moestream.pipeline import run as pipeline_run  # noqa: E402

ATTENTION = dict(num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
                 max_position_embeddings=128)
ARCHS: dict[str, dict[str, Any]] = {
    "qwen3_moe": dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                      num_experts=8, num_experts_per_tok=2, num_hidden_layers=2, head_dim=16,
                      **ATTENTION),
    "qwen2_moe": dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=2,
                      num_hidden_layers=2, **ATTENTION),
    "mixtral": dict(hidden_size=64, intermediate_size=32, num_local_experts=8,
                    num_experts_per_tok=2, num_hidden_layers=2, **ATTENTION),
    "deepseek_v3": dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                        first_k_dense_replace=1, n_group=2, topk_group=1,
                        num_hidden_layers=3, q_lora_rank=None, kv_lora_rank=16,
                        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                        **{**ATTENTION, "num_key_value_heads": 4}),
    # the reference model's architecture: hash-routed first layers, fused w1/w3 on load,
    # a clamped SwiGLU (a limit small enough to clamp these weights: the module's own gate)
    "deepseek_v4": dict(hidden_size=64, moe_intermediate_size=32, n_routed_experts=8,
                        num_experts_per_tok=2, num_hidden_layers=4, head_dim=16,
                        q_lora_rank=24, qk_rope_head_dim=8, o_lora_rank=16, o_groups=2,
                        index_topk=16, index_head_dim=16, index_n_heads=2, sliding_window=8,
                        swiglu_limit=0.001,
                        layer_types=["heavily_compressed_attention"] * 3
                        + ["compressed_sparse_attention"],
                        mlp_layer_types=["hash_moe"] * 3 + ["moe"],
                        compress_rates={"compressed_sparse_attention": 4,
                                        "heavily_compressed_attention": 8},
                        **{**ATTENTION, "num_key_value_heads": 1}),
    # experts under feed_forward, every other layer, beside Mamba layers
    "jamba": dict(hidden_size=64, intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                  num_hidden_layers=4, mamba_dt_rank=8, mamba_d_state=4,
                  use_mamba_kernels=False, attn_layer_period=2, attn_layer_offset=1,
                  expert_layer_period=2, expert_layer_offset=1, **ATTENTION),
    # fused experts named input_linear / output_linear
    "granitemoe": dict(hidden_size=64, intermediate_size=32, num_local_experts=8,
                       num_experts_per_tok=2, num_hidden_layers=2, **ATTENTION),
    # dense weights transformers builds from three checkpoint tensors (its converter)
    "kimi_linear": dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                        num_experts=8, num_experts_per_token=2, num_hidden_layers=4,
                        kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
                        qk_nope_head_dim=8, v_head_dim=16, linear_head_dim=16,
                        linear_num_heads=4, num_expert_group=1, topk_group=1,
                        mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
                        layer_types=["linear_attention", "full_attention"] * 2,
                        pad_token_id=0, bos_token_id=1, eos_token_id=2,
                        **{**ATTENTION, "num_key_value_heads": 4}),
    # transposed gate_up, gate and up interleaved, per-expert biases, its own clamped gate
    "gpt_oss": dict(hidden_size=64, intermediate_size=32, num_local_experts=8,
                    num_experts_per_tok=2, num_hidden_layers=4, head_dim=16,
                    swiglu_limit=0.001,
                    layer_types=["sliding_attention", "full_attention"] * 2, **ATTENTION),
    # experts without a gate (up, ReLU squared, down) under backbone.layers.L.mixer, Mamba
    "nemotron_h": dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                       n_routed_experts=8, num_experts_per_tok=2, head_dim=16,
                       moe_shared_expert_intermediate_size=48, mamba_num_heads=4,
                       mamba_head_dim=16, ssm_state_size=8, n_groups=1,
                       layers_block_type=["mamba", "moe", "attention", "moe"], **ATTENTION),
    # no AutoModelForCausalLM entry: built by its own class, named in config.json
    "mistral4": dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                     n_routed_experts=8, num_experts_per_tok=2, num_hidden_layers=3,
                     kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8,
                     v_head_dim=16, first_k_dense_replace=1,
                     **{**ATTENTION, "num_key_value_heads": 4}),
}
EAGER_SINCE = {"nemotron_h": (5, 25)}
"""Architectures whose class has its own eager arithmetic that moestream's ``eager``
matches from this transformers release on (checked on 5.25; 5.17's Nemotron-H sums its
experts in float32, the generic eager in the hidden states' dtype)."""
OWN_CLASS = {"mistral4": "Mistral4ForCausalLM"}
"""Architectures transformers' AutoModelForCausalLM does not map (built by their class)."""
REFERENCE = {"grouped": "grouped_mm", "eager": "eager"}
PROMPTS = [[3, 17, 42, 5, 9, 11], [7, 8, 9, 10, 11, 12]]


def _lm(kind: str) -> Any:
    """The class that builds ``kind``: AutoModelForCausalLM, or its own (``OWN_CLASS``)."""
    return getattr(transformers, OWN_CLASS.get(kind, ""), transformers.AutoModelForCausalLM)


def _from_config(kind: str, config: Any, **kwargs: Any) -> Any:
    lm = _lm(kind)
    made = lm.from_config if lm is transformers.AutoModelForCausalLM else lm._from_config
    return made(config, **kwargs)


def _save(kind: str, where: Path, dtype: Any = None, shard: str = "5GB",
          **overrides: Any) -> Path:
    config = transformers.AutoConfig.for_model(kind, **{**ARCHS[kind], **overrides})
    torch.manual_seed(0)
    model = _from_config(kind, config, dtype=dtype or torch.bfloat16)
    with torch.no_grad():  # experts' biases (gpt-oss) start at zero: make them count
        for name, param in model.named_parameters():
            if ".experts." in name and name.endswith("_bias"):
                param.normal_(0.0, 0.02)
    model.save_pretrained(where, max_shard_size=shard)
    return where


def _unserved(kind: str) -> str | None:
    """Why this transformers cannot run ``kind`` through its experts registry (the GPU
    machine's may be older than the newest), or None."""
    if kind not in transformers.CONFIG_MAPPING:
        return f"transformers {transformers.__version__} has no {kind}"
    if kind in OWN_CLASS and not hasattr(transformers, OWN_CLASS[kind]):
        return f"transformers {transformers.__version__} has no {OWN_CLASS[kind]}"
    config = transformers.AutoConfig.for_model(kind, **ARCHS[kind])
    with torch.device("meta"):
        model = _from_config(kind, config)
    if not any(hasattr(m, "has_gate") for m in model.modules()):
        return f"transformers {transformers.__version__} computes {kind}'s experts outside " \
               "its experts registry"
    return None


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each architecture's checkpoint; one this transformers cannot serve is skipped where
    a test asks for it."""
    root = tmp_path_factory.mktemp("checkpoints")
    return _Checkpoints({kind: _save(kind, root / kind) for kind in ARCHS
                         if _unserved(kind) is None})


class _Checkpoints(dict[str, Path]):
    def __missing__(self, kind: str) -> Path:
        pytest.skip(_unserved(kind) or f"no checkpoint of {kind}")


def _open_sessions() -> int:
    return sum(1 for t in threading.enumerate() if t.name == "moestream-loop")


@pytest.fixture
def loops() -> Any:
    """No moestream session (its loop thread) the test opened outlives it."""
    before = _open_sessions()
    yield
    assert _open_sessions() <= before, "a session was left open"


def _whole(path: Path, implementation: str) -> Any:
    """The whole model as transformers loads it (``path``'s folder is named by its kind)."""
    return _lm(path.name).from_pretrained(path, experts_implementation=implementation)


def _eager_differs(kind: str, compute: str) -> None:
    """Skip an eager comparison this transformers' own class computes otherwise."""
    since = EAGER_SINCE.get(kind)
    version = tuple(int(v) for v in transformers.__version__.split(".")[:2])
    if compute == "eager" and since is not None and version < since:
        pytest.skip(f"transformers {transformers.__version__}'s own eager {kind} sums "
                    "otherwise than moestream's eager (equal from "
                    f"{'.'.join(map(str, since))})")


def _reference(whole: Any, ids: Any, kind: str) -> Any:
    """The whole model's logits; skipped where transformers' own model of ``kind`` fails to
    run here (5.17's DeepSeek-V4 mixes float32 and bfloat16 on the CPU): nothing to match."""
    try:
        with torch.no_grad():
            return whole(ids).logits
    except RuntimeError as exc:
        pytest.skip(f"transformers {transformers.__version__}'s own {kind} fails: "
                    f"{str(exc).splitlines()[0]}")


def _assert_same_logits(path: Path, implementation: str, given: Path | None = None,
                        **options: Any) -> None:
    """The whole model (experts ``implementation``) and moestream's of ``given`` (default
    ``path``; ``options`` to ``from_pretrained``) give equal logits on the CPU."""
    whole = _whole(path, implementation)
    model = mt.from_pretrained(given or path, device="cpu", **options)
    try:
        with torch.no_grad():
            assert torch.equal(whole(torch.tensor(PROMPTS)).logits,
                               model(torch.tensor(PROMPTS)).logits)
    finally:
        model.moestream.close()


def _generate(model: Any, tokens: int = 6) -> Any:
    ids = torch.tensor(PROMPTS, device=model.device)
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                          min_new_tokens=tokens, do_sample=False)


class TestExactness:
    """Streamed experts compute what the whole model computes."""

    @pytest.mark.parametrize("compute", ["grouped", "eager"])
    @pytest.mark.parametrize("kind", list(ARCHS))
    def test_logits_and_tokens(self, checkpoints: dict[str, Path], kind: str, compute: str,
                               loops: None) -> None:
        """Logits torch.equal to the whole model with the matching experts implementation,
        greedy tokens identical, batch of 2, every expert loaded through moestream."""
        _eager_differs(kind, compute)
        whole = _whole(checkpoints[kind], REFERENCE[compute])
        expected = _reference(whole, torch.tensor(PROMPTS), kind)
        model = mt.from_pretrained(checkpoints[kind], device="cpu", compute=compute)
        try:
            with torch.no_grad():
                got = model(torch.tensor(PROMPTS)).logits
            assert torch.equal(expected, got)
            assert torch.equal(_generate(whole), _generate(model))
            assert model.moestream.session.counters().misses > 0
        finally:
            model.moestream.close()

    def test_default_implementation_tokens(self, checkpoints: dict[str, Path],
                                           loops: None) -> None:
        """Greedy tokens identical to the whole model with transformers' default experts
        implementation."""
        whole = transformers.AutoModelForCausalLM.from_pretrained(checkpoints["qwen3_moe"])
        model = mt.from_pretrained(checkpoints["qwen3_moe"], device="cpu")
        try:
            assert torch.equal(_generate(whole, 8), _generate(model, 8))
        finally:
            model.moestream.close()

    @pytest.mark.parametrize("compute", ["grouped", "eager"])
    @pytest.mark.parametrize("kind", ["deepseek_v3", "gpt_oss"])
    def test_small_budget_evicts_and_stays_exact(self, checkpoints: dict[str, Path],
                                                 kind: str, compute: str, loops: None) -> None:
        """A budget of two layers' top-k: the prefill's experts come in groups (gpt-oss:
        each group's rows with their experts' biases), the cache evicts, and the tokens do
        not change."""
        path = checkpoints[kind]
        whole = _whole(path, REFERENCE[compute])
        model = mt.from_pretrained(path, device="cpu", budget="4", compute=compute)
        try:
            assert model.moestream.group_experts == 2
            assert torch.equal(_generate(whole, 8), _generate(model, 8))
            counters = model.moestream.session.counters()
            assert counters.evictions > 0
            assert counters.peak_device_bytes <= counters.budget_bytes
        finally:
            model.moestream.close()

    @pytest.mark.parametrize("kind", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
    def test_batched_arithmetic_equals_batched_mm(self, checkpoints: dict[str, Path],
                                                  kind: str, monkeypatch: pytest.MonkeyPatch,
                                                  loops: None) -> None:
        """``batched`` (set while generate decodes on a GPU, where transformers computes
        grouped_mm experts in batched_mm): every MoE layer's call goes through
        transformers' own batched_mm_experts_forward, logits torch.equal to the whole
        model with ``experts_implementation="batched_mm"`` (gpt-oss: transposed, biased).
        (On a CPU the two arithmetics' bits agree here: the spy tells them apart.)"""
        from moestream.transformers import _layout

        calls = []

        def spy(*args: Any) -> Any:
            calls.append(args[0])
            return batched_mm(*args)

        batched_mm = _layout.BATCHED_MM
        monkeypatch.setattr(_layout, "BATCHED_MM", spy)
        whole = _whole(checkpoints[kind], "batched_mm")
        expected = _reference(whole, torch.tensor(PROMPTS), kind)
        model = mt.from_pretrained(checkpoints[kind], device="cpu")
        try:
            model.moestream.batched = True
            with torch.no_grad():
                assert torch.equal(expected, model(torch.tensor(PROMPTS)).logits)
            assert len(calls) == len(model.moestream.session.model.moe_layers)
        finally:
            model.moestream.close()

    def test_decode_switch_followed(self, checkpoints: dict[str, Path],
                                    monkeypatch: pytest.MonkeyPatch, loops: None) -> None:
        """generate's decode context (``_optimize_model_for_decode``) sets ``batched`` and
        ``defer`` where transformers would switch grouped_mm (not on a CPU), and puts them
        back after."""
        model = mt.from_pretrained(checkpoints["qwen3_moe"], device="cpu")
        stream = model.moestream
        try:
            seen = []
            with model._optimize_model_for_decode():
                seen.append((stream.batched, stream.defer))
            monkeypatch.setattr(stream, "device", torch.device("cuda"))
            with model._optimize_model_for_decode():
                seen.append((stream.batched, stream.defer))
            assert seen == [(False, False), (True, True)]
            assert stream.batched is False and stream.defer is False
        finally:
            model.moestream.close()

    def test_kept_in_float32_as_from_pretrained_keeps_it(
            self, checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch,
            loops: None) -> None:
        """A class's ``_keep_in_fp32_modules_strict`` (transformers 5.17's DeepSeek-V4 names
        its hyper-connections and sinks, made in the default dtype): from_pretrained's dtype
        plan keeps those tensors in float32 at bf16, from_config alone does not; moestream's
        model holds them as from_pretrained does, dtype and values."""
        lm = type(_whole(checkpoints["qwen3_moe"], "grouped_mm"))
        monkeypatch.setattr(lm, "_keep_in_fp32_modules_strict", ["input_layernorm"])
        whole = dict(_whole(checkpoints["qwen3_moe"], "grouped_mm").named_parameters())
        kept = {n for n, p in whole.items() if p.dtype == torch.float32}
        assert kept and all(n.endswith("input_layernorm.weight") for n in kept)
        model = mt.from_pretrained(checkpoints["qwen3_moe"], device="cpu")
        try:
            ours = dict(model.named_parameters())
            assert {n for n, p in ours.items() if p.dtype == torch.float32} == kept
            assert all(torch.equal(whole[n], ours[n]) for n in kept)
        finally:
            model.moestream.close()

    def test_float32_checkpoint(self, tmp_path: Path, loops: None) -> None:
        """F32 experts compute as F32, equal to the whole model."""
        path = _save("qwen3_moe", tmp_path / "f32", dtype=torch.float32)
        _assert_same_logits(path, "eager", compute="eager")

    @pytest.mark.parametrize("kind", ["qwen3_moe", "gpt_oss"])
    def test_sharded_checkpoint(self, tmp_path: Path, kind: str, loops: None) -> None:
        """Shards of 40 KB (an index, experts, their biases and dense weights spread over
        many files, as the hub's large checkpoints are): the same logits."""
        path = _save(kind, tmp_path / kind, shard="40KB")
        assert len(list(path.glob("*.safetensors"))) > 3
        _assert_same_logits(path, "grouped_mm")


class TestModel:
    """What from_pretrained hands out."""

    def test_single_file(self, checkpoints: dict[str, Path], loops: None) -> None:
        """One .safetensors file given (its config.json beside it) loads as its directory."""
        path = checkpoints["mixtral"]
        _assert_same_logits(path, "grouped_mm", given=path / "model.safetensors")

    def test_routed_experts_never_loaded(self, checkpoints: dict[str, Path],
                                         loops: None) -> None:
        """The experts' parameters stay on the meta device (no storage anywhere); every
        other parameter is real; the registry names the implementation."""
        model = mt.from_pretrained(checkpoints["qwen2_moe"], device="cpu")
        try:
            assert "moestream" in transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS
            assert model.config._experts_implementation == "moestream"
            meta = {n for n, p in model.named_parameters() if p.is_meta}
            assert meta == {f"model.layers.{i}.mlp.experts.{w}" for i in range(2)
                            for w in ("gate_up_proj", "down_proj")}
            assert not any(b.is_meta for b in model.buffers())
        finally:
            model.moestream.close()

    def test_one_token_per_forward(self, checkpoints: dict[str, Path], loops: None) -> None:
        """generate(N) ends N moestream tokens: the prefill's, then one per decode step."""
        model = mt.from_pretrained(checkpoints["mixtral"], device="cpu")
        try:
            seen: list[int] = []
            model.moestream.on_token = lambda stats: seen.append(stats.token)
            _generate(model, 5)
            assert seen == [0, 1, 2, 3, 4]
            assert model.moestream.last is not None
        finally:
            model.moestream.close()

    def test_plain_model_refuses_the_implementation(self, checkpoints: dict[str, Path]) -> None:
        """A model not loaded by moestream cannot use experts_implementation="moestream"."""
        mt.register()
        model = _whole(checkpoints["qwen3_moe"], "moestream")
        with pytest.raises(moestream.UsageError, match="from_pretrained"):
            model(torch.tensor(PROMPTS))

    def test_is_available(self) -> None:
        assert mt.is_available()

    def test_core_never_imports_torch(self) -> None:
        """moestream, pipeline.cli.run (its parser included) and moestream.transformers' gate
        import neither torch nor transformers."""
        import subprocess
        import sys

        code = ("import sys, moestream, moestream.transformers, moestream.pipeline.cli.run; "
                "moestream.pipeline.cli.run.build_parser(); "
                "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True).stdout
        assert out.strip() == "[]"


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(path: Path, **changes: Any) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def _drop_tensor(path: Path, name: str) -> None:
    from safetensors.torch import load_file, save_file

    file = path / "model.safetensors"
    tensors = load_file(file)
    del tensors[name]
    save_file(tensors, file, metadata={"format": "pt"})


class TestBadInput:
    """Bad input: one line, a moestream error, nothing left open."""

    def test_config_disagrees_with_experts(self, checkpoints: dict[str, Path], tmp_path: Path,
                                           loops: None) -> None:
        path = _copy(checkpoints["qwen3_moe"], tmp_path / "m")
        _edit_config(path, moe_intermediate_size=16)
        with pytest.raises(moestream.ExpertLayoutError, match=r"FFN.* 16"):
            mt.from_pretrained(path, device="cpu")

    def test_expert_count_disagrees(self, checkpoints: dict[str, Path], tmp_path: Path,
                                    loops: None) -> None:
        path = _copy(checkpoints["qwen3_moe"], tmp_path / "m")
        _edit_config(path, num_experts=4)
        with pytest.raises(moestream.ModelFileError):
            mt.from_pretrained(path, device="cpu")

    def test_missing_expert_tensor(self, checkpoints: dict[str, Path], tmp_path: Path,
                                   loops: None) -> None:
        path = _copy(checkpoints["qwen3_moe"], tmp_path / "m")
        _drop_tensor(path, "model.layers.1.mlp.experts.3.down_proj.weight")
        with pytest.raises(moestream.ModelFileError):
            mt.from_pretrained(path, device="cpu")

    def test_missing_dense_tensor(self, checkpoints: dict[str, Path], tmp_path: Path,
                                  loops: None) -> None:
        path = _copy(checkpoints["qwen3_moe"], tmp_path / "m")
        _drop_tensor(path, "model.norm.weight")
        with pytest.raises(moestream.ModelFileError, match=r"lacks 1 tensors.*model\.norm"):
            mt.from_pretrained(path, device="cpu")

    def test_experts_torch_cannot_compute(self, checkpoints: dict[str, Path], tmp_path: Path,
                                          loops: None) -> None:
        from safetensors.torch import load_file, save_file

        path = _copy(checkpoints["qwen3_moe"], tmp_path / "m")
        file = path / "model.safetensors"
        tensors = {k: (v.to(torch.int8) if ".experts." in k else v)
                   for k, v in load_file(file).items()}
        save_file(tensors, file, metadata={"format": "pt"})
        with pytest.raises(moestream.ModelFileError):
            mt.from_pretrained(path, device="cpu")

    def test_layout_disagrees_with_the_model(self, checkpoints: dict[str, Path],
                                             tmp_path: Path, loops: None) -> None:
        """gpt-oss's experts rewritten in the [E, 2F, D] layout: the table reads them as
        such, the model keeps them transposed: refused, not computed wrong."""
        from safetensors.torch import load_file, save_file

        path = _copy(checkpoints["gpt_oss"], tmp_path / "m")
        file = path / "model.safetensors"
        tensors = {k: (v.transpose(1, 2).contiguous() if k.endswith(("experts.gate_up_proj",
                                                                      "experts.down_proj"))
                       else v) for k, v in load_file(file).items()}
        save_file(tensors, file, metadata={"format": "pt"})
        with pytest.raises(moestream.ExpertLayoutError, match="transposed"):
            mt.from_pretrained(path, device="cpu")

    def test_merged_dense_weight_of_a_wrong_shape(self, checkpoints: dict[str, Path],
                                                  tmp_path: Path, loops: None) -> None:
        """One of the three tensors transformers stacks into Kimi-Linear's convolution cut
        short: refused in one line, the session closed."""
        from safetensors.torch import load_file, save_file

        path = _copy(checkpoints["kimi_linear"], tmp_path / "m")
        file = path / "model.safetensors"
        tensors = load_file(file)
        name = "model.layers.0.self_attn.k_conv1d.weight"
        tensors[name] = tensors[name][:-1].clone()
        save_file(tensors, file, metadata={"format": "pt"})
        with pytest.raises(moestream.ModelFileError) as caught:
            mt.from_pretrained(path, device="cpu")
        assert "conv1d" in str(caught.value) and "\n" not in str(caught.value)

    def test_budget_below_a_layer(self, checkpoints: dict[str, Path], loops: None) -> None:
        with pytest.raises(moestream.UsageError, match="budget"):
            mt.from_pretrained(checkpoints["qwen3_moe"], device="cpu", budget="1")

    def test_model_without_routed_experts(self, tmp_path: Path, loops: None) -> None:
        config = transformers.AutoConfig.for_model(
            "qwen3", hidden_size=64, intermediate_size=96, num_hidden_layers=1, head_dim=16,
            **ATTENTION)
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "d")
        with pytest.raises(moestream.ModelFileError, match="no routed expert"):
            mt.from_pretrained(tmp_path / "d", device="cpu")

    def test_missing_gguf(self, tmp_path: Path) -> None:
        with pytest.raises(moestream.ModelFileError, match="no such checkpoint"):
            mt.from_pretrained(tmp_path / "model.gguf", device="cpu")

    def test_not_a_checkpoint(self, tmp_path: Path) -> None:
        with pytest.raises(moestream.ModelFileError, match=r"no config\.json"):
            mt.from_pretrained(tmp_path, device="cpu")

    def test_bad_compute(self, checkpoints: dict[str, Path]) -> None:
        with pytest.raises(moestream.UsageError, match="compute"):
            mt.from_pretrained(checkpoints["qwen3_moe"], device="cpu",
                               compute="fast")  # type: ignore[arg-type]


_CUDA = torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _CUDA, reason="torch sees no CUDA device")
class TestGpu:
    """On a GPU (CuPy backend, torch's stream waiting on the uploads): the same equalities."""

    @pytest.mark.parametrize("compute", ["grouped", "eager"])
    @pytest.mark.parametrize("kind", list(ARCHS))
    def test_logits_and_tokens(self, checkpoints: dict[str, Path], kind: str, compute: str,
                               loops: None) -> None:
        _eager_differs(kind, compute)
        whole = _whole(checkpoints[kind], REFERENCE[compute]).to("cuda")
        expected = _reference(whole, torch.tensor(PROMPTS, device="cuda"), kind)
        for budget in (None, "4"):
            model = mt.from_pretrained(checkpoints[kind], device="cuda", compute=compute,
                                       budget=budget)
            try:
                assert model.moestream.session.backend == "cupy"
                ids = torch.tensor(PROMPTS, device="cuda")
                with torch.no_grad():
                    assert torch.equal(expected, model(ids).logits)
                assert torch.equal(_generate(whole.to("cuda"), 8).cpu(), _generate(model, 8).cpu())
            finally:
                model.moestream.close()


class TestCli:
    """python -m pipeline.run --engine transformers."""

    def test_generates_and_logs(self, checkpoints: dict[str, Path], tmp_path: Path,
                                capsys: pytest.CaptureFixture[str], loops: None) -> None:
        log = tmp_path / "run.jsonl"
        code = pipeline_run.main(["--engine", "transformers", "-m", str(checkpoints["qwen3_moe"]),
                                  "--prompt-ids", "3,17,42", "--tokens", "5",
                                  "--cache-budget", "6", "--log", str(log)])
        out = capsys.readouterr().out
        assert code == 0
        assert "decoded    5 tokens" in out
        whole = _whole(checkpoints["qwen3_moe"], "grouped_mm")
        ids = torch.tensor([[3, 17, 42]])
        expected = whole.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5,
                                  min_new_tokens=5, do_sample=False)[0, 3:].tolist()
        assert f"tokens     {','.join(map(str, expected))}" in out
        events = [json.loads(line)["event"] for line in log.read_text().splitlines()]
        assert events.count("token") == 5
        assert events[0] == "run_start" and events[-1] == "run_end"

    def test_streaming_options_reach_the_session(self, checkpoints: dict[str, Path],
                                                 tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str],
                                                 loops: None) -> None:
        """The command line's reading, staging and controller options are the session's
        (its log header's config), as the proxy engine's are."""
        log = tmp_path / "run.jsonl"
        code = pipeline_run.main(["--engine", "transformers", "-m", str(checkpoints["qwen3_moe"]),
                                  "--prompt-ids", "3,17", "--tokens", "1", "--log", str(log),
                                  "--queue-depth", "3", "--staging-slots", "5", "--chunk",
                                  "1MiB", "--ram-limit", "8GiB", "--sample-ms", "100",
                                  "--no-gather"])
        capsys.readouterr()
        assert code == 0
        config = json.loads(log.read_text().splitlines()[0])["config"]
        assert {k: config[k] for k in ("queue_depth", "staging_slots", "chunk_bytes",
                                       "ram_limit", "sample_ms", "gather")} == {
            "queue_depth": 3, "staging_slots": 5, "chunk_bytes": 1 << 20,
            "ram_limit": 8 << 30, "sample_ms": 100.0, "gather": False}

    @pytest.mark.parametrize("argv, message", [
        (["--prompt-ids", "1,2", "--cache-budget", "1"], "budget"),
        (["--prompt", "hello"], "no tokenizer"),
        (["--prompt-ids", "1,x"], "--prompt-ids"),
        ([], "--prompt"),
        # an id past the embeddings, or negative: not torch's index error from the forward
        (["--prompt-ids", "1,96"], "the prompt's token id 96 is not one of this model's "
         "(0..95)"),
        (["--prompt-ids", "-1"], "the prompt's token id -1 is not one"),
        # the proxy engine's options, never dropped without a word; streaming ones checked
        (["--prompt-ids", "1", "--devices", "1", "--seed", "2"], "--devices, --seed: options "
         "of the proxy engine"),
        (["--prompt-ids", "1", "--queue-depth", "0"], "--queue-depth must be >= 1"),
    ])
    def test_bad_input_one_line_exit_2(self, checkpoints: dict[str, Path], argv: list[str],
                                       message: str, capsys: pytest.CaptureFixture[str],
                                       loops: None) -> None:
        code = pipeline_run.main(["--engine", "transformers", "-m",
                                  str(checkpoints["qwen3_moe"]), *argv])
        err = capsys.readouterr().err
        assert code == 2
        assert err.startswith("moestream: error: ") and err.count("\n") == 1
        assert message in err
