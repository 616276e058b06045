"""Fault injection: a test facility that makes a stage fail on purpose (off by default).

A ``FaultPlan`` names which calls fail and how: ``read_eio@3`` makes the third read raise
EIO, ``odirect_einval@1`` makes the first O_DIRECT read be refused as on tmpfs, ``short@2``
cuts the second read short, ``slow_ms=50@1+`` delays every read by 50 ms from the first on,
``upload@4`` fails the fourth upload, ``device_oom@2`` the second device allocation.
Stages ask ``plan.hit(kind)`` at their boundary; counting is per kind and thread-safe.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field

from pipeline.errors import UsageError

__all__ = ["KINDS", "FaultPlan", "parse_faults"]

KINDS = ("read_eio", "odirect_einval", "short", "slow_ms", "upload", "device_oom", "staging_oom")
_SPEC = re.compile(r"^(?P<kind>[a-z_]+)(?:=(?P<value>\d+))?@(?P<at>\d+)(?P<on>\+?)$")


@dataclass
class FaultPlan:
    """Which call of each kind fails: ``{kind: (first call, repeat?, value)}``."""

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

    def __bool__(self) -> bool:
        return bool(self.rules)


def parse_faults(text: str) -> FaultPlan:
    """``kind[=value]@N[+]`` items, comma separated (see the module docstring)."""
    plan = FaultPlan()
    for item in filter(None, (part.strip() for part in text.split(","))):
        m = _SPEC.match(item)
        if m is None or m.group("kind") not in KINDS:
            raise UsageError(f"cannot read fault {item!r} (kinds: {', '.join(KINDS)}; "
                             "form kind[=value]@N[+])")
        plan.rules[m.group("kind")] = (int(m.group("at")), bool(m.group("on")),
                                       int(m.group("value") or 1))
    return plan
