"""Library logging: silent unless the application configures it.

moestream's modules log structlog events (``moestream.session``, ``moestream.cache``...).
structlog left unconfigured prints every event to stdout, which is no place for a
library's words in an engine's process. So the first ``open`` of a process whose
structlog is unconfigured routes structlog to the standard library's ``logging``, under
the ``moestream`` logger, which has a ``logging.NullHandler`` (the convention for
libraries): nothing is printed until the application configures ``logging`` (e.g.
``logging.basicConfig(level=logging.INFO)``) or structlog itself, whose configuration
always wins. The command-line tools configure structlog for the console and keep their
output. Nothing here runs at import.
"""

from __future__ import annotations

import logging
from typing import Any

import structlog

__all__ = ["LOGGER", "route_unconfigured"]

LOGGER = "moestream"
"""The standard library logger moestream's events go to (and its children's names)."""


def _stdlib_logger(*args: Any) -> logging.Logger:
    """The ``logging`` logger of a structlog logger's name, under ``moestream``."""
    name = str(args[0]) if args else LOGGER
    if name != LOGGER and not name.startswith(LOGGER + "."):
        name = f"{LOGGER}.{name}"
    return logging.getLogger(name)


def route_unconfigured() -> None:
    """Send structlog's events to ``logging`` (silent by default) if the application has
    not configured structlog; otherwise leave its configuration alone."""
    if structlog.is_configured():
        return
    root = logging.getLogger(LOGGER)
    if not any(isinstance(h, logging.NullHandler) for h in root.handlers):
        root.addHandler(logging.NullHandler())
    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            structlog.processors.KeyValueRenderer(key_order=["event"]),
        ],
        logger_factory=_stdlib_logger,
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )
