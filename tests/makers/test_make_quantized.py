"""Tests of ``tools.make_model --format safetensors --quant``: FP8 (Qwen3-MoE), MXFP4 (gpt-oss)
and FP4 (DeepSeek-V4) checkpoints and the quantizers behind them (``pipeline.makers.quantgen``).

Every check decodes by a rule written here, independently of the writer: E4M3 and E2M1
values from their bit fields, scales from their definition, nibbles low first. The writer's
FP8 bytes must equal torch's own cast of the same division, its E2M1 bytes a brute-force
nearest-value search; dequantized, the experts must equal the plain BF16 checkpoint of the
same seed within the format's rounding. transformers itself must load each checkpoint
(``FineGrainedFP8Config`` / ``Mxfp4Config`` with ``dequantize=True``, on the CPU, at the
``tiny`` preset cut to 2 layers of 4 experts) with no missing or unexpected tensor, and hold
exactly the weights decoded here; and moestream, streaming them quantized, must compute the
logits and tokens transformers computes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import structlog
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from moestream.pipeline.foundation.errors import UsageError
from moestream.pipeline.makers.checkpointgen import CheckpointOptions, write_checkpoint
from moestream.pipeline.makers.modelgen import ModelSpec, spec_for
from moestream.pipeline.makers.quantgen import e4m3_codes, quantize_fp8_blocks, quantize_mx_e2m1
from moestream.tools.make_model import main

torch = pytest.importorskip("torch")

SPEC = spec_for("tiny", 2, 4, seed=3)  # hidden 512, expert FFN 256, top-4
EDGES = dataclasses.replace(SPEC, hidden=320, expert_ffn=200)  # partial blocks
F32 = npt.NDArray[np.float32]


def _e4m3_table() -> F32:
    """Every E4M3FN byte's value, from its fields (bias 7, subnormals at exponent 0)."""
    out = np.empty(256, dtype=np.float32)
    for b in range(256):
        e, m = (b >> 3) & 15, b & 7
        v = m * 2.0**-9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
        out[b] = np.nan if (e, m) == (15, 7) else (-v if b & 0x80 else v)
    return out


E4M3 = _e4m3_table()
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6],
                dtype=np.float32)


def _tensors(path: Path) -> dict[str, Any]:
    """Every tensor of a checkpoint directory, as torch tensors."""
    from safetensors import safe_open

    out: dict[str, Any] = {}
    for shard in sorted(path.glob("*.safetensors")):
        with safe_open(shard, framework="pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})  # noqa: SIM118
    return out


def _shard(path: Path) -> tuple[dict[str, Any], bytes]:
    """A one-shard checkpoint's parsed header and the digest of its data."""
    raw = (path / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8: 8 + n]), hashlib.sha256(raw[8 + n:]).digest()


def _f32(t: Any) -> F32:
    out: F32 = t.float().numpy()
    return out


def _u8(t: Any) -> npt.NDArray[np.uint8]:
    out: npt.NDArray[np.uint8] = t.contiguous().view(torch.uint8).numpy()
    return out


def _expand(scales: F32, shape: tuple[int, ...], block: tuple[int, int]) -> F32:
    """Block scales broadcast over the ``[rows, cols]`` they cover (edge blocks cut)."""
    grown = np.repeat(np.repeat(scales, block[0], axis=0), block[1], axis=1)
    return grown[: shape[0], : shape[1]]


def _fp8_dequant(codes: Any, scales: F32, block: tuple[int, int]) -> F32:
    q = _u8(codes)
    return E4M3[q] * _expand(scales, q.shape, block)


def _unpack(packed: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint8]:
    """E2M1 codes from bytes, the low nibble first."""
    out = np.empty((*packed.shape[:-1], packed.shape[-1] * 2), dtype=np.uint8)
    out[..., 0::2], out[..., 1::2] = packed & 15, packed >> 4
    return out


def _mx_dequant(packed: npt.NDArray[np.uint8], scales: npt.NDArray[np.uint8]) -> F32:
    """``[rows, cols / 2]`` packed codes with ``[rows, cols / 32]`` E8M0 scales."""
    values = E2M1[_unpack(packed)].astype(np.float64)
    factors = np.repeat(2.0 ** (scales.astype(np.float64) - 127), 32, axis=-1)
    return (values * factors).astype(np.float32)


def _pow2_exponent(amax: F32, limit: float) -> npt.NDArray[np.int64]:
    """The smallest e with amax <= limit * 2**e, in float64 with exact comparisons."""
    a = amax.astype(np.float64)
    e = np.ceil(np.log2(np.maximum(a, 1e-300) / limit)).astype(np.int64)
    e = np.where(a > limit * np.exp2(e), e + 1, e)
    e = np.where(a <= limit * np.exp2(e - 1), e - 1, e)
    return np.clip(e, -127, 127)


def _mx_reference(weight: F32) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint8]]:
    """MX E2M1 by brute force: every value's nearest E2M1 magnitude (ties: even code)."""
    rows, cols = weight.shape
    groups = weight.reshape(rows, cols // 32, 32).astype(np.float64)
    e = _pow2_exponent(np.abs(groups).max(axis=2).astype(np.float32), 6.0)
    scaled = groups / np.exp2(e)[..., None]
    dist = np.abs(np.abs(scaled)[..., None] - E2M1[:8].astype(np.float64))
    best = dist == dist.min(axis=-1, keepdims=True)
    codes = np.arange(8)
    even = np.where(best & (codes % 2 == 0), codes, 99).min(axis=-1)
    code = np.where(even < 99, even, np.where(best, codes, 99).min(axis=-1)).astype(np.uint8)
    code |= np.signbit(scaled).astype(np.uint8) << 3
    code = code.reshape(rows, cols)
    return code[:, 0::2] | (code[:, 1::2] << 4), (e + 127).astype(np.uint8)


def _within_fp8(deq: F32, ref: F32, scales: F32, block: tuple[int, int]) -> bool:
    """Within half an E4M3 step: 2^-4 of the value, 2^-10 of the scale below 2^-6."""
    bound = np.maximum(np.abs(ref) / 16, _expand(scales, ref.shape, block) * 2.0**-10)
    return bool(np.all(np.abs(deq - ref) <= bound * (1 + 1e-6)))


def _within_mx(deq: F32, ref: F32, scales: npt.NDArray[np.uint8]) -> bool:
    """Within half an E2M1 step: a quarter of the value, a quarter of the scale below 1."""
    factors = np.repeat(2.0 ** (scales.astype(np.float64) - 127), 32, axis=-1)
    bound = np.maximum(np.abs(ref) / 4, factors / 4)
    return bool(np.all(np.abs(deq.astype(np.float64) - ref) <= bound))


def _write(directory: Path, name: str, spec: ModelSpec = SPEC, **options: Any) -> Path:
    return write_checkpoint(spec, directory / name, CheckpointOptions(**options)).path


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The plain BF16 checkpoint and each quantized one of one seed, written once."""
    d = tmp_path_factory.mktemp("quantized")
    return {"bf16": _write(d, "bf16"), "fp8": _write(d, "fp8", quant="fp8"),
            "mxfp4": _write(d, "mxfp4", quant="mxfp4"), "fp4": _write(d, "fp4", quant="fp4"),
            "bf16-edges": _write(d, "bf16-edges", EDGES),
            "fp8-edges": _write(d, "fp8-edges", EDGES, quant="fp8", block=(64, 48))}


@pytest.fixture(scope="module")
def plain(written: dict[str, Path]) -> dict[str, Any]:
    return _tensors(written["bf16"])


def _plain_expert(plain: dict[str, Any], layer: int, expert: int, matrix: str) -> F32:
    return _f32(plain[f"model.layers.{layer}.mlp.experts.{expert}.{matrix}_proj.weight"])


class TestE4M3:
    """The E4M3 rounding is torch's cast (nearest, ties to even) on every value and tie."""

    def test_every_value_and_midpoint(self) -> None:
        finite = np.unique(E4M3[np.isfinite(E4M3)])
        mids = (finite[1:] + finite[:-1]) / 2
        around = np.concatenate([finite, mids, np.nextafter(mids, np.float32(-np.inf)),
                                 np.nextafter(mids, np.float32(np.inf))]).astype(np.float32)
        want = torch.from_numpy(around).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        assert np.array_equal(e4m3_codes(around), want)

    def test_every_bf16_value_and_between(self) -> None:
        """Every float32 up to 448 whose low 16 bits are 0, 1, 0x7FFF, 0x8000 or 0xFFFF."""
        high = np.arange(0x43E1, dtype=np.uint32) << np.uint32(16)
        bits = (high[:, None] | np.array([0, 1, 0x7FFF, 0x8000, 0xFFFF], dtype=np.uint32))
        x = bits.reshape(-1).view(np.float32)
        x = np.concatenate([x[x <= 448], -x[x <= 448]])
        want = torch.from_numpy(x).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        assert np.array_equal(e4m3_codes(x), want)

    @given(hnp.arrays(np.float32, 64, elements=st.floats(-464, 464, width=32)))
    def test_random_floats(self, x: F32) -> None:
        want = torch.from_numpy(x.copy()).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        assert np.array_equal(e4m3_codes(x.copy()), want)

    def test_beyond_448_saturates(self) -> None:
        assert e4m3_codes(np.array([500.0, -1e9], dtype=np.float32)).tolist() == [0x7E, 0xFE]


class TestFp8Blocks:
    """Block scales are max|w| / 448; codes are torch's cast of w / scale."""

    @settings(max_examples=40, deadline=None)
    @given(st.integers(1, 300), st.integers(1, 300), st.sampled_from([(128, 128), (64, 32)]),
           st.floats(-30, 10), st.integers(0, 2**32 - 1))
    def test_equals_torch_rule(self, rows: int, cols: int, block: tuple[int, int],
                               log_scale: float, seed: int) -> None:
        w = (np.random.default_rng(seed).standard_normal((rows, cols)) * 2.0**log_scale
             ).astype(np.float32)
        codes, scales = quantize_fp8_blocks(w, block)
        assert scales.shape == (-(-rows // block[0]), -(-cols // block[1]))
        t = torch.from_numpy(w)
        grid = torch.zeros(scales.shape[0] * block[0], scales.shape[1] * block[1])
        grid[:rows, :cols] = t
        grid = grid.view(scales.shape[0], block[0], scales.shape[1], block[1])
        want_scales = grid.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
        want = (grid / want_scales[:, None, :, None]).to(torch.float8_e4m3fn)
        want = want.view(torch.uint8).reshape(grid.shape[0] * block[0], -1)[:rows, :cols]
        assert np.array_equal(scales, want_scales.numpy())
        assert np.array_equal(codes, want.numpy())
        assert _within_fp8(_fp8_dequant(torch.from_numpy(codes), scales, block), w, scales,
                           block)

    @given(hnp.arrays(np.float32, (3, 40), elements=st.floats(-2.0**100, 2.0**100, width=32)))
    def test_pow2_scales_hold_the_largest_value(self, w: F32) -> None:
        _, scales = quantize_fp8_blocks(w, (2, 16), pow2=True)
        mantissa, _ = np.frexp(scales)
        assert np.all(mantissa == 0.5)
        amax = np.maximum(np.abs(np.pad(w, ((0, 1), (0, 8)))).reshape(2, 2, 3, 16).max(
            axis=(1, 3)), 1e-12)
        e = _pow2_exponent(amax.astype(np.float32), 448.0)
        assert np.array_equal(scales, np.exp2(e).astype(np.float32))


class TestMx:
    """E8M0 scales are the smallest power of two keeping max|w| within 6; codes are the
    nearest E2M1 values, ties to the even code, two a byte, low nibble first."""

    @settings(max_examples=60, deadline=None)
    @given(st.integers(1, 8), st.sampled_from([32, 64, 96]), st.floats(-40, 40),
           st.integers(0, 2**32 - 1))
    def test_equals_brute_force(self, rows: int, cols: int, log_scale: float,
                                seed: int) -> None:
        w = (np.random.default_rng(seed).standard_normal((rows, cols)) * 2.0**log_scale
             ).astype(np.float32)
        w[0, :4] = 0.0
        packed, scales = quantize_mx_e2m1(w)
        want_packed, want_scales = _mx_reference(w)
        assert np.array_equal(scales, want_scales) and np.array_equal(packed, want_packed)
        assert _within_mx(_mx_dequant(packed, scales), w, scales)

    def test_every_code_and_tie(self) -> None:
        magnitudes = np.array([0, 0.25, 0.5, 0.75, 1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5,
                               6, 0.3, 4.9, 5.1, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0,
                               0.0, 0.0, 0.0, 0.0, 0.0, 0.0], dtype=np.float32)
        w = np.stack([magnitudes, -magnitudes])  # max 6: scale 1, values as they are
        packed, scales = quantize_mx_e2m1(w)
        assert scales.tolist() == [[127], [127]]
        got = E2M1[_unpack(packed)][0, :18]
        assert got.tolist() == [0, 0, 0.5, 1, 1, 1, 1.5, 2, 2, 2, 3, 4, 4, 4, 6, 0.5, 4, 6]
        assert np.array_equal(E2M1[_unpack(packed)][1], -E2M1[_unpack(packed)][0])

    def test_every_bf16_magnitude_and_between(self) -> None:
        """Scale 1 (each row holds a 6): every float32 up to 6 whose low 16 bits are 0, 1,
        0x8000 or 0xFFFF rounds as the brute force does."""
        high = np.arange(0x40C1, dtype=np.uint32) << np.uint32(16)
        bits = high[:, None] | np.array([0, 1, 0x8000, 0xFFFF], dtype=np.uint32)
        x = bits.reshape(-1).view(np.float32)
        x = x[x <= 6]
        rows = np.concatenate([x, np.zeros(-len(x) % 31, dtype=np.float32)]).reshape(-1, 31)
        w = np.concatenate([np.full((len(rows), 1), 6, dtype=np.float32), rows], axis=1)
        packed, scales = quantize_mx_e2m1(w)
        assert np.all(scales == 127)
        assert np.array_equal(packed, _mx_reference(w)[0])

    def test_columns_not_a_multiple_of_32_refused(self) -> None:
        with pytest.raises(ValueError, match="multiple of 32"):
            quantize_mx_e2m1(np.ones((2, 48), dtype=np.float32))


class TestFp8Checkpoint:
    """Qwen3-MoE FP8: every *_proj.weight F8_E4M3 with F32 block scales, dequantizing to the
    BF16 checkpoint of the seed; everything else that checkpoint's bytes."""

    def test_dtypes_shapes_and_values(self, written: dict[str, Path],
                                      plain: dict[str, Any]) -> None:
        got = _tensors(written["fp8"])
        projs = [n for n in plain if n.endswith("_proj.weight")]
        assert len(projs) == SPEC.n_layers * (4 + 3 * SPEC.n_experts)
        assert set(got) == set(plain) | {n[:-6] + "weight_scale_inv" for n in projs}
        for name, ref in plain.items():
            if name not in projs:
                assert torch.equal(got[name], ref), name
                continue
            weight, scales = got[name], got[name[:-6] + "weight_scale_inv"]
            rows, cols = ref.shape
            assert weight.dtype == torch.float8_e4m3fn and tuple(weight.shape) == (rows, cols)
            assert scales.dtype == torch.float32
            assert tuple(scales.shape) == (-(-rows // 128), -(-cols // 128))
            assert _within_fp8(_fp8_dequant(weight, scales.numpy(), (128, 128)), _f32(ref),
                               scales.numpy(), (128, 128)), name
        config = json.loads((written["fp8"] / "config.json").read_text())
        assert config["quantization_config"] == {
            "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
            "activation_scheme": "dynamic"}
        assert config["model_type"] == "qwen3_moe"

    def test_partial_edge_blocks(self, written: dict[str, Path]) -> None:
        plain, got = _tensors(written["bf16-edges"]), _tensors(written["fp8-edges"])
        ref = plain["model.layers.1.mlp.experts.2.down_proj.weight"]
        weight = got["model.layers.1.mlp.experts.2.down_proj.weight"]
        scales = got["model.layers.1.mlp.experts.2.down_proj.weight_scale_inv"].numpy()
        assert tuple(weight.shape) == (320, 200) and scales.shape == (5, 5)
        assert _within_fp8(_fp8_dequant(weight, scales, (64, 48)), _f32(ref), scales,
                           (64, 48))
        config = json.loads((written["fp8-edges"] / "config.json").read_text())
        assert config["quantization_config"]["weight_block_size"] == [64, 48]

    def test_transformers_reads_it(self, written: dict[str, Path]) -> None:
        transformers = pytest.importorskip("transformers")
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            written["fp8"], quantization_config=transformers.FineGrainedFP8Config(
                dequantize=True), output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"]
        got = _tensors(written["fp8"])

        def deq(name: str) -> Any:
            scales = got[name + "_scale_inv"].numpy()
            return torch.from_numpy(_fp8_dequant(got[name], scales, (128, 128))).bfloat16()

        layer = model.model.layers[1]
        p = "model.layers.1."
        assert torch.equal(layer.self_attn.q_proj.weight, deq(p + "self_attn.q_proj.weight"))
        f = SPEC.expert_ffn
        for e in range(SPEC.n_experts):
            x = f"{p}mlp.experts.{e}."
            assert torch.equal(layer.mlp.experts.gate_up_proj[e][:f], deq(x + "gate_proj.weight"))
            assert torch.equal(layer.mlp.experts.gate_up_proj[e][f:], deq(x + "up_proj.weight"))
            assert torch.equal(layer.mlp.experts.down_proj[e], deq(x + "down_proj.weight"))
        with torch.no_grad():
            logits = model(torch.tensor([[1, 5, 9, 200]])).logits
        assert torch.isfinite(logits).all()

    def test_transformers_refuses_partial_edge_blocks(self, written: dict[str, Path]) -> None:
        """Not a check of ours: transformers 5's dequantization derives a block from the
        scale grid (rows / grid rows), so it cannot read edge blocks; recorded so a release
        that can shows up here."""
        transformers = pytest.importorskip("transformers")
        with pytest.raises(RuntimeError, match="conversion"):
            transformers.AutoModelForCausalLM.from_pretrained(
                written["fp8-edges"],
                quantization_config=transformers.FineGrainedFP8Config(dequantize=True))


class TestMxfp4Checkpoint:
    """gpt-oss MXFP4: fused, transposed as gpt-oss ships it, gate and up rows interleaved."""

    def test_dtypes_shapes_and_values(self, written: dict[str, Path],
                                      plain: dict[str, Any]) -> None:
        got = _tensors(written["mxfp4"])
        n, f, d = SPEC.n_experts, SPEC.expert_ffn, SPEC.hidden
        x = "model.layers.1.mlp.experts."
        shapes = {"gate_up_proj_blocks": ((n, 2 * f, d // 32, 16), torch.uint8),
                  "gate_up_proj_scales": ((n, 2 * f, d // 32), torch.uint8),
                  "gate_up_proj_bias": ((n, 2 * f), torch.float32),
                  "down_proj_blocks": ((n, d, f // 32, 16), torch.uint8),
                  "down_proj_scales": ((n, d, f // 32), torch.uint8),
                  "down_proj_bias": ((n, d), torch.float32)}
        for name, (shape, dtype) in shapes.items():
            assert (tuple(got[x + name].shape), got[x + name].dtype) == (shape, dtype), name
        for e in range(n):
            blocks = got[x + "gate_up_proj_blocks"][e].numpy().reshape(2 * f, d // 2)
            scales = got[x + "gate_up_proj_scales"][e].numpy()
            for first, matrix in ((0, "gate"), (1, "up")):
                ref = _plain_expert(plain, 1, e, matrix)
                assert np.array_equal(blocks[first::2], _mx_reference(ref)[0])
                assert _within_mx(_mx_dequant(blocks[first::2], scales[first::2]), ref,
                                  scales[first::2])
            ref = _plain_expert(plain, 1, e, "down")
            blocks = got[x + "down_proj_blocks"][e].numpy().reshape(d, f // 2)
            assert np.array_equal(blocks, _mx_reference(ref)[0])
        config = json.loads((written["mxfp4"] / "config.json").read_text())
        assert config["model_type"] == "gpt_oss"
        assert config["quantization_config"]["quant_method"] == "mxfp4"
        assert "lm_head" in config["quantization_config"]["modules_to_not_convert"]

    def test_transformers_reads_it(self, written: dict[str, Path],
                                   plain: dict[str, Any]) -> None:
        transformers = pytest.importorskip("transformers")
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            written["mxfp4"], quantization_config=transformers.Mxfp4Config(dequantize=True),
            output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"]
        assert type(model.config).__name__ == "GptOssConfig"
        got = _tensors(written["mxfp4"])
        experts = model.model.layers[1].mlp.experts
        x = "model.layers.1.mlp.experts."
        n, f, d = SPEC.n_experts, SPEC.expert_ffn, SPEC.hidden
        assert tuple(experts.gate_up_proj.shape) == (n, d, 2 * f)
        for e in range(n):
            gate_up = _mx_dequant(got[x + "gate_up_proj_blocks"][e].numpy().reshape(2 * f, -1),
                                  got[x + "gate_up_proj_scales"][e].numpy())
            down = _mx_dequant(got[x + "down_proj_blocks"][e].numpy().reshape(d, -1),
                               got[x + "down_proj_scales"][e].numpy())
            # gpt-oss computes x @ gate_up: gate the even columns, up the odd ones
            assert torch.equal(experts.gate_up_proj[e], torch.from_numpy(gate_up.T).bfloat16())
            assert torch.equal(experts.down_proj[e], torch.from_numpy(down.T).bfloat16())
            gate = experts.gate_up_proj[e][:, 0::2].detach().float().numpy().T
            assert _within_mx(gate, _plain_expert(plain, 1, e, "gate"),
                              got[x + "gate_up_proj_scales"][e].numpy()[0::2])
        bias = got[x + "down_proj_bias"]
        assert torch.equal(experts.down_proj_bias, bias.to(experts.down_proj_bias.dtype))
        with torch.no_grad():
            logits = model(torch.tensor([[1, 5, 9, 200]])).logits
        assert torch.isfinite(logits).all()


class TestFp4Checkpoint:
    """DeepSeek-V4 FP4: experts E2M1 in I8 with E8M0 scales per 32, attention and shared
    experts FP8 with E8M0 128x128 scales, named as DeepSeek ships them."""

    def test_dtypes_shapes_and_values(self, written: dict[str, Path],
                                      plain: dict[str, Any]) -> None:
        got = _tensors(written["fp4"])
        f, d = SPEC.expert_ffn, SPEC.hidden
        for e in range(SPEC.n_experts):
            for name, (rows, cols), matrix in (("w1", (f, d), "gate"), ("w3", (f, d), "up"),
                                               ("w2", (d, f), "down")):
                x = f"layers.1.ffn.experts.{e}.{name}."
                weight, scale = got[x + "weight"], got[x + "scale"]
                assert weight.dtype == torch.int8 and tuple(weight.shape) == (rows, cols // 2)
                assert scale.dtype == torch.float8_e8m0fnu
                assert tuple(scale.shape) == (rows, cols // 32)
                ref = _plain_expert(plain, 1, e, matrix)
                assert np.array_equal(_u8(weight), _mx_reference(ref)[0])
                assert np.array_equal(_u8(scale), _mx_reference(ref)[1])
        for name in ("attn.wq_a", "attn.wo_b", "ffn.shared_experts.w2"):
            weight, scale = got[f"layers.0.{name}.weight"], got[f"layers.0.{name}.scale"]
            assert weight.dtype == torch.float8_e4m3fn and scale.dtype == torch.float8_e8m0fnu
            rows, cols = weight.shape
            assert tuple(scale.shape) == (-(-rows // 128), -(-cols // 128))
            # the smallest power-of-two scale: each block's largest code is above 448 / 2
            codes = np.abs(E4M3[_u8(weight)])
            tops = np.pad(codes, ((0, -rows % 128), (0, -cols % 128))).reshape(
                scale.shape[0], 128, scale.shape[1], 128).max(axis=(1, 3))
            assert np.all((tops > 224) & (tops <= 448))
            factors = np.exp2(_u8(scale).astype(np.float64) - 127).astype(np.float32)
            deq = _fp8_dequant(weight, factors, (128, 128))
            assert np.abs(deq).max() <= 0.02 * 3**0.5 * (1 + 2**-4)  # uniform of std 0.02
        assert got["layers.0.ffn.gate.tid2eid"].dtype == torch.int64
        routes = got["layers.0.ffn.gate.tid2eid"].numpy()
        assert routes.shape == (SPEC.vocab, SPEC.top_k) and routes.max() < SPEC.n_experts
        assert all(len(set(row)) == SPEC.top_k for row in routes.tolist())
        config = json.loads((written["fp4"] / "config.json").read_text())
        assert config["model_type"] == "deepseek_v4" and config["expert_dtype"] == "fp4"
        assert config["quantization_config"] == {
            "quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
            "weight_block_size": [128, 128]}

    def test_transformers_reads_it(self, written: dict[str, Path]) -> None:
        """transformers dequantizes DeepSeek-V4's FP4 experts with its FP8 quantizer."""
        transformers = pytest.importorskip("transformers")
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            written["fp4"], quantization_config=transformers.FineGrainedFP8Config(
                dequantize=True), output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"]
        got = _tensors(written["fp4"])
        experts = model.model.layers[1].mlp.experts
        f = SPEC.expert_ffn

        def deq(name: str) -> Any:
            out = _mx_dequant(_u8(got[name + ".weight"]), _u8(got[name + ".scale"]))
            return torch.from_numpy(out).bfloat16()

        for e in range(SPEC.n_experts):
            x = f"layers.1.ffn.experts.{e}."
            assert torch.equal(experts.gate_up_proj[e][:f], deq(x + "w1"))
            assert torch.equal(experts.gate_up_proj[e][f:], deq(x + "w3"))
            assert torch.equal(experts.down_proj[e], deq(x + "w2"))
        with torch.no_grad():
            logits = model(torch.tensor([[1, 5, 9, 200]])).logits
        assert torch.isfinite(logits).all()


class TestWriting:
    """Deterministic; a weight and its scales share a shard; bytes per expert reported."""

    def test_same_seed_same_bytes(self, written: dict[str, Path], tmp_path: Path) -> None:
        """The same header entries and data bytes (safetensors writes ``__metadata__``'s
        keys in hash order, so the header's bytes may differ)."""
        for quant in ("fp8", "mxfp4", "fp4"):
            again = _write(tmp_path, quant, quant=quant, shard_bytes=1 << 30)
            assert _shard(again) == _shard(written[quant]), quant

    def test_scales_share_their_weights_shard(self, tmp_path: Path) -> None:
        path = _write(tmp_path, "sharded", quant="fp8", shard_bytes=300 << 10)
        index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
        assert len(set(index.values())) > 10
        for name, shard in index.items():
            if name.endswith("weight_scale_inv"):
                assert index[name.removesuffix("_scale_inv")] == shard

    def test_expert_bytes(self, tmp_path: Path) -> None:
        spec = spec_for("qwen3-30b-a3b", 1, 2)
        fp8 = write_checkpoint(spec, tmp_path / "a", CheckpointOptions(quant="fp8"))
        assert fp8.expert_bytes == 3 * (768 * 2048 + 6 * 16 * 4)
        fp4 = write_checkpoint(spec, tmp_path / "b", CheckpointOptions(quant="fp4"))
        assert fp4.expert_bytes == 3 * (768 * 2048 // 2 + 768 * 2048 // 32)

    def test_refusals(self) -> None:
        with pytest.raises(UsageError, match="one tensor per expert"):
            CheckpointOptions(quant="fp8", fused_experts=True)
        with pytest.raises(UsageError, match="--block is for"):
            CheckpointOptions(quant="mxfp4", block=(64, 64))
        with pytest.raises(UsageError, match="unknown quantization"):
            CheckpointOptions(quant="int4")  # type: ignore[arg-type]


class TestCli:
    """``--quant`` on the command line: a summary with bytes per expert; misuse in one line."""

    @pytest.fixture(autouse=True)
    def _reset_logging(self) -> Any:
        yield
        structlog.reset_defaults()

    def test_summary(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        out = tmp_path / "oss"
        assert main([str(out), "--format", "safetensors", "--preset", "tiny", "--layers", "1",
                     "--experts", "2", "--quant", "mxfp4", "--hidden", "320",
                     "--expert-ffn", "96", "--top-k", "1"]) == 0
        line = capsys.readouterr().out
        per_expert = 3 * (320 * 96 // 2 + 320 * 96 // 32) / 2**20
        assert f"mxfp4 (bf16 dense), {per_expert:.3f} MiB per expert" in line
        config = json.loads((out / "config.json").read_text())
        assert (config["hidden_size"], config["intermediate_size"]) == (320, 96)
        assert config["num_experts_per_tok"] == 1

    def test_reshaping_a_gguf_quantized_preset(self, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
        """qwen3-30b-a3b's GGUF type (Q4_K, 256-value blocks) does not bind a checkpoint:
        gpt-oss-120b's 2880 takes partial FP8 edge blocks."""
        out = tmp_path / "wide"
        assert main([str(out), "--format", "safetensors", "--preset", "qwen3-30b-a3b",
                     "--layers", "1", "--experts", "1", "--hidden", "2880", "--expert-ffn",
                     "2880", "--quant", "fp8"]) == 0
        per_expert = 3 * (2880 * 2880 + 23 * 23 * 4) / 2**20
        assert f"fp8 (bf16 dense), {per_expert:.3f} MiB per expert" in capsys.readouterr().out
        scales = _tensors(out)["model.layers.0.mlp.experts.0.down_proj.weight_scale_inv"]
        assert tuple(scales.shape) == (23, 23)

    @pytest.mark.parametrize("argv, message", [
        (["--quant", "fp8"], "--quant is for --format safetensors"),
        (["--format", "safetensors", "--quant", "fp8", "--fused-experts"],
         "one tensor per expert"),
        (["--format", "safetensors", "--quant", "fp4", "--fused-experts"],
         "one tensor per expert"),
        (["--format", "safetensors", "--quant", "mxfp4", "--hidden", "500"],
         "hidden size divisible by 32"),
        (["--format", "safetensors", "--quant", "fp4", "--expert-ffn", "100"],
         "expert FFN divisible by 32"),
        (["--format", "safetensors", "--block", "64"], "--block is for --quant fp8"),
        (["--format", "safetensors", "--quant", "fp8", "--block", "0x4"], "--block"),
        (["--format", "safetensors", "--quant", "fp8", "--block", "big"], "--block"),
        (["--format", "safetensors", "--top-k", "9", "--experts", "4"], "more than the 4"),
        (["--format", "safetensors", "--hidden", "0"], "--hidden must be >= 1"),
        (["--format", "safetensors", "--quant", "int4"], "invalid choice"),
    ])
    def test_misuse_one_line(self, tmp_path: Path, argv: list[str], message: str,
                             capsys: pytest.CaptureFixture[str]) -> None:
        assert main([str(tmp_path / "m"), "--layers", "1", "--experts", "4", *argv]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1
        assert not (tmp_path / "m").exists()


class TestMoestreamReadsThem:
    """moestream streams each checkpoint's experts quantized and computes what transformers
    computes on the dequantized model: at a budget of 4 of 16 experts (misses, evictions)."""

    @pytest.mark.parametrize("quant", ["fp8", "mxfp4", "fp4"])
    def test_logits_and_tokens_equal_transformers(self, tmp_path: Path, quant: str) -> None:
        transformers = pytest.importorskip("transformers")
        import moestream.transformers as mt

        spec = dataclasses.replace(spec_for("tiny", 2, 8, seed=5), top_k=2)
        path = _write(tmp_path, quant, spec, quant=quant)
        config = (transformers.Mxfp4Config(dequantize=True) if quant == "mxfp4"
                  else transformers.FineGrainedFP8Config(dequantize=True))
        reference = transformers.AutoModelForCausalLM.from_pretrained(
            path, quantization_config=config)
        model = mt.from_pretrained(path, device="cpu", budget="4")
        ids = torch.tensor([[1, 5, 9, 200, 17, 33]])
        try:
            with torch.no_grad():
                assert torch.equal(model(ids).logits, reference(ids).logits)
                assert torch.equal(model.generate(ids, max_new_tokens=6, do_sample=False),
                                   reference.generate(ids, max_new_tokens=6, do_sample=False))
        finally:
            model.moestream.close()  # its session's threads end with it
