"""Library events rendered on a command line's console.

The library prints nothing: its events go to structlog, which an application configures
(``moestream._logging``). A command line is such an application, so choosing how its
events read (stderr, a timestamp, colour on a terminal, warnings and up unless ``--debug``)
is the client's concern, here, shared by ``python -m pipeline.run`` and the warm-up command.
"""

from __future__ import annotations

import logging
import sys

import structlog

__all__ = ["configure_console"]


def configure_console(*, debug: bool = False) -> None:
    """Render library events on stderr: warnings and up, everything with ``debug``."""
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="%H:%M:%S", utc=False),
            structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty()),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.DEBUG if debug else logging.WARNING
        ),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
