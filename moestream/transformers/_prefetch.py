"""Next-layer prefetch: guess the experts the next MoE layer will pick, and hint them.

With ``from_pretrained(..., prefetch="predict")`` a MoE layer's experts call applies the
NEXT MoE layer's router to its own input hidden state (the residual stream changes little
from one layer to the next, so the guess is often right) and asks the session to
``prefetch`` those experts once the current layer's are pinned: their loads overlap this
layer's compute, and the next layer finds them cached. This is the proxy engine's
``--prefetch predict``; the session counts the guesses, the right ones and the wasted bytes
in the token line's ``prefetch`` object. The guess changes what is resident, never the
arithmetic: tokens are those of a run without it.

The router is read as a linear map (its ``weight``, ``[experts, hidden]``, and ``bias``
where it has one) scored as the top-k of its logits, or of ``sigmoid(logits) +
e_score_correction_bias`` where the router keeps that bias (DeepSeek-V3's selection);
group-limited selection and hashed layers are not modelled: a guess that misses costs only
wasted reads.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch  # type: ignore[import-not-found, unused-ignore]

from moestream.pipeline.foundation.errors import UsageError

__all__ = ["PREFETCHES", "NextRouter", "Prefetch", "check_prefetch", "next_routers"]

Prefetch = Literal["none", "predict"]
PREFETCHES: tuple[Prefetch, ...] = ("none", "predict")

_ROUTER_NAMES = ("gate", "router")


def check_prefetch(prefetch: object) -> Prefetch:
    """``prefetch`` when it is one of :data:`PREFETCHES`.

    Raises:
        UsageError: any other value, in one line.
    """
    for known in PREFETCHES:
        if prefetch == known:
            return known
    raise UsageError(f"prefetch must be one of {', '.join(PREFETCHES)}, got {prefetch!r}")


class _Float32Weight:
    """A router's weight as float32, cast again only when the weight's storage, type,
    device or contents changed (the loader replaced it, the model moved or was cast, a load
    wrote it in place): DeepSeek's router scores in float32, and a cast each call would copy
    its ``[experts, hidden]`` weight a layer a token. The copy is the model's memory, as its
    dense weights are, outside the experts' budget (a DeepSeek-V3 holds ~7 MB a layer)."""

    __slots__ = ("_cast", "_source", "_stamp")

    def __init__(self) -> None:
        self._source: Any = None  # the storage held: its address is no other tensor's
        self._stamp: tuple[Any, ...] = ()
        self._cast: Any = None

    def of(self, weight: Any) -> Any:
        """``weight.float()``, the one made before while ``weight`` is unchanged."""
        if weight.is_inference():  # writable in place with no version counter to tell
            return weight.detach().float()
        stamp = (weight.data_ptr(), weight.dtype, weight.device, weight._version)
        if stamp != self._stamp:
            self._cast = weight.detach().float()
            self._source, self._stamp = weight.detach(), stamp
        return self._cast


@dataclass(frozen=True)
class NextRouter:
    """The MoE layer after one, and its router module (its weights are read per call:
    the loader may have replaced the parameters since; a float32 copy of the weight is
    kept while the weight is unchanged)."""

    layer: int
    router: Any
    _float32: _Float32Weight = field(default_factory=_Float32Weight, init=False,
                                     repr=False, compare=False)

    def guess(self, hidden: Any, top_k: int) -> Any:
        """``(tokens, top_k)`` expert ids this router would pick for ``hidden``, on its
        device (no host read: the caller copies them with its own ids); sigmoid scores
        plus ``e_score_correction_bias`` where the router keeps one, else its logits."""
        weight = self.router.weight
        bias = getattr(self.router, "e_score_correction_bias", None)
        if bias is None:  # the logits in the router's dtype (softmax keeps their order)
            offset = getattr(self.router, "bias", None)  # gpt-oss's router is affine
            offset = offset if isinstance(offset, torch.Tensor) else None
            scores = torch.nn.functional.linear(hidden.to(weight.dtype), weight, offset)
        else:  # as DeepSeek-V3's router: float32 sigmoid scores plus the bias
            scores = torch.nn.functional.linear(hidden.float(), self._float32.of(weight))
            scores = scores.sigmoid() + bias
        return torch.topk(scores, min(top_k, scores.shape[-1]), dim=-1).indices


def next_routers(model: Any, experts: Mapping[int, Any]) -> dict[int, NextRouter]:
    """For each MoE layer but the last, the next MoE layer's router, found as the
    ``gate``/``router`` child (a 2-D ``weight`` of ``[experts, hidden]``) of the block
    that holds that layer's experts module; a layer whose next router is not found that
    way is left out (its calls hint nothing)."""
    parents = {id(module): name.rpartition(".")[0] for name, module in model.named_modules()}
    modules = dict(model.named_modules())
    layers = sorted(experts)
    found: dict[int, NextRouter] = {}
    for layer, following in itertools.pairwise(layers):
        module = experts[following]
        block = modules.get(parents.get(id(module), ""))
        router = _router(block, module.num_experts) if block is not None else None
        if router is not None:
            found[layer] = NextRouter(following, router)
    return found


def _router(block: Any, n_experts: int) -> Any:
    """The block's router: a child named gate or router with an ``[experts, hidden]``
    weight, or None."""
    for name in _ROUTER_NAMES:
        router = getattr(block, name, None)
        weight = getattr(router, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.dim() == 2 \
                and weight.shape[0] == n_experts:
            return router
    return None
