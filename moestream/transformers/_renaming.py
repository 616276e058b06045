"""Checkpoint names to a transformers model's names, by transformers' own conversion mapping,
and its converters run.

Apart from the dense loader because three loaders rename: the safetensors checkpoints', the
DeepSeek-V4 GGUF mapping's, which maps ds4's names to DeepSeek's checkpoint names first, and
the GGUF conversion ops' (``_gguf_ops``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import structlog

from moestream.pipeline.foundation.errors import ModelFileError
from moestream.transformers._arguments import first_line

__all__ = ["converted", "renamer"]

_log = structlog.get_logger("moestream.transformers")


def renamer(model: Any) -> Any:
    """Checkpoint name -> (model name, the converter that builds it or None), by
    transformers' own renamings and converters for this model; the routed experts are never
    asked for (their converters stay unused)."""
    meta_state = model.state_dict()
    try:
        from transformers.conversion_mapping import (  # type: ignore[import-not-found, unused-ignore]
            get_model_conversion_mapping,
        )
        from transformers.core_model_loading import (  # type: ignore[import-not-found, unused-ignore]
            WeightConverter,
            WeightRenaming,
            rename_source_key,
        )
    except ImportError as exc:  # an older 5.x: the names as they are
        _log.warning("transformers_renamings_unavailable", reason=str(exc),
                     fallback="checkpoint names used as they are")
        return lambda key: (key, None)
    mapping = get_model_conversion_mapping(model)
    renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
    converters = [t for t in mapping if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    prefix = getattr(model, "base_model_prefix", None)

    def rename(key: str) -> tuple[str, tuple[Any, str] | None]:
        renamed, pattern = rename_source_key(key, renamings, converters, prefix, meta_state)
        if renamed not in meta_state and key in meta_state:
            # as transformers' loading: a renaming that should not have fired (DeepSeek-V4's
            # ``.norm.`` -> ``.kv_norm.`` on the final ``model.norm``); the prefix only
            return rename_source_key(key, [], [], prefix, meta_state)[0], None
        return renamed, (by_pattern[pattern], pattern) if pattern is not None else None

    return rename


def converted(converter: Any, target: str, model: Any, path: Path, name: str) -> dict[str, Any]:
    """The tensors ``converter`` (a copy of transformers' own, holding its sources) builds
    for ``target``, by model name.

    Raises:
        ModelFileError: one of its ops failed (``name``, the tensor, and the op's reason).
    """
    try:
        built = converter.convert(target, model=model, config=model.config)
    except Exception as exc:  # transformers' ops raise their own errors
        raise ModelFileError(path, f"{name[:120]}: transformers' converter failed: "
                             f"{first_line(exc)[:200]}") from exc
    return {key: tensor[0] if isinstance(tensor, list) else tensor
            for key, tensor in built.items()}
