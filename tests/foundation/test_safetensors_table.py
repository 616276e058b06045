"""Tests of pipeline.foundation.safetensors_table on checkpoints from other writers: odd but
valid layouts map every expert to its bytes; hostile ones are refused in one line, by the
table and through ``python -m pipeline.run``. The files are written here byte by byte (an
8-byte little-endian header length, the JSON header, the data)."""

from __future__ import annotations

import json
import math
import os
import random
import re
import struct
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from safetensors import SafetensorError, safe_open

import moestream
from moestream.pipeline.foundation import safetensors_table
from moestream.pipeline.foundation.compute import ComputeSpec, resolve_compute
from moestream.pipeline.foundation.errors import ExpertLayoutError, ModelFileError
from moestream.pipeline.foundation.experts import ExpertTable
from moestream.pipeline.foundation.safetensors_table import is_routed
from moestream.pipeline.foundation.table import open_table
from moestream.pipeline.run import main as run_main

D, F, E, LAYERS = 8, 4, 3, 2  # hidden, expert FFN, experts, layers
ITEM = {"F16": 2, "BF16": 2, "F32": 4, "F8_E4M3": 1, "I8": 1, "I32": 4}
CONFIG = {"model_type": "qwen3_moe", "hidden_size": D, "moe_intermediate_size": F,
          "num_experts": E, "num_experts_per_tok": 2, "num_hidden_layers": LAYERS}
ROOT = Path(__file__).resolve().parents[2]


class T:
    """One tensor: name, dtype, shape and its bytes."""

    __slots__ = ("data", "dtype", "name", "shape")

    def __init__(self, name: str, dtype: str, shape: tuple[int, ...], data: bytes) -> None:
        self.name, self.dtype, self.shape, self.data = name, dtype, shape, data


def _names(layer: int, expert: int, mixtral: bool = False) -> tuple[str, str, str]:
    """(gate, up, down) tensor names of one expert."""
    if mixtral:
        p = f"model.layers.{layer}.block_sparse_moe.experts.{expert}."
        return p + "w1.weight", p + "w3.weight", p + "w2.weight"
    p = f"model.layers.{layer}.mlp.experts.{expert}."
    return p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight"


def model(dtype: str = "F16", *, seed: int = 0, mixtral: bool = False,
          expert_dtype: str | None = None) -> list[T]:
    """A small MoE model's tensors, every one with distinct random bytes."""
    rng = np.random.default_rng(seed)

    def t(name: str, shape: tuple[int, ...], kind: str = dtype) -> T:
        return T(name, kind, shape, rng.bytes(math.prod(shape) * ITEM[kind]))

    out = [t("model.embed_tokens.weight", (16, D))]
    for layer in range(LAYERS):
        out.append(t(f"model.layers.{layer}.input_layernorm.weight", (D,)))
        moe = "block_sparse_moe" if mixtral else "mlp"
        out.append(t(f"model.layers.{layer}.{moe}.gate.weight", (E, D)))
        for e in range(E):
            gate, up, down = _names(layer, e, mixtral)
            kind = expert_dtype or dtype
            out += [t(gate, (F, D), kind), t(up, (F, D), kind), t(down, (D, F), kind)]
    out.append(t("model.norm.weight", (D,)))
    return out


def shard_bytes(tensors: Sequence[T], *, gap: int = 0, header_pad: bytes = b"",
                data_order: Sequence[int] | None = None,
                entries: dict[str, Any] | None = None) -> bytes:
    """A shard holding ``tensors``: header keys in their order, data in ``data_order``, with
    ``gap`` zero bytes before each tensor and ``header_pad`` after the JSON. ``entries``
    replaces or adds header entries as they are."""
    order = range(len(tensors)) if data_order is None else data_order
    offsets: dict[str, list[int]] = {}
    data = bytearray()
    for i in order:
        data += bytes(gap)
        offsets[tensors[i].name] = [len(data), len(data) + len(tensors[i].data)]
        data += tensors[i].data
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    for t in tensors:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape),
                          "data_offsets": offsets[t.name]}
    header.update(entries or {})
    raw = json.dumps(header).encode() + header_pad
    return struct.pack("<Q", len(raw)) + raw + bytes(data)


def write_dir(directory: Path, shards: Sequence[Sequence[T]], *, index: bool = True,
              config: dict[str, Any] | None = CONFIG, **shard_options: Any) -> Path:
    """A checkpoint directory of ``shards`` (with the index when ``index``)."""
    directory.mkdir(parents=True, exist_ok=True)
    n = len(shards)
    names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    weight_map = {}
    for name, tensors in zip(names, shards, strict=True):
        (directory / name).write_bytes(shard_bytes(tensors, **shard_options))
        weight_map.update({t.name: name for t in tensors})
    if index:
        doc = {"metadata": {"total_size": 0}, "weight_map": weight_map}
        (directory / "model.safetensors.index.json").write_text(json.dumps(doc))
    if config is not None:
        (directory / "config.json").write_text(json.dumps(config))
    return directory


def assert_maps(table: ExpertTable, tensors: Sequence[T], mixtral: bool = False) -> None:
    """Every expert of ``table`` reads back as its three tensors' bytes."""
    by_name = {t.name: t.data for t in tensors}
    assert table.moe_layers == list(range(LAYERS))
    assert table.n_experts == E and table.hidden == D
    for layer in range(LAYERS):
        assert table.layers[layer].shape == (D, F)
        for e in range(E):
            s = table.slices((layer, e))
            got = [table.read_bytes(r.offset, r.nbytes) for r in s.ranges]
            assert got == [by_name[n] for n in _names(layer, e, mixtral)]


def _assert_halves(path: Path, table: ExpertTable, gate_up: bytes, down: bytes,
                   flag: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A one-layer fused checkpoint whose experts' gate and up slices are the two halves of
    each expert's ``gate_up`` bytes as stored, and down its own: the slices read so, real
    compute falls back to digests, and the session says ``flag`` of the layer and hands
    the halves out as gate and up. Returns a leased expert's gate and down shapes."""
    per, down_per = len(gate_up) // E, len(down) // E
    for e in range(E):
        s = table.slices((0, e))
        got = table.read_bytes(s.gate.offset, s.gate.nbytes) + table.read_bytes(
            s.up.offset, s.up.nbytes)
        assert got == gate_up[e * per: (e + 1) * per] and s.gate.nbytes == per // 2
        assert table.read_bytes(s.down.offset, s.down.nbytes) == down[
            e * down_per: (e + 1) * down_per]
    assert resolve_compute(ComputeSpec("real"), table).kind == "digest"
    with moestream.open_sync(path, backend="host", verify=False) as ms:
        assert getattr(ms.model.layers[0], flag)
        with ms.fetch(0, [1]) as lease:
            (h,) = lease.gather()
            assert h.gate.shape == h.up.shape
            assert h.gate.bytes.tobytes() + h.up.bytes.tobytes() == gate_up[per: 2 * per]
            return h.gate.shape, h.down.shape


class TestOddLayouts:
    """Layouts other writers produce map every expert to its bytes."""

    def test_shuffled_header_and_data_order(self, tmp_path: Path) -> None:
        tensors = model()
        order = list(range(len(tensors)))
        random.Random(1).shuffle(order)
        shuffled = [tensors[i] for i in reversed(order)]
        path = write_dir(tmp_path / "c", [shuffled], data_order=order)
        assert_maps(open_table(path), tensors)

    def test_an_experts_matrices_over_two_shards(self, tmp_path: Path) -> None:
        tensors = model()
        gate = _names(1, 2)[0]
        first = [t for t in tensors if t.name != gate]
        path = write_dir(tmp_path / "c", [first, [t for t in tensors if t.name == gate]])
        table = open_table(path)
        assert_maps(table, tensors)
        s = table.slices((1, 2))
        assert table.file_of(s.gate.offset) != table.file_of(s.up.offset)

    def test_whitespace_around_the_header_json(self, tmp_path: Path) -> None:
        """safetensors pads its header with spaces; JSON whitespace of any kind is read."""
        tensors = model()
        path = write_dir(tmp_path / "c", [tensors[:20], tensors[20:]],
                         header_pad=b"    \n\t \r")
        assert_maps(open_table(path), tensors)

    def test_one_tensor_a_shard(self, tmp_path: Path) -> None:
        tensors = model("F32")
        path = write_dir(tmp_path / "c", [[t] for t in tensors])
        table = open_table(path)
        assert len(table.files) == len(tensors)
        assert all(f.base % 4096 == 0 for f in table.files)
        assert_maps(table, tensors)

    def test_shards_without_an_index(self, tmp_path: Path) -> None:
        tensors = model("BF16")
        path = write_dir(tmp_path / "c", [tensors[:9], tensors[9:]], index=False)
        assert_maps(open_table(path), tensors)

    def test_mixtral_names(self, tmp_path: Path) -> None:
        tensors = model(mixtral=True)
        table = open_table(write_dir(tmp_path / "c", [tensors]))
        assert_maps(table, tensors, mixtral=True)
        assert table.layers[0].router is not None

    @pytest.mark.parametrize("with_config", [True, False])
    def test_a_single_file(self, tmp_path: Path, with_config: bool) -> None:
        tensors = model()
        path = tmp_path / "one.safetensors"
        path.write_bytes(shard_bytes(tensors))
        if with_config:
            (tmp_path / "config.json").write_text(json.dumps(CONFIG))
        table = open_table(path)
        assert_maps(table, tensors)
        assert table.top_k == (2 if with_config else E)  # without: min(8, experts)
        assert table.n_layers == LAYERS

    @pytest.mark.parametrize("block, mixtral", [("ffn", True), ("feed_forward", False)])
    def test_other_moe_block_names(self, tmp_path: Path, block: str, mixtral: bool) -> None:
        """DeepSeek-V4's ``ffn.experts.E.w1`` and Jamba's ``feed_forward.experts.E.gate_proj``
        (routers ``ffn.gate``, ``feed_forward.router``), as transformers writes them."""
        moe = "block_sparse_moe" if mixtral else "mlp"
        renamed = {t.name: t.name.replace(f".{moe}.", f".{block}.") for t in model(mixtral=mixtral)}
        if block == "feed_forward":
            renamed = {k: v.replace(".feed_forward.gate.", ".feed_forward.router.")
                       for k, v in renamed.items()}
        tensors = [T(renamed[t.name], t.dtype, t.shape, t.data) for t in model(mixtral=mixtral)]
        table = open_table(write_dir(tmp_path / "c", [tensors]))
        by_name = {t.name: t.data for t in tensors}
        for layer in range(LAYERS):
            assert table.layers[layer].router is not None
            for e in range(E):
                s = table.slices((layer, e))
                want = [by_name[renamed[n]] for n in _names(layer, e, mixtral)]
                assert [table.read_bytes(r.offset, r.nbytes) for r in s.ranges] == want
        routed = [t.name for t in tensors if is_routed(t.name)]
        assert len(routed) == LAYERS * E * 3
        assert {t.name for t in table.non_routed} == {t.name for t in tensors} - set(routed)

    def test_granite_fused_names(self, tmp_path: Path) -> None:
        """Granite-MoE's ``block_sparse_moe.input_linear`` [E, 2F, D] and ``output_linear``
        [E, D, F] are the fused form; its shared MLP's 2-D ``input_linear`` is not."""
        rng = np.random.default_rng(5)
        gate_up, down = rng.bytes(E * 2 * F * D * 2), rng.bytes(E * D * F * 2)
        moe = "model.layers.0.block_sparse_moe."
        tensors = [T(moe + "input_linear.weight", "BF16", (E, 2 * F, D), gate_up),
                   T(moe + "output_linear.weight", "BF16", (E, D, F), down),
                   T(moe + "router.layer.weight", "BF16", (E, D), rng.bytes(E * D * 2)),
                   T("model.layers.0.shared_mlp.input_linear.weight", "BF16", (2 * F, D),
                     rng.bytes(2 * F * D * 2))]
        config = {**CONFIG, "num_hidden_layers": 1}
        table = open_table(write_dir(tmp_path / "c", [tensors], config=config))
        assert table.layers[0].router is not None
        per, half = 2 * F * D * 2, F * D * 2
        for e in range(E):
            s = table.slices((0, e))
            assert table.read_bytes(s.gate.offset, half) == gate_up[e * per: e * per + half]
            assert table.read_bytes(s.down.offset, s.down.nbytes) == down[
                e * D * F * 2: (e + 1) * D * F * 2]
        assert [is_routed(t.name) for t in tensors] == [True, True, False, False]

    def test_transposed_fused_layout(self, tmp_path: Path) -> None:
        """gpt-oss: gate_up [E, D, 2F] and down [E, F, D], told apart by their shapes; an
        expert's gate and up are its gate_up's two halves, its biases non-routed; the
        session hands them out as the row halves, and real compute falls back."""
        rng = np.random.default_rng(7)
        gate_up, down = rng.bytes(E * D * 2 * F * 2), rng.bytes(E * F * D * 2)
        moe = "model.layers.0.mlp.experts."
        tensors = [T(moe + "gate_up_proj", "BF16", (E, D, 2 * F), gate_up),
                   T(moe + "down_proj", "BF16", (E, F, D), down),
                   T(moe + "gate_up_proj_bias", "BF16", (E, 2 * F), rng.bytes(E * 2 * F * 2)),
                   T(moe + "down_proj_bias", "BF16", (E, D), rng.bytes(E * D * 2))]
        config = {**CONFIG, "num_hidden_layers": 1, "num_experts_per_tok": 1}
        path = write_dir(tmp_path / "c", [tensors], config=config)
        table = open_table(path)
        assert table.layers[0].transposed and table.layers[0].shape == (D, F)
        assert [is_routed(t.name) for t in tensors] == [True, True, False, False]
        halves = _assert_halves(path, table, gate_up, down, "transposed")
        assert halves == ((D // 2, 2 * F), (F, D))

    def test_interleaved_fused_names(self, tmp_path: Path) -> None:
        """Inkling2's ``experts.w13_weight`` [E, 2F, D] (gate and up rows interleaved) and
        ``w2_weight`` [E, D, F]: the fused form, ``interleaved``; an expert's gate and up are
        its w13 rows' two halves as stored, the session hands them out so (the engine
        de-interleaves), and real compute falls back; its scale is not routed."""
        rng = np.random.default_rng(11)
        gate_up, down = rng.bytes(E * 2 * F * D * 2), rng.bytes(E * D * F * 2)
        moe = "model.llm.layers.0.mlp."
        tensors = [T(moe + "experts.w13_weight", "BF16", (E, 2 * F, D), gate_up),
                   T(moe + "experts.w2_weight", "BF16", (E, D, F), down),
                   T(moe + "gate.weight", "F32", (E, D), rng.bytes(E * D * 4)),
                   T(moe + "experts.w13_weight_scale", "F32", (E, 2 * F), rng.bytes(E * 2 * F * 4))]
        config = {**CONFIG, "num_hidden_layers": 1, "num_experts_per_tok": 1}
        path = write_dir(tmp_path / "c", [tensors], config=config)
        table = open_table(path)
        layer = table.layers[0]
        assert layer.interleaved and not layer.transposed and layer.shape == (D, F)
        assert layer.router is not None
        assert [is_routed(t.name) for t in tensors] == [True, True, False, False]
        assert _assert_halves(path, table, gate_up, down, "interleaved") == ((F, D), (D, F))

    def test_experts_without_a_gate(self, tmp_path: Path) -> None:
        """Nemotron-H: ``backbone.layers.L.mixer.experts.E.{up,down}_proj`` only; the up
        projection's two row halves stand as the expert's gate and up slices."""
        rng = np.random.default_rng(11)
        tensors, ups = [], {}
        for e in range(E):
            p = f"backbone.layers.0.mixer.experts.{e}."
            ups[e] = rng.bytes(F * D * 2)
            tensors += [T(p + "up_proj.weight", "BF16", (F, D), ups[e]),
                        T(p + "down_proj.weight", "BF16", (D, F), rng.bytes(D * F * 2))]
        config = {**CONFIG, "num_hidden_layers": 1, "num_experts_per_tok": 1}
        path = write_dir(tmp_path / "c", [tensors], config=config)
        table = open_table(path)
        assert not table.layers[0].gated and table.layers[0].shape == (D, F)
        for e in range(E):
            s = table.slices((0, e))
            assert table.read_bytes(s.gate.offset, s.gate.nbytes) + table.read_bytes(
                s.up.offset, s.up.nbytes) == ups[e]
        assert resolve_compute(ComputeSpec("real"), table).kind == "digest"
        with moestream.open_sync(path, backend="host", verify=False) as ms:
            assert not ms.model.layers[0].gated
            with ms.fetch(0, [2]) as lease:
                (h,) = lease.gather()
                assert h.gate.shape == h.up.shape == (F // 2, D)
                assert h.down.shape == (D, F)
                assert h.gate.bytes.tobytes() + h.up.bytes.tobytes() == ups[2]
        odd = [T("model.layers.0.mlp.experts.0.up_proj.weight", "BF16", (F + 1, D),
                 bytes((F + 1) * D * 2)),
               T("model.layers.0.mlp.experts.0.down_proj.weight", "BF16", (D, F + 1),
                 bytes(D * (F + 1) * 2))]
        with pytest.raises(ExpertLayoutError, match="odd FFN"):
            open_table(write_dir(tmp_path / "odd", [odd], config={"num_hidden_layers": 1}))

    def test_transposed_with_an_odd_hidden_size_refused(self, tmp_path: Path) -> None:
        """Its halves would split a row: refused in one line."""
        odd = D + 1
        moe = "model.layers.0.mlp.experts."
        tensors = [T(moe + "gate_up_proj", "BF16", (E, odd, 2 * F), bytes(E * odd * 4 * F)),
                   T(moe + "down_proj", "BF16", (E, F, odd), bytes(E * F * odd * 2))]
        path = write_dir(tmp_path / "c", [tensors], config={"num_hidden_layers": 1})
        with pytest.raises(ExpertLayoutError, match="D even"):
            open_table(path)

    @settings(max_examples=60, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(n=st.integers(1, 3), ffn=st.integers(1, 3), hidden=st.integers(1, 4),
           layout=st.sampled_from(["standard", "transposed", "any"]),
           other=st.tuples(st.integers(0, 6), st.integers(0, 6), st.integers(0, 6),
                           st.integers(0, 6)))
    def test_any_fused_shapes_map_or_refuse(self, tmp_path_factory: pytest.TempPathFactory,
                                            n: int, ffn: int, hidden: int, layout: str,
                                            other: tuple[int, int, int, int]) -> None:
        """Whatever 3-D shapes a fused pair claims (both layouts as written, or any
        others): a layer whose every expert reads back as its slices of the two tensors,
        transposed exactly when the shapes are gpt-oss's, or one ExpertLayoutError line."""
        up, down = {"standard": ((2 * ffn, hidden), (hidden, ffn)),
                    "transposed": ((hidden, 2 * ffn), (ffn, hidden)),
                    "any": (other[:2], other[2:])}[layout]
        rng = np.random.default_rng(ffn * 7 + hidden)
        gate_up = rng.bytes(n * up[0] * up[1] * 2)
        down_bytes = rng.bytes(n * down[0] * down[1] * 2)
        moe = "model.layers.0.mlp.experts."
        tensors = [T(moe + "gate_up_proj", "BF16", (n, *up), gate_up),
                   T(moe + "down_proj", "BF16", (n, *down), down_bytes)]
        directory = tmp_path_factory.mktemp("fused")
        path = write_dir(directory / "c", [tensors], config={"num_hidden_layers": 1})
        try:
            layer = open_table(path).layers[0]
        except ExpertLayoutError as exc:
            assert "\n" not in str(exc)
            return
        rows, cols = up
        # the two readings never both fit a non-empty pair: [E, D, 2F] with D even, or not
        assert layer.transposed == (down == (cols // 2, rows) and rows % 2 == 0
                                    and cols % 2 == 0)
        per, down_per = len(gate_up) // n, len(down_bytes) // n
        table = open_table(path)
        for e in range(n):
            s = table.slices((0, e))
            assert table.read_bytes(s.gate.offset, s.gate.nbytes) + table.read_bytes(
                s.up.offset, s.up.nbytes) == gate_up[e * per: (e + 1) * per]
            assert table.read_bytes(s.down.offset, s.down.nbytes) == down_bytes[
                e * down_per: (e + 1) * down_per]

    def test_fused_written_by_hand(self, tmp_path: Path) -> None:
        rng = np.random.default_rng(3)
        gate_up = rng.bytes(E * 2 * F * D * 2)
        down = rng.bytes(E * D * F * 2)
        tensors = [T("model.layers.0.mlp.experts.down_proj", "BF16", (E, D, F), down),
                   T("model.layers.0.mlp.experts.gate_up_proj", "BF16", (E, 2 * F, D), gate_up)]
        config = {**CONFIG, "num_hidden_layers": 1}
        table = open_table(write_dir(tmp_path / "c", [tensors], config=config))
        per, half = 2 * F * D * 2, F * D * 2
        for e in range(E):
            s = table.slices((0, e))
            assert table.read_bytes(s.gate.offset, half) == gate_up[e * per: e * per + half]
            assert table.read_bytes(s.up.offset, half) == gate_up[e * per + half: (e + 1) * per]
            assert table.read_bytes(s.down.offset, s.down.nbytes) == down[
                e * D * F * 2: (e + 1) * D * F * 2]

    def test_other_scripts_digits_name_no_expert(self, tmp_path: Path) -> None:
        tensors = model()
        alias = T("model.layers.0.mlp.experts.\u0663.gate_proj.weight", "F16", (F, D),
                  bytes(F * D * 2))  # U+0663 is a 3 to int(), not to the table
        table = open_table(write_dir(tmp_path / "c", [[*tensors, alias]]))
        assert_maps(table, tensors)
        assert alias.name in {t.name for t in table.non_routed}

    @settings(max_examples=30, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(seed=st.integers(0, 2**32 - 1), n_shards=st.integers(1, 5), index=st.booleans())
    def test_any_split_and_order_maps_the_same_bytes(self, seed: int, n_shards: int,
                                                     index: bool) -> None:
        tensors = model(seed=seed % 7)
        rnd = random.Random(seed)
        shards: list[list[T]] = [[] for _ in range(n_shards)]
        for t in tensors:
            shards[rnd.randrange(n_shards)].append(t)
        shards = [s for s in shards if s]
        orders = []
        for s in shards:
            rnd.shuffle(s)
            order = list(range(len(s)))
            rnd.shuffle(order)
            orders.append(order)
        with tempfile.TemporaryDirectory() as tmp:
            directory = Path(tmp) / "c"
            write_dir(directory, shards, index=index)
            for shard, s, order in zip(sorted(directory.glob("*.safetensors")), shards, orders,
                                       strict=True):  # rewrite each with its own data order
                shard.write_bytes(shard_bytes(s, data_order=order))
            assert_maps(open_table(directory), tensors)


# --- hostile checkpoints: each builder makes one in ``directory`` and returns the path ---

def _raw(directory: Path, header: bytes, data: bytes = b"", length: int | None = None) -> Path:
    directory.mkdir()
    path = directory / "model.safetensors"
    n = len(header) if length is None else length
    path.write_bytes(struct.pack("<Q", n) + header + data)
    (directory / "config.json").write_text(json.dumps(CONFIG))
    return directory


def _entries(directory: Path, entries: dict[str, Any], data: bytes = bytes(64)) -> Path:
    return _raw(directory, json.dumps(entries).encode(), data)


def _with(directory: Path, change: Callable[[list[T]], list[T]], **options: Any) -> Path:
    return write_dir(directory, [change(model())], **options)


def _two_shards_same_name(directory: Path) -> Path:
    tensors = model()
    return write_dir(directory, [tensors, tensors[:1]], index=False)


def _index_names(directory: Path, shard: str) -> Path:
    write_dir(directory, [model()])
    index = directory / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    doc["weight_map"]["model.norm.weight"] = shard
    index.write_text(json.dumps(doc))
    return directory


def _wrong_shard(directory: Path) -> Path:
    tensors = model()
    write_dir(directory, [tensors[:-1], tensors[-1:]])
    index = directory / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    doc["weight_map"]["model.norm.weight"] = "model-00001-of-00002.safetensors"
    index.write_text(json.dumps(doc))
    return directory


def _special_shard(directory: Path, make: Callable[[Path], None]) -> Path:
    tensors = model()
    write_dir(directory, [tensors, []], index=False)
    second = directory / "model-00002-of-00002.safetensors"
    second.unlink()
    make(second)
    return directory


def _drop(*names: str) -> Callable[[list[T]], list[T]]:
    return lambda tensors: [t for t in tensors if t.name not in names]


def _rename(old: str, new: str) -> Callable[[list[T]], list[T]]:
    return lambda tensors: [T(t.name.replace(old, new), t.dtype, t.shape, t.data)
                            for t in tensors]


def _bom(directory: Path) -> Path:
    write_dir(directory, [model()])
    shard = directory / "model-00001-of-00001.safetensors"
    data = shard.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    shard.write_bytes(struct.pack("<Q", n + 3) + b"\xef\xbb\xbf" + data[8:])
    return directory


def _utf16(directory: Path) -> Path:
    header = json.dumps({"x": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}})
    return _raw(directory, header.encode("utf-16-le"), bytes(2))


def _config(**changes: Any) -> Callable[[Path], Path]:
    return lambda d: write_dir(d, [model()], config={**CONFIG, **changes})


_ENTRY = {"dtype": "F16", "shape": [2], "data_offsets": [0, 4]}


HOSTILE: dict[str, tuple[Callable[[Path], Path], str]] = {
    "header length past the file": (lambda d: _raw(d, b"{}", length=1000), "past its end"),
    "header over 100 MiB": (lambda d: _raw(d, b"{}", length=200 << 20), "over the"),
    "header not JSON": (lambda d: _raw(d, b"{not json"), "not JSON"),
    "header not an object": (lambda d: _raw(d, b"[1, 2]"), "not a JSON object"),
    "header one entry": (lambda d: _raw(d, json.dumps(_ENTRY).encode(), bytes(4)),
                         "one tensor entry"),
    "header nests 3000 deep": (
        lambda d: _raw(d, b'{"a":' + b"[" * 3000 + b"]" * 3000 + b"}"), "nests too deeply"),
    "offsets past the file": (lambda d: _entries(d, {"x": {
        "dtype": "F16", "shape": [100], "data_offsets": [0, 200]}}), "outside"),
    "overlapping tensors": (lambda d: _entries(d, {
        "a": {"dtype": "F16", "shape": [8], "data_offsets": [0, 16]},
        "b": {"dtype": "F16", "shape": [8], "data_offsets": [8, 24]}}), "overlap"),
    "offsets not dtype x shape": (lambda d: _entries(d, {"x": {
        "dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}), "spans 8"),
    "negative or float offsets": (lambda d: _entries(d, {"x": {
        "dtype": "F16", "shape": [4], "data_offsets": [0, 8.0]}}), "bad shape or data_offsets"),
    "duplicate name in a header": (lambda d: _raw(
        d, b'{"x": {"dtype": "F16", "shape": [1], "data_offsets": [0, 2]}, '
           b'"x": {"dtype": "F16", "shape": [1], "data_offsets": [2, 4]}}', bytes(4)), "twice"),
    "duplicate name across shards": (_two_shards_same_name, "is also in"),
    "index names a missing shard": (
        lambda d: _index_names(d, "model-00009-of-00009.safetensors"), "which is missing"),
    "index names ../x.safetensors": (
        lambda d: _index_names(d, "../x.safetensors"), "outside the checkpoint directory"),
    "index names an absolute path": (
        lambda d: _index_names(d, "/etc/x.safetensors"), "outside the checkpoint directory"),
    "index puts a tensor in the wrong shard": (_wrong_shard, "but it is in"),
    "a FIFO shard": (lambda d: _special_shard(d, os.mkfifo), "is a FIFO"),
    "a directory shard": (lambda d: _special_shard(d, Path.mkdir), "is a directory"),
    "config expert count": (lambda d: _with(d, list, config={**CONFIG, "num_experts": 5}),
                            "config.json says experts 5"),
    "config hidden size": (lambda d: _with(d, list, config={**CONFIG, "hidden_size": 16}),
                           "config.json says hidden_size 16"),
    "config layer count": (lambda d: _with(d, list, config={**CONFIG, "num_hidden_layers": 1}),
                           "says 1 layers"),
    "config top-k": (lambda d: _with(d, list, config={**CONFIG, "num_experts_per_tok": 9}),
                     "num_experts_per_tok 9"),
    "a missing expert": (lambda d: _with(d, _drop(*_names(0, 1))), "expert 1 is missing"),
    "a missing down matrix": (lambda d: _with(d, _drop(_names(1, 2)[2])), "no down matrix"),
    "the last experts without a down matrix (zero experts)": (
        lambda d: _with(d, _drop(_names(0, 1)[2], _names(0, 2)[2])),
        "expert 1 has no down matrix (experts 1-2 all lack one"),
    "no experts at all": (lambda d: _with(d, lambda ts: [t for t in ts if "experts" not in
                                                         t.name]), "no routed expert"),
    "F8_E4M3 experts": (lambda d: write_dir(d, [model(expert_dtype="F8_E4M3")]), "F8_E4M3"),
    "I8 experts": (lambda d: write_dir(d, [model(expert_dtype="I8")]), "is I8"),
    "a huge expert index": (lambda d: _with(d, lambda ts: [*ts, T(
        "model.layers.0.mlp.experts.999999999999.gate_proj.weight", "F16", (F, D),
        bytes(F * D * 2))]), "no model has that many"),
    "two names for one matrix": (lambda d: _with(d, lambda ts: [*ts, T(
        "language_model.layers.0.mlp.experts.1.gate_proj.weight", "F16", (F, D),
        bytes(F * D * 2))]), "both"),
    "two routers for one layer": (lambda d: _with(d, lambda ts: [*ts, T(
        "vision.layers.1.mlp.gate.weight", "F16", (E, D), bytes(E * D * 2))]), "both"),
    "mixed names for one matrix": (lambda d: _with(d, lambda ts: [*ts, T(
        "model.layers.1.mlp.experts.2.w2.weight", "F16", (D, F), bytes(F * D * 2))]), "both"),
    "no config.json in a directory": (lambda d: _with(d, list, config=None),
                                      "no config.json"),
    "a directory of no shards": (lambda d: write_dir(d, [], index=False), "no .safetensors file"),
    # dtypes, shapes and data coverage: what safetensors' own reader refuses
    "a dense tensor of an unknown dtype, 2^62 x 2^62": (lambda d: _entries(d, {"x": {
        "dtype": "Q4_K", "shape": [2**62, 2**62], "data_offsets": [0, 64]}}),
        "'Q4_K', which safetensors does not know"),
    "a shape whose product overflows 64 bits": (lambda d: _entries(d, {"x": {
        "dtype": "U8", "shape": [2**40, 2**40, 0], "data_offsets": [0, 0]}}, b""),
        "element count overflows 64 bits"),
    "a shape axis of 2^64": (lambda d: _entries(d, {"x": {
        "dtype": "U8", "shape": [0, 2**64], "data_offsets": [0, 0]}}, b""), "bad shape"),
    "F4 elements ending mid-byte": (lambda d: _entries(d, {"x": {
        "dtype": "F4", "shape": [3], "data_offsets": [0, 2]}}, bytes(2)), "end mid-byte"),
    "a 4000-digit shape": (lambda d: _entries(d, {"x": {
        "dtype": "F16", "shape": [1] * 4000, "data_offsets": [0, 4]}}, bytes(4)), "spans 4"),
    "a gap between tensors": (lambda d: _entries(d, {"x": _ENTRY, "y": {
        **_ENTRY, "data_offsets": [6, 10]}}, bytes(10)), "a gap of 2 bytes (no tensor's) between"),
    "padding before each tensor": (lambda d: write_dir(d, [model()], gap=13),
                                   "starts with 13 bytes"),
    "bytes before the first tensor": (lambda d: _entries(d, {"x": {
        **_ENTRY, "data_offsets": [2, 6]}}, bytes(6)), "starts with 2 bytes"),
    "bytes after the last tensor": (lambda d: _entries(d, {"x": _ENTRY}, bytes(6)),
                                    "cover 4 of its 6 bytes"),
    "an empty tensor inside another": (lambda d: _entries(d, {"x": _ENTRY, "y": {
        "dtype": "F16", "shape": [0], "data_offsets": [2, 2]}}, bytes(4)), "overlap"),
    "a UTF-8 byte order mark before the header": (_bom, "byte order mark"),
    "a UTF-16 header": (_utf16, "not JSON"),
    "__metadata__ of numbers": (lambda d: _entries(d, {"__metadata__": {"a": 1},
                                                       "x": _ENTRY}, bytes(4)), "__metadata__"),
    "an unpaired surrogate in a name": (lambda d: _raw(
        d, b'{"x\\ud800": {"dtype": "F16", "shape": [2], "data_offsets": [0, 4]}}', bytes(4)),
        "unpaired surrogate"),
    # indices: canonical decimals only
    "experts.01 alone": (lambda d: _with(d, _rename(".experts.1.", ".experts.01.")),
                         "expert '01', with a leading zero"),
    "experts.007": (lambda d: _with(d, _rename(".experts.2.", ".experts.007.")),
                    "expert '007', with a leading zero"),
    "layers.01 on a dense tensor": (lambda d: _with(d, _rename(
        "layers.1.input_layernorm", "layers.01.input_layernorm")), "layer '01'"),
    # config.json: integers only, and in agreement with the tensors
    "top-k a string": (_config(num_experts_per_tok="2"),
                       "num_experts_per_tok is a string (\"2\"), not an integer"),
    "top-k a fraction": (_config(num_experts_per_tok=2.5), "is a float (2.5)"),
    "top-k true": (_config(num_experts_per_tok=True), "num_experts_per_tok is a boolean (true)"),
    "moe_topk a string": (_config(num_experts_per_tok=None, moe_topk="2"),
                          "moe_topk is a string"),
    "moe_k out of range": (_config(num_experts_per_tok=None, moe_k=4),
                           "config.json's moe_k 4 is outside 1..3"),
    "two top-k that disagree": (_config(num_experts_per_token=3),
                                "names two top-k: num_experts_per_tok 2, num_experts_per_token 3"),
    "expert count 16.0": (_config(num_experts=None, num_local_experts=16.0),
                          "num_local_experts is a float (16.0)"),
    "hidden size a string": (_config(hidden_size="8"), "hidden_size is a string"),
    "expert FFN a list": (_config(moe_intermediate_size=[4]), "moe_intermediate_size is a list"),
    "layer count a float": (_config(num_hidden_layers=2.0), "num_hidden_layers is a float (2.0)"),
    "5 layers, the tensors name 2": (_config(num_hidden_layers=5),
                                     "says 5 layers, but the tensors name layers 0..1"),
    "200000 layers, the tensors name 2": (_config(num_hidden_layers=200000), "says 200000"),
    "a 4000-digit layer count": (_config(num_hidden_layers=10**3999), "(4000 characters)"),
    "more layers than the MTP layers explain": (
        _config(num_hidden_layers=1, num_nextn_predict_layers=2),
        "says 1 layers (and 2 multi-token prediction)"),
}


class TestHostile:
    """Every hostile checkpoint is one ModelFileError line, at once."""

    @pytest.mark.parametrize("case", list(HOSTILE))
    def test_refused_in_one_line(self, tmp_path: Path, case: str) -> None:
        build, message = HOSTILE[case]
        path = build(tmp_path / "c")
        with pytest.raises(ModelFileError) as caught:
            open_table(path)
        text = str(caught.value)
        assert message in text and "\n" not in text and len(text) < 400

    def test_unsupported_dtypes_are_layout_errors(self, tmp_path: Path) -> None:
        path = write_dir(tmp_path / "c", [model(expert_dtype="F8_E4M3")])
        with pytest.raises(ExpertLayoutError, match="F8_E4M3; experts must be BF16, F16, F32"):
            open_table(path)

    @pytest.mark.parametrize("case", list(HOSTILE))
    def test_run_exits_2_with_one_line(self, tmp_path: Path, case: str,
                                       capsys: pytest.CaptureFixture[str]) -> None:
        build, message = HOSTILE[case]
        path = build(tmp_path / "c")
        assert run_main(["-m", str(path), "--tokens", "1", "--backend", "host"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        errors = [line for line in err if line.startswith("moestream: error: ")]
        assert len(errors) == 1 and message in errors[0]
        assert not any("Traceback" in line for line in err)

    @pytest.mark.parametrize("case", ["header nests 3000 deep", "a FIFO shard",
                                      "a dense tensor of an unknown dtype, 2^62 x 2^62",
                                      "a UTF-8 byte order mark before the header",
                                      "experts.01 alone", "a gap between tensors",
                                      "top-k a string", "5 layers, the tensors name 2"])
    def test_the_command_itself(self, tmp_path: Path, case: str) -> None:
        build, message = HOSTILE[case]
        path = build(tmp_path / "c")
        done = subprocess.run([sys.executable, "-m", "pipeline.run", "-m", str(path),
                               "--tokens", "1"], cwd=ROOT, capture_output=True, text=True,
                              timeout=120, check=False)
        assert done.returncode == 2
        lines = done.stderr.strip().splitlines()
        assert lines[-1].startswith("moestream: error: ") and message in lines[-1]
        assert "Traceback" not in done.stderr


def test_implausible_layer_index_refused(tmp_path: Path) -> None:
    """A tensor naming layer 10^12 (no config.json to say otherwise) is refused in one line,
    not counted as a model of 10^12 layers."""
    import json

    import moestream.pipeline.foundation.table as table_module
    from moestream.pipeline.foundation.errors import ExpertLayoutError

    header: dict[str, object] = {}
    data = b""
    names = ["model.layers.0.mlp.experts.0.gate_proj.weight",
             "model.layers.0.mlp.experts.0.up_proj.weight",
             "model.layers.0.mlp.experts.0.down_proj.weight",
             "model.layers.999999999999.input_layernorm.weight"]
    for name in names:
        header[name] = {"dtype": "F32", "shape": [2, 2],
                        "data_offsets": [len(data), len(data) + 16]}
        data += bytes(16)
    raw = json.dumps(header).encode()
    path = tmp_path / "one.safetensors"
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)
    with pytest.raises(ExpertLayoutError, match="no model has that many"):
        table_module.open_table(path)


INT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_latent_size",
            "hidden_size", "moe_intermediate_size", "intermediate_size", "num_hidden_layers",
            "num_nextn_predict_layers", "num_experts_per_tok", "moe_topk", "moe_k",
            "num_experts_per_token", "moe_top_k")
"""Every config.json key the table reads; each must be an integer where present."""
TOP_K_KEYS = INT_KEYS[-5:]
NOT_INTS = st.one_of(
    st.booleans(), st.floats(), st.text(max_size=6),
    st.lists(st.one_of(st.integers(-3, 9), st.text(max_size=2)), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
"""JSON values of every type but an integer (null is an absent key, as transformers reads
it)."""


class TestConfig:
    """config.json's integers are integers and agree with the tensors, or the checkpoint is
    refused in one line naming the key."""

    @settings(max_examples=80, deadline=None)
    @given(key=st.sampled_from(INT_KEYS), value=NOT_INTS)
    def test_any_value_but_an_integer_is_refused(self, key: str, value: Any) -> None:
        if key in TOP_K_KEYS and isinstance(value, list):
            return  # a per-layer top-k (Hunyuan's moe_topk): the default top-k, as before
        with tempfile.TemporaryDirectory() as tmp:
            path = write_dir(Path(tmp) / "c", [model()], config={**CONFIG, key: value})
            with pytest.raises(ExpertLayoutError) as caught:
                open_table(path)
        text = str(caught.value)
        assert f"config.json's {key} is " in text and text.endswith("not an integer")
        assert "\n" not in text and len(text) < 400

    def test_a_per_layer_top_k_keeps_the_default(self, tmp_path: Path) -> None:
        config = {**CONFIG, "num_experts_per_tok": None, "moe_topk": [2, 2]}
        assert open_table(write_dir(tmp_path / "c", [model()], config=config)).top_k == E

    def test_a_nested_text_config_is_read(self, tmp_path: Path) -> None:
        """A multimodal checkpoint (Llama 4's) keeps its language model's integers in
        ``text_config``: its top-k is read there, not defaulted, and its other integers
        are checked against the tensors as at the top level."""
        nested = {"model_type": "llama4", "text_config": {**CONFIG, "num_experts_per_tok": 1}}
        table = open_table(write_dir(tmp_path / "c", [model()], config=nested))
        assert table.top_k == 1
        wrong = {"text_config": {**CONFIG, "num_experts": E + 1}}
        with pytest.raises(ExpertLayoutError, match=f"experts {E + 1}"):
            open_table(write_dir(tmp_path / "d", [model()], config=wrong))
        odd = {"text_config": {**CONFIG, "num_experts_per_tok": "1"}}
        with pytest.raises(ExpertLayoutError, match=r"text_config\.num_experts_per_tok is a str"):
            open_table(write_dir(tmp_path / "e", [model()], config=odd))

    @pytest.mark.parametrize("key", TOP_K_KEYS)
    def test_top_k_under_each_of_its_names(self, tmp_path: Path, key: str) -> None:
        config = {k: v for k, v in CONFIG.items() if k != "num_experts_per_tok"}
        table = open_table(write_dir(tmp_path / "c", [model()], config={**config, key: 1}))
        assert table.top_k == 1

    def test_null_is_absent(self, tmp_path: Path) -> None:
        """transformers writes an unset value as null (Nemotron-H's moe_latent_size)."""
        config = {**CONFIG, "moe_latent_size": None, "num_hidden_layers": None}
        table = open_table(write_dir(tmp_path / "c", [model()], config=config))
        assert table.n_layers == LAYERS and table.hidden == D

    def test_dense_layers_count(self, tmp_path: Path) -> None:
        """A dense layer after the MoE ones names a layer too: num_hidden_layers counts it."""
        dense = T("model.layers.2.mlp.down_proj.weight", "F16", (D, F), bytes(D * F * 2))
        tensors = [*model(), dense]
        table = open_table(write_dir(tmp_path / "ok", [tensors],
                                     config={**CONFIG, "num_hidden_layers": 3}))
        assert table.n_layers == 3 and table.moe_layers == [0, 1]
        with pytest.raises(ExpertLayoutError, match="says 2 layers, but the tensors name "
                                                    r"layers 0\.\.2"):
            open_table(write_dir(tmp_path / "short", [tensors]))

    def test_multi_token_prediction_layers(self, tmp_path: Path) -> None:
        """DeepSeek-V3 ships its MTP layer as layer ``num_hidden_layers``: accepted when
        ``num_nextn_predict_layers`` accounts for it, refused otherwise."""
        config = {**CONFIG, "num_hidden_layers": LAYERS - 1, "num_nextn_predict_layers": 1}
        table = open_table(write_dir(tmp_path / "mtp", [model()], config=config))
        assert table.n_layers == LAYERS and table.moe_layers == list(range(LAYERS))
        config["num_nextn_predict_layers"] = 0
        with pytest.raises(ExpertLayoutError, match=f"says {LAYERS - 1} layers"):
            open_table(write_dir(tmp_path / "none", [model()], config=config))

    def test_through_the_api(self, tmp_path: Path) -> None:
        path = write_dir(tmp_path / "c", [model()], config={**CONFIG, "num_experts_per_tok": 2.5})
        with pytest.raises(ExpertLayoutError, match="num_experts_per_tok is a float"):
            moestream.open_sync(path, backend="host", verify=False)


def _header_length(path: Path) -> int:
    length: int = struct.unpack("<Q", path.read_bytes()[:8])[0]
    return length


def _spoil_after(shard: Path, entries: int) -> None:
    """Overwrite ``shard``'s header past its first ``entries`` tensor entries with bytes that
    are not JSON (the same length): a parse that reaches them fails."""
    data = shard.read_bytes()
    n = _header_length(shard)
    header = data[8:8 + n]
    cut = 0
    for _ in range(entries):
        cut = header.index(b"]}", cut) + 2
    spoiled = header[:cut] + b", !" + b" " * (n - cut - 3)
    shard.write_bytes(data[:8] + spoiled + data[8 + n:])


class TestLimits:
    """What a checkpoint's headers may cost is bounded per model, all shards together, and a
    checkpoint over a limit is refused before the parse that would pass it."""

    def test_header_bytes_are_summed_before_any_shard_is_parsed(
            self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        tensors = model()
        path = write_dir(tmp_path / "c", [tensors[:8], tensors[8:16], tensors[16:]])
        shards = sorted(path.glob("*.safetensors"))
        sizes = [_header_length(s) for s in shards]
        for shard in shards[:2]:  # neither is parsed: refused by their lengths alone
            _spoil_after(shard, 0)
        monkeypatch.setattr(safetensors_table, "MODEL_HEADER_LIMIT_BYTES", sizes[0] + sizes[1] - 1)
        with pytest.raises(ModelFileError) as caught:
            open_table(path)
        text = str(caught.value)
        assert text.startswith(str(shards[1])) and "headers to" in text and "\n" not in text
        monkeypatch.setattr(safetensors_table, "MODEL_HEADER_LIMIT_BYTES", sum(sizes))
        with pytest.raises(ModelFileError, match="not JSON"):  # allowed, so parsed
            open_table(path)

    def test_tensors_are_counted_over_shards_and_stop_the_parse(
            self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        tensors = model()
        path = write_dir(tmp_path / "c", [tensors[:12], tensors[12:]])
        second = sorted(path.glob("*.safetensors"))[1]
        _spoil_after(second, 3)  # the parse stops at the 15th tensor, before these bytes
        monkeypatch.setattr(safetensors_table, "MODEL_TENSOR_LIMIT", 14)
        with pytest.raises(ModelFileError) as caught:
            open_table(path)
        text = str(caught.value)
        assert text.startswith(str(second)) and "more than 14 tensors" in text

    @pytest.mark.slow
    def test_one_tensor_over_the_limit(self, tmp_path: Path) -> None:
        """A real header of MODEL_TENSOR_LIMIT + 1 empty tensors (55 MB) is refused in one
        line (its cost is measured by hand, not here)."""
        n = safetensors_table.MODEL_TENSOR_LIMIT + 1
        header = b"{" + b",".join(b'"t%d":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}' % i
                                  for i in range(n)) + b"}"
        path = _raw(tmp_path / "c", header)
        del header
        with pytest.raises(ModelFileError, match=f"more than {n - 1} tensors"):
            open_table(path)


def _safetensors_accepts(path: Path) -> bool:
    try:
        with safe_open(str(path), framework="numpy"):
            return True
    except SafetensorError:
        return False


class TestAsSafetensorsReads:
    """A shard is refused exactly when safetensors' own reader refuses it."""

    def test_the_dtypes_are_safetensors_own(self, tmp_path: Path) -> None:
        path = _entries(tmp_path / "c", {"x": {"dtype": "NOT_A_DTYPE", "shape": [0],
                                               "data_offsets": [0, 0]}}, b"")
        with pytest.raises(SafetensorError) as caught, safe_open(
                str(path / "model.safetensors"), framework="numpy"):
            pass
        named = set(re.findall(r"`(\w+)`", str(caught.value))) - {"NOT_A_DTYPE"}
        assert named == set(safetensors_table.SAFETENSORS_DTYPE_BITS)

    @settings(max_examples=150, deadline=None)
    @given(extras=st.lists(st.tuples(
               st.sampled_from([*safetensors_table.SAFETENSORS_DTYPE_BITS, "F8", "Q4_K"]),
               st.lists(st.sampled_from([0, 1, 2, 3, 5, 8]), max_size=3),
               st.sampled_from(["exact", "exact", "exact", "short", "long"])), max_size=4),
           layout=st.sampled_from(["contiguous", "gap", "overlap", "lead", "trail",
                                   "empty inside"]),
           where=st.integers(0, 40), seed=st.integers(0, 2**16))
    def test_refused_exactly_when_safetensors_refuses(
            self, extras: list[tuple[str, list[int], str]], layout: str, where: int,
            seed: int) -> None:
        """A valid model plus extra tensors of any dtype, shape and size, laid out end to end
        or with a gap, an overlap, bytes before or after, or an empty tensor inside another."""
        items = [(t.name, t.dtype, list(t.shape), len(t.data)) for t in model()]
        for i, (dtype, shape, size) in enumerate(extras):
            bits = safetensors_table.SAFETENSORS_DTYPE_BITS.get(dtype, 8)
            nbytes = math.prod(shape) * bits // 8
            nbytes += {"exact": 0, "short": -1 if nbytes else 1, "long": 1}[size]
            items.append((f"extra.{i}", dtype, shape, nbytes))
        order = list(range(len(items)))
        random.Random(seed).shuffle(order)
        header: dict[str, Any] = {}
        at = 2 if layout == "lead" else 0
        for position, i in enumerate(order):
            if position == where % len(items) and position:
                at += {"gap": 3, "overlap": -1}.get(layout, 0)
            name, dtype, shape, nbytes = items[i]
            header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [at, at + nbytes]}
            at += nbytes
        if layout == "empty inside":
            first = header[items[order[where % len(items)]][0]]["data_offsets"]
            inside = first[0] + 1 if first[1] - first[0] >= 2 else first[0]
            header["extra.inside"] = {"dtype": "U8", "shape": [0],
                                      "data_offsets": [inside, inside]}
        ends = [e["data_offsets"][1] for e in header.values()]
        data = bytes(max(ends) + (5 if layout == "trail" else 0))
        with tempfile.TemporaryDirectory() as tmp:
            directory = _entries(Path(tmp) / "c", header, data)
            expected = _safetensors_accepts(directory / "model.safetensors")
            try:
                open_table(directory)
                accepted = True
            except ModelFileError as exc:
                assert "\n" not in str(exc)
                accepted = False
        event(f"safetensors {'accepts' if expected else 'refuses'}")
        assert accepted == expected, header
