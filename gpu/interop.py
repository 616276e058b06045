"""Streams and events an engine brings: waiting on our upload events, recording its own.

An engine computes on its own streams (CuPy's, torch's, or raw ``cudaStream_t`` handles).
Readiness is handed to it as our upload events, which its stream waits on, on the device;
a released expert's buffer is reused only after an event the engine's stream records after
its compute. On the host backend every event is complete from birth, so all of this is a
no-op there.

Stream-like values accepted, as ``StreamLike``: None (CuPy's current stream of the device),
an ``int`` ``cudaStream_t`` (0 is the legacy default stream; torch's
``stream.cuda_stream``), an object with ``ptr`` (``cupy.cuda.Stream``,
``cupy.cuda.ExternalStream``) or ``cuda_stream`` (``torch.cuda.Stream``), or one of our
streams (``gpu.cuda.CudaStream``). Waits and records go through the CUDA runtime on the raw
handles, so no stream object is made for an engine's stream.
"""

from __future__ import annotations

from typing import Any

from moestream.gpu.backend import Backend, Event
from moestream.pipeline.foundation.errors import UsageError

__all__ = ["StreamLike", "event_after", "stream_pointer", "wait_on"]

StreamLike = Any
"""None, an ``int`` handle, or an object with ``ptr``, ``cuda_stream`` or ``raw.ptr``."""


def stream_pointer(stream: StreamLike) -> int:
    """The ``cudaStream_t`` of a stream-like value (None: CuPy's current stream)."""
    if stream is None:
        import cupy

        return int(cupy.cuda.get_current_stream().ptr)
    if isinstance(stream, bool):
        raise UsageError(f"not a CUDA stream: {stream!r}")
    if isinstance(stream, int):
        return stream
    for attribute in ("ptr", "cuda_stream"):
        value = getattr(stream, attribute, None)
        if isinstance(value, int):
            return value
    raw = getattr(stream, "raw", None)
    if raw is not None and isinstance(getattr(raw, "ptr", None), int):
        return int(raw.ptr)
    raise UsageError(f"not a CUDA stream: {stream!r} (pass a cupy or torch stream, or a "
                     "cudaStream_t as an int)")


def wait_on(event: Event, stream: StreamLike) -> None:
    """Make ``stream`` wait for ``event`` on the device (the host never blocks)."""
    raw = getattr(event, "raw", None)
    if raw is None or event.done():  # a host event, or one already complete
        return
    import cupy

    # the runtime call on the raw handles: no stream object to wrap an engine's stream in
    # (CuPy's ExternalStream is deprecated)
    cupy.cuda.runtime.streamWaitEvent(stream_pointer(stream), raw.ptr)


def event_after(backend: Backend, after: StreamLike | Event) -> Event | None:
    """An event that completes once the engine's work on ``after`` (a stream, or an event
    it recorded) has run; None on the host backend, whose work is done when queued."""
    if backend.name != "cupy":
        return None
    from moestream.gpu.cuda import CudaEvent

    if isinstance(after, CudaEvent):
        return after
    import cupy

    if isinstance(after, cupy.cuda.Event):
        return CudaEvent(after)
    with backend.activate():
        pointer = stream_pointer(after)
        event = cupy.cuda.Event(block=False, disable_timing=True)
        cupy.cuda.runtime.eventRecord(event.ptr, pointer)
    return CudaEvent(event)
