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

from importlib.metadata import PackageNotFoundError, version

from moestream._handles import ExpertHandle, Matrix, wait_uploads
from moestream._session import (
    Counters,
    LayerInfo,
    Lease,
    ModelInfo,
    Router,
    Session,
    TensorSpec,
    TokenStats,
    Tuning,
    open,
)
from moestream._sync import SyncLease, SyncSession, open_sync
from pipeline.foundation.config import Budget
from pipeline.foundation.errors import (
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
from pipeline.foundation.quantization import ExpertQuant

try:
    __version__ = version("moestream")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0.0.0+unknown"

__all__ = [
    "Budget",
    "Counters",
    "DeviceMemoryError",
    "ExpertHandle",
    "ExpertLayoutError",
    "ExpertQuant",
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
    "Session",
    "StageError",
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
    "open_sync",
    "wait_uploads",
]
