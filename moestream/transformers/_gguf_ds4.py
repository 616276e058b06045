"""DeepSeek V4 Flash as ds4 runs it: ds4's GGUF tensors mapped onto transformers'
DeepSeek-V4.

What it gives the GGUF loader, for a file whose ``general.architecture`` is ``deepseek4``
(its config is ``_gguf_ds4_config``'s): ``ds4_dense_tensors`` (every non-routed tensor as
the model holds it, under the model's name), in place of transformers' tensor processor;
``Ds4Names`` says where each tensor goes, routed experts included (``gate_up_proj`` stacks
gate rows then up rows, as the loader's GGUF experts fill it). Each refuses in one line
what does not map.

How the names map, in two public steps and no guess:

1. ds4's GGUF name -> DeepSeek's checkpoint name, by ds4's own converter table
   (``gguf-tools/deepseek4-quantize.c``, ``top_map`` / ``layer_map``; github.com/antirez/ds4
   at commit 8d576642c39b9a2d782a80159ba84ef5a81c0b81). The converter copies each tensor
   with its shape reversed into ggml's ``ne`` order and nothing permuted
   (``check_reversed_shape``), so numpy's view of a GGUF tensor is DeepSeek's tensor as
   it was (dequantized); ``tid2eid`` is stored I32 where DeepSeek's is I64.
2. DeepSeek's name -> the model's, by transformers' own conversion mapping for
   ``deepseek_v4`` (the renamings, and the converter that stacks ``experts.*.w1`` and
   ``w3`` into ``gate_up_proj`` in that order, ``w2`` into ``down_proj``), asked through
   the model as its loading asks (``_renaming.renamer``).

Refused, each in one line: multi-token-prediction blocks inside the main file (llama.cpp's
``blk.N.nextn.*``: ds4 ships them as a separate file, and transformers builds none); a
tensor ds4's layout does not have, or one it requires missing (the selection bias
``exp_probs_b``, optional to ds4, included: DeepSeek's checkpoint has it on every top-k
layer). DeepSeek's own ``mtp.*`` tensors are skipped, as transformers skips them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch  # type: ignore[import-not-found, unused-ignore]

import moestream
from moestream.pipeline.foundation.errors import ExpertLayoutError
from moestream.transformers._gguf_tensors import dequantized
from moestream.transformers._renaming import renamer

__all__ = ["Ds4Names", "Target", "ds4_dense_tensors"]

# ds4's converter (deepseek4-quantize.c): GGUF name -> DeepSeek's checkpoint name.
_TOP = {
    "token_embd.weight": "embed.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "head.weight",
    "output_hc_base.weight": "hc_head_base",
    "output_hc_fn.weight": "hc_head_fn",
    "output_hc_scale.weight": "hc_head_scale",
}
_LAYER = {
    "hc_attn_base.weight": "hc_attn_base",
    "hc_attn_fn.weight": "hc_attn_fn",
    "hc_attn_scale.weight": "hc_attn_scale",
    "hc_ffn_base.weight": "hc_ffn_base",
    "hc_ffn_fn.weight": "hc_ffn_fn",
    "hc_ffn_scale.weight": "hc_ffn_scale",
    "attn_sinks.weight": "attn.attn_sink",
    "attn_q_a.weight": "attn.wq_a.weight",
    "attn_q_b.weight": "attn.wq_b.weight",
    "attn_q_a_norm.weight": "attn.q_norm.weight",
    "attn_kv.weight": "attn.wkv.weight",
    "attn_kv_a_norm.weight": "attn.kv_norm.weight",
    "attn_output_a.weight": "attn.wo_a.weight",
    "attn_output_b.weight": "attn.wo_b.weight",
    "attn_compressor_ape.weight": "attn.compressor.ape",
    "attn_compressor_kv.weight": "attn.compressor.wkv.weight",
    "attn_compressor_gate.weight": "attn.compressor.wgate.weight",
    "attn_compressor_norm.weight": "attn.compressor.norm.weight",
    "indexer.attn_q_b.weight": "attn.indexer.wq_b.weight",
    "indexer.proj.weight": "attn.indexer.weights_proj.weight",
    "indexer_compressor_ape.weight": "attn.indexer.compressor.ape",
    "indexer_compressor_kv.weight": "attn.indexer.compressor.wkv.weight",
    "indexer_compressor_gate.weight": "attn.indexer.compressor.wgate.weight",
    "indexer_compressor_norm.weight": "attn.indexer.compressor.norm.weight",
    "attn_norm.weight": "attn_norm.weight",
    "ffn_norm.weight": "ffn_norm.weight",
    "ffn_gate_shexp.weight": "ffn.shared_experts.w1.weight",
    "ffn_up_shexp.weight": "ffn.shared_experts.w3.weight",
    "ffn_down_shexp.weight": "ffn.shared_experts.w2.weight",
    "ffn_gate_inp.weight": "ffn.gate.weight",
    "exp_probs_b.bias": "ffn.gate.bias",
    "ffn_gate_tid2eid.weight": "ffn.gate.tid2eid",
}
# The routed experts, as DeepSeek names one expert's matrices (the converter reads
# ``layers.L.ffn.experts.E.{w1,w2,w3}``); moestream's fused form holds gate rows then up.
_EXPERT_PARTS = {"gate": ("w1",), "up": ("w3",), "down": ("w2",), "gate_up": ("w1", "w3")}
_EXPERTS = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down|gate_up)_exps\.weight$")
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")
_ALWAYS = ("hc_attn_base.weight", "hc_attn_fn.weight", "hc_attn_scale.weight",
           "hc_ffn_base.weight", "hc_ffn_fn.weight", "hc_ffn_scale.weight", "attn_sinks.weight",
           "attn_q_a.weight", "attn_q_b.weight", "attn_q_a_norm.weight", "attn_kv.weight",
           "attn_kv_a_norm.weight", "attn_output_a.weight", "attn_output_b.weight",
           "attn_norm.weight", "ffn_norm.weight", "ffn_gate_shexp.weight",
           "ffn_up_shexp.weight", "ffn_down_shexp.weight", "ffn_gate_inp.weight")
_COMPRESSOR = tuple(f"attn_compressor_{n}.weight" for n in ("ape", "kv", "gate", "norm"))
_INDEXER = ("indexer.attn_q_b.weight", "indexer.proj.weight",
            *(f"indexer_compressor_{n}.weight" for n in ("ape", "kv", "gate", "norm")))


@dataclass(frozen=True)
class Target:
    """Where one GGUF tensor goes in the model.

    Attributes:
        name: the model's parameter or buffer (``model.layers.3.mlp.experts.gate_up_proj``).
        slot: for a routed-expert part, which of the parameter's stacked parts along its
            rows it is (``gate_up_proj``: gate 0, up 1; a fused GGUF tensor fills both from
            slot 0); 0 otherwise.
        experts: whether it is a routed-expert tensor (the loader streams these).
        integer: whether the model keeps it as int64 (``tid2eid``; the file has I32).
    """

    name: str
    slot: int = 0
    experts: bool = False
    integer: bool = False


class Ds4Names:
    """ds4's GGUF tensor names -> the model's, through DeepSeek's checkpoint names.

    Args:
        model: the ``DeepseekV4ForCausalLM`` being loaded (on the meta device is enough):
            transformers' renamings are asked through it.
        path: the file, for the messages.
    """

    def __init__(self, model: Any, path: Path) -> None:
        self._rename = renamer(model)
        self._path = path
        self._state = set(model.state_dict())
        self._config = model.config

    def target(self, name: str) -> Target | None:
        """Where GGUF tensor ``name`` goes; None for the MTP layers transformers skips.

        Raises:
            ExpertLayoutError: a name ds4's layout does not have, or one the model has no
                place for (a selection bias on a hash-routed layer).
        """
        if name.startswith("mtp."):
            return None  # transformers ignores DeepSeek's mtp.* (its unexpected-keys list)
        expert = _EXPERTS.match(name)
        if expert is not None:
            layer, part = int(expert.group(1)), expert.group(2)
            source = f"layers.{layer}.ffn.experts.0.{_EXPERT_PARTS[part][0]}.weight"
            target, converter = self._rename(source)
            slot = 0
            if converter is not None:
                slot = list(converter[0].source_patterns).index(converter[1])
            return self._known(name, Target(target, slot, experts=True))
        return self._known(name, Target(self._rename(_checkpoint_name(self._path, name))[0],
                                        integer=name.endswith("ffn_gate_tid2eid.weight")))

    def _known(self, name: str, target: Target) -> Target:
        if target.name not in self._state:
            raise ExpertLayoutError(self._path, f"{name} ({target.name}) has no place in "
                                                f"transformers' DeepSeek-V4 of this config")
        return target

    def check(self, names: Iterable[str], moe_layers: Iterable[int]) -> dict[str, Target]:
        """Every non-routed tensor of the file mapped, checked against ds4's per-layer
        layout, and every layer an MoE layer (``moe_layers``: those whose routed experts
        the file has, as the expert table found them).

        Raises:
            ExpertLayoutError: a tensor ds4 requires missing, or one it does not have.
        """
        names = list(names)
        present = set(names)
        lacking = sorted(set(range(self._config.num_hidden_layers)) - set(moe_layers))
        if lacking:
            raise ExpertLayoutError(self._path, f"ds4 GGUF without routed experts in layer "
                                                f"{lacking[0]} (every DeepSeek V4 layer has them)")
        missing = [n for n in _expected(self._config) if n not in present]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise ExpertLayoutError(self._path, f"ds4 GGUF without {missing[0]}{more}")
        return {n: t for n in names if (t := self.target(n)) is not None}


def _checkpoint_name(path: Path, name: str) -> str:
    """DeepSeek's checkpoint name of GGUF tensor ``name`` (ds4's converter table)."""
    if name in _TOP:
        return _TOP[name]
    if ".nextn." in name:
        raise ExpertLayoutError(path, f"{name}: a multi-token-prediction layer inside the "
                                      f"model file (llama.cpp's form; ds4 ships them as a "
                                      f"separate file, and transformers builds none)")
    block = _BLOCK.match(name)
    if block is None or block.group(2) not in _LAYER:
        raise ExpertLayoutError(path, f"tensor {name} is not in ds4's DeepSeek V4 layout")
    return f"layers.{block.group(1)}.{_LAYER[block.group(2)]}"


def _expected(config: Any) -> list[str]:
    """The non-routed tensors ds4 requires of a file of ``config`` (``weights_bind``)."""
    names = list(_TOP)
    for layer in range(config.num_hidden_layers):
        kind = config.layer_types[layer]
        hashed = config.mlp_layer_types[layer] == "hash_moe"
        parts = list(_ALWAYS)
        if kind != "sliding_attention":
            parts += _COMPRESSOR
        if kind == "compressed_sparse_attention":
            parts += _INDEXER
        parts.append("ffn_gate_tid2eid.weight" if hashed else "exp_probs_b.bias")
        names += [f"blk.{layer}.{part}" for part in parts]
    return names


def ds4_dense_tensors(model: Any, session: moestream.SyncSession) -> Iterator[
        tuple[str, str, Any]]:
    """Each non-routed tensor of a ds4 file as the model holds it: (file name, model name,
    CPU tensor), read through the session, float tensors dequantized by gguf-py to float32,
    ``tid2eid`` as int64; the layout checked first (:meth:`Ds4Names.check`).

    Raises:
        ExpertLayoutError: a tensor ds4's layout does not have, or one it requires missing.
        ModelFileError: a tensor gguf cannot dequantize.
    """
    path = session.model.path
    names = Ds4Names(model, path)
    dense = session.model.tensors
    targets = names.check(dense, session.model.moe_layers)
    for spec in dense.values():
        target = targets.get(spec.name)
        if target is None:
            continue  # the MTP layers transformers builds none of
        yield spec.name, target.name, _tensor(path, spec, session.read_tensor(spec.name),
                                              target.integer)


def _tensor(path: Path, spec: moestream.TensorSpec, data: bytearray, integer: bool) -> Any:
    """A tensor's bytes as the model's values: int64 ids, else gguf-py's float32."""
    if not integer:
        return torch.from_numpy(dequantized(path, spec, data))
    if spec.dtype != "I32":
        raise ExpertLayoutError(path, f"{spec.name} is {spec.dtype}, ds4 stores it I32")
    ids = np.frombuffer(data, dtype="<i4")
    return torch.from_numpy(ids.astype(np.int64).reshape(spec.shape))
