"""FP8 experts on a GPU: streamed through the CuPy backend, dequantized on the device by
torch's ops on its stream, logits and tokens equal to transformers' dequantized model there."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from moestream import transformers as mt  # noqa: E402
from tests.test_transformers_fp8 import (  # noqa: E402
    ARCHS,
    PROMPTS,
    _float,
    fp8_checkpoint,
)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]


@pytest.mark.parametrize("compute, implementation", [("grouped", "grouped_mm"),
                                                     ("eager", "eager")])
@pytest.mark.parametrize("kind", list(ARCHS))
def test_logits_and_tokens(tmp_path: Path, kind: str, compute: str,
                           implementation: str) -> None:
    path = fp8_checkpoint(_float(kind, tmp_path / "bf16"), tmp_path / "fp8")
    whole = transformers.AutoModelForCausalLM.from_pretrained(
        path, quantization_config=transformers.FineGrainedFP8Config(dequantize=True),
        experts_implementation=implementation).to("cuda")
    ids = torch.tensor(PROMPTS, device="cuda")
    for budget in (None, "4"):
        model = mt.from_pretrained(path, device="cuda", compute=compute, budget=budget)
        try:
            assert model.moestream.session.backend == "cupy"
            with torch.no_grad():
                assert torch.equal(whole(ids).logits, model(ids).logits)
            args = dict(attention_mask=torch.ones_like(ids), max_new_tokens=6,
                        min_new_tokens=6, do_sample=False)
            assert torch.equal(whole.generate(ids, **args), model.generate(ids, **args))
        finally:
            model.moestream.close()
