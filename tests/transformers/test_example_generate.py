"""examples/transformers_generate.py run as a new user runs it: a process of its own on a
checkpoint its ``--tiny`` wrote, its tokens those of transformers' own model of that
checkpoint, and a bad argument or checkpoint one line on stderr with a non-zero exit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.integrations.moe")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "transformers_generate.py"


def _example(*args: str | Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    return subprocess.run([sys.executable, str(EXAMPLE), *map(str, args), "--device", "cpu"],
                          capture_output=True, text=True, timeout=300, env=env, check=False)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The example's own tiny checkpoint, and its stdout from decoding it at a budget of four
    experts (of 16)."""
    where = tmp_path_factory.mktemp("example") / "tiny"
    run = _example(where, "--tiny", "--budget", "4", "-n", "6", "--prompt-ids", "5,7,11")
    assert run.returncode == 0, run.stderr
    return where, run.stdout


def test_tokens_are_transformers_own(tiny: tuple[Path, str]) -> None:
    where, stdout = tiny
    model = transformers.AutoModelForCausalLM.from_pretrained(where)
    ids = torch.tensor([[5, 7, 11]])
    want = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                          max_new_tokens=6, min_new_tokens=6)[0, 3:].tolist()
    assert f"tokens: {want}" in stdout.splitlines()


def test_the_summary_states_the_cache(tiny: tuple[Path, str]) -> None:
    """Four bf16 experts of 3 x 64 x 32: 48 KiB, which MiB to one place read as 0.0."""
    summary = tiny[1].splitlines()[-1]
    assert "misses" in summary and summary.endswith("peak 48.0 KiB of 48.0 KiB"), summary


@pytest.mark.parametrize(("args", "says"), [
    (["--prompt-ids", "1,x"], "--prompt-ids: not comma-separated token ids: '1,x'"),
    (["-n", "0"], "-n/--tokens: not a positive count: '0'"),
    (["--prompt", "hi"], "the checkpoint has no tokenizer for --prompt"),
    (["--budget", "lots"], "lots"),
    (["--prompt-ids", "1,96"], "--prompt-ids: the model's token ids are 0..95"),
])
def test_bad_input_is_one_line(tiny: tuple[Path, str], args: list[str], says: str) -> None:
    run = _example(tiny[0], *args)
    assert run.returncode != 0 and run.stdout == ""
    lines = run.stderr.strip().splitlines()
    assert "Traceback" not in run.stderr and says in lines[-1], run.stderr


def test_no_checkpoint_is_one_line(tmp_path: Path) -> None:
    absent = tmp_path / "absent"
    run = _example(absent)
    assert run.returncode == 2
    assert run.stderr.strip() == f"error: {absent}: no such checkpoint directory or file"
