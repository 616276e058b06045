"""Quantized checkpoints for the tests, written here independently of moestream's code.

``fp8_checkpoint`` turns a float checkpoint written by transformers' ``save_pretrained``
into one laid out as DeepSeek-V3 and Qwen3-FP8 ship theirs: every linear projection
(``*_proj.weight``, routed experts included; not the routers, norms, embeddings or the
head) F8_E4M3 with a ``weight_scale_inv`` per ``block`` (F32 or BF16, partial edge blocks
allowed), and ``quantization_config: {quant_method: fp8, fmt: e4m3, weight_block_size,
activation_scheme: dynamic}`` in ``config.json``. The quantization is the formats' own rule:
a block's scale is its largest magnitude over 448 (E4M3's largest finite), each value
divided by it and rounded to E4M3.

``mxfp4_checkpoint`` turns a gpt-oss float checkpoint into one laid out as OpenAI ships
gpt-oss: each layer's experts ``gate_up_proj_blocks`` ``[E, 2F, D / 32, 16]`` and
``down_proj_blocks`` ``[E, D, F / 32, 16]`` (the transposes of the float layout, in groups
of 32 along a row, two E2M1 codes a byte, the low nibble first), ``*_scales`` U8 beside
them, the biases F32, ``quantization_config: {quant_method: mxfp4, modules_to_not_convert}``.
The rule is OCP MX's: a group's shared exponent is ``floor(log2(amax)) - 2`` (E2M1's
largest exponent), stored plus 127; each value divided by ``2 ** exponent``, rounded to the
nearest E2M1 (ties to the even code) and saturated at 6.

``fp4_checkpoint`` turns a DeepSeek-V4 float checkpoint into one laid out as DeepSeek ships
V4-Flash: routed experts ``ffn.experts.E.w{1,2,3}.weight`` I8 ``[rows, cols / 2]`` (E2M1
pairs, the low nibble first) with ``.scale`` F8_E8M0 ``[rows, cols / 32]``; attention and
shared-expert weights F8_E4M3 with ``.scale`` F8_E8M0 per block; ``quantization_config:
{quant_method: fp8, fmt: e4m3, scale_fmt: ue8m0, weight_block_size}`` and ``expert_dtype:
fp4``. Its scales are DeepSeek's ue8m0 rule: the smallest power of two that brings the
group's (or block's) largest magnitude within the format's largest finite (6, 448).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch  # type: ignore[import-not-found, unused-ignore]
from safetensors.torch import load_file, save_file  # type: ignore[import-not-found, unused-ignore]

__all__ = ["PROMPTS", "assert_streams_like", "dequantized", "fp4_checkpoint", "fp8_checkpoint",
           "logits", "mxfp4_checkpoint", "quantize_fp4", "quantize_fp8", "quantize_mxfp4"]

E4M3_MAX = 448.0
E2M1_MAX = 6.0
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
GROUP = 32


def _power_of_two(amax: Any, largest: float) -> Any:
    """The ue8m0 scale: the smallest power of two ``s`` with ``amax / s <= largest``."""
    exponent = torch.ceil(torch.log2(amax.clamp(min=2.0**-126) / largest))
    return torch.exp2(exponent.clamp(-127, 127))


def quantize_fp8(weight: Any, block: tuple[int, int], ue8m0: bool = False) -> tuple[Any, Any]:
    """``weight`` (rows, cols) as E4M3 and its float32 block scales (powers of two with
    ``ue8m0``)."""
    rows, cols = weight.shape
    bm, bn = block
    sr, sc = -(-rows // bm), -(-cols // bn)
    w = weight.to(torch.float32)
    out = torch.empty((rows, cols), dtype=torch.float8_e4m3fn)
    scales = torch.empty((sr, sc), dtype=torch.float32)
    for i in range(sr):
        for j in range(sc):
            part = w[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn]
            amax = part.abs().max()
            scale = _power_of_two(amax, E4M3_MAX) if ue8m0 else amax.clamp(min=1e-12) / E4M3_MAX
            scales[i, j] = scale
            out[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn] = (part / scale).to(torch.float8_e4m3fn)
    return out, scales


def _quantized(name: str, tensor: Any) -> bool:
    return name.endswith("_proj.weight") and tensor.dim() == 2


def fp8_checkpoint(source: Path, target: Path, block: tuple[int, int] = (16, 16),
                   scale_dtype: Any = torch.float32) -> Path:
    """``source``'s checkpoint (every shard) written to ``target`` with FP8 projections."""
    target.mkdir(parents=True)
    for file in source.iterdir():
        if file.suffix == ".safetensors":
            out: dict[str, Any] = {}
            for name, tensor in load_file(file).items():
                if _quantized(name, tensor):
                    out[name], scales = quantize_fp8(tensor, block)
                    out[name.removesuffix("weight") + "weight_scale_inv"] = scales.to(scale_dtype)
                else:
                    out[name] = tensor
            save_file(out, target / file.name, metadata={"format": "pt"})
        elif file.name == "model.safetensors.index.json":
            index = json.loads(file.read_text())
            weight_map = index["weight_map"]
            for name in list(weight_map):
                if name.endswith("_proj.weight"):
                    weight_map[name.removesuffix("weight") + "weight_scale_inv"] = weight_map[name]
            (target / file.name).write_text(json.dumps(index))
        elif file.is_file():
            shutil.copyfile(file, target / file.name)
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                     "weight_block_size": list(block),
                                     "activation_scheme": "dynamic"}
    (target / "config.json").write_text(json.dumps(config))
    return target


def _e2m1_codes(scaled: Any) -> Any:
    """Values already divided by their scale, as E2M1 codes (uint8): the nearest magnitude,
    ties to the even code, saturated at 6; the sign in bit 3."""
    magnitudes = torch.tensor(E2M1_MAGNITUDES)
    distance = (scaled.abs().clamp(max=E2M1_MAX)[..., None] - magnitudes).abs()
    tied = distance == distance.min(-1, keepdim=True).values
    even = tied & (torch.arange(8) % 2 == 0)
    code = torch.where(even.any(-1), even.int().argmax(-1), tied.int().argmax(-1))
    return (code | torch.where(scaled < 0, 8, 0)).to(torch.uint8)


def _pack(codes: Any) -> Any:
    """Two codes a byte along the last axis, the first in the low nibble."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()


def quantize_mxfp4(weight: Any) -> tuple[Any, Any]:
    """``weight`` (..., cols) as MXFP4: blocks (..., cols / 32, 16) uint8 and E8M0 scales
    (..., cols / 32) uint8 (OCP MX: ``floor(log2(amax)) - 2``, plus 127)."""
    *lead, cols = weight.shape
    groups = weight.to(torch.float32).reshape(*lead, cols // GROUP, GROUP)
    amax = groups.abs().amax(-1)
    exponent = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2,
                           torch.full_like(amax, -127)).clamp(-127, 127)
    codes = _e2m1_codes(groups / torch.exp2(exponent)[..., None])
    return _pack(codes), (exponent + 127).to(torch.uint8)


def quantize_fp4(weight: Any) -> tuple[Any, Any]:
    """``weight`` (rows, cols) as DeepSeek-V4's FP4: int8 (rows, cols / 2) and float8_e8m0
    scales (rows, cols / 32)."""
    rows, cols = weight.shape
    groups = weight.to(torch.float32).reshape(rows, cols // GROUP, GROUP)
    scale = _power_of_two(groups.abs().amax(-1), E2M1_MAX)
    codes = _e2m1_codes(groups / scale[..., None]).reshape(rows, cols)
    return _pack(codes).view(torch.int8), scale.to(torch.float8_e8m0fnu)


def _rewrite(source: Path, target: Path, convert: Any) -> None:
    """``source``'s shards through ``convert`` (name, tensor -> {name: tensor}) into
    ``target``, its index following the new names; every other file copied."""
    target.mkdir(parents=True)
    index = None
    renamed: dict[str, list[str]] = {}
    for file in source.iterdir():
        if file.suffix == ".safetensors":
            out: dict[str, Any] = {}
            for name, tensor in load_file(file).items():
                made = convert(name, tensor)
                renamed[name] = list(made)
                out.update(made)
            save_file(out, target / file.name, metadata={"format": "pt"})
        elif file.name == "model.safetensors.index.json":
            index = json.loads(file.read_text())
        elif file.is_file():
            shutil.copyfile(file, target / file.name)
    if index is not None:
        weight_map = index["weight_map"]
        index["weight_map"] = {new: weight_map[old] for old, news in renamed.items()
                               for new in news}
        (target / "model.safetensors.index.json").write_text(json.dumps(index))


def _config(target: Path, **changes: Any) -> None:
    config = json.loads((target / "config.json").read_text())
    config.update(changes)
    (target / "config.json").write_text(json.dumps(config))


def mxfp4_checkpoint(source: Path, target: Path) -> Path:
    """``source``'s gpt-oss checkpoint written to ``target`` with MXFP4 experts."""
    def convert(name: str, tensor: Any) -> dict[str, Any]:
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = quantize_mxfp4(tensor.transpose(1, 2))  # rows of [E, out, in]
            return {name + "_blocks": blocks, name + "_scales": scales}
        if ".experts." in name and name.endswith("_bias"):
            return {name: tensor.to(torch.float32)}
        return {name: tensor}

    _rewrite(source, target, convert)
    _config(target, quantization_config={
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                   "model.embed_tokens", "lm_head"]})
    return target


def fp4_checkpoint(source: Path, target: Path, block: tuple[int, int] = (128, 128),
                   experts: str = "fp4") -> Path:
    """``source``'s DeepSeek-V4 checkpoint written to ``target`` as DeepSeek ships V4-Flash
    (``experts="fp8"``: the experts FP8 blocks too, with ``expert_dtype: fp8``)."""
    def convert(name: str, tensor: Any) -> dict[str, Any]:
        if not name.endswith(".weight") or tensor.dim() != 2:
            return {name: tensor}
        scale_name = name.removesuffix("weight") + "scale"
        if ".ffn.experts." in name and experts == "fp4":
            packed, scales = quantize_fp4(tensor)
            return {name: packed, scale_name: scales}
        if ".attn." in name or ".shared_experts." in name or ".ffn.experts." in name:
            weight, scales = quantize_fp8(tensor, block, ue8m0=True)
            return {name: weight, scale_name: scales.to(torch.float8_e8m0fnu)}
        return {name: tensor}

    _rewrite(source, target, convert)
    _config(target, expert_dtype=experts, quantization_config={
        "quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
        "weight_block_size": list(block), "activation_scheme": "dynamic"})
    return target


PROMPTS = [[3, 17, 42, 5, 9, 11], [7, 8, 9, 10, 11, 12]]
"""The prompts every quantized model test compares logits and tokens on."""


def dequantized(path: Path, config: Any, implementation: str = "eager") -> Any:
    """transformers' own model of a quantized checkpoint, its weights dequantized at load
    (``config``: ``FineGrainedFP8Config(dequantize=True)`` or ``Mxfp4Config(...)``)."""
    import transformers  # type: ignore[import-not-found, unused-ignore]

    return transformers.AutoModelForCausalLM.from_pretrained(
        path, quantization_config=config, experts_implementation=implementation)


def logits(model: Any) -> Any:
    with torch.no_grad():
        return model(torch.tensor(PROMPTS, device=model.device)).logits


def assert_streams_like(whole: Any, path: Path, compute: str, budget: str | None = "4",
                        device: str = "cpu", dtype: Any = None, mode: str = "auto") -> None:
    """moestream's model of ``path`` (in ``dtype``, None: the checkpoint's; I/O ``mode``)
    gives ``whole``'s logits (``torch.equal``) and greedy tokens; at a budget below the
    experts, misses and evictions happen meanwhile."""
    from moestream import transformers as mt

    model = mt.from_pretrained(path, device=device, compute=compute, budget=budget,
                               dtype=dtype, mode=mode)
    try:
        assert torch.equal(logits(whole), logits(model))
        counters = model.moestream.session.counters()
        if budget is not None:
            assert counters.evictions > 0
        if mode != "auto":
            assert counters.mode == mode
        ids = torch.tensor(PROMPTS, device=device)
        args = dict(attention_mask=torch.ones_like(ids), max_new_tokens=4, min_new_tokens=4,
                    do_sample=False)
        assert torch.equal(whole.generate(ids, **args), model.generate(ids, **args))
    finally:
        model.moestream.close()
