"""Can the transformers integration run here: torch, and transformers with its experts registry."""

from __future__ import annotations

import importlib
import importlib.metadata

from moestream.pipeline.foundation.errors import UsageError

__all__ = ["EXTRA", "MIN_TRANSFORMERS", "is_available"]

EXTRA = "pip install 'moestream[transformers]'"
"""What installs the integration's requirements."""
MIN_TRANSFORMERS = 5
"""The first transformers major version with the experts-implementation registry."""


def _missing() -> str | None:
    """Why the integration cannot run here, or None when it can."""
    for package in ("torch", "transformers"):
        try:
            importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return f"{package} is not installed"
    version = importlib.metadata.version("transformers")
    try:
        major = int(version.split(".")[0])
    except ValueError:
        major = 0
    if major < MIN_TRANSFORMERS:
        return f"transformers {version} has no experts registry (needs >= {MIN_TRANSFORMERS})"
    try:
        moe = importlib.import_module("transformers.integrations.moe")
    except ImportError as exc:
        return f"transformers.integrations.moe does not import ({exc})"
    if not hasattr(moe, "ALL_EXPERTS_FUNCTIONS"):
        return f"transformers {version} has no ALL_EXPERTS_FUNCTIONS"
    return None


def is_available(raise_error: bool = False) -> bool:
    """Whether moestream can serve a transformers model's experts here: torch and
    transformers >= 5 installed, with ``transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS``.

    Args:
        raise_error: raise ``UsageError`` naming what is missing instead of returning False.

    Raises:
        UsageError: with ``raise_error``, when the requirements are not met.
    """
    why = _missing()
    if why is None:
        return True
    if raise_error:
        raise UsageError(f"moestream.transformers needs torch and transformers >= "
                         f"{MIN_TRANSFORMERS}: {why}; {EXTRA} (without them, an engine "
                         "drives moestream through its own API, docs/API.md)")
    return False
