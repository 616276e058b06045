"""Tests of pipeline.table: offsets and sizes against the file, layouts, and bad files.

Good files come from ``tools.make_model`` (every preset, separate and fused gate/up); bad ones
are written by gguf's own ``GGUFWriter`` with one thing wrong, or cut from a good file by
byte surgery. Each bad file must raise its ``ModelFileError`` subclass in-process, and make
the CLI exit 2 with one stderr line naming the file.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType
from gguf import GGUFReader, GGUFWriter, ReaderTensor

from moestream.pipeline.foundation.digest import digest_bytes
from moestream.pipeline.foundation.errors import (
    ExpertLayoutError,
    ModelFileError,
    NotGGUFError,
    TruncatedFileError,
)
from moestream.pipeline.foundation.table import ByteRange, open_table
from moestream.pipeline.makers.modelgen import spec_for, write_model
from tests.gguf_files import finish_gguf

ROOT = Path(__file__).resolve().parents[2]
HIDDEN, FFN, EXPERTS = 32, 16, 4  # the hand-made files: tiny F16 experts

# (layers, experts) per preset: small files that keep every preset's per-expert sizes.
MODELS = {
    "tiny": ("tiny", 3, 8, False),
    "tiny-fused": ("tiny", 3, 8, True),
    "q2": ("ds4-flash-q2", 1, 2, False),
    "q4": ("ds4-flash-q4", 1, 2, False),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One file per entry of MODELS, written once for the module."""
    directory = tmp_path_factory.mktemp("models")
    return {
        name: write_model(spec_for(preset, layers, experts, fused_gate_up=fused),
                          directory / f"{name}.gguf")
        for name, (preset, layers, experts, fused) in MODELS.items()
    }


def _tensors(path: Path) -> tuple[GGUFReader, dict[str, ReaderTensor]]:
    reader = GGUFReader(path)
    return reader, {t.name: t for t in reader.tensors}


def _read(fd: int, r: ByteRange) -> bytes:
    data = os.pread(fd, r.nbytes, r.offset)
    assert len(data) == r.nbytes
    return data


def _reader_slices(tensors: dict[str, ReaderTensor], layer: int, expert: int) -> list[bytes]:
    """Expert ``expert``'s gate, up and down bytes as gguf's reader sees the tensors."""
    fused = tensors.get(f"blk.{layer}.ffn_gate_up_exps.weight")
    down = tensors[f"blk.{layer}.ffn_down_exps.weight"].data[expert].tobytes()
    if fused is not None:
        both = fused.data[expert].tobytes()
        return [both[: len(both) // 2], both[len(both) // 2 :], down]
    return [tensors[f"blk.{layer}.ffn_{m}_exps.weight"].data[expert].tobytes()
            for m in ("gate", "up")] + [down]


class TestSlices:
    """Every expert's ranges hold exactly the bytes gguf's reader and the digests describe."""

    @pytest.mark.parametrize("name", list(MODELS))
    def test_bytes_match_reader_and_digests(self, models: dict[str, Path], name: str) -> None:
        path = models[name]
        table = open_table(path)
        _, tensors = _tensors(path)
        fd = os.open(path, os.O_RDONLY)
        try:
            for slices in table.iter_slices():
                got = [_read(fd, r) for r in slices.ranges]
                assert got == _reader_slices(tensors, *slices.key), slices.key
                assert table.expected_digests(slices.key) == tuple(digest_bytes(b) for b in got)
        finally:
            os.close(fd)
        experts = MODELS[name][2]
        assert sum(1 for _ in table.iter_slices()) == len(table.layers) * experts
        assert table.file_bytes == path.stat().st_size

    @pytest.mark.parametrize(
        ("name", "sizes", "types", "shape"),
        [
            ("tiny", (262144, 262144, 262144), (QType.F16, QType.F16), (512, 256)),
            ("q2", (2162688, 2162688, 2752512), (QType.IQ2_XXS, QType.Q2_K), (4096, 2048)),
            ("q4", (4718592, 4718592, 4718592), (QType.Q4_K, QType.Q4_K), (4096, 2048)),
        ],
    )
    def test_preset_sizes(self, models: dict[str, Path], name: str,
                          sizes: tuple[int, int, int], types: tuple[QType, QType],
                          shape: tuple[int, int]) -> None:
        table = open_table(models[name])
        for layer in table.layers.values():
            assert (layer.gate_bytes, layer.up_bytes, layer.down_bytes) == sizes
            assert (layer.gate_up_type, layer.down_type) == types
            assert layer.shape == shape and layer.expert_bytes == sum(sizes)
            assert table.slices((layer.index, layer.n_experts - 1)).nbytes == sum(sizes)
        assert table.routed_bytes == len(table.layers) * table.n_experts * sum(sizes)

    def test_fused_gate_up_same_bytes_as_separate(self, models: dict[str, Path]) -> None:
        separate, fused = open_table(models["tiny"]), open_table(models["tiny-fused"])
        assert fused.moe_layers == separate.moe_layers
        for layer in fused.layers.values():
            assert layer.fused_gate_up and not separate.layers[layer.index].fused_gate_up
            assert layer.up_offset == layer.gate_offset + layer.gate_bytes
            assert layer.gate_up_stride == 2 * layer.gate_bytes
        fd_s, fd_f = os.open(separate.path, os.O_RDONLY), os.open(fused.path, os.O_RDONLY)
        try:
            for want in separate.iter_slices():
                got = fused.slices(want.key)
                assert got.nbytes == want.nbytes
                assert ([_read(fd_f, r) for r in got.ranges]
                        == [_read(fd_s, r) for r in want.ranges]), want.key
                assert fused.expected_digests(want.key) == separate.expected_digests(want.key)
        finally:
            os.close(fd_s)
            os.close(fd_f)

    def test_keys_outside_the_table(self, models: dict[str, Path]) -> None:
        table = open_table(models["tiny"])
        with pytest.raises(IndexError, match="not a MoE layer"):
            table.slices((0, 0))  # layer 0 is dense
        with pytest.raises(IndexError, match="has 8 experts"):
            table.slices((1, 8))


class TestLayout:
    """Dense, hash-routed and routed layers, and what else the file holds, are all accounted."""

    def test_dense_and_hash_routed_layers(self, models: dict[str, Path]) -> None:
        table = open_table(models["tiny"])
        assert table.n_layers == 3 and table.moe_layers == [1, 2]
        assert table.hash_routed == 1 and table.n_experts == 8 and table.top_k == 4
        assert table.layers[1].router is None  # hash-routed: no ffn_gate_inp
        router = table.layers[2].router
        assert router is not None and router.name == "blk.2.ffn_gate_inp.weight"
        assert table.hidden == 512
        summary = table.summary()
        assert summary["moe_layers"] == [1, 2] and summary["gate_up_type"] == "F16"

    @pytest.mark.parametrize("name", ["tiny", "tiny-fused", "q2"])
    def test_non_routed_listing_and_total(self, models: dict[str, Path], name: str) -> None:
        path = models[name]
        table = open_table(path)
        reader, tensors = _tensors(path)
        others = {n: t for n, t in tensors.items() if not n.endswith("_exps.weight")}
        assert [t.name for t in table.non_routed] == list(others)
        for info in table.non_routed:
            t = others[info.name]
            assert (info.offset, info.nbytes, info.type_name) == (
                t.data_offset, t.n_bytes, t.tensor_type.name)
        assert table.non_routed_bytes == sum(t.n_bytes for t in others.values())
        # Header, every tensor padded to the alignment: nothing in the file is unaccounted.
        padded = sum(-(-t.n_bytes // reader.alignment) * reader.alignment
                     for t in tensors.values())
        assert reader.data_offset + padded == table.file_bytes
        assert table.routed_bytes + table.non_routed_bytes <= table.file_bytes - reader.data_offset
        if name != "q2":
            assert "blk.0.ffn_gate.weight" in others  # the dense layer's FFN


# --- hand-made files -------------------------------------------------------------------------

Tensors = dict[str, np.ndarray]


def _moe_tensors(layers: tuple[int, ...] = (1, 2)) -> Tensors:
    """A dense block 0 and MoE ``layers`` of tiny F16 experts, in file order."""
    rng = np.random.default_rng(0)
    tensors: Tensors = {
        "token_embd.weight": rng.standard_normal((8, HIDDEN)).astype(np.float32),
        "blk.0.ffn_up.weight": rng.standard_normal((FFN, HIDDEN)).astype(np.float16),
    }
    for layer in layers:
        for matrix, shape in (("gate", (FFN, HIDDEN)), ("up", (FFN, HIDDEN)),
                              ("down", (HIDDEN, FFN))):
            tensors[f"blk.{layer}.ffn_{matrix}_exps.weight"] = (
                rng.standard_normal((EXPERTS, *shape)).astype(np.float16))
    return tensors


def _write_gguf(path: Path, tensors: Tensors, meta: dict[str, int] | None = None,
                digests: list[int] | None = None) -> Path:
    """``tensors`` in a GGUF written by gguf's writer, with block and expert counts."""
    blocks = 1 + max(int(n.split(".")[1]) for n in tensors if n.startswith("blk."))
    values = {"deepseek2.block_count": blocks, "deepseek2.expert_used_count": 2, **(meta or {})}
    writer = GGUFWriter(path, "deepseek2")
    for key, value in values.items():
        writer.add_uint32(key, value)
    return finish_gguf(writer, path, tensors, digests)


def _surgery(base: Path, out: Path, edit: Callable[[bytearray, GGUFReader], bytes]) -> Path:
    out.write_bytes(edit(bytearray(base.read_bytes()), GGUFReader(base)))
    return out


def _grow_last_tensor(data: bytearray, reader: GGUFReader) -> bytes:
    """Double the expert count of the last tensor: its data now runs past the end."""
    field = reader.tensors[-1].field
    dims_at = field.offset + sum(int(p.nbytes) for p in field.parts[:3])
    last_dim = dims_at + 8 * (len(reader.tensors[-1].shape) - 1)
    data[last_dim : last_dim + 8] = (2 * EXPERTS).to_bytes(8, "little")
    return bytes(data)


def _layout(edit: Callable[[Tensors], None]) -> Callable[[Path, Path], Path]:
    def make(base: Path, out: Path) -> Path:
        tensors = _moe_tensors()
        edit(tensors)
        return _write_gguf(out, tensors)
    return make


def _drop(name: str) -> Callable[[Tensors], None]:
    def edit(tensors: Tensors) -> None:
        del tensors[name]
    return edit


def _fewer_experts(*names: str, n: int) -> Callable[[Tensors], None]:
    def edit(tensors: Tensors) -> None:
        for name in names:
            tensors[name] = tensors[name][:n].copy()
    return edit


def _as_f32(name: str) -> Callable[[Tensors], None]:
    return lambda t: t.update({name: t[name].astype(np.float32)})


def _dense_only(tensors: Tensors) -> None:
    for name in [n for n in tensors if "_exps." in n]:
        del tensors[name]


def _bytes(content: bytes | Callable[[bytes], bytes]) -> Callable[[Path, Path], Path]:
    def make(base: Path, out: Path) -> Path:
        out.write_bytes(content(base.read_bytes()) if callable(content) else content)
        return out
    return make


def _mkdir(path: Path) -> Path:
    path.mkdir()
    return path


def _cut_in_data(data: bytes) -> bytes:
    return data[: (len(data) + 2048) // 2]


BAD: dict[str, tuple[Callable[[Path, Path], Path], type[ModelFileError]]] = {
    "wrong-magic": (_bytes(lambda d: b"GGML" + d[4:]), NotGGUFError),
    "version-1": (_bytes(lambda d: d[:4] + (1).to_bytes(4, "little") + d[8:]), NotGGUFError),
    "version-4": (_bytes(lambda d: d[:4] + (4).to_bytes(4, "little") + d[8:]), NotGGUFError),
    "big-endian": (_bytes(lambda d: d[:4] + (3).to_bytes(4, "big") + d[8:]), NotGGUFError),
    "cut-in-header": (_bytes(lambda d: d[:300]), TruncatedFileError),
    "cut-in-magic": (_bytes(b"GGU"), TruncatedFileError),
    "cut-in-data": (_bytes(_cut_in_data), TruncatedFileError),
    "data-past-end": (lambda base, out: _surgery(base, out, _grow_last_tensor),
                      TruncatedFileError),
    "no-down-exps": (_layout(_drop("blk.2.ffn_down_exps.weight")), ExpertLayoutError),
    "no-up-exps": (_layout(_drop("blk.1.ffn_up_exps.weight")), ExpertLayoutError),
    "experts-across-layers": (_layout(_fewer_experts(
        "blk.2.ffn_gate_exps.weight", "blk.2.ffn_up_exps.weight",
        "blk.2.ffn_down_exps.weight", n=2)), ExpertLayoutError),
    "experts-within-layer": (_layout(_fewer_experts("blk.1.ffn_gate_exps.weight", n=3)),
                             ExpertLayoutError),
    "gate-up-types": (_layout(_as_f32("blk.1.ffn_up_exps.weight")), ExpertLayoutError),
    "no-routed-experts": (_layout(_dense_only), ExpertLayoutError),
    "empty-file": (_bytes(b""), NotGGUFError),
    "text-file": (_bytes(b"not a model at all\n"), NotGGUFError),
    "directory": (lambda base, out: _mkdir(out), ModelFileError),
    "missing": (lambda base, out: out, ModelFileError),
    "device": (lambda base, out: Path(os.devnull), ModelFileError),
}


@pytest.fixture(scope="module")
def base_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The valid hand-made file every bad one differs from in one way."""
    return _write_gguf(tmp_path_factory.mktemp("base") / "base.gguf", _moe_tensors())


@pytest.fixture(scope="module")
def bad_files(base_file: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    directory = tmp_path_factory.mktemp("bad")
    return {name: make(base_file, directory / f"{name}.gguf") for name, (make, _) in BAD.items()}


# The CLI cases of the contract (the other entries differ only in the in-process check);
# each run is an interpreter start (~0.5 s), so they run a few at a time.
CLI_CASES = ["wrong-magic", "version-4", "cut-in-header", "cut-in-data", "data-past-end",
             "no-down-exps", "experts-across-layers", "experts-within-layer", "gate-up-types",
             "no-routed-experts", "directory", "missing", "empty-file"]


def _run_cli(path: Path) -> tuple[int, str, str]:
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline.run", "-m", str(path), "-n", "1", "--backend", "host"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    return proc.returncode, proc.stdout, proc.stderr


@pytest.fixture(scope="module")
def cli_runs(bad_files: dict[str, Path]) -> dict[str, tuple[int, str, str]]:
    """``python -m pipeline.run -m BAD -n 1 --backend host`` on every CLI case."""
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        runs = pool.map(_run_cli, [bad_files[name] for name in CLI_CASES])
        return dict(zip(CLI_CASES, runs, strict=True))


class TestBadFiles:
    """Each bad file is one typed error in-process and one line with exit 2 from the CLI."""

    def test_base_is_valid(self, base_file: Path) -> None:
        table = open_table(base_file)
        assert table.moe_layers == [1, 2] and table.n_experts == EXPERTS
        assert table.digests is None and table.expected_digests((1, 0)) is None
        assert table.layers[1].shape == (HIDDEN, FFN)

    @pytest.mark.parametrize("name", list(BAD))
    def test_typed_error(self, bad_files: dict[str, Path], name: str) -> None:
        path, error = bad_files[name], BAD[name][1]
        with pytest.raises(ModelFileError) as caught:
            open_table(path)
        assert type(caught.value) is error, caught.value
        message = str(caught.value)
        assert message.startswith(f"{path}: ") and "\n" not in message

    @pytest.mark.parametrize("name", CLI_CASES)
    def test_cli_exits_2_with_one_line(self, bad_files: dict[str, Path],
                                       cli_runs: dict[str, tuple[int, str, str]],
                                       name: str) -> None:
        code, _, err = cli_runs[name]
        assert code == 2, err
        lines = err.splitlines()
        assert len(lines) == 1, err
        assert lines[0].startswith("moestream: error: ") and str(bad_files[name]) in lines[0]
        assert "Traceback" not in err

    def test_messages_say_what_is_wrong(self, bad_files: dict[str, Path]) -> None:
        expected = {
            "wrong-magic": "magic b'GGML'",
            "version-4": "unsupported GGUF version 4",
            "big-endian": "big-endian",
            "data-past-end": "'blk.2.ffn_down_exps.weight' data ends at byte",
            "no-down-exps": "blk.2.ffn_down_exps.weight missing",
            "experts-across-layers": "disagree on the expert count: [2, 4]",
            "gate-up-types": "gate is F16 but up is F32",
            "directory": "is a directory",
            "missing": "no such file",
            "device": "not a regular file",
        }
        for name, words in expected.items():
            with pytest.raises(ModelFileError, match=words.replace("[", r"\[")):
                open_table(bad_files[name])


class TestMetadataChecks:
    """Metadata that contradicts the tensors is refused instead of reaching later stages."""

    @pytest.mark.parametrize(
        ("meta", "digests", "words"),
        [
            ({"deepseek2.expert_used_count": 0}, None, "expert_used_count 0 outside 1..4"),
            ({"deepseek2.expert_used_count": 5}, None, "expert_used_count 5 outside 1..4"),
            ({"moestream.hash_routed_layer_count": 3}, None, "hash_routed_layer_count 3"),
            ({"deepseek2.block_count": 7}, None, "block_count is 7"),
            ({}, [1, 2, 3], "holds 3 values"),
        ],
    )
    def test_refused(self, tmp_path: Path, meta: dict[str, int], digests: list[int] | None,
                     words: str) -> None:
        path = _write_gguf(tmp_path / "m.gguf", _moe_tensors(), meta, digests)
        with pytest.raises(ExpertLayoutError, match=words):
            open_table(path)

    def test_wrong_type_for_a_count(self, tmp_path: Path) -> None:
        path = tmp_path / "f.gguf"
        writer = GGUFWriter(path, "deepseek2")
        writer.add_float32("deepseek2.expert_used_count", 2.0)
        for name, array in _moe_tensors().items():
            writer.add_tensor(name, array)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        with pytest.raises(ExpertLayoutError, match="FLOAT32, not an integer"):
            open_table(path)

    @pytest.mark.parametrize(
        ("name", "shape", "words"),
        [
            ("blk.1.ffn_down_exps.weight", (EXPERTS, FFN, HIDDEN), "down experts are"),
            ("blk.1.ffn_up_exps.weight", (EXPERTS, HIDDEN, FFN), "up experts"),
        ],
    )
    def test_shapes_must_agree(self, tmp_path: Path, name: str, shape: tuple[int, ...],
                               words: str) -> None:
        tensors = _moe_tensors()
        tensors[name] = np.zeros(shape, np.float16)  # same bytes, transposed shape
        with pytest.raises(ExpertLayoutError, match=words):
            open_table(_write_gguf(tmp_path / "s.gguf", tensors))

