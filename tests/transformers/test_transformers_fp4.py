"""DeepSeek-V4-Flash's FP4 experts through moestream.transformers: experts streamed as their
packed E2M1 bytes and dequantized per use, dense FP8 weights (E8M0 ``.scale``) folded in at
load, logits equal to transformers' own dequantization.

The checkpoints are written by ``tests/quantized.py`` (DeepSeek's ue8m0 rule, not
moestream's code) from a DeepSeek-V4 ``save_pretrained`` checkpoint, laid out as DeepSeek
ships V4-Flash; the reference is transformers' ``from_pretrained(..., quantization_config=
FineGrainedFP8Config(dequantize=True))``, which runs on the CPU: it renames ``.scale`` to
``weight_scale_inv`` and unpacks the FP4 experts (``Fp8Dequantize``) at load.
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
if "deepseek_v4" not in transformers.CONFIG_MAPPING:
    pytest.skip(f"transformers {transformers.__version__} has no deepseek_v4",
                allow_module_level=True)
from safetensors.torch import load_file, save_file  # noqa: E402

import moestream  # noqa: E402
from moestream import transformers as mt  # noqa: E402
from moestream.pipeline.foundation.quantization import CARRIER  # noqa: E402
from tests.quantized import (  # noqa: E402
    PROMPTS,
    assert_streams_like,
    dequantized,
    fp4_checkpoint,
    logits,
    quantize_fp4,
)
from tests.transformers.test_transformers import ARCHS  # noqa: E402

FP8 = transformers.FineGrainedFP8Config(dequantize=True)
"""transformers' own dequantization at load: the reference."""
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

EXPERT = "model.layers.{}.ffn.experts.{}.{}"


@pytest.fixture(scope="module")
def fp4(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """V4 checkpoints: FP4 experts with dense FP8 in 32 x 32 blocks (several a matrix) and
    in DeepSeek's 128 x 128; FP8 experts with E8M0 ``.scale`` (``expert_dtype: fp8``)."""
    root = tmp_path_factory.mktemp("fp4")
    config = transformers.AutoConfig.for_model("deepseek_v4", **ARCHS["deepseek_v4"])
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(
        root / "bf16")
    return {"fp4": fp4_checkpoint(root / "bf16", root / "fp4", block=(32, 32)),
            "fp4-128": fp4_checkpoint(root / "bf16", root / "fp4-128"),
            "fp8": fp4_checkpoint(root / "bf16", root / "fp8", block=(32, 32), experts="fp8")}


class TestFp4Experts:
    """Experts streamed as FP4 bytes, dequantized per use."""

    @pytest.mark.parametrize("compute, implementation", [("grouped", "grouped_mm"),
                                                         ("eager", "eager")])
    @pytest.mark.parametrize("kind", ["fp4", "fp4-128"])
    def test_logits_equal_transformers_dequantized(self, fp4: dict[str, Path], kind: str,
                                                   compute: str, implementation: str) -> None:
        """At a budget of a few experts: misses, evictions and grouped fetches happen."""
        assert_streams_like(dequantized(fp4[kind], FP8, implementation), fp4[kind],
                            compute)

    def test_each_expert_equals_transformers(self, fp4: dict[str, Path]) -> None:
        """Every expert of every layer, one at a time (eager's matrices) and as one grouped
        batch: gate_up (2F, D) and down (D, F) as transformers dequantizes them."""
        whole = dequantized(fp4["fp4"], FP8)
        model = mt.from_pretrained(fp4["fp4"], device="cpu")
        stream = model.moestream
        try:
            for layer in stream.session.model.moe_layers:
                theirs = whole.model.layers[layer].mlp.experts
                module = model.model.layers[layer].mlp.experts
                with stream.session.fetch(layer, range(theirs.num_experts)) as lease:
                    handles = sorted(lease.gather(), key=lambda h: h.expert)
                    for h in handles:
                        gate, up, down = stream.weights(module, h)
                        assert torch.equal(torch.cat((gate, up)), theirs.gate_up_proj[h.expert])
                        assert torch.equal(down, theirs.down_proj[h.expert])
                    gate_up, down = stream.stacked(module, handles)
                    assert torch.equal(gate_up, theirs.gate_up_proj.data)
                    assert torch.equal(down, theirs.down_proj.data)
        finally:
            stream.close()

    def test_fp8_experts_with_e8m0_scales(self, fp4: dict[str, Path]) -> None:
        """``expert_dtype: fp8``: FP8 experts whose ``.scale`` are E8M0, as the dense ones."""
        whole = dequantized(fp4["fp8"], FP8)
        model = mt.from_pretrained(fp4["fp8"], device="cpu", compute="eager", budget="4")
        try:
            assert model.moestream.session.model.layers[3].quant.scale_dtype == "F8_E8M0"
            assert torch.equal(logits(whole), logits(model))
        finally:
            model.moestream.close()

    @pytest.mark.parametrize("in_file_dtype", [True, False])
    def test_renamed_float_tensors_as_transformers_loads_them(
            self, fp4: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
            in_file_dtype: bool) -> None:
        """A layer norm stored BF16 as DeepSeek ships it (``attn_norm``, renamed
        ``input_layernorm``; named by V4's float32 plan): transformers before
        ``HfQuantizer.get_new_dtype`` (5.17) loads a pre-quantized checkpoint's renamed
        float tensors in the file's dtype, later ones by the plan; moestream as the
        installed one does."""
        from moestream.transformers import _dense

        path = Path(shutil.copytree(fp4["fp4"], tmp_path / "m"))
        tensors = load_file(path / "model.safetensors")
        name = "model.layers.0.attn_norm.weight"
        tensors[name] = tensors[name].to(torch.bfloat16)
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
        monkeypatch.setattr(_dense, "_RENAMED_IN_FILE_DTYPE", in_file_dtype)
        model = mt.from_pretrained(path, device="cpu")
        try:
            norm = model.model.layers[0].input_layernorm.weight
            assert norm.dtype == (torch.bfloat16 if in_file_dtype else torch.float32)
            assert torch.equal(norm.float(), tensors[name].float())
        finally:
            model.moestream.close()

    def test_streamed_as_packed_bytes(self, fp4: dict[str, Path]) -> None:
        """A miss reads and the budget counts half a byte a weight; each matrix's E8M0
        scales are named beside it."""
        cfg = ARCHS["deepseek_v4"]
        hidden, ffn = cfg["hidden_size"], cfg["moe_intermediate_size"]
        with moestream.open_sync(fp4["fp4-128"], backend="host", budget="4") as session:
            layer = session.model.layers[3]
            assert layer.gate_up_type == CARRIER == layer.down_type
            assert layer.quant is not None and layer.quant.method == "fp4"
            assert (layer.hidden, layer.ffn) == (hidden, ffn)
            assert layer.expert_bytes == 3 * hidden * ffn // 2
            assert session.counters().budget_bytes == 4 * layer.expert_bytes
            assert layer.quant.block == (1, 32) and layer.quant.scale_dtype == "F8_E8M0"
            assert layer.quant.scales[6] == tuple(EXPERT.format(3, 6, f"{w}.scale")
                                                  for w in ("w1", "w3", "w2"))
            with session.fetch(3, [6]) as lease:
                (h,) = lease.gather()
                assert [m.shape for m in h.matrices] == [(ffn, hidden // 2)] * 2 + [
                    (hidden, ffn // 2)]
                file = fp4["fp4-128"] / "model.safetensors"
                w1 = load_file(file)[EXPERT.format(3, 6, "w1.weight")]
                assert bytes(h.gate.array) == w1.numpy().tobytes()


class TestRefused:
    """FP4 forms moestream does not read: one line naming them."""

    def _config(self, source: Path, target: Path, **changes: Any) -> Path:
        path = Path(shutil.copytree(source, target))
        config = json.loads((path / "config.json").read_text())
        for key, value in changes.items():
            if value is None:
                del config[key]
            else:
                config[key] = value
        (path / "config.json").write_text(json.dumps(config))
        return path

    def test_other_expert_dtype(self, fp4: dict[str, Path], tmp_path: Path) -> None:
        path = self._config(fp4["fp4"], tmp_path / "m", expert_dtype="fp6")
        with pytest.raises(moestream.ExpertLayoutError, match="expert_dtype 'fp6'"):
            moestream.open_sync(path, backend="host")

    def test_fp4_experts_without_expert_dtype(self, fp4: dict[str, Path],
                                              tmp_path: Path) -> None:
        path = self._config(fp4["fp4"], tmp_path / "m", expert_dtype=None)
        with pytest.raises(moestream.ExpertLayoutError, match=r"w1\.weight' is I8 "
                           r"\(quantization_config: fp8 experts\)"):
            moestream.open_sync(path, backend="host")

    def test_other_scale_fmt(self, fp4: dict[str, Path], tmp_path: Path) -> None:
        quant = {**json.loads((fp4["fp4"] / "config.json").read_text())["quantization_config"],
                 "scale_fmt": "ue5m3"}
        path = self._config(fp4["fp4"], tmp_path / "m", quantization_config=quant)
        with pytest.raises(moestream.ExpertLayoutError, match="scale_fmt 'ue5m3'"):
            moestream.open_sync(path, backend="host")

    def test_scale_not_e8m0(self, fp4: dict[str, Path], tmp_path: Path) -> None:
        path = Path(shutil.copytree(fp4["fp4"], tmp_path / "m"))
        tensors = load_file(path / "model.safetensors")
        name = EXPERT.format(3, 2, "w2.scale")
        tensors[name] = tensors[name].to(torch.float32)
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(moestream.ExpertLayoutError, match=r"experts\.2\.w2\.scale is F32"):
            moestream.open_sync(path, backend="host")

    def test_missing_scale(self, fp4: dict[str, Path], tmp_path: Path) -> None:
        path = Path(shutil.copytree(fp4["fp4"], tmp_path / "m"))
        tensors = load_file(path / "model.safetensors")
        del tensors[EXPERT.format(3, 5, "w3.scale")]
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(moestream.ExpertLayoutError, match=r"experts\.5\.w3\.weight_scale_"
                           r"inv \(or .*experts\.5\.w3\.scale\) is missing"):
            moestream.open_sync(path, backend="host")

    def test_fp4_dense_weight(self, fp4: dict[str, Path], tmp_path: Path) -> None:
        """A dense weight in FP4 (a shared expert here): refused, never cast as integers."""
        path = Path(shutil.copytree(fp4["fp4"], tmp_path / "m"))
        tensors = load_file(path / "model.safetensors")
        bf16 = load_file(fp4["fp4"].parent / "bf16" / "model.safetensors")
        name = "model.layers.3.ffn.shared_experts.w1.weight"
        tensors[name], tensors[name.removesuffix("weight") + "scale"] = quantize_fp4(bf16[name])
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(moestream.ModelFileError, match=r"shared_experts\.w1\.weight is I8 "
                           "with a scale"):
            mt.from_pretrained(path, device="cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")
class TestGpu:
    """On a GPU: FP4 bytes streamed through the CuPy backend, dequantized by torch's ops on
    its stream; logits and tokens equal to transformers' dequantized model on the device."""

    @pytest.mark.parametrize("compute, implementation", [("grouped", "grouped_mm"),
                                                         ("eager", "eager")])
    def test_logits_and_tokens(self, fp4: dict[str, Path], compute: str,
                               implementation: str) -> None:
        whole = dequantized(fp4["fp4"], FP8, implementation).to("cuda")
        ids = torch.tensor(PROMPTS, device="cuda")
        try:
            with torch.no_grad():
                whole(ids)
        except RuntimeError as exc:  # 5.17's own V4 mixes float32 and bfloat16 on the GPU
            pytest.skip(f"transformers {transformers.__version__}'s own deepseek_v4 fails: "
                        f"{str(exc).splitlines()[0]}")
        for budget in (None, "4"):
            model = mt.from_pretrained(fp4["fp4"], device="cuda", compute=compute,
                                       budget=budget)
            try:
                assert model.moestream.session.backend == "cupy"
                with torch.no_grad():
                    assert torch.equal(whole(ids).logits, model(ids).logits)
                args = dict(attention_mask=torch.ones_like(ids), max_new_tokens=4,
                            min_new_tokens=4, do_sample=False)
                assert torch.equal(whole.generate(ids, **args), model.generate(ids, **args))
            finally:
                model.moestream.close()
