"""The model ``from_pretrained`` hands out: the transformers model, and what its session adds.

The model owns a resource an ordinary transformers model does not (the moestream session:
open files, a loop's thread, device memory), so it behaves as resource owners do in Python:
``with from_pretrained(...) as model:`` closes it on leaving, and a model collected unclosed
warns (``ResourceWarning``, from its ``ExpertStream``) and closes it. Two of transformers'
methods change meaning: ``generate`` also records that call's own figures
(``model.moestream.last_generate``), and ``save_pretrained`` is refused in one line, since
the routed experts were never loaded (the source checkpoint already is the saved model);
``to`` changes the dtype, and the device only to the one the model computes on (its
session serves the experts there).

These are methods of a subclass of the model's own class (same name and module), made once
per class and given to the instance after it is built: transformers' classes are not
changed, ``isinstance`` and ``can_generate`` answer as before, and the model's forward,
cache and sampling are transformers' own.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import torch  # type: ignore[import-not-found, unused-ignore]

from moestream.pipeline.foundation.errors import UsageError
from moestream.transformers._generate import GenerateStats

__all__ = ["serve"]


class _Served:
    """What a served model adds to its transformers class (put first in its bases)."""

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.moestream.close()  # type: ignore[attr-defined]

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """transformers' ``generate``; its own hits, misses, bytes and stall time are then
        ``model.moestream.last_generate`` (a ``GenerateStats``)."""
        experts_stream = self.moestream  # type: ignore[attr-defined]
        session = experts_stream.session
        before = session.counters()
        started = time.perf_counter()
        try:
            return super().generate(*args, **kwargs)  # type: ignore[misc]
        finally:
            if not session.closed:  # closed meanwhile (by another thread): no figures
                experts_stream.last_generate = GenerateStats.between(
                    before, session.counters(), (time.perf_counter() - started) * 1000)

    def save_pretrained(self, *args: Any, **kwargs: Any) -> None:
        """Refused: the routed experts are not in memory to be saved."""
        path = self.moestream.session.model.path  # type: ignore[attr-defined]
        raise UsageError(f"save_pretrained: moestream streams this model's routed experts from "
                         f"{path} and never loads them, so there is nothing new to save: copy "
                         "that checkpoint, or load it with transformers' own from_pretrained "
                         "to change and save it")

    def push_to_hub(self, *args: Any, **kwargs: Any) -> None:
        """Refused, as ``save_pretrained`` (which it would call)."""
        self.save_pretrained()

    def to(self, *args: Any, **kwargs: Any) -> Any:
        """``Module.to`` for a dtype, or the device the model already computes on; another
        device is refused in one line (its session streams the experts to this one)."""
        device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
        self._stays_on(device)
        if dtype is None:
            return self
        return super().to(dtype=dtype, non_blocking=non_blocking)  # type: ignore[misc]

    def cuda(self, device: Any = None) -> Any:
        """As ``to``: the model stays where it computes."""
        self._stays_on(torch.device("cuda", device) if isinstance(device, int)
                       else torch.device(device or "cuda"))
        return self

    def cpu(self) -> Any:
        """As ``to``: the model stays where it computes."""
        self._stays_on(torch.device("cpu"))
        return self

    def _stays_on(self, device: Any) -> None:
        if device is None:
            return
        wanted, mine = torch.device(device), self.moestream.device  # type: ignore[attr-defined]
        if wanted.type != mine.type or wanted.index not in (None, mine.index or 0):
            instead = (f"; load it with device=\"{wanted}\" to compute there"
                       if wanted.type in ("cpu", "cuda") else "")
            raise UsageError(f"moving the model to {wanted}: it computes on {mine}, where its "
                             "session streams the routed experts (they were never loaded, to "
                             f"be moved){instead}")


@functools.cache
def _served_class(cls: Any) -> type:
    """``cls`` with the served model's methods first; the same name, so that transformers'
    messages and ``repr`` name the model's class."""
    return type(cls.__name__, (_Served, cls), {"__module__": cls.__module__,
                                               "__qualname__": cls.__qualname__,
                                               "__doc__": cls.__doc__})


def serve(model: Any) -> Any:
    """``model`` (with ``model.moestream`` set), now of its served class."""
    model.__class__ = _served_class(model.__class__)
    return model
