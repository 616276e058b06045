"""gpt-oss's MXFP4 experts through moestream.transformers: experts streamed as their blocks
and dequantized per use, logits equal to transformers' own dequantization.

The MXFP4 checkpoints are written by ``tests/quantized.py`` (OCP MX's rule, not moestream's
code) from a gpt-oss ``save_pretrained`` checkpoint, laid out as OpenAI ships gpt-oss; the
reference is transformers' ``from_pretrained(..., quantization_config=Mxfp4Config(
dequantize=True))``, which runs on the CPU and folds the blocks and scales into the model's
dtype at load (``convert_moe_packed_tensors``).
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
pytest.importorskip("transformers.integrations.mxfp4")
pytest.importorskip("accelerate")  # transformers' MXFP4 loading asks for it
from safetensors.torch import load_file, save_file  # noqa: E402

import moestream  # noqa: E402
from moestream import transformers as mt  # noqa: E402
from moestream.pipeline.foundation.quantization import CARRIER  # noqa: E402
from tests.quantized import (  # noqa: E402
    PROMPTS,
    assert_streams_like,
    dequantized,
    mxfp4_checkpoint,
)
from tests.transformers.test_transformers import ARCHS  # noqa: E402

MXFP4 = transformers.Mxfp4Config(dequantize=True)
"""transformers' own dequantization at load: the reference."""
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

LAYER = "model.layers.{}.mlp.experts.{}"


def _float(where: Path) -> Path:
    config = transformers.AutoConfig.for_model("gpt_oss", **ARCHS["gpt_oss"])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():  # the experts' biases start at zero: make them count
        for name, param in model.named_parameters():
            if ".experts." in name and name.endswith("_bias"):
                param.normal_(0.0, 0.02)
    model.save_pretrained(where)
    return where


@pytest.fixture(scope="module")
def mxfp4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("mxfp4")
    return mxfp4_checkpoint(_float(root / "bf16"), root / "gpt_oss")


class TestMxfp4Experts:
    """Experts streamed as MXFP4 blocks, dequantized per use."""

    @pytest.mark.parametrize("compute, implementation", [("grouped", "grouped_mm"),
                                                         ("eager", "eager")])
    def test_logits_equal_transformers_dequantized(self, mxfp4: Path, compute: str,
                                                   implementation: str) -> None:
        """At a budget of a few experts: misses, evictions and grouped fetches happen."""
        assert_streams_like(dequantized(mxfp4, MXFP4, implementation), mxfp4,
                            compute)

    def test_each_expert_equals_transformers(self, mxfp4: Path) -> None:
        """Every expert of every layer, one at a time (eager's matrices) and as one grouped
        batch: the module's gate_up (D, 2F) and down (F, D) as transformers dequantizes."""
        whole = dequantized(mxfp4, MXFP4)
        model = mt.from_pretrained(mxfp4, device="cpu")
        stream = model.moestream
        try:
            for layer in stream.session.model.moe_layers:
                theirs = whole.model.layers[layer].mlp.experts
                module = model.model.layers[layer].mlp.experts
                with stream.session.fetch(layer, range(theirs.num_experts)) as lease:
                    handles = sorted(lease.gather(), key=lambda h: h.expert)
                    for h in handles:
                        first, second, down = stream.weights(module, h)
                        assert torch.equal(torch.cat((first, second)),
                                           theirs.gate_up_proj[h.expert])
                        assert torch.equal(down, theirs.down_proj[h.expert])
                    gate_up, down = stream.stacked(module, handles)
                    assert torch.equal(gate_up, theirs.gate_up_proj.data)
                    assert torch.equal(down, theirs.down_proj.data)
        finally:
            stream.close()

    def test_streamed_as_blocks(self, mxfp4: Path) -> None:
        """A miss reads and the budget counts half a byte a weight; the scales are one
        tensor a layer, read once."""
        cfg = ARCHS["gpt_oss"]
        hidden, ffn = cfg["hidden_size"], cfg["intermediate_size"]
        with moestream.open_sync(mxfp4, backend="host", budget="4") as session:
            layer = session.model.layers[0]
            assert layer.gate_up_type == CARRIER == layer.down_type
            assert layer.quant is not None and layer.quant.method == "mxfp4"
            assert (layer.hidden, layer.ffn, layer.transposed) == (hidden, ffn, True)
            assert layer.expert_bytes == 3 * hidden * ffn // 2
            assert session.counters().budget_bytes == 4 * layer.expert_bytes
            assert layer.quant.layer_scales == (LAYER.format(0, "gate_up_proj_scales"),
                                                LAYER.format(0, "down_proj_scales"))
            with session.fetch(0, [5]) as lease:
                (h,) = lease.gather()
                assert [m.shape for m in h.matrices] == [(ffn, hidden // 2)] * 2 + [
                    (hidden, ffn // 2)]
                blocks = load_file(mxfp4 / "model.safetensors")[
                    LAYER.format(0, "gate_up_proj_blocks")][5]
                got = bytes(h.gate.array) + bytes(h.up.array)
                assert got == blocks.numpy().tobytes()


class TestRefused:
    """MXFP4 forms moestream does not read: one line naming them."""

    def _edit(self, source: Path, target: Path, drop: str = "", **tensors: Any) -> Path:
        path = Path(shutil.copytree(source, target))
        file = path / "model.safetensors"
        found = {k: v for k, v in load_file(file).items() if k != drop}
        save_file({**found, **tensors}, file, metadata={"format": "pt"})
        return path

    def test_blocks_without_quantization_config(self, mxfp4: Path, tmp_path: Path) -> None:
        path = Path(shutil.copytree(mxfp4, tmp_path / "m"))
        config = json.loads((path / "config.json").read_text())
        del config["quantization_config"]
        (path / "config.json").write_text(json.dumps(config))
        with pytest.raises(moestream.ExpertLayoutError, match="MXFP4 blocks, but "
                           "quantization_config is absent"):
            moestream.open_sync(path, backend="host")

    def test_missing_scales(self, mxfp4: Path, tmp_path: Path) -> None:
        path = self._edit(mxfp4, tmp_path / "m", drop=LAYER.format(2, "down_proj_scales"))
        with pytest.raises(moestream.ExpertLayoutError,
                           match=r"layer 2: .*down_proj_scales is missing"):
            moestream.open_sync(path, backend="host")

    def test_scales_of_another_type(self, mxfp4: Path, tmp_path: Path) -> None:
        name = LAYER.format(1, "gate_up_proj_scales")
        scales = load_file(mxfp4 / "model.safetensors")[name]
        path = self._edit(mxfp4, tmp_path / "m", **{name: scales.to(torch.float32)})
        with pytest.raises(moestream.ExpertLayoutError, match=r"is F32 .* expected U8"):
            moestream.open_sync(path, backend="host")

    def test_blocks_of_a_wrong_shape(self, mxfp4: Path, tmp_path: Path) -> None:
        name = LAYER.format(0, "down_proj_blocks")
        blocks = load_file(mxfp4 / "model.safetensors")[name]
        path = self._edit(mxfp4, tmp_path / "m", **{name: blocks.reshape(8, 32, 2, 16)})
        with pytest.raises(moestream.ExpertLayoutError, match=r"are not \[E, 2F"):
            moestream.open_sync(path, backend="host")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")
class TestGpu:
    """On a GPU: blocks streamed through the CuPy backend, dequantized by torch's ops on its
    stream; logits and tokens equal to transformers' dequantized model on the device."""

    @pytest.mark.parametrize("compute, implementation", [("grouped", "grouped_mm"),
                                                         ("eager", "eager")])
    def test_logits_and_tokens(self, mxfp4: Path, compute: str, implementation: str) -> None:
        whole = dequantized(mxfp4, MXFP4, implementation).to("cuda")
        ids = torch.tensor(PROMPTS, device="cuda")
        for budget in (None, "4"):
            model = mt.from_pretrained(mxfp4, device="cuda", compute=compute, budget=budget)
            try:
                assert model.moestream.session.backend == "cupy"
                with torch.no_grad():
                    assert torch.equal(whole(ids).logits, model(ids).logits)
                args = dict(attention_mask=torch.ones_like(ids), max_new_tokens=4,
                            min_new_tokens=4, do_sample=False)
                assert torch.equal(whole.generate(ids, **args), model.generate(ids, **args))
            finally:
                model.moestream.close()
