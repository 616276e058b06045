"""DeepSeek-V3 checkpoints with a multi-token-prediction layer (``num_nextn_predict_layers``):
served as transformers serves them, the extra layer ignored.

The checkpoint is a ``save_pretrained`` DeepSeek-V3 of one layer more than its config.json
then says, that last layer given the MTP tensors DeepSeek ships beside a decoder layer
(``enorm``, ``hnorm``, ``eh_proj``, its own embedding and shared head): the layout of
``model.layers.61`` in DeepSeek-V3/R1. transformers loads it with those weights unused; so
must moestream, with logits and greedy tokens equal, plain and FP8.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.integrations.moe")
pytest.importorskip("accelerate")  # transformers' FP8 loading asks for it
from safetensors.torch import load_file, save_file  # noqa: E402

from moestream import transformers as mt  # noqa: E402
from moestream.pipeline.foundation.errors import ExpertLayoutError  # noqa: E402
from moestream.transformers._budget import warn_if_clamped  # noqa: E402
from moestream.transformers._mtp import mtp_layers  # noqa: E402
from tests.quantized import assert_streams_like, dequantized, fp8_checkpoint  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

LAYERS = 3
"""The model's layers (0 dense, 1 and 2 MoE); the checkpoint holds one more, the MTP."""
HIDDEN, VOCAB = 64, 96
CONFIG = dict(hidden_size=HIDDEN, intermediate_size=96, moe_intermediate_size=32,
              n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
              first_k_dense_replace=1, n_group=2, topk_group=1, q_lora_rank=None,
              kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
              num_attention_heads=4, num_key_value_heads=4, vocab_size=VOCAB)


def _with_mtp(where: Path) -> Path:
    """A DeepSeek-V3 checkpoint of ``LAYERS`` layers plus one MTP layer, as DeepSeek ships."""
    config = transformers.AutoConfig.for_model("deepseek_v3", num_hidden_layers=LAYERS + 1,
                                               **CONFIG)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(where)
    shard = where / "model.safetensors"
    tensors = load_file(shard)
    mtp = f"model.layers.{LAYERS}."
    hidden, vocab = HIDDEN, VOCAB
    gen = torch.Generator().manual_seed(1)
    for name, shape in (("enorm.weight", (hidden,)), ("hnorm.weight", (hidden,)),
                        ("eh_proj.weight", (hidden, 2 * hidden)),
                        ("embed_tokens.weight", (vocab, hidden)),
                        ("shared_head.norm.weight", (hidden,)),
                        ("shared_head.head.weight", (vocab, hidden))):
        tensors[mtp + name] = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
    save_file(tensors, shard, metadata={"format": "pt"})
    doc = json.loads((where / "config.json").read_text())
    doc.update(num_hidden_layers=LAYERS, num_nextn_predict_layers=1)
    (where / "config.json").write_text(json.dumps(doc))
    return where


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _with_mtp(tmp_path_factory.mktemp("mtp") / "v3")


class TestMtpLayer:
    """The MTP layer is in the files, not in the model."""

    @pytest.mark.parametrize("compute", ["grouped", "eager"])
    def test_tokens_equal_transformers(self, checkpoint: Path, compute: str) -> None:
        whole = transformers.AutoModelForCausalLM.from_pretrained(
            checkpoint, experts_implementation="grouped_mm" if compute == "grouped"
            else "eager")
        assert len(whole.model.layers) == LAYERS
        assert_streams_like(whole, checkpoint, compute)

    def test_fp8(self, checkpoint: Path, tmp_path: Path) -> None:
        fp8 = fp8_checkpoint(checkpoint, tmp_path / "fp8")
        whole = dequantized(fp8, transformers.FineGrainedFP8Config(dequantize=True))
        assert_streams_like(whole, fp8, "eager")

    def test_its_experts_are_never_fetched(self, checkpoint: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
        model = mt.from_pretrained(checkpoint, device="cpu", budget="6")
        try:
            session = model.moestream.session
            assert LAYERS in session.model.moe_layers  # the table has it
            fetched: list[int] = []
            fetch = session.fetch

            def recorded(layer: int, experts: Any, *args: Any, **kwargs: Any) -> Any:
                fetched.append(layer)
                return fetch(layer, experts, *args, **kwargs)

            monkeypatch.setattr(session, "fetch", recorded)
            with torch.no_grad():
                model(torch.tensor([[3, 17, 42, 5]]))
            assert sorted(set(fetched)) == list(range(1, LAYERS))
        finally:
            model.moestream.close()

    def test_without_the_count_the_extra_layer_is_refused(self, checkpoint: Path,
                                                          tmp_path: Path) -> None:
        """An extra layer config.json does not declare is refused in one line."""
        plain = tmp_path / "undeclared"
        plain.mkdir()
        for file in checkpoint.iterdir():
            (plain / file.name).write_bytes(file.read_bytes())
        doc = json.loads((plain / "config.json").read_text())
        doc["num_nextn_predict_layers"] = 0
        (plain / "config.json").write_text(json.dumps(doc))
        with pytest.raises(ExpertLayoutError, match="says 3 layers"):
            mt.from_pretrained(plain, device="cpu")


@pytest.mark.parametrize("config, layers, want", [
    ({"num_hidden_layers": 61, "num_nextn_predict_layers": 1}, range(3, 62), {61}),
    ({"num_hidden_layers": 61, "num_mtp_layers": 2}, [60, 61, 62, 63], {61, 62}),
    ({"num_hidden_layers": 61, "num_nextn_predict_layers": 0}, [61], set()),
    ({"num_hidden_layers": 61}, [61], set()),
    ({"num_hidden_layers": "61", "num_nextn_predict_layers": 1}, [61], set()),
])
def test_mtp_layers(config: dict[str, Any], layers: Any, want: set[int]) -> None:
    assert mtp_layers(config, layers) == want


class TestClampWarning:
    """``warn_if_clamped`` with every expert asked: the model's own experts, not a
    checkpoint's MTP layer, which is never fetched."""

    @staticmethod
    def _session(held: int) -> Any:
        config = {"num_hidden_layers": 3, "num_nextn_predict_layers": 1}
        layers = {layer: SimpleNamespace(n_experts=4, expert_bytes=100)
                  for layer in (1, 2, 3)}
        return SimpleNamespace(model=SimpleNamespace(layers=layers, config=config),
                               counters=lambda: SimpleNamespace(budget_bytes=held))

    def test_room_for_the_models_experts_is_no_clamp(self) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            warn_if_clamped(self._session(2 * 4 * 100), None)

    def test_less_is_warned(self) -> None:
        with pytest.warns(UserWarning, match="every expert"):
            warn_if_clamped(self._session(2 * 4 * 100 - 1), None)
