"""Multi-token-prediction layers a checkpoint ships and transformers does not build.

DeepSeek-V3/R1 (and GLM-4.5, ERNIE, others) ship ``num_nextn_predict_layers`` extra decoder
layers after the model's ``num_hidden_layers`` (DeepSeek-V3's ``model.layers.61``: an
embedding, ``enorm``/``hnorm``/``eh_proj``, a full MoE layer and a shared head), used for
speculative decoding by their own inference code. transformers' model has only the
``num_hidden_layers`` layers: it lists the extra layer's weights as unexpected keys
(``_keys_to_ignore_on_load_unexpected``) and never computes with them. moestream does the
same: the extra layers' experts stay in the session's table (never fetched), the model's
MoE layers are compared without them, and their dense weights are unused keys.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["mtp_layers"]

_COUNT_KEYS = ("num_nextn_predict_layers", "num_mtp_layers")


def mtp_layers(config: Mapping[str, Any], layers: Iterable[int]) -> frozenset[int]:
    """Those of ``layers`` (a checkpoint's layer indices) that are its MTP layers: from
    ``num_hidden_layers`` up to that plus ``num_nextn_predict_layers`` (transformers' alias
    ``num_mtp_layers``), as config.json says; none where it declares none."""
    hidden = config.get("num_hidden_layers")
    count = next((config[key] for key in _COUNT_KEYS if key in config), 0)
    if type(hidden) is not int or type(count) is not int or count < 1:
        return frozenset()
    return frozenset(layer for layer in layers if hidden <= layer < hidden + count)
