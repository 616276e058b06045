"""Tests of pipeline.makers.checkpointgen and ``tools.make_model --format safetensors``: the written
checkpoint opens as an expert table whose every expert's bytes are the tensor bytes the
safetensors reader sees; shards, dtypes, values, atomic replacement and the CLI. Also
checkpoints written by transformers itself (``save_pretrained``)."""

from __future__ import annotations

import itertools
import json
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from safetensors import safe_open

from moestream.pipeline.foundation.errors import OutputError, UsageError
from moestream.pipeline.foundation.experts import ExpertTable
from moestream.pipeline.foundation.table import open_table
from moestream.pipeline.makers import checkpointgen
from moestream.pipeline.makers.checkpointgen import (
    INDEX_NAME,
    CheckpointOptions,
    checkpoint_config,
    plan_shards,
    shard_names,
    to_bf16,
    write_checkpoint,
)
from moestream.pipeline.makers.modelgen import ModelSpec, spec_for
from moestream.tools.make_model import main

KiB = 1024
SPEC = spec_for("tiny", 2, 3, seed=7)  # hidden 512, expert FFN 256


def _header(path: Path) -> tuple[dict[str, Any], int]:
    """A shard's header entries (without metadata) and where its data starts."""
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


def _raw_tensors(directory: Path) -> dict[str, tuple[str, list[int], bytes]]:
    """Every tensor of every shard as (dtype, shape, bytes), by plain header parsing."""
    out = {}
    for shard in sorted(directory.glob("*.safetensors")):
        header, start = _header(shard)
        data = shard.read_bytes()
        for name, entry in header.items():
            begin, end = entry["data_offsets"]
            out[name] = (entry["dtype"], entry["shape"], data[start + begin: start + end])
    return out


def _expert_bytes(tensors: dict[str, tuple[str, list[int], bytes]], layer: int, expert: int,
                  ) -> tuple[bytes, bytes, bytes]:
    """Expert ``(layer, expert)``'s gate, up, down bytes as the tensors hold them."""
    p = f"model.layers.{layer}.mlp.experts."
    if p + "gate_up_proj" in tensors:
        _, shape, gate_up = tensors[p + "gate_up_proj"]
        _, _, down = tensors[p + "down_proj"]
        per, down_per = len(gate_up) // shape[0], len(down) // shape[0]
        one = gate_up[expert * per: (expert + 1) * per]
        return (one[: per // 2], one[per // 2:],
                down[expert * down_per: (expert + 1) * down_per])
    return tuple(tensors[f"{p}{expert}.{m}_proj.weight"][2]  # type: ignore[return-value]
                 for m in ("gate", "up", "down"))


def _table_bytes(table: ExpertTable, layer: int, expert: int) -> tuple[bytes, ...]:
    s = table.slices((layer, expert))
    return tuple(table.read_bytes(r.offset, r.nbytes) for r in s.ranges)


def _write(tmp_path: Path, name: str, spec: ModelSpec = SPEC, **options: object) -> Path:
    opts = CheckpointOptions(**options)  # type: ignore[arg-type]
    return write_checkpoint(spec, tmp_path / name, opts).path


class TestTable:
    """What make_model writes opens as a table that maps every expert to its tensors."""

    @pytest.mark.parametrize("fused", [False, True], ids=["per-expert", "fused"])
    @pytest.mark.parametrize("dtype", ["bf16", "f16", "f32"])
    def test_every_expert_maps_to_its_tensor_bytes(self, tmp_path: Path, fused: bool,
                                                   dtype: str) -> None:
        path = _write(tmp_path, "ckpt", dtype=dtype, fused_experts=fused,
                      shard_bytes=700 * KiB)
        shards = sorted(path.glob("*.safetensors"))
        assert len(shards) > 3
        table = open_table(path)
        assert table.format == "safetensors"
        assert len(table.files) == len(shards)
        assert table.moe_layers == list(range(SPEC.n_layers))
        assert table.n_experts == SPEC.n_experts and table.top_k == SPEC.top_k
        assert table.hidden == SPEC.hidden
        item = {"bf16": 2, "f16": 2, "f32": 4}[dtype]
        layer0 = table.layers[0]
        assert layer0.shape == (SPEC.hidden, SPEC.expert_ffn)
        assert layer0.gate_up_type.name == dtype.upper()
        assert layer0.expert_bytes == 3 * SPEC.hidden * SPEC.expert_ffn * item
        assert layer0.router is not None
        assert layer0.router.name == "model.layers.0.mlp.gate.weight"
        tensors = _raw_tensors(path)
        for layer in range(SPEC.n_layers):
            for expert in range(SPEC.n_experts):
                assert _table_bytes(table, layer, expert) == _expert_bytes(tensors, layer,
                                                                           expert)

    @pytest.mark.parametrize("dtype", ["f16", "f32"])
    def test_the_safetensors_reader_sees_the_same_tensors(self, tmp_path: Path,
                                                          dtype: str) -> None:
        path = _write(tmp_path, "ckpt", dtype=dtype, shard_bytes=1 << 20)
        tensors = _raw_tensors(path)
        index = json.loads((path / INDEX_NAME).read_text())
        assert set(index["weight_map"]) == set(tensors)
        for name, shard in index["weight_map"].items():
            with safe_open(path / shard, framework="numpy") as f:
                array = f.get_tensor(name)
            assert array.dtype == {"f16": np.float16, "f32": np.float32}[dtype]
            assert list(array.shape) == tensors[name][1]
            assert array.tobytes() == tensors[name][2]

    def test_bf16_read_back_by_torch_is_the_table_bytes(self, tmp_path: Path) -> None:
        torch = pytest.importorskip("torch")
        from safetensors.torch import load_file

        path = _write(tmp_path, "ckpt", shard_bytes=1 << 20)
        table = open_table(path)
        loaded = {}
        for shard in path.glob("*.safetensors"):
            loaded.update(load_file(shard))
        for layer in range(SPEC.n_layers):
            for expert in range(SPEC.n_experts):
                for m, got in zip(("gate", "up", "down"), _table_bytes(table, layer, expert),
                                  strict=True):
                    t = loaded[f"model.layers.{layer}.mlp.experts.{expert}.{m}_proj.weight"]
                    assert t.dtype == torch.bfloat16
                    assert t.view(torch.int16).numpy().tobytes() == got


class TestValues:
    """Deterministic, small, finite values; the same experts in either layout."""

    def test_same_seed_same_bytes_other_seed_others(self, tmp_path: Path) -> None:
        a = _raw_tensors(_write(tmp_path, "a"))
        b = _raw_tensors(_write(tmp_path, "b"))
        c = _raw_tensors(_write(tmp_path, "c", spec_for("tiny", 2, 3, seed=8)))
        assert a == b
        name = "model.layers.1.mlp.experts.2.down_proj.weight"
        assert a[name][2] != c[name][2]

    @pytest.mark.parametrize("dtype", ["bf16", "f16", "f32"])
    def test_fused_and_per_expert_hold_the_same_experts(self, tmp_path: Path,
                                                        dtype: str) -> None:
        per = open_table(_write(tmp_path, "per", dtype=dtype))
        fused = open_table(_write(tmp_path, "fused", dtype=dtype, fused_experts=True))
        for layer in range(SPEC.n_layers):
            for expert in range(SPEC.n_experts):
                assert _table_bytes(per, layer, expert) == _table_bytes(fused, layer, expert)

    def test_experts_differ_and_are_small_and_finite(self, tmp_path: Path) -> None:
        path = _write(tmp_path, "ckpt", dtype="f32")
        with safe_open(path / "model.safetensors", framework="numpy") as f:
            gate = f.get_tensor("model.layers.0.mlp.experts.0.gate_proj.weight")
            other = f.get_tensor("model.layers.0.mlp.experts.1.gate_proj.weight")
            norm = f.get_tensor("model.layers.0.input_layernorm.weight")
        assert np.isfinite(gate).all() and np.abs(gate).max() < 0.05
        assert 0.015 < float(gate.std()) < 0.025
        assert not np.array_equal(gate, other)
        assert (norm == 1).all()

    def test_bf16_rounds_to_nearest_even(self) -> None:
        values = np.array([1.0, 1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-20, -0.02,
                           np.float32(np.pi)], dtype=np.float32)
        want = [0x3F80, 0x3F80, 0x3F82, 0x3F81]  # ties go to even, above a tie up
        got = to_bf16(values.copy())
        assert [int(v) for v in got[:4]] == want
        torch = pytest.importorskip("torch")
        ref = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy()
        assert got.tobytes() == ref.tobytes()


class TestShards:
    """Shards of at most the size asked, named as transformers names them."""

    @given(st.lists(st.integers(1, 1000), min_size=1, max_size=60), st.integers(1, 3000))
    def test_runs_cover_in_order_within_the_size(self, sizes: list[int], limit: int) -> None:
        runs = plan_shards(sizes, limit)
        assert [i for r in runs for i in r] == list(range(len(sizes)))
        for r in runs:
            held = sum(sizes[i] for i in r)
            assert held <= limit or len(r) == 1
        for a, b in itertools.pairwise(runs):  # greedy: b's first did not fit in a
            assert sum(sizes[i] for i in a) + sizes[b[0]] > limit

    def test_names(self) -> None:
        assert shard_names(1) == ["model.safetensors"]
        assert shard_names(3)[2] == "model-00003-of-00003.safetensors"

    def test_index_only_with_several_shards(self, tmp_path: Path) -> None:
        one = _write(tmp_path, "one")
        assert sorted(p.name for p in one.iterdir()) == ["config.json", "model.safetensors"]
        many = _write(tmp_path, "many", shard_bytes=1 << 20)
        index = json.loads((many / INDEX_NAME).read_text())
        shards = sorted(p.name for p in many.glob("*.safetensors"))
        assert shards == shard_names(len(shards))
        assert sorted(set(index["weight_map"].values())) == shards
        total = sum(len(t[2]) for t in _raw_tensors(many).values())
        assert index["metadata"]["total_size"] == total
        for shard in shards[:-1]:  # within the size (each holds more than one tensor here)
            _, start = _header(many / shard)
            assert (many / shard).stat().st_size - start <= 1 << 20

    def test_a_tensor_larger_than_the_shard_size_gets_its_own(self, tmp_path: Path) -> None:
        path = _write(tmp_path, "ckpt", fused_experts=True, shard_bytes=100 * KiB)
        for shard in path.glob("*.safetensors"):
            header, _ = _header(shard)
            big = [n for n, e in header.items()
                   if e["data_offsets"][1] - e["data_offsets"][0] > 100 * KiB]
            assert len(big) <= 1 and (not big or len(header) == 1)


class TestConfig:
    """config.json is a Qwen3-MoE config the table and transformers both read."""

    def test_keys(self) -> None:
        config = checkpoint_config(SPEC, CheckpointOptions())
        assert config["model_type"] == "qwen3_moe"
        assert config["architectures"] == ["Qwen3MoeForCausalLM"]
        assert config["num_experts"] == 3 and config["num_hidden_layers"] == 2
        assert config["mlp_only_layers"] == [] and config["decoder_sparse_step"] == 1
        assert config["torch_dtype"] == "bfloat16"

    def test_transformers_loads_it_whole(self, tmp_path: Path) -> None:
        pytest.importorskip("torch")
        transformers = pytest.importorskip("transformers")
        path = _write(tmp_path, "ckpt", spec_for("tiny", 2, 4), shard_bytes=1 << 20)
        config = transformers.AutoConfig.from_pretrained(path)
        assert type(config).__name__ == "Qwen3MoeConfig"
        assert config.num_experts == 4 and config.moe_intermediate_size == 256
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            path, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"]
        experts = model.model.layers[1].mlp.experts
        table = open_table(path)
        gate, up, down = _table_bytes(table, 1, 3)
        f = SPEC.expert_ffn
        weight = experts.gate_up_proj[3].detach().contiguous()
        import torch

        assert weight[:f].view(torch.int16).numpy().tobytes() == gate
        assert weight[f:].view(torch.int16).numpy().tobytes() == up
        assert experts.down_proj[3].detach().view(torch.int16).numpy().tobytes() == down


class TestOutput:
    """Atomic: a finished directory or nothing; an existing one only with --force."""

    def test_existing_refused_without_replace(self, tmp_path: Path) -> None:
        path = _write(tmp_path, "ckpt")
        with pytest.raises(UsageError, match="exists"):
            _write(tmp_path, "ckpt")
        before = _raw_tensors(path)
        write_checkpoint(spec_for("tiny", 2, 3, seed=9), path, replace=True)
        assert _raw_tensors(path) != before
        assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]

    def test_replace_takes_a_file_but_never_a_directory_of_other_things(
            self, tmp_path: Path) -> None:
        (tmp_path / "model").write_bytes(b"old")
        write_checkpoint(SPEC, tmp_path / "model", replace=True)
        assert (tmp_path / "model" / "config.json").is_file()
        home = tmp_path / "home"
        home.mkdir()
        (home / "notes.txt").write_text("keep")
        with pytest.raises(OutputError, match=r"notes\.txt"):
            write_checkpoint(SPEC, home, replace=True)
        assert (home / "notes.txt").read_text() == "keep"

    def test_links_and_fifos_refused(self, tmp_path: Path) -> None:
        (tmp_path / "real").mkdir()
        (tmp_path / "link").symlink_to(tmp_path / "real")
        with pytest.raises(OutputError, match="symbolic link"):
            write_checkpoint(SPEC, tmp_path / "link", replace=True)
        os.mkfifo(tmp_path / "fifo")
        with pytest.raises(OutputError, match=r"(?i)fifo"):
            write_checkpoint(SPEC, tmp_path / "fifo", replace=True)
        with pytest.raises(OutputError):
            write_checkpoint(SPEC, tmp_path / "missing" / "ckpt")

    def test_a_failed_write_leaves_nothing_and_the_old_checkpoint(
            self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        path = _write(tmp_path, "ckpt")
        before = _raw_tensors(path)

        def full(*args: object) -> None:
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(checkpointgen, "serialize_file", full)
        with pytest.raises(OutputError, match="No space left"):
            write_checkpoint(SPEC, path, CheckpointOptions(shard_bytes=1 << 20), replace=True)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
        assert _raw_tensors(path) == before

    def test_bad_options(self) -> None:
        with pytest.raises(UsageError):
            CheckpointOptions(dtype="f8")  # type: ignore[arg-type]
        with pytest.raises(UsageError):
            CheckpointOptions(shard_bytes=0)


class TestCli:
    """``python -m tools.make_model OUT --format safetensors``."""

    def test_writes_and_summarizes(self, tmp_path: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
        out = tmp_path / "q"
        argv = [str(out), "--format", "safetensors", "--preset", "qwen3-30b-a3b", "--layers",
                "1", "--experts", "4", "--dtype", "f16", "--fused-experts", "--shard-size",
                "4MiB"]
        assert main(argv) == 0
        line = capsys.readouterr().out
        assert "qwen3-30b-a3b, 1 layers x 4 experts, f16" in line and "shards" in line
        table = open_table(out)
        assert table.layers[0].fused_gate_up and table.layers[0].shape == (2048, 768)
        assert table.layers[0].gate_up_type.name == "F16"
        assert main(argv) == 2
        assert "exists (use --force" in capsys.readouterr().err
        assert main([*argv, "--force"]) == 0

    @pytest.mark.parametrize("argv, message", [
        (["--dtype", "f16"], "--dtype is for --format safetensors"),
        (["--shard-size", "lots"], "cannot read size"),
        (["--format", "safetensors", "--fused-gate-up"], "--fused-experts"),
        (["--format", "safetensors", "--shard-size", "lots"], "cannot read size"),
        (["--format", "safetensors", "--dtype", "f8"], "invalid choice"),
    ])
    def test_misused_options_one_line(self, tmp_path: Path, argv: list[str], message: str,
                                      capsys: pytest.CaptureFixture[str]) -> None:
        assert main([str(tmp_path / "m"), *argv]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1
        assert not (tmp_path / "m").exists()


class TestWrittenByTransformers:
    """Checkpoints ``save_pretrained`` writes map every expert to the model's weights."""

    @pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
    @pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
    def test_every_expert_is_the_models_weight(self, tmp_path: Path, arch: str,
                                               dtype: str) -> None:
        torch = pytest.importorskip("torch")
        transformers = pytest.importorskip("transformers")
        torch.manual_seed(0)
        shape = {"hidden_size": 64, "num_hidden_layers": 3, "vocab_size": 128,
                 "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
                 "num_experts_per_tok": 2}
        if arch == "mixtral":
            config = transformers.MixtralConfig(intermediate_size=48, num_local_experts=4,
                                                **shape)
            model = transformers.MixtralForCausalLM(config)
        else:
            config = transformers.Qwen3MoeConfig(intermediate_size=96,
                                                 moe_intermediate_size=48, num_experts=4,
                                                 **shape)
            model = transformers.Qwen3MoeForCausalLM(config)
        model = model.to(getattr(torch, dtype))
        model.save_pretrained(tmp_path / "hf", max_shard_size="40KB")
        assert (tmp_path / "hf" / INDEX_NAME).exists()
        table = open_table(tmp_path / "hf")
        assert table.moe_layers == [0, 1, 2] and table.n_experts == 4 and table.top_k == 2
        assert table.layers[0].shape == (64, 48)
        as_int = torch.int16 if dtype == "bfloat16" else torch.int32
        for layer in range(3):
            experts = model.model.layers[layer].mlp.experts
            for e in range(4):
                gate_up = experts.gate_up_proj[e].detach().contiguous()
                want = (gate_up[:48], gate_up[48:], experts.down_proj[e].detach())
                got = _table_bytes(table, layer, e)
                for w, g in zip(want, got, strict=True):
                    assert w.contiguous().view(as_int).numpy().tobytes() == g
