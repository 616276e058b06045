"""Tests of the ds4 presets' layout: the tensors and keys ds4's loader requires, as ds4.c
states them (antirez/ds4 at 8d576642c39b9a2d782a80159ba84ef5a81c0b81)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType
from gguf import GGUFReader, GGUFValueType

from moestream.pipeline.foundation.errors import UsageError
from moestream.pipeline.foundation.table import open_table
from moestream.pipeline.makers.ds4layout import compress_ratio, ds4_tensors
from moestream.pipeline.makers.modelgen import write_model
from moestream.pipeline.makers.modelspec import (
    DS4_FLASH,
    DS4_SMALL,
    PRESETS,
    ModelSpec,
    spec_for,
)

# ds4.c's DS4_N_* constants
EMBD, VOCAB, HEAD, HEAD_DIM, LORA_Q, LORA_O, OUT_GROUP = 4096, 129280, 64, 512, 1024, 1024, 8
EXPERT, USED, FF_EXP, INDEXER_HEAD, INDEXER_HEAD_DIM, HC = 256, 6, 2048, 64, 128, 4


def _ds4_layout(layers: int, hash_layers: int) -> dict[str, tuple[QType | None, tuple[int, ...]]]:
    """ds4.c's weights_validate_layout, transcribed: name -> (type, ne); None where ds4
    takes any quant type of the routed experts."""
    hc_dim, mix = EMBD * HC, 2 * HC + HC * HC
    out_low = OUT_GROUP * LORA_O
    want: dict[str, tuple[QType | None, tuple[int, ...]]] = {
        "token_embd.weight": (QType.F16, (EMBD, VOCAB)),
        "output_hc_base.weight": (QType.F32, (HC,)),
        "output_hc_fn.weight": (QType.F16, (hc_dim, HC)),
        "output_hc_scale.weight": (QType.F32, (1,)),
        "output_norm.weight": (QType.F32, (EMBD,)),
        "output.weight": (QType.Q8_0, (EMBD, VOCAB)),
    }
    for il in range(layers):
        p = f"blk.{il}."
        ratio = 0 if il < 2 else (4 if il % 2 == 0 else 128)
        layer = {
            "hc_attn_fn": (QType.F16, (hc_dim, mix)), "hc_attn_scale": (QType.F32, (3,)),
            "hc_attn_base": (QType.F32, (mix,)), "attn_norm": (QType.F32, (EMBD,)),
            "attn_q_a": (QType.Q8_0, (EMBD, LORA_Q)), "attn_q_a_norm": (QType.F32, (LORA_Q,)),
            "attn_q_b": (QType.Q8_0, (LORA_Q, HEAD * HEAD_DIM)),
            "attn_kv": (QType.Q8_0, (EMBD, HEAD_DIM)),
            "attn_kv_a_norm": (QType.F32, (HEAD_DIM,)), "attn_sinks": (QType.F32, (HEAD,)),
            "attn_output_a": (QType.Q8_0, (HEAD_DIM * (HEAD // OUT_GROUP), out_low)),
            "attn_output_b": (QType.Q8_0, (out_low, EMBD)),
            "hc_ffn_fn": (QType.F16, (hc_dim, mix)), "hc_ffn_scale": (QType.F32, (3,)),
            "hc_ffn_base": (QType.F32, (mix,)), "ffn_norm": (QType.F32, (EMBD,)),
            "ffn_gate_inp": (QType.F16, (EMBD, EXPERT)),
            "ffn_gate_exps": (None, (EMBD, FF_EXP, EXPERT)),
            "ffn_up_exps": (None, (EMBD, FF_EXP, EXPERT)),
            "ffn_down_exps": (None, (FF_EXP, EMBD, EXPERT)),
            "ffn_gate_shexp": (QType.Q8_0, (EMBD, FF_EXP)),
            "ffn_up_shexp": (QType.Q8_0, (EMBD, FF_EXP)),
            "ffn_down_shexp": (QType.Q8_0, (FF_EXP, EMBD)),
        }
        if ratio:
            width = (2 if ratio == 4 else 1) * HEAD_DIM
            layer |= {"attn_compressor_ape": (QType.F16, (width, ratio)),
                      "attn_compressor_kv": (QType.F16, (EMBD, width)),
                      "attn_compressor_gate": (QType.F16, (EMBD, width)),
                      "attn_compressor_norm": (QType.F32, (HEAD_DIM,))}
        if ratio == 4:
            width = 2 * INDEXER_HEAD_DIM
            layer |= {"indexer.attn_q_b": (QType.F16, (LORA_Q, INDEXER_HEAD * INDEXER_HEAD_DIM)),
                      "indexer.proj": (QType.F16, (EMBD, INDEXER_HEAD)),
                      "indexer_compressor_ape": (QType.F16, (width, ratio)),
                      "indexer_compressor_kv": (QType.F16, (EMBD, width)),
                      "indexer_compressor_gate": (QType.F16, (EMBD, width)),
                      "indexer_compressor_norm": (QType.F32, (INDEXER_HEAD_DIM,))}
        if il < hash_layers:
            layer["ffn_gate_tid2eid"] = (QType.I32, (USED, VOCAB))
        want |= {p + name + ".weight": kind for name, kind in layer.items()}
        if il >= hash_layers:  # optional in ds4; DeepSeek's checkpoint has it on top-k layers
            want[p + "exp_probs_b.bias"] = (QType.F32, (EXPERT,))
    return want


# ds4.c config_validate_model: every key it requires, with the type it reads it as
_U32 = ("block_count", "embedding_length", "vocab_size", "attention.head_count",
        "attention.head_count_kv", "attention.key_length", "attention.value_length",
        "rope.dimension_count", "attention.q_lora_rank", "attention.output_lora_rank",
        "attention.output_group_count", "expert_count", "expert_used_count",
        "expert_feed_forward_length", "expert_shared_count", "hash_layer_count",
        "attention.sliding_window", "attention.indexer.head_count",
        "attention.indexer.key_length", "attention.indexer.top_k", "hyper_connection.count",
        "hyper_connection.sinkhorn_iterations", "rope.scaling.original_context_length")
_F32 = ("rope.freq_base", "rope.scaling.factor", "rope.scaling.yarn_beta_fast",
        "rope.scaling.yarn_beta_slow", "attention.compress_rope_freq_base",
        "expert_weights_scale", "attention.layer_norm_rms_epsilon", "hyper_connection.epsilon")


class TestFullShape:
    """The unscaled presets are ds4's DeepSeek V4 Flash, tensor for tensor."""

    @pytest.mark.parametrize("preset", ["ds4-flash-q2", "ds4-flash-q4", "ds4-flash-f16"])
    def test_every_tensor_as_ds4_validates_it(self, preset: str) -> None:
        spec = PRESETS[preset]
        got = {t.name: (t.qtype, tuple(reversed(t.shape))) for t in ds4_tensors(spec)}
        want = _ds4_layout(spec.n_layers, spec.hash_routed)
        assert set(got) == set(want)
        for name, (kind, ne) in want.items():
            assert got[name][1] == ne, name
            if kind is None:  # a routed-experts tensor: the preset's quantization
                kind = spec.down_type if "down_exps" in name else spec.gate_up_type
            assert got[name][0] == kind, name

    def test_q2_file_size(self) -> None:
        # ds4's download script: the q2 file is "about 81 GB on disk"; DESIGN: ~8.2 GiB
        # of it non-routed. Both follow from the layout; checked as sums of tensor bytes.
        from gguf import GGML_QUANT_SIZES

        spec = PRESETS["ds4-flash-q2"]
        sizes = {t.name: int(np.prod(t.shape)) // GGML_QUANT_SIZES[t.qtype][0]
                 * GGML_QUANT_SIZES[t.qtype][1] for t in ds4_tensors(spec)}
        routed = sum(n for name, n in sizes.items() if "_exps." in name)
        assert routed == spec.n_layers * spec.n_experts * spec.expert_bytes
        assert 8.1 < (sum(sizes.values()) - routed) / 2**30 < 8.3
        assert 86 < sum(sizes.values()) / 1e9 < 88  # ~81 GiB

    def test_compress_ratios(self) -> None:
        assert [compress_ratio(i) for i in range(6)] == [0, 0, 4, 128, 4, 128]


class TestWrittenKeys:
    """A written file carries every key ds4 requires, in a type it reads it as."""

    def test_keys_and_types(self, tmp_path: Path) -> None:
        spec = spec_for("ds4-flash-q2", layers=4, experts=2)
        fields = GGUFReader(write_model(spec, tmp_path / "m.gguf")).fields
        assert fields["general.architecture"].contents() == "deepseek4"
        for key in _U32:
            assert fields["deepseek4." + key].types == [GGUFValueType.UINT32], key
        for key in _F32:
            assert fields["deepseek4." + key].types == [GGUFValueType.FLOAT32], key
        assert fields["deepseek4.expert_weights_norm"].contents() is True
        ratios = fields["deepseek4.attention.compress_ratios"]
        assert ratios.types == [GGUFValueType.ARRAY, GGUFValueType.UINT32]
        assert ratios.contents() == [0, 0, 4, 128]
        clamp = fields["deepseek4.swiglu_clamp_exp"]
        assert clamp.types == [GGUFValueType.ARRAY, GGUFValueType.FLOAT32]
        assert clamp.contents() == [10.0] * 4
        assert fields["deepseek4.hash_layer_count"].contents() == spec.hash_routed == 3
        assert fields["deepseek4.vocab_size"].contents() == DS4_SMALL.vocab

    def test_hash_tables_and_table(self, tmp_path: Path) -> None:
        spec = spec_for("ds4-flash-q2", layers=4, experts=8)
        path = write_model(spec, tmp_path / "m.gguf", record_digests=False)
        tensors = {t.name: t for t in GGUFReader(path).tensors}
        for layer in range(spec.hash_routed):
            ids = np.asarray(tensors[f"blk.{layer}.ffn_gate_tid2eid.weight"].data)
            assert ids.shape == (spec.vocab, spec.top_k) and ids.dtype == np.int32
            assert ids.min() >= 0 and ids.max() < spec.n_experts
            assert all(len(set(row)) == spec.top_k for row in ids.tolist())
        # without moestream's keys, the table still knows the hash-routed layers (ds4's key)
        table = open_table(path)
        assert table.hash_routed == 3 and table.digests is None
        assert all(layer.router is not None for layer in table.layers.values())


class TestScaling:
    """Scaled down, a ds4 preset's non-routed tensors shrink too unless told otherwise."""

    def test_shapes(self) -> None:
        assert PRESETS["ds4-flash-q2"].ds4 == DS4_FLASH
        assert spec_for("ds4-flash-q2").ds4 == DS4_FLASH
        small = spec_for("ds4-flash-q2", layers=4)
        assert small.ds4 == DS4_SMALL and small.vocab == DS4_SMALL.vocab
        full = spec_for("ds4-flash-q2", layers=4, ds4_shape="flash")
        assert full.ds4 == DS4_FLASH and full.vocab == VOCAB
        assert spec_for("ds4-flash-q2", ds4_shape="small").ds4 == DS4_SMALL

    def test_refused(self) -> None:
        with pytest.raises(UsageError, match="ds4 presets"):
            spec_for("tiny", ds4_shape="small")
        with pytest.raises(UsageError, match="unknown ds4 shape"):
            spec_for("ds4-flash-q2", ds4_shape="huge")
        with pytest.raises(UsageError, match="arch"):
            ModelSpec("x", 4, 0, 3, 4, 2, 256, 256, QType.Q2_K, QType.Q2_K, ds4=DS4_SMALL)
