"""FP8 experts on a GPU: streamed through the CuPy backend, dequantized on the device (the
CUDA kernel, or torch's ops), logits and tokens equal to transformers' dequantized model
there."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from tests.quantized import assert_streams_like, dequantized  # noqa: E402
from tests.transformers.test_transformers_fp8 import ARCHS, FP8, _float, fp8_checkpoint  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]


@pytest.mark.parametrize("compute, implementation", [("grouped", "grouped_mm"),
                                                     ("eager", "eager")])
@pytest.mark.parametrize("kind", list(ARCHS))
def test_logits_and_tokens(tmp_path: Path, kind: str, compute: str,
                           implementation: str) -> None:
    path = fp8_checkpoint(_float(kind, tmp_path / "bf16"), tmp_path / "fp8")
    whole = dequantized(path, FP8, implementation).to("cuda")
    for budget in (None, "4"):
        assert_streams_like(whole, path, compute, budget, device="cuda")
