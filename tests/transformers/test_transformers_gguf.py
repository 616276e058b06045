"""GGUF files through moestream.transformers: the config, tokenizer and dense weights by
transformers' own GGUF mapping, the experts streamed quantized and dequantized per use.

The files are written here, as llama.cpp's ``convert_hf_to_gguf.py`` writes them (its tensor
names through gguf's own name map, its metadata keys, a GPT-2 byte-level tokenizer), from a
tiny qwen2moe / qwen3moe / minimax-m2 ``save_pretrained`` checkpoint: dense weights F16 or
Q8_0, norms F32, the routed experts in a different type per layer and per projection, quantized by
``gguf.quants.quantize`` (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, BF16, F16) or, for the types
gguf-py cannot quantize (the K-quants, IQ types, MXFP4), random blocks with finite scales.
The reference is transformers' own ``from_pretrained(dir, gguf_file=...)`` on the same file,
which dequantizes the whole file at load (gguf-py) and so reads every one of these types.
Where transformers' legacy mapping cannot build the model (an expert width other than the
config class's default: it drops ``expert_feed_forward_length``), the reference is a
transformers model holding gguf's dequantization of the same blocks.
"""

from __future__ import annotations

import json
import os
import struct
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.integrations.moe")
pytest.importorskip("transformers.modeling_gguf_pytorch_utils")
pytest.importorskip("accelerate")  # transformers' GGUF loading asks for it
import gguf  # noqa: E402
import numpy as np  # noqa: E402
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf import GGUFWriter  # noqa: E402

import moestream  # noqa: E402
from moestream import transformers as mt  # noqa: E402
from moestream.pipeline import run as pipeline_run  # noqa: E402
from moestream.pipeline.foundation.errors import ModelFileError, UsageError  # noqa: E402
from moestream.pipeline.foundation.ggml_blocks import put_scales, scale_count  # noqa: E402
from moestream.transformers._gguf_blocks import ROUTINES  # noqa: E402
from tests.gguf_files import write_plain_moe  # noqa: E402
from tests.quantized import assert_streams_like, logits  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

SHAPES: dict[str, dict[str, Any]] = {
    # the experts' widths are the config classes' defaults: transformers' legacy GGUF
    # mapping drops expert_feed_forward_length, so only these load there
    "qwen3_moe": dict(hidden_size=256, intermediate_size=96, num_experts=8,
                      num_experts_per_tok=2, num_hidden_layers=4, head_dim=16,
                      num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=128, norm_topk_prob=True),
    "qwen2_moe": dict(hidden_size=64, intermediate_size=96, num_experts=8,
                      num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128),
    "minimax_m2": dict(hidden_size=64, intermediate_size=96, num_local_experts=8,
                       num_experts_per_tok=2, num_hidden_layers=2, head_dim=16,
                       num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=128),
}
ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "minimax_m2": "minimax-m2"}
EXPERT_TYPES: dict[str, list[tuple[Q, Q]]] = {
    # per layer, (gate and up, down): quantized by gguf-py, or random blocks where it cannot
    "qwen3_moe": [(Q.Q8_0, Q.Q4_0), (Q.Q5_1, Q.BF16), (Q.Q4_K, Q.Q6_K), (Q.IQ2_XXS, Q.Q2_K)],
    # qwen2moe's expert width (1408) is no whole number of 256-value blocks: no K-quants
    "qwen2_moe": [(Q.Q4_1, Q.Q8_0), (Q.F16, Q.Q5_0)],
    "minimax_m2": [(Q.Q8_0, Q.Q4_0), (Q.Q5_1, Q.BF16)],
}
MORE_TYPES = [(Q.Q3_K, Q.IQ4_XS), (Q.Q5_K, Q.MXFP4), (Q.IQ2_XS, Q.IQ3_XXS), (Q.IQ2_S, Q.IQ3_S),
              (Q.IQ1_S, Q.IQ4_NL), (Q.IQ1_M, Q.NVFP4), (Q.BF16, Q.F16)]
"""The other types, in a second qwen3moe file (the last layer float only: cast from the
cache as a checkpoint's experts are)."""

_QUANTIZABLE = {Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.BF16}
_SCALE = np.float16(2.0 ** -13)
"""The random-block types' float16 scales: small enough that no activation overflows, a
normal float16."""


def _tokenizer_metadata(writer: GGUFWriter) -> None:
    """A GPT-2 byte-level vocabulary of 256 bytes, three merges and an end-of-text token,
    as convert_hf_to_gguf writes a Qwen tokenizer."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = [*bytes_to_unicode().values(), "he", "ll", "llo", "<|endoftext|>"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - 1) + [3])
    writer.add_token_merges(["h e", "l l", "ll o"])
    writer.add_bos_token_id(len(tokens) - 1)
    writer.add_eos_token_id(len(tokens) - 1)


VOCAB = 260


def _metadata(writer: GGUFWriter, config: Any, arch: str) -> None:
    """The hyperparameters convert_hf_to_gguf writes for Qwen2-MoE, Qwen3-MoE and
    MiniMax-M2."""
    writer.add_name("tiny")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_expert_count(getattr(config, "num_experts", None) or config.num_local_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    if arch == "minimax-m2":  # its experts are intermediate_size wide, sigmoid-routed
        writer.add_expert_feed_forward_length(config.intermediate_size)
        writer.add_rope_dimension_count(config.head_dim)
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    else:
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if arch == "qwen2moe":
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    else:
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    _tokenizer_metadata(writer)


def _random_blocks(shape: tuple[int, ...], kind: Q, seed: int) -> np.ndarray:
    """Random valid blocks for values of ``shape``: random bytes, small finite scales."""
    block, nbytes = gguf.GGML_QUANT_SIZES[kind]
    rows = int(np.prod(shape[:-1])) * (shape[-1] // block)
    raw = np.random.default_rng(seed).integers(0, 256, (rows, nbytes), dtype=np.uint8)
    if kind == Q.MXFP4:
        raw[:, 0] = 127 - 8  # the E8M0 exponent: 2 ** -8
    elif kind == Q.NVFP4:
        raw[:, 0:4] = 1  # UE4M3 scales: 2 ** -10
    elif kind in ROUTINES:
        put_scales(raw, kind, np.full((rows, scale_count(kind)), _SCALE).view(np.uint16))
    return raw.reshape(*shape[:-1], shape[-1] // block * nbytes)


def _stored(value: np.ndarray, kind: Q, seed: int) -> np.ndarray:
    """``value`` as the file stores it: float bytes or quantized blocks."""
    value = np.ascontiguousarray(value, dtype=np.float32)
    if kind == Q.F32:
        return value
    if kind == Q.F16:
        return value.astype(np.float16)
    if kind in _QUANTIZABLE:
        return gguf.quants.quantize(value, kind)
    return _random_blocks(value.shape, kind, seed)


class _Gguf:
    """A GGUF file being written, and gguf's float32 dequantization of every tensor by
    its model name (the reference checkpoint)."""

    def __init__(self, path: Path, arch: str, split_max_tensors: int = 0) -> None:
        self.writer = GGUFWriter(path, arch, split_max_tensors=split_max_tensors)
        self.path = path
        self.values: dict[str, np.ndarray] = {}

    def add(self, name: str, model_name: str, value: np.ndarray, kind: Q, seed: int = 0) -> None:
        stored = _stored(value, kind, seed)
        if kind in (Q.F32, Q.F16):
            self.writer.add_tensor(name, stored)
        else:
            self.writer.add_tensor(name, stored, raw_shape=stored.shape, raw_dtype=kind)
        self.values[model_name] = gguf.quants.dequantize(stored, kind).reshape(value.shape)

    def close(self) -> Path:
        self.writer.write_header_to_file()
        self.writer.write_kv_data_to_file()
        self.writer.write_tensors_to_file()
        self.writer.close()
        self.path = self.writer.format_shard_names(self.path)[0]  # a split's first shard
        return self.path


def _convert(checkpoint: Path, path: Path, arch: str, types: list[tuple[Q, Q]],
             dense: Q = Q.F16, split_max_tensors: int = 0) -> _Gguf:
    """``checkpoint`` (a save_pretrained directory) as llama.cpp converts it: gguf's tensor
    names, 1-D tensors F32, other dense ``dense``, layer ``i``'s experts ``types[i]``; split
    into shards of ``split_max_tensors`` tensors by gguf's writer when given."""
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    config = model.config
    names = gguf.get_tensor_name_map(
        next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), config.num_hidden_layers)
    out = _Gguf(path, arch, split_max_tensors)
    _metadata(out.writer, config, arch)
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    for name, value in state.items():
        if ".mlp.experts." in name:
            continue
        gguf_name = _gguf_name(names, name)
        if gguf_name.startswith("blk.") and ".ffn_gate_inp_shexp." in gguf_name:
            value = value.reshape(-1)  # llama.cpp's shared-expert gate is a vector
        out.add(gguf_name, name, value, Q.F32 if value.ndim == 1 else dense)
        out.values[name] = out.values[name].reshape(state[name].shape)
    for layer, (gate_up_type, down_type) in enumerate(types):
        prefix = f"model.layers.{layer}.mlp.experts."
        gate_up, down = state[prefix + "gate_up_proj"], state[prefix + "down_proj"]
        ffn = gate_up.shape[1] // 2
        out.add(f"blk.{layer}.ffn_gate_exps.weight", f"{prefix}gate", gate_up[:, :ffn],
                gate_up_type, seed=3 * layer)
        out.add(f"blk.{layer}.ffn_up_exps.weight", f"{prefix}up", gate_up[:, ffn:],
                gate_up_type, seed=3 * layer + 1)
        out.add(f"blk.{layer}.ffn_down_exps.weight", prefix + "down_proj", down, down_type,
                seed=3 * layer + 2)
        out.values[prefix + "gate_up_proj"] = np.concatenate(
            (out.values.pop(f"{prefix}gate"), out.values.pop(f"{prefix}up")), axis=1)
    out.close()
    return out


def _gguf_name(names: Any, name: str) -> str:
    """The GGUF name convert_hf_to_gguf gives a model tensor: gguf's name map, and
    MiniMax-M2's routing bias as llama.cpp names it."""
    if name.endswith(".mlp.e_score_correction_bias"):
        return f"blk.{name.split('.')[2]}.exp_probs_b.bias"
    base, _, suffix = name.rpartition(".")
    return f"{names.get_name(base)}.{suffix}"


def _saved(kind: str, where: Path, **overrides: Any) -> Path:
    config = transformers.AutoConfig.for_model(kind, vocab_size=VOCAB,
                                               **{**SHAPES[kind], **overrides})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(where)
    return where


def _gguf(root: Path, kind: str, types: list[tuple[Q, Q]], name: str = "model.gguf",
          split_max_tensors: int = 0, **overrides: Any) -> _Gguf:
    checkpoint = _saved(kind, root / f"{kind}-checkpoint", **overrides)
    return _convert(checkpoint, root / name, ARCH[kind], types,
                    dense=Q.Q8_0 if kind == "qwen3_moe" else Q.F16,
                    split_max_tensors=split_max_tensors)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, _Gguf]:
    """The GGUF files, each alone in its directory (transformers' gguf_file= is a name in
    one)."""
    made = {}
    for kind in SHAPES:
        root = tmp_path_factory.mktemp(kind)
        made[kind] = _gguf(root, kind, EXPERT_TYPES[kind])
    root = tmp_path_factory.mktemp("more")
    made["more"] = _gguf(root, "qwen3_moe", MORE_TYPES, num_hidden_layers=len(MORE_TYPES))
    return made


def _transformers(path: Path, implementation: str, dtype: Any = None) -> Any:
    """transformers' own model of the GGUF file: the whole file dequantized at load (in
    float32 unless ``dtype``, as transformers loads a GGUF)."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, experts_implementation=implementation, dtype=dtype)


def _holding(made: _Gguf, kind: str, implementation: str, dtype: Any = None,
             **overrides: Any) -> Any:
    """A transformers model holding gguf's dequantization of every tensor of the file
    (rounded once to ``dtype``, float32 unless given)."""
    config = transformers.AutoConfig.for_model(kind, vocab_size=VOCAB,
                                               **{**SHAPES[kind], **overrides})
    model = transformers.AutoModelForCausalLM.from_config(
        config, dtype=dtype or torch.float32, experts_implementation=implementation)
    tensors = {name: torch.from_numpy(np.array(value)).to(model.dtype)
               for name, value in made.values.items()}
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    return model.eval()


ARITHMETICS = pytest.mark.parametrize("compute, implementation, dtype", [
    ("grouped", "grouped_mm", torch.bfloat16),
    ("eager", "eager", None),
    ("eager", "eager", torch.bfloat16),
])
"""Both arithmetics. Grouped at bfloat16: torch's grouped product on the CPU is not bitwise
the same over other groupings of the rows in float32 (a safetensors float32 checkpoint
differs as much), so grouped is compared where it is exact; eager in both."""


class TestExact:
    """Logits ``torch.equal`` and greedy tokens identical to transformers' own GGUF
    loading, at a budget of four experts (misses, evictions, grouped fetches)."""

    @ARITHMETICS
    @pytest.mark.parametrize("kind", ["qwen3_moe", "qwen2_moe", "minimax_m2", "more"])
    def test_equals_transformers(self, files: dict[str, _Gguf], kind: str, compute: str,
                                 implementation: str, dtype: Any) -> None:
        path = files[kind].path
        assert_streams_like(_transformers(path, implementation, dtype), path, compute,
                            dtype=dtype)

    @pytest.mark.parametrize("mode", ["direct", "resident"])
    def test_each_io_mode(self, files: dict[str, _Gguf], mode: str) -> None:
        """The same equality whether the blocks come by O_DIRECT reads (aligned covers of
        GGUFWriter's offsets) or from the page cache."""
        path = files["more"].path
        assert_streams_like(_transformers(path, "eager"), path, "eager", mode=mode)

    @pytest.mark.parametrize("split_max_tensors", [1, 7])
    def test_split_file(self, files: dict[str, _Gguf], tmp_path: Path,
                        split_max_tensors: int) -> None:
        """The same file split into shards by gguf's writer (one tensor a shard; seven, so
        a layer's experts lie in two), opened by any shard's name: tokens and logits equal
        transformers' own loading of the whole file (transformers reads no split file)."""
        whole = _transformers(files["qwen3_moe"].path, "eager")
        split = _gguf(tmp_path, "qwen3_moe", EXPERT_TYPES["qwen3_moe"],
                      split_max_tensors=split_max_tensors).path
        shards = sorted(split.parent.glob("model-*-of-*.gguf"))
        assert split == shards[0] and len(shards) > 2
        assert_streams_like(whole, shards[1], "eager")
        with mt.from_pretrained(shards[-1], device="cpu") as model:
            assert model.moestream.session.model.path == split
            assert mt.tokenizer(model)("hello world")["input_ids"] == \
                transformers.AutoTokenizer.from_pretrained(
                    split.parent, gguf_file=split.name)("hello world")["input_ids"]

    def test_reference_is_gguf_dequantization(self, files: dict[str, _Gguf]) -> None:
        """transformers' GGUF model is gguf's dequantization of the file, expert by expert:
        the reference above is the file's own numbers."""
        whole = _transformers(files["qwen3_moe"].path, "eager")
        held = _holding(files["qwen3_moe"], "qwen3_moe", "eager")
        assert torch.equal(logits(whole), logits(held))

    @ARITHMETICS
    def test_expert_width_transformers_drops(self, tmp_path: Path, compute: str,
                                             implementation: str, dtype: Any) -> None:
        """An expert width other than the config class's default: transformers' legacy
        mapping leaves the default (its own loading fails); moestream takes the file's
        ``expert_feed_forward_length`` and equals gguf's dequantization in transformers."""
        made = _gguf(tmp_path, "qwen3_moe", EXPERT_TYPES["qwen3_moe"][:2],
                     num_hidden_layers=2, moe_intermediate_size=512)
        held = _holding(made, "qwen3_moe", implementation, dtype, num_hidden_layers=2,
                        moe_intermediate_size=512)
        assert_streams_like(held, made.path, compute, dtype=dtype)

    def test_budget_counts_quantized_bytes(self, files: dict[str, _Gguf]) -> None:
        """A budget of the least bytes (two layers in flight of top-2 of the largest expert
        as the file stores it, a fraction of its float32 size) serves the model: the cache
        holds and counts the blocks."""
        path = files["qwen3_moe"].path
        reader = gguf.GGUFReader(path)
        per_layer: dict[str, int] = {}
        for t in reader.tensors:
            if "_exps." in t.name:
                layer = t.name.split(".")[1]
                per_layer[layer] = per_layer.get(layer, 0) + int(t.n_bytes) // 8
        largest = max(per_layer.values())
        float32_expert = 3 * SHAPES["qwen3_moe"]["hidden_size"] * 768 * 4
        budget = 4 * largest
        assert budget < 4 * float32_expert  # the least, were the experts held as float32
        model = mt.from_pretrained(path, device="cpu", budget=f"{budget}B")
        try:
            logits(model)
            counters = model.moestream.session.counters()
            assert counters.budget_bytes == budget
            assert 0 < counters.live_bytes <= budget and counters.evictions > 0
        finally:
            model.moestream.close()


    def test_gguf_file_word(self, files: dict[str, _Gguf]) -> None:
        """transformers' own spelling, ``from_pretrained(dir, gguf_file=name)``."""
        path = files["qwen2_moe"].path
        whole = _transformers(path, "eager")
        model = mt.from_pretrained(path.parent, gguf_file=path.name, device="cpu",
                                   compute="eager", budget="4")
        try:
            assert model.moestream.session.model.path == path
            assert torch.equal(logits(whole), logits(model))
        finally:
            model.moestream.close()


    @pytest.mark.parametrize("dtype, size", [(None, 4), (torch.bfloat16, 2)])
    def test_max_memory_counts_dense_as_loaded(self, files: dict[str, _Gguf], dtype: Any,
                                               size: int) -> None:
        """max_memory's dense weights are the file's dense tensors as the model holds them,
        dequantized (float32 unless dtype), not their blocks: the experts get the rest."""
        path = files["qwen3_moe"].path
        dense = sum(int(np.prod(t.shape)) * size for t in gguf.GGUFReader(path).tensors
                    if "_exps." not in t.name)
        limit = dense + (8 << 20)
        model = mt.from_pretrained(path, device="cpu", dtype=dtype,
                                   max_memory={"cpu": limit})
        try:
            assert model.moestream.session.counters().budget_bytes == limit - dense
        finally:
            model.moestream.close()


class TestTokenizer:
    """The GGUF's tokenizer, as transformers builds it."""

    def test_same_as_transformers(self, files: dict[str, _Gguf]) -> None:
        from moestream.transformers._gguf import gguf_tokenizer

        path = files["qwen3_moe"].path
        theirs = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        with moestream.open_sync(path) as session:
            ours = gguf_tokenizer(session)
        assert ours("hello world")["input_ids"] == theirs("hello world")["input_ids"]

    def test_the_public_name_reads_the_models_header(self, files: dict[str, _Gguf]) -> None:
        """``mt.tokenizer(model)`` is the session's header's; the path alone is refused (a
        second open of it could read another file)."""
        path = files["qwen3_moe"].path
        theirs = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        with mt.from_pretrained(path, device="cpu") as model:
            ours = mt.tokenizer(model)
        assert ours("hello world")["input_ids"] == theirs("hello world")["input_ids"]
        with pytest.raises(UsageError, match="pass the model"):
            mt.tokenizer(path)


def _after_open(monkeypatch: pytest.MonkeyPatch, act: Callable[[], None]) -> None:
    """Run ``act`` right after the loader's session opened: the window an attacker races."""
    opened = moestream.open_sync

    def open_then_act(*args: Any, **kwargs: Any) -> Any:
        session = opened(*args, **kwargs)
        act()
        return session

    monkeypatch.setattr(moestream, "open_sync", open_then_act)


def _renamed_over(victim: Path, other: bytes) -> Callable[[], None]:
    def rename() -> None:
        staged = victim.with_name(victim.name + ".new")
        staged.write_bytes(other)
        os.replace(staged, victim)

    return rename


def _written(victim: Path, other: bytes) -> Callable[[], None]:
    def write() -> None:  # same size, same inode: only the times tell
        with open(victim, "r+b") as f:
            f.write(other)

    return write


def _other_metadata(data: bytes, key: bytes, value: bytes | None) -> bytes:
    """``data`` (a GGUF file) with the value after metadata ``key`` replaced by ``value``
    (type and bytes, the same length), or for None another vocabulary: the tokens "he" and
    "ll" (ids 256 and 257) swapped. The tensor table and the tensor bytes untouched."""
    if value is None:
        he, ll = (struct.pack("<Q", 2) + token for token in (b"he", b"ll"))
        at = data.index(he + ll)
        return data[:at] + ll + he + data[at + len(he + ll):]
    at = data.index(struct.pack("<Q", len(key)) + key) + 8 + len(key)
    return data[:at] + value + data[at + len(value):]


_ROPE = b"qwen3moe.rope.freq_base"
_TOKENS = b"tokenizer.ggml.tokens"


def _configs_built(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every config transformers' ``AutoConfig`` builds from now on."""
    built: list[Any] = []
    build = transformers.AutoConfig.from_pretrained

    def recorded(*args: Any, **kwargs: Any) -> Any:
        built.append(build(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", recorded)
    return built


def _read_by_transformers(data: bytes, where: Path) -> tuple[Any, list[int]]:
    """What transformers reads of a GGUF file's metadata: its rope theta, "hello"'s ids."""
    (where / "read.gguf").write_bytes(data)
    config = transformers.AutoConfig.from_pretrained(where, gguf_file="read.gguf")
    tokenizer = transformers.AutoTokenizer.from_pretrained(where, gguf_file="read.gguf")
    return config.rope_parameters["rope_theta"], tokenizer("hello")["input_ids"]


def _tensor_table(data: bytes, where: Path) -> list[tuple[str, str, list[int], int]]:
    """gguf's reading of a GGUF file's tensor table (name, type, shape, data offset)."""
    path = where / "table.gguf"
    path.write_bytes(data)
    return [(t.name, t.tensor_type.name, [int(n) for n in t.shape], int(t.data_offset))
            for t in gguf.GGUFReader(path).tensors]


class TestRefused:
    """What cannot be served is refused in one line naming it; nothing stays open."""

    def _refused(self, path: Path, *words: str, error: type = ModelFileError) -> None:
        with pytest.raises(error) as caught:
            mt.from_pretrained(path, device="cpu")
        message = str(caught.value)
        assert "\n" not in message
        for word in words:
            assert word in message

    @pytest.mark.parametrize("arch, words", [
        ("deepseek2", ("'deepseek2'", "maps no MoE model")),
        ("gpt-oss", ("'gpt-oss'", "ffn_*_exps", "no reference")),
    ])
    def test_unmapped_architecture(self, tmp_path: Path, arch: str,
                                   words: tuple[str, ...]) -> None:
        path = write_plain_moe(tmp_path / f"{arch}.gguf", layers=2, experts=4, arch=arch)
        self._refused(path, *words, "qwen3moe")

    def test_expert_type_the_dequantizer_lacks(self, tmp_path: Path) -> None:
        made = _gguf(tmp_path, "qwen3_moe", [(Q.Q8_0, Q.TQ1_0)], num_hidden_layers=1)
        self._refused(made.path, "TQ1_0", "layer 0")

    def test_transformers_without_gguf(self, files: dict[str, _Gguf],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setitem(sys.modules, "transformers.modeling_gguf_pytorch_utils", None)
        self._refused(files["qwen3_moe"].path, f"transformers {transformers.__version__}",
                      "reads no GGUF", error=UsageError)

    def test_file_replaced_after_open(self, files: dict[str, _Gguf],
                                      monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
        """Another GGUF renamed over the path right after the session opened it: transformers
        never builds the config from it."""
        path = tmp_path / "model.gguf"
        path.write_bytes(files["qwen3_moe"].path.read_bytes())
        _after_open(monkeypatch, _renamed_over(path, files["more"].path.read_bytes()))
        self._refused(path, "replaced by another file", error=moestream.ModelChangedError)

    @pytest.mark.parametrize("attack", [_renamed_over, _written])
    def test_same_tensors_other_metadata(self, files: dict[str, _Gguf],
                                         monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                         attack: Callable[[Path, bytes], Callable[[], None]]
                                         ) -> None:
        """A file with the session's tensor table and tensor bytes but another rope theta
        put at the path after the open, renamed over it or written in place: the config
        comes from the header the session reads of the file it identified, so the load stops
        in one line before transformers builds any config, none from the other's metadata."""
        path = tmp_path / "model.gguf"
        original = files["qwen3_moe"].path.read_bytes()
        path.write_bytes(original)
        other = _other_metadata(original, _ROPE, struct.pack("<If", 6, 12345.0))
        assert _tensor_table(other, tmp_path) == _tensor_table(original, tmp_path)
        assert _read_by_transformers(other, tmp_path)[0] == 12345.0
        built = _configs_built(monkeypatch)
        _after_open(monkeypatch, attack(path, other))
        self._refused(path, path.name, error=moestream.ModelChangedError)
        assert built == []

    def test_cli_other_metadata_no_tokens(self, files: dict[str, _Gguf], tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
        """Another vocabulary (same tensors) renamed over the path after the open, through
        the command line with prompt text: exit 2, one line, no tokens."""
        path = tmp_path / "model.gguf"
        original = files["qwen3_moe"].path.read_bytes()
        path.write_bytes(original)
        _after_open(monkeypatch, _renamed_over(path, _other_metadata(original, _TOKENS, None)))
        code = pipeline_run.main(["--engine", "transformers", "-m", str(path), "--prompt",
                                  "hello", "--tokens", "2", "--backend", "host"])
        captured = capsys.readouterr()
        assert code == moestream.ModelChangedError.exit_code != 0
        assert "tokens" not in captured.out and "text" not in captured.out
        assert captured.err.count("\n") == 1 and "replaced by another file" in captured.err


class TestCli:
    """python -m pipeline.run --engine transformers -m FILE.gguf."""

    def test_generates(self, files: dict[str, _Gguf], capsys: pytest.CaptureFixture[str]) -> None:
        path = files["qwen3_moe"].path
        code = pipeline_run.main(["--engine", "transformers", "-m", str(path),
                                  "--prompt-ids", "3,17,42", "--tokens", "4",
                                  "--cache-budget", "4", "--backend", "host"])
        out = capsys.readouterr().out
        assert code == 0
        whole = _transformers(path, "grouped_mm")
        ids = torch.tensor([[3, 17, 42]])
        expected = whole.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4,
                                  min_new_tokens=4, do_sample=False)[0, 3:].tolist()
        assert f"tokens     {','.join(map(str, expected))}" in out

    def test_prompt_through_the_gguf_tokenizer(self, files: dict[str, _Gguf],
                                               capsys: pytest.CaptureFixture[str]) -> None:
        path = files["qwen3_moe"].path
        code = pipeline_run.main(["--engine", "transformers", "-m", str(path),
                                  "--prompt", "hello", "--tokens", "2", "--backend", "host"])
        out = capsys.readouterr().out
        assert code == 0
        assert "text       " in out

    def test_chat_through_the_gguf_tokenizer(self, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
        """``--chat`` on a GGUF file with a chat template in its metadata (as llama.cpp's
        converter writes one): the template transformers' tokenizer of the file applies,
        and transformers' own reply from that file."""
        template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                    "{% if add_generation_prompt %}he{% endif %}")

        vocabulary = _tokenizer_metadata

        def with_template(writer: GGUFWriter) -> None:
            vocabulary(writer)
            writer.add_chat_template(template)

        monkeypatch.setattr(sys.modules[__name__], "_tokenizer_metadata", with_template)
        path = _gguf(tmp_path, "qwen3_moe", EXPERT_TYPES["qwen3_moe"][:2],
                     num_hidden_layers=2).path
        monkeypatch.undo()
        code = pipeline_run.main(["--engine", "transformers", "-m", str(path), "--prompt",
                                  "hello", "--chat", "--tokens", "3", "--backend", "host",
                                  "--json"])
        got = json.loads(capsys.readouterr().out)
        assert code == 0
        tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        ids = tokenizer.apply_chat_template([{"role": "user", "content": "hello"}],
                                            add_generation_prompt=True,
                                            return_dict=True)["input_ids"]
        assert got["prompt_ids"] == ids == tokenizer("hellohe")["input_ids"]
        prompt = torch.tensor([ids])
        reply = _transformers(path, "grouped_mm").generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=3, do_sample=False)
        assert got["token_ids"] == reply[0, len(ids):].tolist()

    def test_prompt_by_the_file_the_session_opened(self, files: dict[str, _Gguf],
                                                   tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
        """Another vocabulary (same tensors) renamed over the path after the command started
        but before the session opened: the prompt is encoded by the vocabulary of the file
        the session opened and computes with, not by the one the path named first."""
        path = tmp_path / "model.gguf"
        original = files["qwen3_moe"].path.read_bytes()
        path.write_bytes(original)
        other = _other_metadata(original, _TOKENS, None)
        wanted = _read_by_transformers(other, tmp_path)[1]
        assert wanted != _read_by_transformers(original, tmp_path)[1]
        opened = moestream.open_sync

        def replace_then_open(*args: Any, **kwargs: Any) -> Any:
            _renamed_over(path, other)()
            return opened(*args, **kwargs)

        monkeypatch.setattr(moestream, "open_sync", replace_then_open)
        code = pipeline_run.main(["--engine", "transformers", "-m", str(path), "--prompt",
                                  "hello", "--tokens", "2", "--backend", "host", "--json"])
        assert code == 0
        assert json.loads(capsys.readouterr().out)["prompt_ids"] == wanted


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")
class TestGpu:
    """On a GPU (CuPy backend, the blocks dequantized on the device): the same equalities
    against transformers' own GGUF model moved to the GPU."""

    @ARITHMETICS
    @pytest.mark.parametrize("kind", ["qwen3_moe", "qwen2_moe", "minimax_m2", "more"])
    def test_equals_transformers(self, files: dict[str, _Gguf], kind: str, compute: str,
                                 implementation: str, dtype: Any) -> None:
        path = files[kind].path
        whole = _transformers(path, implementation, dtype).to("cuda")
        assert_streams_like(whole, path, compute, device="cuda", dtype=dtype)
