"""moestream: stream a MoE model's routed experts into a device cache while an engine decodes.

The engine routes; moestream gets the experts it picked onto the device, hits first and
misses as they land, under a byte budget, choosing direct I/O or page-cache residency from
live RAM. ``docs/API.md`` is the guide; in short::

    async with moestream.open("model.gguf", budget="20GiB") as ms:
        for layer in ms.model.moe_layers:
            async with ms.fetch(layer, experts) as lease:
                async for h in lease:          # hits first, then misses as they land
                    h.wait(stream)             # device-side wait on the upload event
                    compute(h.gate.array, h.up.array, h.down.array)
        await ms.end_token()

``open_sync`` gives the same session to code without asyncio. Errors are the classes of
``pipeline.foundation.errors``, re-exported here. The library prints nothing: its events go
to the standard library's ``logging`` (logger ``moestream``) unless the application
configured structlog (``moestream._logging``).
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from moestream._handles import ExpertHandle, Matrix, wait_uploads
    from moestream._lease import Lease
    from moestream._model_info import LayerInfo, ModelInfo, Router, TensorSpec
    from moestream._open import open
    from moestream._run_session import RunSession, open_config
    from moestream._session import Session
    from moestream._stats import Counters, TokenStats
    from moestream._sync import SyncLease, SyncSession, open_sync
    from moestream._tuning import Tuning
    from moestream.pipeline.foundation.config import Budget, StreamConfig
    from moestream.pipeline.foundation.errors import (
        DeviceMemoryError,
        ExpertLayoutError,
        ModelChangedError,
        ModelFileError,
        MoestreamError,
        NotGGUFError,
        OutputError,
        ReadError,
        StageError,
        TruncatedFileError,
        UploadError,
        UsageError,
        UsageTypeError,
        VerificationError,
    )
    from moestream.pipeline.foundation.quantization import ExpertQuant
    from moestream.pipeline.streaming.decision import ControllerReadings, Sampler
    from moestream.pipeline.streaming.summary import RunSummary

# each public name and the module that defines it: imported on first use, so that a
# command importing one low module (``python -m pipeline.run`` installs its signal handlers
# first) or ``moestream.pipeline.foundation.errors`` does not pull in the whole library
_EXPORTS = {
    "ExpertHandle": "moestream._handles",
    "InPlace": "moestream._handles",
    "Matrix": "moestream._handles",
    "wait_uploads": "moestream._handles",
    "Counters": "moestream._stats",
    "LayerInfo": "moestream._model_info",
    "Lease": "moestream._lease",
    "ModelInfo": "moestream._model_info",
    "Router": "moestream._model_info",
    "Session": "moestream._session",
    "TensorSpec": "moestream._model_info",
    "TokenStats": "moestream._stats",
    "Tuning": "moestream._tuning",
    "open": "moestream._open",
    "open_config": "moestream._run_session",
    "RunSession": "moestream._run_session",
    "SyncLease": "moestream._sync",
    "SyncSession": "moestream._sync",
    "open_sync": "moestream._sync",
    "Budget": "moestream.pipeline.foundation.config",
    "StreamConfig": "moestream.pipeline.foundation.config",
    "DeviceMemoryError": "moestream.pipeline.foundation.errors",
    "ExpertLayoutError": "moestream.pipeline.foundation.errors",
    "ModelChangedError": "moestream.pipeline.foundation.errors",
    "ModelFileError": "moestream.pipeline.foundation.errors",
    "MoestreamError": "moestream.pipeline.foundation.errors",
    "NotGGUFError": "moestream.pipeline.foundation.errors",
    "OutputError": "moestream.pipeline.foundation.errors",
    "ReadError": "moestream.pipeline.foundation.errors",
    "StageError": "moestream.pipeline.foundation.errors",
    "TruncatedFileError": "moestream.pipeline.foundation.errors",
    "UploadError": "moestream.pipeline.foundation.errors",
    "UsageError": "moestream.pipeline.foundation.errors",
    "UsageTypeError": "moestream.pipeline.foundation.errors",
    "VerificationError": "moestream.pipeline.foundation.errors",
    "ExpertQuant": "moestream.pipeline.foundation.quantization",
    "RunSummary": "moestream.pipeline.streaming.summary",
    "ControllerReadings": "moestream.pipeline.streaming.decision",
    "Sampler": "moestream.pipeline.streaming.decision",
}

try:
    __version__ = version("moestream")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0.0.0+unknown"

__all__ = [
    "Budget",
    "ControllerReadings",
    "Counters",
    "DeviceMemoryError",
    "ExpertHandle",
    "ExpertLayoutError",
    "ExpertQuant",
    "InPlace",
    "LayerInfo",
    "Lease",
    "Matrix",
    "ModelChangedError",
    "ModelFileError",
    "ModelInfo",
    "MoestreamError",
    "NotGGUFError",
    "OutputError",
    "ReadError",
    "Router",
    "RunSession",
    "RunSummary",
    "Sampler",
    "Session",
    "StageError",
    "StreamConfig",
    "SyncLease",
    "SyncSession",
    "TensorSpec",
    "TokenStats",
    "TruncatedFileError",
    "Tuning",
    "UploadError",
    "UsageError",
    "UsageTypeError",
    "VerificationError",
    "__version__",
    "open",
    "open_config",
    "open_sync",
    "wait_uploads",
]



def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'moestream' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
