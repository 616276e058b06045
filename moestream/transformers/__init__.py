"""moestream as a transformers experts implementation: routed experts streamed, not loaded.

Registers ``"moestream"`` in transformers' experts-implementation registry
(``transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS``, chosen per model by
``experts_implementation``), the seam transformers' MoE blocks call their experts through
(``forward(self, hidden_states, top_k_index, top_k_weights)``). :func:`from_pretrained`
returns an ordinary transformers model whose attention, norms, embeddings, routers, shared
experts and dense MLPs are loaded onto the device as usual, while its routed experts are
never loaded, neither in host RAM nor on the device: the MoE blocks keep their own router
and top-k, and each experts call fetches the routed experts from a moestream session
(``moestream.open_sync``) under a byte budget, hits first, misses as they land.

Requires torch and transformers >= 5 (``pip install 'moestream[transformers]'``);
:func:`is_available` says whether they are here. The rest of moestream never imports
either. Supported: the model types whose routed experts transformers computes behind its
experts registry (``gate_up_proj`` and ``down_proj``, transposed and biased as gpt-oss's
included, and experts without a gate), and Llama 4 and JetMoE, whose experts module it
swaps for its own (``_swap.py``), with F16, BF16 or F32 experts in a safetensors
checkpoint: 58 of the 77 MoE types of transformers 5.25 that ``python -m bench.archs``
sweeps (DeepSeek-V2/V3/V4, Qwen2/3-MoE, Qwen3-Next, Mixtral, gpt-oss, GLM-4-MoE, Llama 4,
Gemma 4, Kimi-Linear, Nemotron-H...; the others are refused or have no causal LM).
``docs/TRANSFORMERS.md`` is the guide.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from moestream.transformers._gate import EXTRA, is_available

if TYPE_CHECKING:  # the names __getattr__ hands out, for type checkers
    from moestream.transformers._experts import ExpertStream, register, stream_of
    from moestream.transformers._generate import GenerateStats
    from moestream.transformers._gguf import is_gguf
    from moestream.transformers._hub import local_checkpoint
    from moestream.transformers._loader import from_pretrained
    from moestream.transformers._tokenizer import held_scale_bytes, tokenizer

__all__ = ["EXTRA", "ExpertStream", "GenerateStats", "from_pretrained", "held_scale_bytes",
           "is_available", "is_gguf", "local_checkpoint", "register", "stream_of", "tokenizer"]

_LAZY = {"ExpertStream": "_experts", "register": "_experts", "stream_of": "_experts",
         "GenerateStats": "_generate", "from_pretrained": "_loader", "is_gguf": "_gguf",
         "local_checkpoint": "_hub", "tokenizer": "_tokenizer",
         "held_scale_bytes": "_tokenizer"}
"""Each public name __getattr__ hands out, and the private module that defines it."""


def __getattr__(name: str) -> Any:
    # torch and transformers are imported only when something that needs them is asked for:
    # ``import moestream.transformers`` stays cheap and works without them
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'moestream.transformers' has no attribute {name!r}")
    return getattr(importlib.import_module(f"moestream.transformers.{module}"), name)
