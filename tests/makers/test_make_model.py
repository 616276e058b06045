"""Tests of tools.make_model: sizes, layout, digests, determinism, atomicity and the CLI."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest
import structlog
from gguf import GGML_QUANT_SIZES, GGUFReader, ReaderTensor, quants
from gguf import GGMLQuantizationType as QType

from moestream.pipeline.foundation.digest import digest_bytes
from moestream.pipeline.foundation.errors import ModelFileError, UsageError
from moestream.pipeline.foundation.table import open_table
from moestream.pipeline.makers import modeldata
from moestream.pipeline.makers.modelgen import (
    PRESETS,
    ModelSpec,
    ensure_default_model,
    spec_for,
    write_model,
)
from moestream.tools.make_model import main

MiB = 2**20
SMALL = {"tiny": (3, 4), "ds4-flash-q2": (4, 2), "ds4-flash-q4": (4, 2)}  # (layers, experts)


def _write(directory: Path, preset: str, *, seed: int = 0, fused: bool = False) -> Path:
    layers, experts = SMALL[preset]
    spec = spec_for(preset, layers, experts, seed, fused_gate_up=fused)
    return write_model(spec, directory / f"{preset}-{seed}-{fused}.gguf")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One small file per preset, written once for the module."""
    directory = tmp_path_factory.mktemp("models")
    return {preset: _write(directory, preset) for preset in SMALL}


def _tensors(reader: GGUFReader) -> dict[str, ReaderTensor]:
    return {t.name: t for t in reader.tensors}


Slices = dict[tuple[int, int, int], npt.NDArray[np.uint8]]


def _expert_slices(path: Path, spec: ModelSpec) -> Slices:
    """Every (layer, expert, matrix) slice of the file, cut by offsets from GGUFReader."""
    reader = GGUFReader(path)
    tensors = _tensors(reader)
    raw = np.memmap(path, np.uint8, "r")
    slices = {}
    for layer in spec.moe_layers:
        for e in range(spec.n_experts):
            if spec.fused_gate_up:
                t = tensors[f"blk.{layer}.ffn_gate_up_exps.weight"]
                per = t.n_bytes // spec.n_experts
                start = t.data_offset + e * per
                half = per // 2
                slices[layer, e, 0] = raw[start : start + half]
                slices[layer, e, 1] = raw[start + half : start + per]
            else:
                for m, name in ((0, "gate"), (1, "up")):
                    t = tensors[f"blk.{layer}.ffn_{name}_exps.weight"]
                    per = t.n_bytes // spec.n_experts
                    start = t.data_offset + e * per
                    slices[layer, e, m] = raw[start : start + per]
            t = tensors[f"blk.{layer}.ffn_down_exps.weight"]
            per = t.n_bytes // spec.n_experts
            start = t.data_offset + e * per
            slices[layer, e, 2] = raw[start : start + per]
    return slices


def _spec_of(preset: str, **kw: object) -> ModelSpec:
    layers, experts = SMALL[preset]
    return spec_for(preset, layers, experts, **kw)  # type: ignore[arg-type]


class TestSpecs:
    """Presets and scaling have the per-expert sizes of DeepSeek V4 Flash quantizations."""

    def test_q2_sizes(self) -> None:
        spec = PRESETS["ds4-flash-q2"]
        assert spec.matrix_bytes == (int(2.0625 * MiB), int(2.0625 * MiB), int(2.625 * MiB))
        assert spec.expert_bytes == 7077888 == int(6.75 * MiB)

    def test_q4_sizes(self) -> None:
        spec = PRESETS["ds4-flash-q4"]
        assert spec.matrix_bytes == (int(4.5 * MiB),) * 3
        assert spec.expert_bytes == int(13.5 * MiB)

    def test_f16_sizes(self) -> None:
        spec = PRESETS["ds4-flash-f16"]
        q2 = PRESETS["ds4-flash-q2"]
        assert spec.expert_bytes == 3 * 4096 * 2048 * 2 == 48 * MiB
        assert spec.gate_up_type == spec.down_type == QType.F16
        shape = ("n_layers", "leading_dense", "hash_routed", "n_experts", "top_k", "hidden",
                 "expert_ffn")
        assert [getattr(spec, f) for f in shape] == [getattr(q2, f) for f in shape]

    def test_tiny_shape(self) -> None:
        spec = PRESETS["tiny"]
        assert (spec.n_layers, spec.leading_dense, spec.hash_routed) == (6, 1, 1)
        assert (spec.n_experts, spec.top_k, spec.hidden, spec.expert_ffn) == (32, 4, 512, 256)
        assert spec.gate_up_type == spec.down_type == QType.F16
        routed = len(spec.moe_layers) * spec.n_experts * spec.expert_bytes
        assert 110 * MiB < routed < 130 * MiB

    @pytest.mark.parametrize("preset", sorted(PRESETS))
    def test_scaling_keeps_expert_size(self, preset: str) -> None:
        small = spec_for(preset, layers=2, experts=3, seed=7)
        assert small.expert_bytes == PRESETS[preset].expert_bytes
        assert (small.n_layers, small.n_experts, small.seed) == (2, 3, 7)
        assert small.top_k <= 3 and len(small.moe_layers) >= 1

    @pytest.mark.parametrize(("layers", "experts"), [(0, 4), (4, 0), (-1, 2)])
    def test_bad_counts(self, layers: int, experts: int) -> None:
        with pytest.raises(UsageError):
            spec_for("ds4-flash-q2", layers, experts)

    def test_unknown_preset(self) -> None:
        with pytest.raises(UsageError, match="unknown preset"):
            spec_for("ds5")


class TestWrittenFile:
    """The written file is GGUF with the documented keys, tensors, sizes and digests."""

    @pytest.mark.parametrize("preset", sorted(SMALL))
    def test_expert_sizes_in_file(self, models: dict[str, Path], preset: str) -> None:
        spec = _spec_of(preset)
        tensors = _tensors(GGUFReader(models[preset]))
        gate, up, down = spec.matrix_bytes
        for layer in spec.moe_layers:
            g = tensors[f"blk.{layer}.ffn_gate_exps.weight"]
            u = tensors[f"blk.{layer}.ffn_up_exps.weight"]
            d = tensors[f"blk.{layer}.ffn_down_exps.weight"]
            assert g.n_bytes == spec.n_experts * gate and u.n_bytes == spec.n_experts * up
            assert d.n_bytes == spec.n_experts * down
            assert g.tensor_type == u.tensor_type == spec.gate_up_type
            assert d.tensor_type == spec.down_type
            # gguf order: ne0 = hidden (innermost), ne2 = experts (outermost)
            assert list(g.shape) == [spec.hidden, spec.expert_ffn, spec.n_experts]
            assert list(d.shape) == [spec.expert_ffn, spec.hidden, spec.n_experts]
        assert all(t.data_offset % 32 == 0 for t in tensors.values())

    @pytest.mark.parametrize("preset", sorted(SMALL))
    def test_metadata(self, models: dict[str, Path], preset: str) -> None:
        spec = _spec_of(preset)
        fields = GGUFReader(models[preset]).fields
        a = spec.arch  # deepseek2 for tiny, ds4's deepseek4 (no dense layers) for the others
        expect = {
            "general.architecture": a,
            f"{a}.block_count": spec.n_layers,
            f"{a}.embedding_length": spec.hidden,
            f"{a}.expert_feed_forward_length": spec.expert_ffn,
            f"{a}.expert_count": spec.n_experts,
            f"{a}.expert_used_count": spec.top_k,
            f"{a}.expert_shared_count": 1,
            **({f"{a}.leading_dense_block_count": spec.leading_dense} if a == "deepseek2"
               else {f"{a}.hash_layer_count": spec.hash_routed}),
            "moestream.preset": preset,
            "moestream.seed": 0,
            "moestream.hash_routed_layer_count": spec.hash_routed,
        }
        assert {key: fields[key].contents() for key in expect} == expect
        digests = fields["moestream.expert_digests"].contents()
        assert len(digests) == len(spec.moe_layers) * spec.n_experts * 3

    def test_layer_kinds(self, models: dict[str, Path]) -> None:
        spec = _spec_of("tiny")
        names = set(_tensors(GGUFReader(models["tiny"])))
        assert {"token_embd.weight", "output_norm.weight", "output.weight"} <= names
        assert {"blk.0.ffn_gate.weight", "blk.0.ffn_up.weight", "blk.0.ffn_down.weight"} <= names
        assert "blk.0.ffn_gate_exps.weight" not in names
        hash_layer = spec.leading_dense
        assert f"blk.{hash_layer}.ffn_gate_inp.weight" not in names
        assert f"blk.{hash_layer}.ffn_gate_exps.weight" in names
        for layer in spec.moe_layers[spec.hash_routed :]:
            assert f"blk.{layer}.ffn_gate_inp.weight" in names
        for layer in range(spec.n_layers):
            for shared in ("gate", "up", "down"):
                assert (f"blk.{layer}.ffn_{shared}_shexp.weight" in names) == (
                    layer >= spec.leading_dense)

    def test_router_shape(self, models: dict[str, Path]) -> None:
        # ds4's layout: every layer has an F16 router (a hash-routed one weights the
        # experts its tid2eid table picks)
        spec = _spec_of("ds4-flash-q2")
        tensors = _tensors(GGUFReader(models["ds4-flash-q2"]))
        for layer in range(spec.n_layers):
            router = tensors[f"blk.{layer}.ffn_gate_inp.weight"]
            assert router.tensor_type == QType.F16
            assert list(router.shape) == [spec.hidden, spec.n_experts]
        assert f"blk.{spec.hash_routed - 1}.ffn_gate_tid2eid.weight" in tensors

    @pytest.mark.parametrize("preset", sorted(SMALL))
    def test_digests_match_slices(self, models: dict[str, Path], preset: str) -> None:
        spec = _spec_of(preset)
        digests = GGUFReader(models[preset]).fields["moestream.expert_digests"].contents()
        slices = _expert_slices(models[preset], spec)
        for (layer, e, m), data in slices.items():
            index = ((layer - spec.leading_dense) * spec.n_experts + e) * 3 + m
            assert digests[index] == digest_bytes(np.ascontiguousarray(data)), (layer, e, m)
            assert data.size == spec.matrix_bytes[m]

    @pytest.mark.parametrize("preset", sorted(SMALL))
    def test_dequantizes_finite(self, models: dict[str, Path], preset: str) -> None:
        spec = _spec_of(preset)
        slices = _expert_slices(models[preset], spec)
        layer = spec.moe_layers[-1]
        for m, qtype in enumerate((spec.gate_up_type, spec.gate_up_type, spec.down_type)):
            values = quants.dequantize(np.ascontiguousarray(slices[layer, 1, m]), qtype)
            assert values.size == spec.hidden * spec.expert_ffn
            assert np.isfinite(values).all()
            assert 0 < np.abs(values).max() < 100


class TestF16Preset:
    """A scaled-down ds4-flash-f16 file opens as an expert table with F16 experts and a
    router: what real compute and the live router need."""

    def test_opens_with_f16_experts_and_a_router(self, tmp_path: Path) -> None:
        # 4 layers is the fewest with a router (the first 3 MoE layers are hash-routed);
        # 2 experts keep the file at ~0.6 GiB (48 MiB experts and shared experts)
        spec = spec_for("ds4-flash-f16", layers=4, experts=2)
        table = open_table(write_model(spec, tmp_path / "f16.gguf"))
        assert table.moe_layers == [0, 1, 2, 3] and table.hash_routed == 3
        assert (table.n_experts, table.top_k, table.hidden) == (2, 2, 4096)
        for layer in table.layers.values():
            assert layer.gate_up_type == layer.down_type == QType.F16
            assert layer.expert_bytes == 48 * MiB and layer.shape == (4096, 2048)
            assert layer.router is not None  # ds4's hash layers carry one too
        router = table.layers[3].router
        assert router is not None and router.type_name == QType.F16.name
        assert router.nbytes == 2 * 4096 * 2
        assert table.digests is not None


class TestDeterminism:
    """Bytes depend only on the seed and differ for every (layer, expert, matrix)."""

    def test_same_seed_same_file(self, models: dict[str, Path], tmp_path: Path) -> None:
        again = _write(tmp_path, "ds4-flash-q2")
        first = hashlib.sha256(models["ds4-flash-q2"].read_bytes()).digest()
        assert hashlib.sha256(again.read_bytes()).digest() == first

    def test_every_matrix_differs(self, models: dict[str, Path]) -> None:
        digests = GGUFReader(models["tiny"]).fields["moestream.expert_digests"].contents()
        assert len(set(digests)) == len(digests)

    def test_other_seed_other_bytes(self, models: dict[str, Path], tmp_path: Path) -> None:
        other = _write(tmp_path, "tiny", seed=1)
        spec = _spec_of("tiny")
        a, b = _expert_slices(models["tiny"], spec), _expert_slices(other, spec)
        assert all(not np.array_equal(a[key], b[key]) for key in a)


class TestFused:
    """With fused_gate_up each expert's slice is its gate rows then its up rows."""

    def test_fused_matches_separate(self, models: dict[str, Path], tmp_path: Path) -> None:
        fused = _write(tmp_path, "ds4-flash-q2", fused=True)
        spec = _spec_of("ds4-flash-q2", fused_gate_up=True)
        tensors = _tensors(GGUFReader(fused))
        layer = spec.moe_layers[0]
        assert f"blk.{layer}.ffn_gate_exps.weight" not in tensors
        gate_up = tensors[f"blk.{layer}.ffn_gate_up_exps.weight"]
        assert gate_up.tensor_type == spec.gate_up_type
        assert list(gate_up.shape) == [spec.hidden, 2 * spec.expert_ffn, spec.n_experts]
        assert gate_up.n_bytes == spec.n_experts * 2 * spec.matrix_bytes[0]
        separate = _expert_slices(models["ds4-flash-q2"], _spec_of("ds4-flash-q2"))
        joined = _expert_slices(fused, spec)
        assert all(np.array_equal(separate[key], joined[key]) for key in separate)
        digests = GGUFReader(fused).fields["moestream.expert_digests"].contents()
        assert digests == GGUFReader(models["ds4-flash-q2"]).fields[
            "moestream.expert_digests"].contents()


class TestAtomicity:
    """A failed or interrupted write leaves no temp file and the old destination intact."""

    @pytest.mark.parametrize("error", [RuntimeError("boom"), KeyboardInterrupt()])
    def test_failure_leaves_nothing(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                    error: BaseException) -> None:
        calls = 0
        real = modeldata.piece_bytes

        def failing(piece: modeldata.Piece) -> npt.NDArray[np.uint8]:
            nonlocal calls
            calls += 1
            if calls == 20:
                raise error
            return real(piece)

        monkeypatch.setattr(modeldata, "piece_bytes", failing)
        target = tmp_path / "m.gguf"
        target.write_bytes(b"old")
        with pytest.raises(type(error)):
            write_model(_spec_of("tiny"), target)
        assert os.listdir(tmp_path) == ["m.gguf"]
        assert target.read_bytes() == b"old"

    def test_os_error_is_model_file_error(self, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
        def full_disk(fd: int) -> None:
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(os, "fsync", full_disk)
        with pytest.raises(ModelFileError, match="No space left"):
            write_model(_spec_of("tiny"), tmp_path / "m.gguf")
        assert os.listdir(tmp_path) == []


class TestDefaultModel:
    """The default tiny model is made once in the user cache and then re-used."""

    def test_made_once(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
        path = ensure_default_model()
        assert path.parent == tmp_path / "moestream" and path.name.startswith("tiny-")
        stamp = path.stat().st_mtime_ns
        assert ensure_default_model() == path and path.stat().st_mtime_ns == stamp
        size = path.stat().st_size
        with path.open("r+b") as f:
            f.truncate(size - 32)
        assert ensure_default_model() == path and path.stat().st_size == size
        assert GGUFReader(path).fields["moestream.preset"].contents() == "tiny"


class TestCli:
    """The command line writes a model and turns bad options into one line and exit 2."""

    @pytest.fixture(autouse=True)
    def _reset_logging(self) -> Iterator[None]:
        """main() points structlog at the current stderr; undo that after each test."""
        yield
        structlog.reset_defaults()

    @pytest.mark.parametrize("argv", [
        ["--preset", "nope"], ["--layers", "x"], ["--experts", "0"], ["--bogus"], [],
    ])
    def test_bad_option(self, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                        argv: list[str]) -> None:
        out = [str(tmp_path / "m.gguf")] if argv else []
        assert main(out + argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "error" in err
        assert not (tmp_path / "m.gguf").exists()

    def test_existing_needs_force(self, tmp_path: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
        target = tmp_path / "m.gguf"
        target.write_bytes(b"old")
        argv = [str(target), "--layers", "2", "--experts", "2"]
        assert main(argv) == 2 and "--force" in capsys.readouterr().err
        assert main([*argv, "--force", "--seed", "3"]) == 0
        summary = capsys.readouterr().out
        assert summary.count("\n") == 1 and "tiny" in summary
        assert GGUFReader(target).fields["moestream.seed"].contents() == 3


class TestOtherShapes:
    """Qwen3-30B-A3B (small experts) and Mixtral-8x7B (large experts), and files written
    the way real ones come, without moestream metadata."""

    def test_qwen3_sizes(self) -> None:
        spec = PRESETS["qwen3-30b-a3b"]
        block, type_size = GGML_QUANT_SIZES[QType.Q4_K]
        matrix = 2048 * 768 // block * type_size
        assert matrix == 864 * 1024 and spec.matrix_bytes == (matrix,) * 3
        assert spec.expert_bytes == 2654208 and round(spec.expert_bytes / MiB, 2) == 2.53
        shape = (spec.n_layers, spec.leading_dense, spec.hash_routed, spec.n_experts,
                 spec.top_k, spec.hidden, spec.expert_ffn, spec.shared_experts)
        assert shape == (48, 0, 0, 128, 8, 2048, 768, 0)
        assert spec.arch == "qwen3moe"

    def test_mixtral_sizes(self) -> None:
        spec = PRESETS["mixtral-8x7b"]
        block, type_size = GGML_QUANT_SIZES[QType.Q4_K]
        assert spec.matrix_bytes == (4096 * 14336 // block * type_size,) * 3
        assert spec.expert_bytes == int(94.5 * MiB) >= 50 * MiB
        shape = (spec.n_layers, spec.n_experts, spec.top_k, spec.hidden, spec.expert_ffn)
        assert shape == (32, 8, 2, 4096, 14336) and spec.arch == "llama"

    def test_small_qwen3_file(self, tmp_path: Path) -> None:
        spec = spec_for("qwen3-30b-a3b", layers=2, experts=4)
        path = write_model(spec, tmp_path / "q.gguf")
        table = open_table(path)
        assert table.moe_layers == [0, 1] and (table.n_experts, table.top_k) == (4, 4)
        assert table.hash_routed == 0 and table.hidden == 2048
        assert all(layer.router is not None for layer in table.layers.values())
        assert all(layer.expert_bytes == spec.expert_bytes for layer in table.layers.values())
        reader = GGUFReader(path)
        assert reader.fields["general.architecture"].contents() == "qwen3moe"
        assert not [t.name for t in reader.tensors if "shexp" in t.name]
        assert table.digests is not None
        slices = _expert_slices(path, spec)
        for (layer, e, m), data in slices.items():
            assert table.digests[layer, e, m] == digest_bytes(np.ascontiguousarray(data))

    def test_no_digests_same_bytes_no_metadata(self, models: dict[str, Path],
                                               tmp_path: Path) -> None:
        spec = _spec_of("tiny")
        plain = write_model(spec, tmp_path / "plain.gguf", record_digests=False)
        assert not [k for k in GGUFReader(plain).fields if k.startswith("moestream.")]
        table = open_table(plain)
        assert table.digests is None and table.hash_routed == 0
        a, b = _expert_slices(models["tiny"], spec), _expert_slices(plain, spec)
        assert all(np.array_equal(a[key], b[key]) for key in a)

    def test_cli_large_experts_without_digests(self, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
        out = tmp_path / "mixtral.gguf"
        assert main([str(out), "--preset", "mixtral-8x7b", "--layers", "1", "--experts", "1",
                     "--no-digests"]) == 0
        assert "mixtral-8x7b, 1 layers x 1 experts" in capsys.readouterr().out
        reader = GGUFReader(out)
        assert reader.fields["general.architecture"].contents() == "llama"
        assert not [k for k in reader.fields if k.startswith("moestream.")]
        table = open_table(out)
        assert table.digests is None and table.top_k == 1
        assert table.layers[0].expert_bytes == int(94.5 * MiB)
