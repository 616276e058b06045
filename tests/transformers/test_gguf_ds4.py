"""Tests of the DeepSeek V4 mapping of ds4's GGUF layout (moestream.transformers._gguf_ds4,
its names and tensors, and _gguf_ds4_config, its config).

The files are make_model's ds4 layout at a tiny shape (4 layers: two sliding-window, one
compressed with an indexer, one heavily compressed; three hash-routed; IQ2_XXS gate/up and
Q2_K down experts). The reference model is transformers' own ``from_pretrained`` of a
checkpoint in DeepSeek's names (ds4's converter table read backwards) holding gguf-py's
dequantization of every tensor of the file, routed experts included.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV4ForCausalLM"):
    pytest.skip("this transformers has no DeepSeek-V4", allow_module_level=True)

import gguf  # noqa: E402
from gguf import GGMLQuantizationType as QType  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

import moestream  # noqa: E402
from moestream.pipeline.foundation.errors import ExpertLayoutError  # noqa: E402
from moestream.pipeline.makers.modelgen import write_model  # noqa: E402
from moestream.pipeline.makers.modelspec import Ds4Shape, ModelSpec  # noqa: E402
from moestream.transformers._gguf_ds4 import Ds4Names, ds4_dense_tensors  # noqa: E402
from moestream.transformers._gguf_ds4_config import (  # noqa: E402
    config_kwargs,
    ds4_config,
    metadata_values,
)
from tests.quantized import PROMPTS, assert_streams_like, logits  # noqa: E402

SHAPE = Ds4Shape(vocab=512, heads=2, head_dim=64, rope_dim=32, q_lora=64, o_lora=32,
                 o_groups=2, index_heads=2, index_head_dim=32, index_top_k=4, sliding_window=8)
SPEC = ModelSpec("ds4-flash-q2", 4, 0, 3, 4, 2, 256, 256, QType.IQ2_XXS, QType.Q2_K,
                 vocab=SHAPE.vocab, arch="deepseek4", ds4=SHAPE)

# ds4's converter (gguf-tools/deepseek4-quantize.c top_map / layer_map), read backwards:
# DeepSeek's checkpoint names of the file's tensors, for the reference checkpoint.
DEEPSEEK_NAMES = {
    "token_embd.weight": "embed.weight", "output_norm.weight": "norm.weight",
    "output.weight": "head.weight", "output_hc_base.weight": "hc_head_base",
    "output_hc_fn.weight": "hc_head_fn", "output_hc_scale.weight": "hc_head_scale",
}
LAYER_NAMES = {
    "hc_attn_base.weight": "hc_attn_base", "hc_attn_fn.weight": "hc_attn_fn",
    "hc_attn_scale.weight": "hc_attn_scale", "hc_ffn_base.weight": "hc_ffn_base",
    "hc_ffn_fn.weight": "hc_ffn_fn", "hc_ffn_scale.weight": "hc_ffn_scale",
    "attn_sinks.weight": "attn.attn_sink", "attn_q_a.weight": "attn.wq_a.weight",
    "attn_q_b.weight": "attn.wq_b.weight", "attn_q_a_norm.weight": "attn.q_norm.weight",
    "attn_kv.weight": "attn.wkv.weight", "attn_kv_a_norm.weight": "attn.kv_norm.weight",
    "attn_output_a.weight": "attn.wo_a.weight", "attn_output_b.weight": "attn.wo_b.weight",
    "attn_compressor_ape.weight": "attn.compressor.ape",
    "attn_compressor_kv.weight": "attn.compressor.wkv.weight",
    "attn_compressor_gate.weight": "attn.compressor.wgate.weight",
    "attn_compressor_norm.weight": "attn.compressor.norm.weight",
    "indexer.attn_q_b.weight": "attn.indexer.wq_b.weight",
    "indexer.proj.weight": "attn.indexer.weights_proj.weight",
    "indexer_compressor_ape.weight": "attn.indexer.compressor.ape",
    "indexer_compressor_kv.weight": "attn.indexer.compressor.wkv.weight",
    "indexer_compressor_gate.weight": "attn.indexer.compressor.wgate.weight",
    "indexer_compressor_norm.weight": "attn.indexer.compressor.norm.weight",
    "attn_norm.weight": "attn_norm.weight", "ffn_norm.weight": "ffn_norm.weight",
    "ffn_gate_shexp.weight": "ffn.shared_experts.w1.weight",
    "ffn_up_shexp.weight": "ffn.shared_experts.w3.weight",
    "ffn_down_shexp.weight": "ffn.shared_experts.w2.weight",
    "ffn_gate_inp.weight": "ffn.gate.weight", "exp_probs_b.bias": "ffn.gate.bias",
    "ffn_gate_tid2eid.weight": "ffn.gate.tid2eid",
}
EXPERT_NAMES = {"gate": "w1", "up": "w3", "down": "w2"}


@pytest.fixture(scope="module")
def ds4_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(SPEC, tmp_path_factory.mktemp("ds4") / "ds4.gguf")


def _values(path: Path) -> dict[str, Any]:
    """Every tensor of the file as gguf-py dequantizes it (float32; I32 as int64), numpy
    order."""
    out = {}
    for t in gguf.GGUFReader(path).tensors:
        shape = tuple(int(n) for n in reversed(t.shape))
        if t.tensor_type == QType.I32:
            out[t.name] = torch.from_numpy(np.array(t.data, dtype=np.int64).reshape(shape))
        else:
            values = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
            out[t.name] = torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape))
    return out


def _deepseek_checkpoint(path: Path, directory: Path) -> Path:
    """A checkpoint in DeepSeek's own names and one tensor per expert matrix, holding the
    file's dequantization, with the config the mapping makes."""
    tensors = {}
    for name, value in _values(path).items():
        if name in DEEPSEEK_NAMES:
            tensors[DEEPSEEK_NAMES[name]] = value
            continue
        _, layer, rest = name.split(".", 2)
        part = rest.removeprefix("ffn_").removesuffix("_exps.weight")
        if part in EXPERT_NAMES:
            for e in range(value.shape[0]):
                key = f"layers.{layer}.ffn.experts.{e}.{EXPERT_NAMES[part]}.weight"
                tensors[key] = value[e].contiguous()
        else:
            tensors[f"layers.{layer}.{LAYER_NAMES[rest]}"] = value
    directory.mkdir()
    save_file(tensors, str(directory / "model.safetensors"))
    config = transformers.DeepseekV4Config(**config_kwargs(path, metadata_values(
        gguf.GGUFReader(path))))
    config.architectures = ["DeepseekV4ForCausalLM"]
    (directory / "config.json").write_text(json.dumps(config.to_dict()))
    return directory


@pytest.fixture(scope="module")
def checkpoint(ds4_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _deepseek_checkpoint(ds4_file, tmp_path_factory.mktemp("ref") / "ckpt")


def _reference(checkpoint: Path, implementation: str = "eager", dtype: Any = None) -> Any:
    """transformers' DeepSeek-V4 from the DeepSeek-named checkpoint, as it loads one, its
    experts computed by ``implementation``, its weights rounded once to ``dtype``."""
    model, info = transformers.DeepseekV4ForCausalLM.from_pretrained(
        checkpoint, dtype=dtype or torch.float32, experts_implementation=implementation,
        output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert not info["mismatched_keys"]
    return model.eval()


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> Any:
    return _reference(checkpoint)


class TestConfig:
    """The deepseek4.* metadata becomes the config ds4's constants describe."""

    def test_values(self, ds4_file: Path) -> None:
        config = ds4_config(ds4_file, gguf.GGUFReader(ds4_file))
        assert config.layer_types == ["sliding_attention", "sliding_attention",
                                      "compressed_sparse_attention",
                                      "heavily_compressed_attention"]
        assert config.mlp_layer_types == ["hash_moe"] * 3 + ["moe"]
        assert (config.hidden_size, config.moe_intermediate_size) == (SPEC.hidden,
                                                                      SPEC.expert_ffn)
        assert (config.n_routed_experts, config.num_experts_per_tok) == (4, 2)
        assert (config.num_attention_heads, config.head_dim, config.qk_rope_head_dim) == (
            SHAPE.heads, SHAPE.head_dim, SHAPE.rope_dim)
        assert (config.q_lora_rank, config.o_groups, config.o_lora_rank) == (64, 2, 32)
        assert (config.index_n_heads, config.index_head_dim, config.index_topk) == (2, 32, 4)
        assert (config.hc_mult, config.hc_sinkhorn_iters, config.sliding_window) == (4, 20, 8)
        assert (config.scoring_func, config.routed_scaling_factor, config.swiglu_limit) == (
            "sqrtsoftplus", 1.5, 10.0)
        assert config.norm_topk_prob and not config.tie_word_embeddings
        main, compress = config.rope_parameters["main"], config.rope_parameters["compress"]
        assert (main["rope_type"], main["rope_theta"]) == ("default", 10000.0)
        assert (compress["rope_type"], compress["rope_theta"], compress["factor"]) == (
            "yarn", 160000.0, 16.0)
        assert compress["attention_factor"] == 1.0
        assert compress["original_max_position_embeddings"] == 65536

    def test_flash_is_transformers_flash(self, tmp_path: Path) -> None:
        """The full preset's keys (ds4's constants) make transformers' own DeepSeek-V4
        Flash config (its defaults) but for what Flash's checkpoint says otherwise: the
        layer schedule (sliding, sliding, then CSA/HCA alternating; the defaults are
        V4-Pro's), YaRN on the compressed layers, and no MTP layer."""
        from moestream.pipeline.makers.ds4layout import ds4_metadata
        from moestream.pipeline.makers.modelspec import PRESETS

        path = tmp_path / "keys.gguf"
        writer = gguf.GGUFWriter(path, "deepseek4")
        ds4_metadata(writer, PRESETS["ds4-flash-q2"])
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        writer.close()
        ours = transformers.DeepseekV4Config(
            **config_kwargs(path, metadata_values(gguf.GGUFReader(path)))).to_dict()
        flash = transformers.DeepseekV4Config().to_dict()
        differ = {k for k in set(ours) | set(flash) if ours.get(k) != flash.get(k)}
        assert differ == {"layer_types", "rope_parameters", "num_nextn_predict_layers"}
        assert ours["layer_types"][:4] == ["sliding_attention"] * 2 + [
            "compressed_sparse_attention", "heavily_compressed_attention"]
        assert ours["rope_parameters"]["main"] == flash["rope_parameters"]["main"]

    @pytest.mark.parametrize(("key", "value", "words"), [
        ("general.architecture", "deepseek2", "not 'deepseek4'"),
        ("deepseek4.attention.head_count_kv", 2, "exactly 1"),
        ("deepseek4.expert_shared_count", 2, "exactly 1"),
        ("deepseek4.attention.value_length", 32, "one head_dim"),
        ("deepseek4.expert_group_count", 8, "grouped expert routing"),
        ("deepseek4.attention.compress_ratios", [0, 0, 8, 128], "0, 4, 128"),
        ("deepseek4.swiglu_clamp_exp", [10.0, 10.0, 7.0, 10.0], "differs between layers"),
        ("deepseek4.swiglu_clamp_exp", [0.0] * 4, "no clamp"),
        ("deepseek4.hash_layer_count", None, "without the metadata key"),
    ])
    def test_refused(self, ds4_file: Path, key: str, value: Any, words: str) -> None:
        metadata = metadata_values(gguf.GGUFReader(ds4_file))
        if value is None:
            del metadata[key]
        else:
            metadata[key] = value
        with pytest.raises(ExpertLayoutError, match=words) as caught:
            config_kwargs(ds4_file, metadata)
        assert "\n" not in str(caught.value)


def _meta_model(path: Path) -> Any:
    with torch.device("meta"):
        return transformers.DeepseekV4ForCausalLM(ds4_config(path, gguf.GGUFReader(path)))


class TestNames:
    """Every tensor of the file has one place in the model, and every place one tensor."""

    def test_every_tensor_maps(self, ds4_file: Path) -> None:
        model = _meta_model(ds4_file)
        reader = gguf.GGUFReader(ds4_file)
        names = Ds4Names(model, ds4_file)
        dense = [t.name for t in reader.tensors if "_exps." not in t.name]
        targets = names.check(dense, range(SPEC.n_layers))
        state = model.state_dict()
        filled: dict[str, list[int]] = {}
        for t in reader.tensors:
            target = targets[t.name] if t.name in targets else names.target(t.name)
            assert target is not None
            shape = tuple(int(n) for n in reversed(t.shape))
            want = tuple(state[target.name].shape)
            if target.experts:  # stacked along the rows: gate rows then up rows
                rows = shape[1]
                assert (shape[0], shape[2]) == (want[0], want[2])
                assert want[1] % rows == 0 and target.slot < want[1] // rows
            else:
                assert shape == want, t.name
                assert target.integer == (state[target.name].dtype == torch.int64)
            filled.setdefault(target.name, []).append(target.slot)
        assert set(filled) == set(state)  # nothing missing, nothing left over
        for name, slots in filled.items():
            assert sorted(slots) == list(range(len(slots))), name
            if name.endswith("gate_up_proj"):
                assert slots == [0, 1]

    @pytest.mark.parametrize(("change", "words"), [
        (lambda n: [*n, "blk.0.attn_k_b.weight"], "not in ds4's DeepSeek V4 layout"),
        (lambda n: [x for x in n if x != "blk.2.indexer.proj.weight"],
         "without blk.2.indexer.proj.weight"),
        (lambda n: [x for x in n if not x.startswith("blk.1.")], "and 20 more"),
        (lambda n: [*n, "blk.0.exp_probs_b.bias"], "has no place"),
        (lambda n: [*n, "blk.4.attn_norm.weight"], "has no place"),
        (lambda n: [*n, "blk.3.nextn.e_proj.weight"], "multi-token-prediction"),
    ])
    def test_refused(self, ds4_file: Path, change: Any, words: str) -> None:
        reader = gguf.GGUFReader(ds4_file)
        dense = [t.name for t in reader.tensors if "_exps." not in t.name]
        with pytest.raises(ExpertLayoutError, match=words):
            Ds4Names(_meta_model(ds4_file), ds4_file).check(change(dense), range(4))

    def test_layer_without_experts(self, ds4_file: Path) -> None:
        reader = gguf.GGUFReader(ds4_file)
        dense = [t.name for t in reader.tensors if "_exps." not in t.name]
        with pytest.raises(ExpertLayoutError, match="routed experts in layer 3"):
            Ds4Names(_meta_model(ds4_file), ds4_file).check(dense, range(3))

    def test_mtp_tensors_skipped(self, ds4_file: Path) -> None:
        # transformers builds no MTP layer (it ignores DeepSeek's mtp.*): nothing to load
        assert Ds4Names(_meta_model(ds4_file), ds4_file).target("mtp.0.e_proj.weight") is None


class TestDense:
    """Through a session, every non-routed tensor is the reference model's own value."""

    def test_equals_reference(self, ds4_file: Path, reference: Any) -> None:
        model = _meta_model(ds4_file)
        state = reference.state_dict()
        seen = set()
        with moestream.open_sync(ds4_file, budget=4, backend="host") as session:
            assert session.model.hash_routed == 3
            for name, target, tensor in ds4_dense_tensors(model, session):
                assert torch.equal(tensor.to(state[target].dtype), state[target]), name
                seen.add(target)
        experts = {n for n in state if ".experts." in n}
        assert seen == set(state) - experts

    def test_reference_runs(self, reference: Any) -> None:
        """The reference computes every layer kind: finite logits that differ by token."""
        out = logits(reference)
        assert out.shape == (len(PROMPTS), len(PROMPTS[0]), SHAPE.vocab)
        assert torch.isfinite(out).all() and not torch.equal(out[0], out[1])


ARITHMETICS = pytest.mark.parametrize(("compute", "implementation", "dtype"), [
    ("grouped", "grouped_mm", torch.bfloat16),
    ("eager", "eager", None),
    ("eager", "eager", torch.bfloat16),
])
"""Both arithmetics; grouped where torch's grouped product is exact on the CPU
(bfloat16), as the GGUF tests compare it."""


def _runs_or_skip(whole: Any, device: str) -> Any:
    """``whole``, skipped where transformers' own DeepSeek-V4 fails to run on ``device``
    (5.17's mixes float32 and bfloat16 on a GPU): there is nothing to match."""
    try:
        with torch.no_grad():
            whole(torch.tensor([[1, 2]], device=device))
    except RuntimeError as exc:
        pytest.skip(f"transformers {transformers.__version__}'s own deepseek_v4 fails on "
                    f"{device}: {str(exc).splitlines()[0]}")
    return whole


class TestTokens:
    """moestream's model of the ds4 file gives the reference's logits (``torch.equal``)
    and greedy tokens, its experts streamed quantized at a budget of four (of 16) and
    dequantized per use."""

    @ARITHMETICS
    def test_identical(self, ds4_file: Path, checkpoint: Path, compute: str,
                       implementation: str, dtype: Any) -> None:
        whole = _runs_or_skip(_reference(checkpoint, implementation, dtype), "cpu")
        assert_streams_like(whole, ds4_file, compute, dtype=dtype)

    def test_split_file(self, checkpoint: Path, tmp_path: Path) -> None:
        """The same model written split (make_model --shard-size, as gguf-split writes
        one; metadata in the first shard only), opened by its second shard's name."""
        first = write_model(SPEC, tmp_path / "ds4.gguf", shard_bytes=1)  # a tensor a shard
        shards = sorted(tmp_path.glob("ds4-*-of-*.gguf"))
        assert first == shards[0] and len(shards) > 3
        whole = _runs_or_skip(_reference(checkpoint), "cpu")
        assert_streams_like(whole, shards[1], "eager")

    @pytest.mark.gpu
    @pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")
    @ARITHMETICS
    def test_identical_on_cuda(self, ds4_file: Path, checkpoint: Path, compute: str,
                               implementation: str, dtype: Any) -> None:
        """On a GPU (IQ2_XXS and Q2_K blocks dequantized on the device): the same
        equalities against the reference moved to the GPU."""
        whole = _runs_or_skip(_reference(checkpoint, implementation, dtype).to("cuda"), "cuda")
        assert_streams_like(whole, ds4_file, compute, device="cuda", dtype=dtype)
