"""Choosing a backend: CuPy where a CUDA device answers, else the host backend.

Kept apart from ``moestream.gpu.backend`` (the protocols) because it imports both implementations,
and both implementations import the protocols: one module doing both was an import cycle.
"""

from __future__ import annotations

import structlog

from moestream.gpu.backend import Backend
from moestream.pipeline.foundation.errors import UsageError

__all__ = ["select_backend", "visible_devices"]

_log = structlog.get_logger("moestream.gpu")


def visible_devices(name: str) -> int:
    """How many devices the backend ``name`` (``host`` or ``cupy``) sees: one host."""
    if name == "cupy":
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    return 1


def select_backend(name: str = "auto", device: int = 0) -> Backend:
    """``cupy`` when a CUDA device answers (or when asked), else ``host``; on ``device``.

    The host backend takes any device index: several host "devices" emulate a multi-GPU
    run (each with its own buffers, streams and cache) on machines without GPUs.

    Raises:
        UsageError: ``cupy`` was asked for but no CUDA device is usable, or ``device`` is
            not one of the visible CUDA devices.
    """
    if name not in ("auto", "host", "cupy"):
        raise UsageError(f"unknown backend {name!r} (expected auto, host or cupy)")
    if name in ("auto", "cupy"):
        from moestream.gpu import cuda

        reason = cuda.unavailable_reason()
        if reason is None:
            count = visible_devices("cupy")
            if not 0 <= device < count:
                raise UsageError(f"no CUDA device {device} (this machine has {count})")
            return cuda.CupyBackend(device)
        if name == "cupy":
            raise UsageError(f"--backend cupy: no usable CUDA device ({reason})")
        _log.info("backend_fallback", backend="host", reason=reason)
    from moestream.gpu.host import HostBackend

    return HostBackend(device)
