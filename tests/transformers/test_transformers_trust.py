"""moestream.transformers against a hostile checkpoint directory: one identity per run, no
checkpoint code, bounded inputs.

Checkpoints are written by transformers' own ``save_pretrained``; the attacks are the ones
a user's directory can suffer between and during the run's reads: another checkpoint's shard
renamed over one of ours right after the session opened, a shard written in place, Python
files and ``auto_map`` entries that transformers would offer to run, and config, generation
and tokenizer files built to exhaust the parser.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.integrations.moe")

import moestream  # noqa: E402
from moestream import transformers as mt  # noqa: E402
from moestream.pipeline import run as pipeline_run  # noqa: E402
from moestream.pipeline.foundation.safetensors_table import is_routed  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

CONFIG = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
              num_experts_per_tok=2, num_hidden_layers=2, head_dim=16, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=96, max_position_embeddings=128)
IDS = [[3, 17, 42, 5]]


def _save(where: Path, seed: int, shard: str = "5GB") -> Path:
    config = transformers.AutoConfig.for_model("qwen3_moe", **CONFIG)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(where, max_shard_size=shard)
    return where


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two checkpoints of one shape and other weights, each whole and sharded (small shards:
    some hold dense tensors only)."""
    root = tmp_path_factory.mktemp("trust")
    return {f"{layout}{seed}": _save(root / f"{layout}{seed}", seed,
                                     "5GB" if layout == "single" else "40KB")
            for layout in ("single", "sharded") for seed in (0, 1)}


def _dense_only_shard(path: Path) -> Path:
    from safetensors import safe_open

    for shard in sorted(path.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            if not any(is_routed(name) for name in f.keys()):  # noqa: SIM118 (not iterable)
                return shard
    raise AssertionError(f"{path} has no shard of dense tensors only")


def _after_open(monkeypatch: pytest.MonkeyPatch, act: Callable[[], None]) -> None:
    """Run ``act`` right after the loader's session opened: the window an attacker races."""
    opened = moestream.open_sync

    def open_then_act(*args: Any, **kwargs: Any) -> Any:
        session = opened(*args, **kwargs)
        act()
        return session

    monkeypatch.setattr(moestream, "open_sync", open_then_act)


def _renamed_over(victim: Path, other: Path) -> Callable[[], None]:
    def rename() -> None:
        staged = victim.with_name(victim.name + ".new")
        shutil.copyfile(other, staged)
        os.replace(staged, victim)

    return rename


def _written(victim: Path, other: Path) -> Callable[[], None]:
    def write() -> None:  # same size, same inode: only the times tell
        with open(victim, "r+b") as f:
            f.write(other.read_bytes())

    return write


def _victim(made: dict[str, Path], tmp_path: Path, layout: str) -> tuple[Path, Path, Path]:
    """A fresh copy of checkpoint 0, the file to attack in it and checkpoint 1's same file."""
    path = Path(shutil.copytree(made[f"{layout}0"], tmp_path / "m"))
    victim = (path / "model.safetensors" if layout == "single" else _dense_only_shard(path))
    return path, victim, made[f"{layout}1"] / victim.name


class TestOneIdentity:
    """Every byte the model computes with comes from the files the session identified."""

    @pytest.mark.parametrize("mode", ["direct", "resident"])
    @pytest.mark.parametrize("attack", [_renamed_over, _written])
    @pytest.mark.parametrize("layout", ["single", "sharded"])
    def test_a_file_changed_after_open_stops_the_load(
            self, made: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
            layout: str, attack: Callable[[Path, Path], Callable[[], None]],
            mode: str) -> None:
        path, victim, other = _victim(made, tmp_path, layout)
        _after_open(monkeypatch, attack(victim, other))
        with pytest.raises(moestream.ModelChangedError, match=victim.name):
            mt.from_pretrained(path, device="cpu", mode=mode)

    def test_the_cli_exits_without_tokens(self, made: dict[str, Path], tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
        path, victim, other = _victim(made, tmp_path, "sharded")
        _after_open(monkeypatch, _renamed_over(victim, other))
        code = pipeline_run.main(["--engine", "transformers", "-m", str(path),
                                  "--prompt-ids", "3,17", "--tokens", "2"])
        captured = capsys.readouterr()
        assert code == moestream.ModelChangedError.exit_code != 0
        assert "tokens" not in captured.out and "verified" not in captured.out
        assert captured.err.count("\n") == 1 and "replaced by another file" in captured.err

    def test_untouched_loads_what_transformers_loads(self, made: dict[str, Path]) -> None:
        """The dense weights read through the session are transformers' own (the control
        for the attacks above)."""
        whole = transformers.AutoModelForCausalLM.from_pretrained(made["sharded0"])
        model = mt.from_pretrained(made["sharded0"], device="cpu")
        try:
            theirs = whole.state_dict()
            for name, tensor in model.state_dict().items():
                if not tensor.is_meta:
                    assert torch.equal(tensor, theirs[name]), name
        finally:
            model.moestream.close()

    def test_read_tensor_refuses_a_replaced_file(self, made: dict[str, Path],
                                                 tmp_path: Path) -> None:
        path, victim, other = _victim(made, tmp_path, "sharded")
        with moestream.open_sync(path, backend="host") as session:
            name = next(n for n in session.model.tensors if "embed" in n)
            before = session.read_tensor(name)
            assert len(before) == session.model.tensors[name].nbytes
            _renamed_over(victim, other)()
            for n in session.model.tensors:
                try:
                    session.read_tensor(n)
                except moestream.ModelChangedError:
                    break
            else:
                raise AssertionError("no read noticed the replaced shard")
            with pytest.raises(moestream.UsageError, match="not a non-routed tensor"):
                session.read_tensor("model.layers.0.mlp.experts.gate_up_proj")


def _unknown_type(path: Path, marker: Path) -> None:
    """Make ``path``'s config name a model type transformers lacks, with an ``auto_map`` to
    a configuration file that would leave ``marker`` if it ever ran."""
    config = json.loads((path / "config.json").read_text())
    config.update(model_type="moestream_attack",
                  auto_map={"AutoConfig": "configuration_attack.AttackConfig",
                            "AutoModelForCausalLM": "modeling_attack.AttackModel"})
    (path / "config.json").write_text(json.dumps(config))
    code = f"open({str(marker)!r}, 'w').write('ran')\n"
    (path / "configuration_attack.py").write_text(
        code + "from transformers import PretrainedConfig\n"
        "class AttackConfig(PretrainedConfig):\n    model_type = 'moestream_attack'\n")
    (path / "modeling_attack.py").write_text(code)


def _cli(args: list[str], stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pipeline.run", "--engine", "transformers",
                           "--tokens", "1", *args], input=stdin, capture_output=True,
                          text=True, timeout=240, cwd=Path(__file__).resolve().parents[2])


class TestNoCheckpointCode:
    """No Python from the checkpoint runs, and nothing asks on stdout or reads stdin."""

    def test_custom_config_refused_even_on_yes(self, made: dict[str, Path],
                                               tmp_path: Path) -> None:
        path = Path(shutil.copytree(made["single0"], tmp_path / "m"))
        marker = tmp_path / "ran"
        _unknown_type(path, marker)
        done = _cli(["-m", str(path), "--prompt-ids", "1,2"], stdin="y\ny\n")
        assert done.returncode == 2, done.stderr
        assert not marker.exists()
        assert "[y/N]" not in done.stdout + done.stderr
        assert done.stderr.count("\n") == 1 and "moestream: error:" in done.stderr

    def test_custom_tokenizer_refused(self, made: dict[str, Path], tmp_path: Path) -> None:
        path = Path(shutil.copytree(made["single0"], tmp_path / "m"))
        marker = tmp_path / "ran"
        (path / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "AttackTokenizer",
             "auto_map": {"AutoTokenizer": ["tokenization_attack.AttackTokenizer", None]}}))
        (path / "tokenization_attack.py").write_text(f"open({str(marker)!r}, 'w')\n")
        done = _cli(["-m", str(path), "--prompt", "hello"], stdin="y\n")
        assert done.returncode == 2, done.stderr
        assert not marker.exists()
        assert "[y/N]" not in done.stdout + done.stderr
        assert done.stderr.count("\n") == 1


def _deep(depth: int) -> str:
    return "[" * depth + "]" * depth


class TestBoundedInputs:
    """Each hostile input of the transformers path: one line, exit 2, nothing big held."""

    @pytest.mark.parametrize("name, text, prompt, message", [
        ("generation_config.json", '{"a": ' + _deep(100_000) + "}", False, "nests too deeply"),
        ("generation_config.json", "{not json", False, "is not JSON"),
        ("generation_config.json", '{"a": 1, "a": 2}', False, "twice"),
        ("tokenizer_config.json", '{"a": ' + _deep(100_000) + "}", True, "nests too deeply"),
        ("tokenizer.json", _deep(100_000), True, "nests too deeply"),
    ])
    def test_hostile_side_files(self, made: dict[str, Path], tmp_path: Path, name: str,
                                text: str, prompt: bool, message: str,
                                capsys: pytest.CaptureFixture[str]) -> None:
        path = Path(shutil.copytree(made["single0"], tmp_path / "m"))
        (path / name).write_text(text)
        given = ["--prompt", "hi"] if prompt else ["--prompt-ids", "1,2"]
        code = pipeline_run.main(["--engine", "transformers", "-m", str(path), "--tokens", "1",
                                  *given])
        err = capsys.readouterr().err
        assert code == 2
        assert err.count("\n") == 1 and message in err and name in err

    @pytest.mark.parametrize("name", ["tokenizer.json", "generation_config.json"])
    def test_a_huge_sparse_file_is_never_read(self, made: dict[str, Path], tmp_path: Path,
                                              name: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
        path = Path(shutil.copytree(made["single0"], tmp_path / "m"))
        with open(path / name, "wb") as f:
            f.truncate(3 << 30)
        code = pipeline_run.main(["--engine", "transformers", "-m", str(path), "--tokens", "1",
                                  "--prompt", "hi"] if name.startswith("tok") else
                                 ["--engine", "transformers", "-m", str(path), "--tokens", "1",
                                  "--prompt-ids", "1"])
        err = capsys.readouterr().err
        assert code == 2 and "larger than" in err and err.count("\n") == 1

    @pytest.mark.parametrize("dtype", ["load", "int8", 7])
    def test_config_dtype_not_a_float_type(self, made: dict[str, Path], tmp_path: Path,
                                           dtype: Any) -> None:
        path = Path(shutil.copytree(made["single0"], tmp_path / "m"))
        config = json.loads((path / "config.json").read_text())
        config["dtype"] = dtype
        (path / "config.json").write_text(json.dumps(config))
        with pytest.raises(moestream.ModelFileError, match="not a torch floating-point dtype"):
            mt.from_pretrained(path, device="cpu")

    @pytest.mark.parametrize("dtype", ["float8", 3, "int32"])
    def test_dtype_argument(self, made: dict[str, Path], dtype: Any) -> None:
        with pytest.raises(moestream.UsageError, match="not a torch floating-point dtype"):
            mt.from_pretrained(made["single0"], device="cpu", dtype=dtype)

    def test_dtype_auto_is_the_checkpoints(self, made: dict[str, Path]) -> None:
        model = mt.from_pretrained(made["single0"], device="cpu", dtype="auto")
        try:
            assert model.dtype == torch.bfloat16
        finally:
            model.moestream.close()

    def test_hub_id_says_what_is_wanted(self, tmp_path: Path) -> None:
        with pytest.raises(moestream.ModelFileError, match="downloads nothing; fetch it first"):
            mt.from_pretrained("Qwen/Qwen3-30B-A3B", device="cpu", cache_dir=str(tmp_path))
