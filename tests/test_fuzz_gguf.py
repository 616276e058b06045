"""Fuzz the GGUF boundary of the expert table: a mutated header gives a table or a typed error.

A small valid MoE GGUF (written by gguf's own writer, with string, float, int and uint64
arrays in its metadata) is mutated in its header and metadata bytes: 1-4 random bytes, or
one field picked by offset (tensor and KV counts, key and string lengths, array item types
and lengths, a tensor's name length, n_dims, dims, type and data offset) set to an
interesting value. ``open_table`` must return a sane table or raise a ``ModelFileError``
naming the file on one line, within a time limit (a hang is caught by an interval timer) and
without a large allocation (measured with tracemalloc). Any other exception fails the test.

``MOESTREAM_FUZZ_EXAMPLES=5000 pytest tests/test_fuzz_gguf.py`` runs a longer pass.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import tracemalloc
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from types import FrameType

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moestream.pipeline.foundation.digest import digest_bytes
from moestream.pipeline.foundation.errors import ModelFileError, NotGGUFError, TruncatedFileError
from moestream.pipeline.foundation.table import ExpertTable, open_table
from tests.gguf_files import finish_gguf

EXAMPLES = int(os.environ.get("MOESTREAM_FUZZ_EXAMPLES", "150"))
HANG_S = 5.0  # far above the few milliseconds one open takes; only a hang reaches it
PEAK_BYTES = 32 << 20  # the base file is ~30 KiB; a corrupt length must not allocate more
HIDDEN, FFN, EXPERTS = 32, 16, 4

FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=timedelta(seconds=2),
    suppress_health_check=[HealthCheck.too_slow],
)


class _Hang(BaseException):
    """Raised by the interval timer; a BaseException so no ``except Exception`` hides it."""


@contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    def on_alarm(signum: int, frame: FrameType | None) -> None:
        raise _Hang(f"open_table still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _write_base(path: Path) -> Path:
    """Three blocks (dense, hash-routed MoE, routed MoE) of tiny F16 experts, with digests."""
    rng = np.random.default_rng(7)
    writer = GGUFWriter(path, "deepseek2")
    writer.add_name("fuzz base")
    writer.add_block_count(3)
    writer.add_embedding_length(HIDDEN)
    writer.add_expert_count(EXPERTS)
    writer.add_expert_used_count(2)
    writer.add_leading_dense_block_count(1)
    writer.add_uint32("moestream.hash_routed_layer_count", 1)
    writer.add_token_list(["<s>", "</s>", "a", "bc", "def", "ghij"])
    writer.add_token_scores([0.0, -1.0, -2.5, -3.0, -4.0, -5.5])
    writer.add_token_types([3, 3, 1, 1, 1, 1])
    writer.add_bool("tokenizer.ggml.add_bos_token", True)
    writer.add_key_value("moestream.fuzz.bytes", list(range(5)), GGUFValueType.ARRAY,
                         sub_type=GGUFValueType.UINT8)
    tensors: dict[str, np.ndarray] = {
        "token_embd.weight": rng.standard_normal((6, HIDDEN)).astype(np.float32),
        "blk.0.ffn_up.weight": rng.standard_normal((FFN, HIDDEN)).astype(np.float16),
    }
    digests: list[int] = []
    for layer in (1, 2):
        gate = rng.standard_normal((EXPERTS, FFN, HIDDEN)).astype(np.float16)
        up = rng.standard_normal((EXPERTS, FFN, HIDDEN)).astype(np.float16)
        down = rng.standard_normal((EXPERTS, HIDDEN, FFN)).astype(np.float16)
        if layer == 2:
            tensors["blk.2.ffn_gate_inp.weight"] = np.ones((EXPERTS, HIDDEN), np.float32)
        tensors[f"blk.{layer}.ffn_gate_exps.weight"] = gate
        tensors[f"blk.{layer}.ffn_up_exps.weight"] = up
        tensors[f"blk.{layer}.ffn_down_exps.weight"] = down
        for e in range(EXPERTS):
            digests += [digest_bytes(m[e].tobytes()) for m in (gate, up, down)]
    return finish_gguf(writer, path, tensors, digests)


@dataclass(frozen=True)
class Field:
    """One integer field of the header, by byte offset and width."""

    what: str
    offset: int
    width: int


def _header_fields(path: Path) -> tuple[int, list[Field]]:
    """The header's length and every count, length, type and offset field in it."""
    reader = GGUFReader(path)
    fields = [Field("tensor count", 8, 8), Field("kv count", 16, 8)]
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        at = [field.offset]
        for part in field.parts:
            at.append(at[-1] + int(part.nbytes))
        fields += [Field(f"{name} key length", at[0], 8), Field(f"{name} type", at[2], 4)]
        if field.types[0] == GGUFValueType.STRING:
            fields.append(Field(f"{name} string length", at[3], 8))
        elif field.types[0] == GGUFValueType.ARRAY:
            fields += [Field(f"{name} item type", at[3], 4), Field(f"{name} length", at[4], 8)]
            if field.types[-1] == GGUFValueType.STRING:
                fields += [Field(f"{name}[{i}] length", at[5 + 2 * i], 8) for i in range(2)]
    for tensor in reader.tensors:
        at = [tensor.field.offset]
        for part in tensor.field.parts:
            at.append(at[-1] + int(part.nbytes))
        t = tensor.name
        fields += [Field(f"{t} name length", at[0], 8), Field(f"{t} n_dims", at[2], 4)]
        fields += [Field(f"{t} dim {d}", at[3] + 8 * d, 8) for d in range(len(tensor.shape))]
        fields += [Field(f"{t} type", at[4], 4), Field(f"{t} offset", at[5], 8)]
    return int(reader.data_offset), fields


@dataclass(frozen=True)
class Base:
    """The valid file, its bytes, its header length and its targetable fields."""

    path: Path
    data: bytes = dataclasses.field(repr=False)
    header_bytes: int
    data_end: int  # where the last tensor's data ends; only padding may follow
    fields: tuple[Field, ...] = dataclasses.field(repr=False)
    scratch: Path


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Base:
    directory = tmp_path_factory.mktemp("fuzz")
    path = _write_base(directory / "base.gguf")
    header_bytes, fields = _header_fields(path)
    data_end = max(t.data_offset + t.n_bytes for t in GGUFReader(path).tensors)
    return Base(path, path.read_bytes(), header_bytes, data_end, tuple(fields),
                directory / "mutant.gguf")


def _set_field(data: bytes, field: Field, value: int) -> bytes:
    out = bytearray(data)
    out[field.offset : field.offset + field.width] = (value % (1 << 8 * field.width)).to_bytes(
        field.width, "little")
    return bytes(out)


def _check_opens_or_fails_typed(path: Path, data: bytes) -> ExpertTable | ModelFileError:
    """Write ``data`` to ``path`` and open it: a sane table or a typed one-line error."""
    path.write_bytes(data)
    tracemalloc.start()
    try:
        with _time_limit(HANG_S):
            try:
                result: ExpertTable | ModelFileError = open_table(path)
            except ModelFileError as exc:
                result = exc
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < PEAK_BYTES, f"open_table allocated {peak} bytes at its peak"
    if isinstance(result, ModelFileError):
        message = str(result)
        assert message.startswith(f"{path}: ") and "\n" not in message, message
        return result
    _check_sane(result, len(data))
    return result


def _check_sane(table: ExpertTable, file_bytes: int) -> None:
    """Every promise the table makes to later stages holds."""
    assert table.file_bytes == file_bytes
    assert table.layers and 1 <= table.top_k <= table.n_experts
    assert 0 <= table.hash_routed <= len(table.layers)
    assert table.n_layers > max(table.layers)
    for slices in table.iter_slices():
        for r in slices.ranges:
            assert r.offset > 0 and r.nbytes > 0 and r.end <= file_bytes
    for t in table.non_routed:
        assert t.offset > 0 and t.offset + t.nbytes <= file_bytes
    if table.digests is not None:
        assert table.digests.shape == (len(table.layers), table.n_experts, 3)
    table.summary()


INTERESTING = [0, 1, 2, 3, 4, 7, 8, 9, 12, 13, 31, 32, 63, 64, 255, 256, 2**16 - 1, 2**31 - 1,
               2**31, 2**32 - 1, 2**32, 2**40, 2**60, 2**62, 2**63 - 1, 2**63, 2**64 - 1]


class TestBase:
    """The unmutated base file is a valid three-block table, so every failure is the mutation's."""

    def test_base_opens(self, base: Base) -> None:
        table = _check_opens_or_fails_typed(base.scratch, base.data)
        assert isinstance(table, ExpertTable)
        assert table.moe_layers == [1, 2] and table.n_experts == EXPERTS
        assert table.hash_routed == 1 and table.digests is not None
        assert len(base.fields) > 60 and base.header_bytes < 4096


class TestKnownHazards:
    """Mutations that hang, over-allocate or crash gguf's reader give a prompt typed error."""

    @pytest.mark.parametrize(
        ("target", "value", "error"),
        [
            ("moestream.expert_digests length", 2**60, TruncatedFileError),
            ("moestream.fuzz.bytes length", 2**60, TruncatedFileError),
            ("moestream.fuzz.bytes length", 40_000, TruncatedFileError),
            ("tokenizer.ggml.scores length", 2**60, TruncatedFileError),
            ("tokenizer.ggml.tokens length", 2**60, TruncatedFileError),
            ("tokenizer.ggml.token_type length", 2**32, TruncatedFileError),
            ("tokenizer.ggml.tokens[1] length", 2**62, TruncatedFileError),
            ("general.name string length", 2**63, TruncatedFileError),
            ("general.name key length", 2**63 - 1, NotGGUFError),
            ("tokenizer.ggml.scores item type", GGUFValueType.ARRAY, NotGGUFError),
            ("tokenizer.ggml.scores item type", 99, NotGGUFError),
            ("general.name type", 13, NotGGUFError),
            ("tensor count", 2**62, TruncatedFileError),
            ("kv count", 2**64 - 1, TruncatedFileError),
            ("blk.1.ffn_down_exps.weight n_dims", 2**32 - 1, NotGGUFError),
            ("blk.1.ffn_down_exps.weight dim 2", 2**63, NotGGUFError),
            ("blk.1.ffn_down_exps.weight dim 0", 2**40, TruncatedFileError),
            ("blk.1.ffn_down_exps.weight type", 2**31, NotGGUFError),
            ("blk.1.ffn_down_exps.weight offset", 2**62, TruncatedFileError),
            ("blk.1.ffn_down_exps.weight offset", 64, NotGGUFError),
            ("blk.1.ffn_down_exps.weight name length", 2**16, NotGGUFError),
        ],
    )
    def test_typed_error(self, base: Base, target: str, value: int, error: type) -> None:
        (field,) = [f for f in base.fields if f.what == target]
        result = _check_opens_or_fails_typed(base.scratch, _set_field(base.data, field, value))
        assert isinstance(result, error), result


class TestFuzz:
    """Random header mutations never escape as anything but a table or a ModelFileError."""

    @FUZZ
    @given(data=st.data())
    def test_random_header_bytes(self, base: Base, data: st.DataObject) -> None:
        edits = data.draw(st.lists(
            st.tuples(st.integers(0, base.header_bytes - 1), st.integers(0, 255)),
            min_size=1, max_size=4), label="edits (offset, byte)")
        mutant = bytearray(base.data)
        for offset, byte in edits:
            mutant[offset] = byte
        _check_opens_or_fails_typed(base.scratch, bytes(mutant))

    @FUZZ
    @given(data=st.data())
    def test_targeted_fields(self, base: Base, data: st.DataObject) -> None:
        field = data.draw(st.sampled_from(base.fields), label="field")
        original = int.from_bytes(base.data[field.offset : field.offset + field.width], "little")
        value = data.draw(st.one_of(
            st.sampled_from(INTERESTING),
            st.integers(-4, 4).map(lambda delta: original + delta),
            st.integers(0, (1 << 8 * field.width) - 1),
        ), label="value")
        _check_opens_or_fails_typed(base.scratch, _set_field(base.data, field, value))

    @FUZZ
    @given(data=st.data())
    def test_truncated_anywhere(self, base: Base, data: st.DataObject) -> None:
        cut = data.draw(st.integers(0, len(base.data) - 1), label="cut at")
        result = _check_opens_or_fails_typed(base.scratch, base.data[:cut])
        assert isinstance(result, ModelFileError) or cut >= base.data_end



def test_more_tensors_than_a_model_has(tmp_path: Path) -> None:
    """A header counting more tensors than any GGUF model holds is refused before gguf's
    reader (tens of microseconds and kilobytes a tensor), even in a file large enough for
    their entries."""
    n = (1 << 16) + 1
    path = tmp_path / "many.gguf"
    path.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + n.to_bytes(8, "little")
                     + bytes(8) + bytes(n * 24))
    with pytest.raises(NotGGUFError, match=f"counts {n} tensors, over the limit of {n - 1}"):
        open_table(path)
