"""bench.archs: one architecture swept end to end through its worker process, the tiny
configs of every default kind, and bad arguments."""

from __future__ import annotations

import contextlib
import io
import json
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.integrations.moe")

from bench.archs import KINDS, MODEL_TYPES, ZERO_INIT, main, overrides  # noqa: E402


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, str, dict[str, Any]]:
    """``--kinds qwen3_moe --out FILE``: the exit code, what it printed, the JSON."""
    out = tmp_path_factory.mktemp("archs") / "archs.json"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(["--kinds", "qwen3_moe", "--out", str(out)])
    return code, printed.getvalue(), json.loads(out.read_text())


class TestSweep:
    """Qwen3-MoE through the command: both computes equal transformers' own."""

    def test_pass_both_computes(self, sweep: tuple[int, str, dict[str, Any]]) -> None:
        code, _, result = sweep
        assert code == 0
        kind = result["kinds"]["qwen3_moe"]
        assert kind["outcome"] == "PASS"
        assert {c: s["status"] for c, s in kind["computes"].items()} == \
            {"grouped": "PASS", "eager": "PASS"}
        assert all(s["expert_misses"] > 0 for s in kind["computes"].values())
        assert kind["overrides"]["hidden_size"] == 64 and kind["seconds"] > 0
        assert result["summary"] == {"PASS": 1}

    def test_header(self, sweep: tuple[int, str, dict[str, Any]]) -> None:
        """The machine, commit, command and versions, as every bench result carries."""
        result = sweep[2]
        assert result["machine"]["host"] and result["machine"]["backend"] == "host"
        assert result["commit"]
        assert result["command"].startswith("python -m bench.archs --kinds qwen3_moe --out ")
        assert result["torch"] == torch.__version__
        assert result["transformers"] == transformers.__version__

    def test_report_lines(self, sweep: tuple[int, str, dict[str, Any]]) -> None:
        lines = sweep[1].splitlines()
        assert lines[0].split()[:2] == ["qwen3_moe", "PASS"]
        assert lines[1] == "summary: 1 PASS (1 kinds)"


@pytest.fixture(scope="module")
def beyond_registry(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The fast subset CI sweeps beside Qwen3-MoE: the swapped kinds (Llama 4, JetMoE), the
    namings (Gemma 4, Aria) and one refused (Doge)."""
    out = tmp_path_factory.mktemp("archs-beyond") / "archs.json"
    with contextlib.redirect_stdout(io.StringIO()):
        code = main(["--kinds", "llama4,jetmoe,gemma4,aria,doge", "--out", str(out)])
    return {"code": code, **json.loads(out.read_text())}


class TestBeyondTheRegistry:
    """Kinds reached by a module swap or by their own namings pass; Doge is refused."""

    def test_swapped_and_named_pass(self, beyond_registry: dict[str, Any]) -> None:
        kinds = beyond_registry["kinds"]
        for kind in ("llama4", "jetmoe", "gemma4", "aria"):
            if kinds[kind]["outcome"] == "SKIPPED":  # a transformers without the type
                continue
            assert kinds[kind]["outcome"] == "PASS", (kind, kinds[kind])
        for kind in ("llama4", "jetmoe"):  # grouped_mm refused: the model as it runs
            reference = kinds[kind]["computes"]["grouped"].get("reference", "")
            assert "experts_implementation" in reference, kind

    def test_refused_with_its_reason(self, beyond_registry: dict[str, Any]) -> None:
        """A refused kind makes the sweep's exit status 1 and says why, per compute."""
        doge = beyond_registry["kinds"]["doge"]
        if doge["outcome"] == "SKIPPED":
            pytest.skip(doge["reason"])
        assert beyond_registry["code"] == 1
        assert doge["outcome"] == "REFUSED"
        assert all("no routed expert tensors" in s["error"] for s in doge["computes"].values())


class TestOverrides:
    """The tiny config of every default kind this transformers knows."""

    def test_every_kind_configures(self) -> None:
        """Each builds, tiny where it has a hidden size (Step3p7's composite config has none
        at its top)."""
        for kind in KINDS:
            model_type = MODEL_TYPES.get(kind, kind)
            if model_type not in transformers.CONFIG_MAPPING:
                continue
            defaults = transformers.AutoConfig.for_model(model_type).to_dict()
            config = transformers.AutoConfig.for_model(model_type, **overrides(kind, defaults))
            assert config.to_dict().get("hidden_size", 64) == 64, kind

    def test_clamps_bind(self) -> None:
        """gpt-oss and DeepSeek-V4 get a swiglu_limit small enough to clamp tiny weights."""
        for kind in ("gpt_oss", "deepseek_v4"):
            if kind in transformers.CONFIG_MAPPING:
                defaults = transformers.AutoConfig.for_model(kind).to_dict()
                assert overrides(kind, defaults)["swiglu_limit"] <= 0.01

    def test_zero_init_names(self) -> None:
        """Experts' biases and a router's weight are filled; a router's correction bias and
        attention biases are left as transformers initialises them."""
        assert ZERO_INIT.search("model.layers.0.mlp.experts.gate_up_proj_bias")
        assert ZERO_INIT.search("model.layers.1.mlp.router.gate.weight")
        assert not ZERO_INIT.search("model.layers.1.mlp.expert_bias")
        assert not ZERO_INIT.search("model.layers.0.self_attn.q_proj.bias")


class TestBadArguments:
    """One line on stderr, exit 2, nothing run."""

    @pytest.mark.parametrize("argv, message", [
        (["--kinds", "qwen3_moe,nope"], "--kinds: unknown nope"),
        (["--kinds", ","], "--kinds: no model type"),
        (["--timeout", "0"], "--timeout"),
        (["--timeout", "soon"], "--timeout"),
        (["--kinds", "qwen3_moe", "--out", "/dev/null"], "--out"),
    ])
    def test_one_line_exit_2(self, argv: list[str], message: str,
                             capsys: pytest.CaptureFixture[str]) -> None:
        assert main(argv) == 2
        captured = capsys.readouterr()
        assert captured.out == ""
        assert captured.err.startswith("bench.archs: error: ") and captured.err.count("\n") == 1
        assert message in captured.err

    @pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device answers here")
    def test_cuda_without_a_device(self, capsys: pytest.CaptureFixture[str]) -> None:
        assert main(["--device", "cuda", "--kinds", "qwen3_moe"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--device cuda: torch sees no CUDA device" in err
