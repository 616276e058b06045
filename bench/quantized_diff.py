"""``python -m bench.quantized_diff``: where moestream's model of a quantized checkpoint
and transformers' own dequantized model part, on one device.

The exactness contract is tokens identical to transformers' ``dequantize=True`` model. When a
run's tokens leave the reference's, the cause is one of: the dense weights dequantized at load
differ, an expert's dequantized matrices differ, or the same weights summed in another order
(the grouped product over a subset of experts against the reference's over all of them). This
tells them apart: every dense parameter compared, every expert's stacked ``gate_up`` and
``down`` compared with the reference's, then the logits of one forward and the greedy tokens
of both models, and the reference's tokens twice (is the reference itself repeatable here?).

Usage: ``python -m bench.quantized_diff -m CHECKPOINT --format fp4 --device cuda --out F``
(the checkpoint made by ``python -m bench.quantized --make DIR --format ... --runs dequant``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from bench.record import report_main
from bench.transformers import _versions

EXPERTS = ".experts."


def _reference(path: Path, fmt: str, device: Any, implementation: str) -> Any:
    import transformers

    config = (transformers.Mxfp4Config(dequantize=True)  # type: ignore[attr-defined]
              if fmt == "mxfp4" else transformers.FineGrainedFP8Config(dequantize=True))
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, quantization_config=config, experts_implementation=implementation,
        device_map=str(device))


def _difference(a: Any, b: Any) -> dict[str, Any]:
    """Equal or not, and by how much (shapes or dtypes that differ said so)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return {"equal": False, "why": f"{tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"}
    if a.dtype.is_floating_point:
        delta = (a.detach().float() - b.detach().float()).abs()
        return {"equal": bool(delta.max() == 0), "max_abs": float(delta.max()),
                "unequal_share": round(float((delta != 0).float().mean()), 6)}
    return {"equal": bool((a.detach() == b.detach()).all())}


def dense(reference: Any, ours: Any) -> dict[str, Any]:
    """Every parameter and buffer both models hold outside the routed experts."""
    theirs = dict(reference.named_parameters()) | dict(reference.named_buffers())
    mine = dict(ours.named_parameters()) | dict(ours.named_buffers())
    unequal = {}
    compared = 0
    for name, tensor in theirs.items():
        if EXPERTS in name or name not in mine or mine[name].is_meta:
            continue
        compared += 1
        diff = _difference(tensor, mine[name].to(tensor.device))
        if not diff["equal"]:
            unequal[name] = diff
    return {"compared": compared, "unequal": unequal,
            "only_reference": sorted(n for n in theirs if n not in mine and EXPERTS not in n)}


def experts(reference: Any, ours: Any) -> dict[str, Any]:
    """Each MoE layer's experts, all of them stacked by moestream (in groups its budget
    holds) against the reference module's ``gate_up_proj`` and ``down_proj``."""
    stream = ours.moestream
    session = stream.session
    layers: dict[str, Any] = {}
    for layer in session.model.moe_layers:
        theirs = _module(reference, layer)
        module = _module(ours, layer)
        if theirs is None or module is None:
            layers[str(layer)] = "no experts module found"
            continue
        count = session.model.layers[layer].n_experts
        found: dict[str, Any] = {"gate_up": [], "down": []}
        with session.fetch(layer, range(count)) as lease:
            handles = sorted(lease.gather(), key=lambda h: h.expert)
            gate_up, down = stream.stacked(module, handles)
            for h, g, d in zip(handles, gate_up, down, strict=True):
                for part, mine, full in (("gate_up", g, theirs.gate_up_proj),
                                         ("down", d, theirs.down_proj)):
                    diff = _difference(full.data[h.expert], mine)
                    if not diff["equal"]:
                        found[part].append({"expert": h.expert, **diff})
        layers[str(layer)] = {"experts": count, "unequal_gate_up": found["gate_up"][:8],
                              "unequal_down": found["down"][:8],
                              "counts": {k: len(v) for k, v in found.items()}}
    return layers


def _module(model: Any, layer: int) -> Any:
    for name, module in model.named_modules():
        if name.endswith(f"layers.{layer}.mlp.experts") or name.endswith(
                f"layers.{layer}.ffn.experts"):
            return module
    return None


def forwards(reference: Any, ours: Any, prompt: Any, tokens: int) -> dict[str, Any]:
    """One forward's logits, then greedy tokens: the reference twice, moestream once."""
    import torch

    def generate(model: Any) -> list[int]:
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                             max_new_tokens=tokens, min_new_tokens=tokens)
        return list(out[0, prompt.shape[1]:].tolist())

    with torch.no_grad():
        logits = _difference(reference(prompt).logits, ours(prompt).logits)
        first, again, mine = generate(reference), generate(reference), generate(ours)
    apart = next((i for i, (a, b) in enumerate(zip(first, mine, strict=True)) if a != b), None)
    return {"logits": logits, "reference_repeats": first == again, "tokens_equal": first == mine,
            "first_different_token": apart, "reference_tokens": first, "moestream_tokens": mine}


def _bench(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from moestream import transformers as mt

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    prompt = torch.tensor([[int(t) for t in args.prompt_ids.split(",")]], device=device)
    reference = _reference(args.model, args.format, device, args.implementation)
    ours = mt.from_pretrained(args.model, device=device, compute=args.compute)
    try:
        report = {"command": "python -m bench.quantized_diff " + " ".join(sys.argv[1:]),
                  "checkpoint": str(args.model), "format": args.format,
                  "device": str(device), **_versions(),
                  "dense": dense(reference, ours), "experts": experts(reference, ours)}
        try:
            report["forwards"] = forwards(reference, ours, prompt, args.tokens)
        except RuntimeError as exc:  # transformers' own model failing is a finding
            report["forwards"] = {"failed": f"{type(exc).__name__}: {str(exc).splitlines()[0]}"}
    finally:
        ours.moestream.close()
    return report


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.quantized_diff",
                                description=__doc__.splitlines()[0])
    p.add_argument("-m", "--model", type=Path, required=True, help="quantized checkpoint")
    p.add_argument("--format", default="fp8", choices=["fp8", "mxfp4", "fp4"])
    p.add_argument("--device", help="cpu or cuda (default: cuda if torch sees one)")
    p.add_argument("--compute", default="grouped", choices=["grouped", "eager"])
    p.add_argument("--implementation", default="grouped_mm",
                   help="the reference's experts_implementation (grouped_mm)")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--prompt-ids", default="1,2,3,4")
    p.add_argument("--out", type=Path, help="also write the JSON here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return report_main("bench.quantized_diff", lambda: _bench(args), args.out,
                       lambda report: bool(report["forwards"].get("tokens_equal")))


if __name__ == "__main__":
    sys.exit(main())
