"""FP8 block-quantized checkpoints through moestream.transformers: experts streamed as FP8
bytes and dequantized per use, logits equal to transformers' own dequantization.

The FP8 checkpoints are written by ``tests/quantized.py`` (the formats' quantization rule,
not moestream's code) from ``save_pretrained`` checkpoints; the reference is transformers'
``from_pretrained(..., quantization_config=FineGrainedFP8Config(dequantize=True))``, which
folds the scales into the model's dtype at load. Where transformers refuses a grid (blocks
that do not divide a matrix), the reference is a BF16 checkpoint of the dequantized
weights, written by the same rule block by block.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.integrations.moe")
pytest.importorskip("accelerate")  # transformers' FP8 loading asks for it
from safetensors.torch import load_file, save_file  # noqa: E402

import moestream  # noqa: E402
from moestream import transformers as mt  # noqa: E402
from moestream.pipeline.foundation.quantization import FP8_CARRIER  # noqa: E402
from tests.quantized import (  # noqa: E402
    assert_streams_like,
    dequantized,
    fp8_checkpoint,
    logits,
)

FP8 = transformers.FineGrainedFP8Config(dequantize=True)
"""transformers' own dequantization at load: the reference."""
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

ATTENTION = dict(num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
                 max_position_embeddings=128)
ARCHS: dict[str, dict[str, Any]] = {
    "qwen3_moe": dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                      num_experts=8, num_experts_per_tok=2, num_hidden_layers=2, head_dim=16,
                      **ATTENTION),
    "deepseek_v3": dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                        first_k_dense_replace=1, n_group=2, topk_group=1,
                        num_hidden_layers=3, q_lora_rank=None, kv_lora_rank=16,
                        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                        **{**ATTENTION, "num_key_value_heads": 4}),
}


def _float(kind: str, where: Path) -> Path:
    config = transformers.AutoConfig.for_model(kind, **ARCHS[kind])
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(
        where)
    return where


@pytest.fixture(scope="module")
def fp8(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fp8")
    made = {kind: fp8_checkpoint(_float(kind, root / f"{kind}-bf16"), root / kind)
            for kind in ARCHS}
    made["qwen3_moe-bf16-scales"] = fp8_checkpoint(root / "qwen3_moe-bf16", root / "bf16s",
                                                   scale_dtype=torch.bfloat16)
    return made


class TestFp8Experts:
    """Experts streamed FP8, dequantized per use."""

    @pytest.mark.parametrize("compute, implementation", [("grouped", "grouped_mm"),
                                                         ("eager", "eager")])
    @pytest.mark.parametrize("kind", ["qwen3_moe", "deepseek_v3", "qwen3_moe-bf16-scales"])
    def test_logits_equal_transformers_dequantized(self, fp8: dict[str, Path], kind: str,
                                                   compute: str, implementation: str) -> None:
        """At a budget of a few experts: misses, evictions and grouped fetches happen."""
        assert_streams_like(dequantized(fp8[kind], FP8, implementation), fp8[kind],
                            compute)

    def test_batched_arithmetic(self, fp8: dict[str, Path]) -> None:
        """``batched`` (generate's decode on a GPU): each pair's expert dequantized into
        its own row, an expert two pairs route to twice; logits torch.equal to
        transformers' dequantized model in batched_mm."""
        whole = dequantized(fp8["qwen3_moe"], FP8, "batched_mm")
        model = mt.from_pretrained(fp8["qwen3_moe"], device="cpu")
        try:
            model.moestream.batched = True
            assert torch.equal(logits(whole), logits(model))
        finally:
            model.moestream.close()

    @pytest.mark.parametrize("mode", ["direct", "resident"])
    def test_each_io_mode(self, fp8: dict[str, Path], mode: str) -> None:
        """The same equality whether the FP8 bytes and their scales come by O_DIRECT
        reads or from the page cache."""
        path = fp8["deepseek_v3"]
        assert_streams_like(dequantized(path, FP8, "eager"), path, "eager", mode=mode)

    def test_streamed_as_fp8_bytes(self, fp8: dict[str, Path]) -> None:
        """A miss reads and the budget counts one byte a weight; the scales are named."""
        with moestream.open_sync(fp8["qwen3_moe"], backend="host") as session:
            layer = session.model.layers[0]
            cfg = ARCHS["qwen3_moe"]
            assert layer.gate_up_type == FP8_CARRIER and layer.quant is not None
            assert layer.expert_bytes == 3 * cfg["hidden_size"] * cfg["moe_intermediate_size"]
            assert layer.quant.block == (16, 16)
            gate_scale = layer.quant.scales[3][0]
            assert gate_scale == "model.layers.0.mlp.experts.3.gate_proj.weight_scale_inv"
            assert session.model.tensors[gate_scale].shape == (2, 4)

    def test_partial_edge_blocks(self, fp8: dict[str, Path], tmp_path: Path) -> None:
        """Blocks of 24 divide none of the matrices (transformers refuses that grid): equal
        to a BF16 checkpoint of the weights dequantized block by block."""
        source = fp8["qwen3_moe"].parent / "qwen3_moe-bf16"
        path = fp8_checkpoint(source, tmp_path / "fp8-24", block=(24, 24))
        dequantized = _dequantized_copy(path, tmp_path / "bf16", (24, 24))
        whole = transformers.AutoModelForCausalLM.from_pretrained(
            dequantized, experts_implementation="eager")
        model = mt.from_pretrained(path, device="cpu", compute="eager", budget="4")
        try:
            assert torch.equal(logits(whole), logits(model))
        finally:
            model.moestream.close()


class TestRefused:
    """Quantized forms moestream does not read: one line naming them."""

    def test_other_quant_method(self, fp8: dict[str, Path], tmp_path: Path) -> None:
        path = Path(shutil.copytree(fp8["qwen3_moe"], tmp_path / "m"))
        config = json.loads((path / "config.json").read_text())
        config["quantization_config"] = {"quant_method": "awq", "bits": 4}
        (path / "config.json").write_text(json.dumps(config))
        with pytest.raises(moestream.ExpertLayoutError, match="quant_method 'awq'"):
            moestream.open_sync(path, backend="host")

    def test_missing_scale(self, fp8: dict[str, Path], tmp_path: Path) -> None:
        path = tmp_path / "m"
        shutil.copytree(fp8["qwen3_moe"], path)
        tensors = load_file(path / "model.safetensors")
        del tensors["model.layers.1.mlp.experts.5.down_proj.weight_scale_inv"]
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(moestream.ExpertLayoutError,
                           match=r"experts\.5\.down_proj\.weight_scale_inv"):
            moestream.open_sync(path, backend="host")

    def test_fp8_without_quantization_config(self, fp8: dict[str, Path],
                                             tmp_path: Path) -> None:
        path = Path(shutil.copytree(fp8["qwen3_moe"], tmp_path / "m"))
        config = json.loads((path / "config.json").read_text())
        del config["quantization_config"]
        (path / "config.json").write_text(json.dumps(config))
        with pytest.raises(moestream.ExpertLayoutError, match="F8_E4M3"):
            moestream.open_sync(path, backend="host")


def _dequantized_copy(path: Path, target: Path, block: tuple[int, int]) -> Path:
    """``path``'s FP8 checkpoint with every weight dequantized block by block (the rule
    written out, not moestream's function), saved as BF16 without a quantization_config."""
    shutil.copytree(path, target)
    tensors = load_file(target / "model.safetensors")
    bm, bn = block
    out = {}
    for name, tensor in tensors.items():
        if name.endswith("weight_scale_inv"):
            continue
        scale = tensors.get(name + "_scale_inv")
        if scale is None:
            out[name] = tensor
            continue
        w = tensor.to(torch.float32)
        for i in range(scale.shape[0]):
            for j in range(scale.shape[1]):
                w[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn] *= scale[i, j].to(torch.float32)
        out[name] = w.to(torch.bfloat16)
    save_file(out, target / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((target / "config.json").read_text())
    del config["quantization_config"]
    (target / "config.json").write_text(json.dumps(config))
    return target
