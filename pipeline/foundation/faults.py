"""Fault injection: a test facility that makes a stage fail on purpose (off by default).

A ``FaultPlan`` names which calls fail and how. Each kind is asked at one stage boundary:

=================  ==========================  =============================================
kind               stage (where it is asked)   what happens
=================  ==========================  =============================================
``read_eio``       prefetch: each read call    the read raises EIO (transient: retried)
``short``          prefetch: each read call    the read returns 0 bytes early (retried)
``odirect_einval`` prefetch: each direct read  O_DIRECT refused (EINVAL): buffered from then
``slow_ms=MS``     prefetch: each read call    the read is delayed MS milliseconds
``truncate``       prefetch: each read call    the file looks truncated at that read
``replace``        prefetch: each read call    the path looks replaced by another file
``staging_oom``    staging: each slot alloc    the pinned allocation is refused
``upload``         upload: each expert upload  the copy fails after its first piece
``corrupt``        upload: each expert upload  one byte of the expert's device copy flips
``device_oom``     cache: each device alloc    the device allocation is refused
=================  ==========================  =============================================

Items are ``kind[=value]@N[+]``, comma separated: ``read_eio@3`` fails the third read call,
``read_eio@3+`` every read call from the third on, ``slow_ms=50@1+`` delays every read by
50 ms. Calls are counted per kind, thread-safely; ``fired`` counts what was injected.
``truncate`` and ``replace`` never touch the file: the reader's view of it changes (reads
past the middle come back empty, or the path's identity differs); the real thing is
exercised by the tests on a copy of a model. ``corrupt`` stands for bytes damaged after
they were read (a bad DIMM, a DMA fault): it flips a byte of the expert's device copy,
queued on the upload stream after the copies and before the install digest, so compute and
verification both see it; verification must end the run with exit 3.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field

from moestream.pipeline.foundation.errors import UsageError

__all__ = ["KINDS", "STAGES", "FaultPlan", "parse_faults"]

STAGES: dict[str, str] = {
    "read_eio": "prefetch",
    "short": "prefetch",
    "odirect_einval": "prefetch",
    "slow_ms": "prefetch",
    "truncate": "prefetch",
    "replace": "prefetch",
    "staging_oom": "staging",
    "upload": "upload",
    "corrupt": "upload",
    "device_oom": "cache",
}
"""The stage that asks for each kind."""

KINDS = tuple(STAGES)
_SPEC = re.compile(r"^(?P<kind>[a-z_]+)(?:=(?P<value>\d+))?@(?P<at>\d+)(?P<on>\+?)$")


@dataclass
class FaultPlan:
    """Which call of each kind fails: ``{kind: (first call, repeat?, value)}``.

    An empty plan is false, so stages test ``if plan:`` and pay nothing when it is off.
    """

    rules: dict[str, tuple[int, bool, int]] = field(default_factory=dict)
    _calls: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    fired: dict[str, int] = field(default_factory=dict)

    def hit(self, kind: str) -> int | None:
        """Count a call of ``kind``; its value (or 1) if this call must fail, else None."""
        rule = self.rules.get(kind)
        if rule is None:
            return None
        at, repeat, value = rule
        with self._lock:
            n = self._calls.get(kind, 0) + 1
            self._calls[kind] = n
            if n == at or (repeat and n > at):
                self.fired[kind] = self.fired.get(kind, 0) + 1
                return value
        return None

    def calls(self, kind: str) -> int:
        """How many calls of ``kind`` were counted so far."""
        with self._lock:
            return self._calls.get(kind, 0)

    def __bool__(self) -> bool:
        return bool(self.rules)

    def __str__(self) -> str:
        return ",".join(
            f"{kind}{'' if value == 1 else f'={value}'}@{at}{'+' if repeat else ''}"
            for kind, (at, repeat, value) in self.rules.items()
        )


def parse_faults(text: str) -> FaultPlan:
    """``kind[=value]@N[+]`` items, comma separated (see the module docstring).

    Raises:
        UsageError: an item that is not of that form, names an unknown kind, or has N < 1.
    """
    plan = FaultPlan()
    for item in filter(None, (part.strip() for part in text.split(","))):
        m = _SPEC.match(item)
        if m is None or m.group("kind") not in KINDS or int(m.group("at")) < 1:
            raise UsageError(f"cannot read fault {item!r} (kinds: {', '.join(KINDS)}; "
                             "form kind[=value]@N[+], N >= 1)")
        plan.rules[m.group("kind")] = (int(m.group("at")), bool(m.group("on")),
                                       int(m.group("value") or 1))
    return plan
