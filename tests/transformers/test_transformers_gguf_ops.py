"""GGUF architectures transformers loads through its conversion ops (Qwen3.5-MoE's
``qwen35moe``): the dense weights by the same ops, the routed experts streamed quantized.

The file is written here as llama.cpp's converter writes a Qwen3.5-MoE: gguf's own name
map, its metadata keys, norms stored as ``w + 1``, ``ssm_a`` as ``-exp(A_log)``, the
convolution squeezed, the shared expert's gate a vector, from a tiny ``qwen3_5_moe_text``
model's random weights (the value heads are not re-tiled: that only permutes random rows);
dense weights Q8_0 where their rows allow, 1-D and state-space tensors F32, the routed
experts in a different type per layer and per projection. The reference is transformers'
own ``from_pretrained(dir, gguf_file=...)`` of the same file, which dequantizes it at load
by its own routines (in the model's dtype: float32 unless asked).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf_utils = pytest.importorskip("transformers.integrations.gguf.utils")
if not getattr(gguf_utils, "is_gguf_arch_supported", lambda _: False)("qwen35moe"):
    pytest.skip(f"transformers {transformers.__version__} loads no qwen35moe GGUF",
                allow_module_level=True)
import gguf  # noqa: E402
import numpy as np  # noqa: E402
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf import GGUFWriter  # noqa: E402

from moestream import transformers as mt  # noqa: E402
from moestream.pipeline.foundation.errors import ModelFileError  # noqa: E402
from tests.quantized import assert_streams_like  # noqa: E402
from tests.transformers.test_transformers_gguf import (  # noqa: E402
    ARITHMETICS,
    VOCAB,
    _stored,
    _tokenizer_metadata,
)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

ARCH = "qwen35moe"
TYPES = {
    # per layer, (gate and up, down): every block type transformers' routines read
    "k_quants": [(Q.Q4_K, Q.Q6_K), (Q.IQ2_XXS, Q.Q2_K), (Q.Q3_K, Q.IQ4_XS), (Q.Q5_K, Q.IQ3_S)],
    "i_quants": [(Q.IQ2_XS, Q.IQ3_XXS), (Q.IQ2_S, Q.IQ1_S), (Q.IQ4_NL, Q.IQ1_M),
                 (Q.Q4_1, Q.BF16)],
}
_NORMS = ("attn_norm.", "post_attention_norm.", "output_norm.", "attn_q_norm.",
          "attn_k_norm.")


def _config() -> Any:
    """Qwen3.5-MoE at a tiny width: three linear-attention layers and one full one, K-quant
    rows (256 values) for the experts, mrope sections of three axes."""
    return transformers.AutoConfig.for_model(
        "qwen3_5_moe_text", vocab_size=VOCAB, hidden_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=256, shared_expert_intermediate_size=32,
        max_position_embeddings=128,
        rope_parameters={"rope_theta": 10000.0, "partial_rotary_factor": 0.375,
                         "rope_type": "default", "mrope_section": [2, 2, 2],
                         "mrope_interleaved": True})


def _metadata(writer: GGUFWriter, config: Any, mtp: bool) -> None:
    """The hyperparameters llama.cpp's converter writes for Qwen3.5-MoE (its block count
    counts a multi-token-prediction block)."""
    key = lambda name: f"{ARCH}.{name}"  # noqa: E731
    writer.add_name("tiny")
    writer.add_block_count(config.num_hidden_layers + mtp)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(12)  # 0.375 of a 32-wide head
    writer.add_array(key("rope.dimension_sections"), [2, 2, 2, 0])
    writer.add_uint32(key("full_attention_interval"), 4)
    writer.add_uint32(key("ssm.conv_kernel"), config.linear_conv_kernel_dim)
    writer.add_uint32(key("ssm.state_size"), config.linear_key_head_dim)
    writer.add_uint32(key("ssm.group_count"), config.linear_num_key_heads)
    writer.add_uint32(key("ssm.time_step_rank"), config.linear_num_value_heads)
    writer.add_uint32(key("ssm.inner_size"),
                      config.linear_num_value_heads * config.linear_value_head_dim)
    writer.add_expert_count(config.num_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    _tokenizer_metadata(writer)


def _add(writer: GGUFWriter, name: str, value: np.ndarray, kind: Q, seed: int = 0) -> None:
    stored = _stored(value, kind, seed)
    if kind in (Q.F32, Q.F16):
        writer.add_tensor(name, stored)
    else:
        writer.add_tensor(name, stored, raw_shape=stored.shape, raw_dtype=kind)


def write_qwen35moe(path: Path, types: list[tuple[Q, Q]], dense: Q = Q.Q8_0,
                    mtp: bool = False, split_max_tensors: int = 0) -> Path:
    """A tiny Qwen3.5-MoE GGUF as llama.cpp writes one (the module docstring); with
    ``mtp``, a multi-token-prediction block after the decoder's layers, as llama.cpp writes
    it (``blk.{layers}``, with routed experts of its own); with ``split_max_tensors``,
    split into shards of that many tensors by gguf's writer (the first shard's path is
    returned)."""
    config = _config()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    names = gguf.get_tensor_name_map(
        next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == ARCH), config.num_hidden_layers)
    writer = GGUFWriter(path, ARCH, split_max_tensors=split_max_tensors)
    _metadata(writer, config, mtp)
    state = {name: value.detach().numpy() for name, value in model.state_dict().items()}
    for name, value in state.items():
        if ".mlp.experts." in name:
            continue
        if name.endswith(".linear_attn.dt_bias"):  # llama.cpp's name for it
            name = name.replace(".dt_bias", ".dt_proj.bias")
        base, _, suffix = name.rpartition(".")
        target = f"{names.get_name(base)}.{suffix}" if suffix in ("weight", "bias") \
            else names.get_name(name)
        if ".ssm_conv1d." in target:
            value = value.reshape(value.shape[0], value.shape[-1])
        if ".ffn_gate_inp_shexp." in target:
            value = value.reshape(-1)
        if target.endswith(".ssm_a"):
            value = -np.exp(value)
        if any(norm in target for norm in _NORMS):
            value = value + 1
        flat = value.ndim == 1 or ".ssm_" in target or value.shape[-1] % 32
        _add(writer, target, value, Q.F32 if flat else dense)
    for layer, (gate_up_type, down_type) in enumerate(types):
        prefix = f"model.layers.{layer}.mlp.experts."
        gate_up, down = state[prefix + "gate_up_proj"], state[prefix + "down_proj"]
        ffn = gate_up.shape[1] // 2
        _add(writer, f"blk.{layer}.ffn_gate_exps.weight", gate_up[:, :ffn], gate_up_type,
             3 * layer)
        _add(writer, f"blk.{layer}.ffn_up_exps.weight", gate_up[:, ffn:], gate_up_type,
             3 * layer + 1)
        _add(writer, f"blk.{layer}.ffn_down_exps.weight", down, down_type, 3 * layer + 2)
    if mtp:
        _mtp_block(writer, state, len(types))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return writer.format_shard_names(path)[0]


def _mtp_block(writer: GGUFWriter, state: dict[str, np.ndarray], block: int) -> None:
    """llama.cpp's multi-token-prediction block ``blk.{block}``: a layer's norms, router
    and routed experts (the last layer's values), and its own projection."""
    writer.add_uint32(f"{ARCH}.nextn_predict_layers", 1)
    last = f"model.layers.{block - 1}."
    for leaf, name in (("attn_norm.weight", "input_layernorm.weight"),
                       ("ffn_gate_inp.weight", "mlp.gate.weight")):
        value = state[last + name]
        _add(writer, f"blk.{block}.{leaf}", value, Q.F32)
    gate_up, down = state[last + "mlp.experts.gate_up_proj"], state[last + "mlp.experts.down_proj"]
    ffn = gate_up.shape[1] // 2
    for leaf, value in (("gate", gate_up[:, :ffn]), ("up", gate_up[:, ffn:]), ("down", down)):
        _add(writer, f"blk.{block}.ffn_{leaf}_exps.weight", value, Q.Q8_0)
    hidden = gate_up.shape[-1]
    _add(writer, f"blk.{block}.nextn.eh_proj.weight",
         np.zeros((hidden, 2 * hidden), dtype=np.float32), Q.Q8_0)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {name: write_qwen35moe(tmp_path_factory.mktemp(name) / "model.gguf", types)
            for name, types in TYPES.items()}


def _transformers(path: Path, implementation: str, dtype: Any = None) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, experts_implementation=implementation, dtype=dtype)


class TestExact:
    """Logits ``torch.equal`` and greedy tokens identical to transformers' own loading of
    the file, at a budget of four experts (misses, evictions)."""

    @ARITHMETICS
    @pytest.mark.parametrize("kind", sorted(TYPES))
    def test_equals_transformers(self, files: dict[str, Path], kind: str, compute: str,
                                 implementation: str, dtype: Any) -> None:
        path = files[kind]
        assert_streams_like(_transformers(path, implementation, dtype), path, compute,
                            dtype=dtype)

    @pytest.mark.parametrize("mode", ["direct", "resident"])
    def test_each_io_mode(self, files: dict[str, Path], mode: str) -> None:
        """The same equality whether the blocks come by O_DIRECT reads (aligned covers of
        GGUFWriter's offsets) or from the page cache."""
        path = files["i_quants"]
        assert_streams_like(_transformers(path, "eager"), path, "eager", mode=mode)

    @pytest.mark.parametrize("kind", sorted(TYPES))
    def test_each_expert_matrix_is_transformers(self, files: dict[str, Path],
                                                kind: str) -> None:
        """Every routed expert matrix of the file, dequantized by moestream's routine into
        float32 (the one its kernels match), equals transformers' conversion-ops routine's,
        and in bf16 the routine moestream then takes is transformers' own."""
        from transformers.integrations.gguf.dequant import dequantize as theirs

        from moestream.transformers._gguf_dequant import dequantize as ours
        from moestream.transformers._gguf_experts import GgufExperts

        reader = gguf.GGUFReader(files[kind])
        routed = [t for t in reader.tensors if "_exps." in t.name]
        assert len(routed) == 3 * len(TYPES[kind])
        for tensor in routed:
            blocks = torch.from_numpy(np.array(tensor.data)).view(torch.uint8)
            blocks = blocks.reshape(*blocks.shape[:-1], -1)
            kind_id = int(tensor.tensor_type)
            if tensor.tensor_type in (Q.BF16, Q.F16, Q.F32):
                continue  # cast once on both paths, no dequantization
            want = theirs(blocks.reshape(-1), kind_id, torch.float32).reshape(
                *blocks.shape[:-1], -1)
            assert torch.equal(ours(blocks, kind_id, torch.float32), want), tensor.name
            experts = GgufExperts(kind_id, kind_id, in_dtype=True)
            assert not experts.own(torch.bfloat16) and experts.own(torch.float32)

    def test_split_file(self, files: dict[str, Path], tmp_path: Path) -> None:
        """The same model split into shards of seven tensors (large Qwen3.5 files ship
        split), opened by a later shard's name: transformers' own loading of the whole
        file (it reads no split file)."""
        split = write_qwen35moe(tmp_path / "model.gguf", TYPES["k_quants"],
                                split_max_tensors=7)
        shards = sorted(split.parent.glob("model-*-of-*.gguf"))
        assert split == shards[0] and len(shards) > 2
        assert_streams_like(_transformers(files["k_quants"], "eager"), shards[1], "eager")

    def test_dense_weights_are_transformers(self, files: dict[str, Path]) -> None:
        """Every dense tensor equals transformers' own (norms un-offset, ``A_log``, the
        value heads regrouped, the convolution unsqueezed), the multi-token-prediction
        block aside; the model is transformers' class."""
        path = files["k_quants"]
        whole = _transformers(path, "eager", torch.bfloat16)
        with mt.from_pretrained(path, device="cpu", dtype=torch.bfloat16) as model:
            assert type(model).__name__ == type(whole).__name__ == "Qwen3_5MoeForCausalLM"
            ours = dict(model.named_parameters())
            theirs = {n: p for n, p in whole.named_parameters() if ".mlp.experts." not in n}
            assert theirs and set(theirs) <= set(ours)
            for name, tensor in theirs.items():
                assert ours[name].dtype == tensor.dtype and torch.equal(ours[name], tensor), name


def test_types_transformers_lacks(tmp_path: Path) -> None:
    """Experts in MXFP4 and Q5_0, which transformers' routines lack (it loads no such file):
    served with gguf-py's values, as the legacy path's; in bf16 the same greedy tokens at a
    budget of four experts as holding every one, the misses dequantized the same way."""
    path = write_qwen35moe(tmp_path / "model.gguf",
                           [(Q.Q4_K, Q.MXFP4), (Q.Q5_0, Q.Q6_K), (Q.Q8_0, Q.Q8_0),
                            (Q.IQ4_XS, Q.Q5_0)])
    with pytest.raises(ValueError):
        _transformers(path, "eager")
    ids = torch.tensor([[3, 17, 42, 5, 9, 11]])
    made = []
    for budget in ("4", None):
        with mt.from_pretrained(path, device="cpu", dtype=torch.bfloat16,
                                budget=budget) as model:
            made.append(model.generate(ids, max_new_tokens=6, do_sample=False))
    assert torch.equal(made[0], made[1])


class TestRefused:
    def test_multi_token_prediction_block(self, tmp_path: Path) -> None:
        """llama.cpp's multi-token-prediction block (routed experts of its own, in a layer
        past the decoder's; gguf's own name map for qwen35moe has none of its tensors, so
        its converter does not write it today): refused in one line naming the layers."""
        path = write_qwen35moe(tmp_path / "model.gguf", TYPES["k_quants"], mtp=True)
        with pytest.raises(ModelFileError) as caught:
            mt.from_pretrained(path, device="cpu")
        message = str(caught.value)
        assert "\n" not in message and "[0, 1, 2, 3, 4]" in message

    def test_dense_type_transformers_does_not_read(self, tmp_path: Path) -> None:
        """A dense tensor in Q5_0, which transformers' conversion routines lack (it refuses
        the whole file): one line naming the tensor and the type."""
        path = write_qwen35moe(tmp_path / "model.gguf", TYPES["k_quants"], dense=Q.Q5_0)
        with pytest.raises(ModelFileError) as caught:
            mt.from_pretrained(path, device="cpu")
        message = str(caught.value)
        assert "\n" not in message and "Q5_0" in message and "conversion" in message
