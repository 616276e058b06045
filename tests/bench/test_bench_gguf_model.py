"""bench.gguf_model: the GGUF file it writes from a tiny checkpoint loads and generates
through moestream.transformers, and the report's figures say what the runs did."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers' GGUF loading asks for it
import gguf  # noqa: E402

from bench.gguf_model import GGUF_NAME, expert_type, main, random_blocks  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, dict[str, Any], Path]:
    """One tiny run: 2 layers, a cache of a quarter of the BF16 experts' bytes."""
    where = tmp_path_factory.mktemp("gguf-model")
    out = where / "report.json"
    code = main(["--make", str(where / "m"), "--shape", "tiny", "--layers", "2",
                 "--tokens", "3", "--warmup", "1", "--repeat", "2", "--cache-share", "0.25",
                 "--device", "cpu", "--out", str(out)])
    return code, json.loads(out.read_text()), where / "m"


class TestFile:
    """The GGUF file as llama.cpp's converter lays one out, experts random blocks."""

    def test_tensors_and_types(self, report: tuple[int, dict[str, Any], Path]) -> None:
        reader = gguf.GGUFReader(report[2] / GGUF_NAME)
        kinds = {t.name: t.tensor_type.name for t in reader.tensors}
        assert kinds["token_embd.weight"] == "F16" and kinds["output.weight"] == "F16"
        assert kinds["blk.0.attn_norm.weight"] == "F32"
        assert kinds["blk.1.ffn_gate_inp.weight"] == "F32"
        assert kinds["blk.1.attn_q.weight"] == "F16" and "blk.1.attn_k_norm.weight" in kinds
        # the tiny shape's widths (64, 32) are no whole Q4_K block: Q4_0, 4.5 bits too
        for layer in range(2):
            for proj in ("gate", "up", "down"):
                assert kinds[f"blk.{layer}.ffn_{proj}_exps.weight"] == "Q4_0"
        down = next(t for t in reader.tensors if t.name == "blk.0.ffn_down_exps.weight")
        assert [int(n) for n in down.shape] == [32, 64, 8]
        assert report[1]["gguf_expert_bytes"] * 32 == report[1]["bf16_expert_bytes"] * 9

    def test_loads_and_generates(self, report: tuple[int, dict[str, Any], Path]) -> None:
        from moestream import transformers as mt

        with mt.from_pretrained(report[2] / GGUF_NAME, device="cpu", dtype=torch.bfloat16,
                                budget="4") as model:
            assert model.dtype == torch.bfloat16 and model.config.vocab_size == 96
            ids = torch.tensor([[1, 2, 3, 4]])
            out = model.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False)
            assert out.shape == (1, 7) and model.moestream.session.counters().misses > 0

    def test_q4_k_blocks_are_valid(self) -> None:
        """Where the widths are whole 256-value blocks the experts are Q4_K; its random
        blocks dequantize to finite values of a random-init model's size."""
        assert expert_type({"hidden_size": 512, "moe_intermediate_size": 256}) == "Q4_K"
        assert expert_type({"hidden_size": 64, "moe_intermediate_size": 32}) == "Q4_0"
        blocks = random_blocks("Q4_K", 8, 512, np.random.default_rng(0))
        assert blocks.shape == (8, 2 * 144)
        values = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q4_K)
        assert values.shape == (8, 512) and np.isfinite(values).all()
        assert 0.001 < float(np.abs(values).mean()) < 0.2


class TestReport:
    """The JSON: the BF16 model streamed gives the resident model's tokens, both at the
    same cache, the GGUF's misses fewer (the same bytes hold 3.6x its experts)."""

    def test_runs(self, report: tuple[int, dict[str, Any], Path]) -> None:
        code, data, _ = report
        runs = data["runs"]
        assert code == 0 and data["dtype"] == "bfloat16" and data["layers"] == 2
        assert runs["resident"]["same_tokens"] and runs["bf16"]["same_tokens"]
        assert runs["bf16"]["tokens"] == data["reference_tokens"]
        assert len(runs["gguf"]["tokens"].split(",")) == 3
        for name in ("bf16", "gguf"):
            assert len(runs[name]["tokens_per_s_runs"]) == 2 and runs[name]["spread"] >= 0
            assert runs[name]["budget_bytes"] == data["cache_budget_bytes"]
            assert runs[name]["bound"] in runs[name]["time_ms"]  # the split was collected
        assert data["cache_budget_bytes"] == data["bf16_expert_bytes"] // 4
        assert data["gguf_over_bf16"] == round(
            runs["gguf"]["tokens_per_s"] / runs["bf16"]["tokens_per_s"], 3)

    def test_counts(self, report: tuple[int, dict[str, Any], Path]) -> None:
        bf16, q4 = report[1]["runs"]["bf16"], report[1]["runs"]["gguf"]
        assert min(bf16["misses_runs"]) > 0 and bf16["hit_rate"] < q4["hit_rate"]
        assert max(q4["misses_runs"]) < min(bf16["misses_runs"])
        # a miss reads one expert's bytes: 4.5 bits a value against 16 (the three Q4_0
        # projections lie in three tensors, each read a little wider than its blocks)
        bf16_miss = bf16["file_bytes_runs"][0] / bf16["misses_runs"][0]
        assert bf16_miss == 3 * 32 * 64 * 2
        assert all(0 < b <= m * bf16_miss / 3
                   for b, m in zip(q4["file_bytes_runs"], q4["misses_runs"], strict=True) if m)
