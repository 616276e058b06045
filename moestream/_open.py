"""``moestream.open``: the asynchronous session over a model, its arguments checked at once."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from moestream._args import budget_of, choice, devices_of
from moestream._logging import route_unconfigured
from moestream._session import Session
from moestream._tuning import Tuning
from moestream.pipeline.foundation.config import Budget, StreamConfig
from moestream.pipeline.foundation.errors import UsageTypeError
from moestream.pipeline.makers.modelgen import ensure_default_model
from moestream.pipeline.streaming.session import StreamSession

__all__ = ["Mode", "open"]

Mode = Literal["auto", "direct", "resident"]


def open(
    model: str | os.PathLike[str] | None = None,
    *,
    devices: int | Sequence[int] | None = None,
    budget: int | str | Budget | None = None,
    mode: Mode = "auto",
    policy: str = "lru",
    verify: bool = True,
    backend: str = "auto",
    log: str | os.PathLike[str] | None = None,
    tuning: Tuning | None = None,
) -> Session:
    """Open a model for streaming; ``await`` the result or use it with ``async with``.

    Args:
        model: a GGUF file (or a split one's shard), a checkpoint directory or
            ``.safetensors`` file; None makes (once) and uses the embedded tiny model.
        devices: a device index or several (experts are sharded over them); None: every
            visible device. On the host backend indices emulate devices.
        budget: the device cache, in experts or bytes: an int or its text (``2522`` or
            ``"2522"``: that many experts of the model's largest size), a size with its
            unit (``"20GiB"``, ``"11GB"``: bytes), or a ``Budget``; None holds every
            expert. Clamped (logged) to free device memory.
        mode: ``auto`` (the controller picks direct or resident from live RAM, and
            switches while running), ``direct`` (O_DIRECT) or ``resident`` (page cache).
        policy: eviction, ``lru`` or ``freq``.
        verify: digest every loaded expert on the device and compare with the file at
            each token's end (``end_token``).
        backend: ``auto`` (CuPy when a CUDA device answers), ``cupy`` or ``host``.
        log: a JSON-lines log in the run log's schema (``docs/LOG_SCHEMA.md``).
        tuning: rarely changed settings (``Tuning``).

    Raises:
        UsageError: a bad value (at once); or, when opened: no usable CUDA device for
            ``backend="cupy"``, a budget below ``Tuning.layers_in_flight`` layers.
        ModelFileError: (when opened) the model is not a usable GGUF MoE file.
        OutputError: (when opened) the log cannot be written.
        StageError: (when opened) a device or pinned allocation failed.
    """
    tuning, chosen = _checked(model, log, verify, tuning, devices)
    choice(mode, "mode", ("auto", "direct", "resident"))
    choice(policy, "policy", ("lru", "freq"))
    choice(backend, "backend", ("auto", "cupy", "host"))
    route_unconfigured()
    cfg = StreamConfig(
        # the embedded tiny model is this API's default, chosen here: never by the session
        model=Path(model) if model is not None else ensure_default_model(),
        budget=budget_of(budget),
        mode=mode, policy=policy, backend=backend,
        devices=chosen,
        queue_depth=tuning.queue_depth, chunk_bytes=tuning.chunk_bytes,
        staging_slots=tuning.staging_slots, upload_streams=tuning.upload_streams,
        gather=tuning.gather, gather_blocks=tuning.gather_blocks,
        verify=verify, log=Path(log) if log is not None else None,
        ram_limit=tuning.ram_limit, sample_ms=tuning.sample_ms,
        margin_bytes=tuning.margin_bytes, warmup=tuning.warmup, dwell_s=tuning.dwell_s,
        faults=tuning.faults,
    )
    return Session(StreamSession(cfg, layers_in_flight=tuning.layers_in_flight,
                                 sampler=tuning.sampler))


def _checked(model: object, log: object, verify: object, tuning: object,
             devices: int | Sequence[int] | None) -> tuple[Tuning, tuple[int, ...] | None]:
    """``open``'s arguments that are not a choice among names, checked in the order given:
    the tuning (its defaults for None) and the devices."""
    if model is not None and not isinstance(model, (str, os.PathLike)):
        raise UsageTypeError(f"model must be a path, not {type(model).__name__}")
    if log is not None and not isinstance(log, (str, os.PathLike)):
        raise UsageTypeError(f"log must be a path, not {type(log).__name__}")
    if not isinstance(verify, bool):
        raise UsageTypeError(f"verify must be True or False, not {verify!r}")
    if tuning is not None and not isinstance(tuning, Tuning):
        raise UsageTypeError(f"tuning must be a moestream.Tuning, not {type(tuning).__name__}")
    return tuning or Tuning(), devices_of(devices)
