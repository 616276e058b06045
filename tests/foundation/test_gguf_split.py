"""A GGUF model split into shards (``pipeline.foundation.gguf_split``): gguf's own writer's
splits and ``tools.make_model --shard-size``'s give the table of the whole file, byte for
byte, from any shard's name; a split that does not hold together is one typed error and one
line with exit 2."""

from __future__ import annotations

import ctypes
import shutil
import tempfile
from pathlib import Path

import pytest
from gguf import GGUFReader
from hypothesis import given, settings
from hypothesis import strategies as st

import moestream
from moestream.pipeline.foundation.errors import ExpertLayoutError, ModelFileError
from moestream.pipeline.foundation.experts import ExpertTable
from moestream.pipeline.foundation.gguf_split import shard_name
from moestream.pipeline.foundation.table import open_table
from moestream.pipeline.makers.modelgen import spec_for, write_model
from moestream.pipeline.run import main
from moestream.tools.make_model import main as make_model
from tests.gguf_files import write_plain_moe


def _shards(first: Path) -> list[Path]:
    return sorted(first.parent.glob(first.name.replace("-00001-of-", "-*-of-")))


def _assert_same_model(split: ExpertTable, whole: ExpertTable) -> None:
    """Every expert slice and every other tensor holds the same bytes in both."""
    assert split.layers.keys() == whole.layers.keys()
    assert (split.top_k, split.hidden, split.n_layers) == (whole.top_k, whole.hidden,
                                                           whole.n_layers)
    for index, layer in whole.layers.items():
        for expert in range(layer.n_experts):
            for ours, theirs in zip(split.layers[index].slices(expert).ranges,
                                    layer.slices(expert).ranges, strict=True):
                assert split.read_bytes(ours.offset, ours.nbytes) == \
                    whole.read_bytes(theirs.offset, theirs.nbytes)
    assert [t.name for t in split.non_routed] == [t.name for t in whole.non_routed]
    for ours, theirs in zip(split.non_routed, whole.non_routed, strict=True):
        assert split.read_bytes(ours.offset, ours.nbytes) == \
            whole.read_bytes(theirs.offset, theirs.nbytes)


class TestGgufWritersSplits:
    """gguf's ``GGUFWriter(split_max_tensors=N)``: tensors of a layer in different shards,
    a tensor a shard, shards at odd offsets (a 333-value tensor first)."""

    @pytest.mark.parametrize("per_shard", [1, 3, 5])
    def test_same_as_the_whole_file(self, tmp_path: Path, per_shard: int) -> None:
        whole = open_table(write_plain_moe(tmp_path / "whole.gguf"))
        (tmp_path / "split").mkdir()
        first = write_plain_moe(tmp_path / "split" / "m.gguf", split_max_tensors=per_shard)
        shards = _shards(first)
        assert first.name == shard_name("m", 1, len(shards)) and len(shards) > 1
        for shard in (shards[0], shards[-1]):
            table = open_table(shard)
            assert table.path == first and [f.path for f in table.files] == shards
            _assert_same_model(table, whole)

    @settings(max_examples=12, deadline=None)
    @given(per_shard=st.integers(1, 11), pad=st.integers(1, 700), layers=st.integers(1, 3))
    def test_any_split_is_the_whole_file(self, per_shard: int, pad: int, layers: int) -> None:
        """Whatever the shard size (a tensor a shard to one shard), and wherever the tensors
        start (a ``pad``-value tensor first), the split's table is the whole file's."""
        with tempfile.TemporaryDirectory() as made:
            root = Path(made)
            whole = open_table(write_plain_moe(root / "w.gguf", layers=layers, pad_elems=pad))
            (root / "s").mkdir()
            first = write_plain_moe(root / "s" / "m.gguf", layers=layers, pad_elems=pad,
                                    split_max_tensors=per_shard)
            _assert_same_model(open_table(first), whole)

    @pytest.mark.parametrize("mode", ["direct", "resident"])
    def test_an_engine_fetches_the_experts_gguf_reads(self, tmp_path: Path, mode: str) -> None:
        """An engine's ``open_sync(shard).fetch`` hands out each expert's matrices as gguf's
        own reader of the shard holding them reads them."""
        first = write_plain_moe(tmp_path / "m.gguf", split_max_tensors=2)
        theirs = {t.name: t for shard in _shards(first) for t in GGUFReader(shard).tensors}
        with moestream.open_sync(_shards(first)[-1], backend="host", mode=mode,
                                 budget="8") as ms:
            for layer in ms.model.moe_layers:
                with ms.fetch(layer, [0, 5]) as lease:
                    for handle in lease.gather():
                        for m, part in zip(handle.matrices, ("gate", "up", "down"),
                                           strict=True):
                            tensor = theirs[f"blk.{layer}.ffn_{part}_exps.weight"]
                            want = tensor.data[handle.expert].tobytes()
                            assert ctypes.string_at(m.ptr, m.nbytes) == want
                ms.end_token()

    def test_decodes_and_verifies(self, tmp_path: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
        """``pipeline.run`` on a split with no recorded digests: its manifest is built over
        every shard, and each expert read in direct mode is verified against it."""
        first = write_plain_moe(tmp_path / "m.gguf", split_max_tensors=4)
        for mode in ("direct", "resident"):
            assert main(["-m", str(first), "-n", "8", "--backend", "host", "--mode", mode,
                         "--compute", "real"]) == 0
            out = capsys.readouterr().out
            assert ", 0 mismatches" in out and "verified: 0 experts" not in out


class TestMadeSplits:
    """``make_model --shard-size``: the split as gguf-py writes one, the same tensors as the
    one file of the same preset, the digests recorded once (in the first shard)."""

    def test_same_as_one_file(self, tmp_path: Path) -> None:
        spec = spec_for("ds4-flash-q2", 3, 8, 0)
        whole = open_table(write_model(spec, tmp_path / "one.gguf"))
        (tmp_path / "split").mkdir()
        first = write_model(spec, tmp_path / "split" / "ds4.gguf", shard_bytes=20 << 20)
        shards = _shards(first)
        assert len(shards) > 2
        table = open_table(shards[1])
        assert table.digests is not None and whole.digests is not None
        assert (table.digests == whole.digests).all()
        _assert_same_model(table, whole)
        for no, shard in enumerate(shards):
            fields = GGUFReader(shard).fields
            assert fields["split.no"].contents() == no
            assert fields["split.count"].contents() == len(shards)
            assert ("moestream.expert_digests" in fields) == (no == 0)

    def test_the_command(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        assert make_model([str(tmp_path / "t.gguf"), "--shard-size", "40MiB"]) == 0
        out = capsys.readouterr().out
        assert out.startswith(f"{tmp_path / shard_name('t', 1, 4)}: tiny") and "4 shards" in out
        assert len(_shards(tmp_path / shard_name("t", 1, 4))) == 4
        assert make_model([str(tmp_path / "t.gguf"), "--shard-size", "40MiB"]) == 2
        assert "t-00001-of-00004.gguf exists (use --force" in capsys.readouterr().err


def _split(tmp_path: Path, name: str = "m", layers: int = 3, per_shard: int = 3) -> list[Path]:
    """A split of ``layers`` layers (one tensor and three a layer) into shards of
    ``per_shard`` tensors."""
    (tmp_path / name).mkdir()
    return _shards(write_plain_moe(tmp_path / name / "m.gguf", layers=layers,
                                   split_max_tensors=per_shard))


class TestBrokenSplits:
    """What does not hold together is refused in one line naming the file."""

    def test_missing_shard(self, tmp_path: Path) -> None:
        shards = _split(tmp_path)
        shards[2].unlink()
        with pytest.raises(ModelFileError, match=f"{shards[2].name}: no such file"):
            open_table(shards[0])

    def test_renamed_shard(self, tmp_path: Path) -> None:
        shards = _split(tmp_path)
        renamed = shards[0].with_name("model.gguf")
        shards[0].rename(renamed)
        with pytest.raises(ModelFileError, match="not named NAME-00001-of-0000"):
            open_table(renamed)

    def test_shard_out_of_place(self, tmp_path: Path) -> None:
        shards = _split(tmp_path)
        shutil.copyfile(shards[1], shards[2])
        with pytest.raises(ExpertLayoutError, match="not shard 3 of"):
            open_table(shards[0])

    def test_shard_of_another_split(self, tmp_path: Path) -> None:
        """The last shard of a split as many shards long but of fewer tensors (7, not 10)."""
        ours = _split(tmp_path, "a", layers=3, per_shard=3)
        other = _split(tmp_path, "b", layers=2, per_shard=2)
        assert len(ours) == len(other) == 4
        shutil.copyfile(other[-1], ours[-1])
        with pytest.raises(ExpertLayoutError, match=r"split\.tensors\.count 7, the first "):
            open_table(ours[0])

    def test_command_line(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        shards = _split(tmp_path)
        shards[1].unlink()
        assert main(["-m", str(shards[0]), "-n", "1", "--backend", "host"]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and shards[1].name in err
