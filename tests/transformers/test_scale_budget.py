"""The quantized experts' scales inside the budget: a size given is the cache plus every
scale the device holds; what the loader holds is what the budget counted; a size the
scales leave too little of is refused naming them; a count of experts keeps its count."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers.integrations.moe")

from moestream import transformers as mt  # noqa: E402
from moestream.pipeline.foundation.errors import UsageError  # noqa: E402
from moestream.pipeline.foundation.sizes import size_text  # noqa: E402
from moestream.pipeline.foundation.table import open_table  # noqa: E402
from moestream.pipeline.makers.checkpointgen import (  # noqa: E402
    CheckpointOptions,
    write_checkpoint,
)
from moestream.pipeline.makers.checkpointlayouts import Quant  # noqa: E402
from moestream.pipeline.makers.modelspec import spec_for  # noqa: E402
from moestream.transformers._scale_budget import (  # noqa: E402
    budget_less_scales,
    held_bytes,
    scale_bytes,
)

QUANTS: list[Quant] = ["fp8", "mxfp4", "fp4"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("scales")
    return {str(quant): write_checkpoint(spec_for("tiny", 2, 8, 0), root / quant,
                                    CheckpointOptions(quant=quant)).path
            for quant in QUANTS}


def _sizes(path: Path) -> tuple[int, int, int]:
    """The scales' bytes, one expert's and the least the cache holds (2 layers' top-k)."""
    table = open_table(path)
    expert = max(layer.expert_bytes for layer in table.layers.values())
    return scale_bytes(table), expert, 2 * table.top_k * expert


@pytest.mark.parametrize("quant", QUANTS)
class TestScalesInTheBudget:
    def test_a_size_is_cache_plus_scales(self, checkpoints: dict[str, Path],
                                         quant: str) -> None:
        path = checkpoints[quant]
        scales, expert, least = _sizes(path)
        assert scales > 0
        given = scales + least + 3 * expert
        model = mt.from_pretrained(path, device="cpu", budget=f"{given}B")
        try:
            assert model.moestream.session.counters().budget_bytes == given - scales
            assert held_bytes(model.moestream.scales) == scales  # counted what is held
            with torch.no_grad():
                model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False)
        finally:
            model.moestream.close()

    def test_too_little_left_is_refused_naming_the_scales(self, checkpoints: dict[str, Path],
                                                          quant: str) -> None:
        path = checkpoints[quant]
        scales, _, least = _sizes(path)
        with pytest.raises(UsageError, match=r"the experts' scales take .* give at least"):
            mt.from_pretrained(path, device="cpu", budget=f"{scales + least - 1}B")

    def test_a_count_keeps_its_experts(self, checkpoints: dict[str, Path],
                                       quant: str) -> None:
        path = checkpoints[quant]
        assert budget_less_scales(path, "12", None) == "12"
        assert budget_less_scales(path, None, None) is None
        # max_memory's budget is what the dense weights, scales among them, leave
        assert budget_less_scales(path, "1MiB", None, {"cpu": "2MiB"}) == "1MiB"


def test_scales_fraction_by_format(checkpoints: dict[str, Path]) -> None:
    """FP4 formats hold a byte a 32 values (1/16 of the expert's bytes), FP8 a float32 a
    128 x 128 block at most."""
    for quant, at_most in (("mxfp4", 1 / 16), ("fp4", 1 / 16), ("fp8", 4 / 128 / 128 * 16)):
        table = open_table(checkpoints[quant])
        experts = sum(layer.n_experts * layer.expert_bytes for layer in table.layers.values())
        assert 0 < scale_bytes(table) <= experts * at_most


def test_plain_checkpoints_hold_none(tmp_path: Path) -> None:
    path = write_checkpoint(spec_for("tiny", 2, 8, 0), tmp_path / "plain").path
    assert scale_bytes(open_table(path)) == 0
    assert budget_less_scales(path, "1MiB", None) == "1MiB"
    assert held_bytes({}) == 0  # the summary names no scales


@pytest.mark.parametrize("quant", QUANTS)
def test_the_model_says_its_scales_bytes(checkpoints: dict[str, Path], quant: str) -> None:
    """``mt.held_scale_bytes``: what the table's scales take on the device, for a summary."""
    path = checkpoints[quant]
    with mt.from_pretrained(path, device="cpu") as model:
        assert mt.held_scale_bytes(model) == scale_bytes(open_table(path)) > 0


def test_the_run_summary_names_the_scales(checkpoints: dict[str, Path],
                                          capsys: pytest.CaptureFixture[str]) -> None:
    from moestream.pipeline import run as pipeline_run

    path = checkpoints["mxfp4"]
    scales, expert, least = _sizes(path)
    code = pipeline_run.main(["--engine", "transformers", "-m", str(path), "--prompt-ids",
                              "1,2,3", "--tokens", "2", "--backend", "host", "--json",
                              "--cache-budget", f"{scales + least + expert}B"])
    summary = json.loads(capsys.readouterr().out)
    assert code == 0
    assert summary["experts"].endswith(f"their scales {size_text(scales)} on the device, "
                                       "in the budget")
    assert summary["budget_bytes"] == least + expert  # the cache: what the scales leave


@pytest.mark.parametrize("quant", QUANTS)
def test_dense_bytes_count_what_the_model_holds(checkpoints: dict[str, Path], quant: str) -> None:
    """max_memory's dense weights: the experts' scales once, at their held size; a dense FP8
    weight's scale (folded into it at load) not at all; other floats in the model's dtype."""
    from moestream.transformers._budget import dense_bytes

    table = open_table(checkpoints[quant])
    experts_scales = {name for layer in table.layers.values() if layer.quant is not None
                      for name in layer.quant.names}
    types = {t.name: t.type_name for t in table.non_routed}
    folded = {name for name in types if name.endswith(".scale")
              and types.get(name.removesuffix(".scale") + ".weight") == "F8_E4M3"}
    folded |= {name for name in types if name.endswith("_scale_inv")
               and name.removesuffix("_scale_inv") in types}
    rest = [t for t in table.non_routed if t.name not in experts_scales | folded]
    as_bf16 = sum(2 * math.prod(t.shape) if t.type_name in ("F32", "BF16", "F16", "F8_E4M3")
                  else t.nbytes for t in rest)
    assert dense_bytes(table, torch.bfloat16) == scale_bytes(table) + as_bf16
    assert quant != "fp4" or folded  # DeepSeek-V4's dense FP8 weights carry .scale tensors
