"""Quantized checkpoints for the tests, written here independently of moestream's code.

``fp8_checkpoint`` turns a float checkpoint written by transformers' ``save_pretrained``
into one laid out as DeepSeek-V3 and Qwen3-FP8 ship theirs: every linear projection
(``*_proj.weight``, routed experts included; not the routers, norms, embeddings or the
head) F8_E4M3 with a ``weight_scale_inv`` per ``block`` (F32 or BF16, partial edge blocks
allowed), and ``quantization_config: {quant_method: fp8, fmt: e4m3, weight_block_size,
activation_scheme: dynamic}`` in ``config.json``. The quantization is the formats' own rule:
a block's scale is its largest magnitude over 448 (E4M3's largest finite), each value
divided by it and rounded to E4M3.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch  # type: ignore[import-not-found, unused-ignore]
from safetensors.torch import load_file, save_file  # type: ignore[import-not-found, unused-ignore]

__all__ = ["fp8_checkpoint", "quantize_fp8"]

E4M3_MAX = 448.0


def quantize_fp8(weight: Any, block: tuple[int, int]) -> tuple[Any, Any]:
    """``weight`` (rows, cols) as E4M3 and its float32 block scales."""
    rows, cols = weight.shape
    bm, bn = block
    sr, sc = -(-rows // bm), -(-cols // bn)
    w = weight.to(torch.float32)
    out = torch.empty((rows, cols), dtype=torch.float8_e4m3fn)
    scales = torch.empty((sr, sc), dtype=torch.float32)
    for i in range(sr):
        for j in range(sc):
            part = w[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn]
            scale = part.abs().max().clamp(min=1e-12) / E4M3_MAX
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
