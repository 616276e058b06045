"""``python -m pipeline.run`` (``moestream-run``): decode a MoE model while streaming its experts.

The entry point only: it chooses the default model (the embedded tiny one, made once by
:mod:`moestream.pipeline.makers.modelgen`) and hands over to
:mod:`moestream.pipeline.cli.run`, which uses the library and the proxy engine and knows no
model maker. ``docs/ARCHITECTURE.md`` draws the layers.
"""

from __future__ import annotations

if __name__ == "__main__":
    # the imports below take half a second; a stop signal meanwhile exits at once and
    # quietly with its status (nothing is open yet), not with a traceback
    from moestream.pipeline.cli.interrupts import exit_on_signals

    exit_on_signals("moestream")

import sys
from collections.abc import Sequence

from moestream.pipeline.cli import run as _run
from moestream.pipeline.makers.modelgen import ensure_default_model

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """The command: ``pipeline.cli.run.main`` with the tiny model as the default ``-m``."""
    return _run.main(argv, default_model=ensure_default_model)


if __name__ == "__main__":
    sys.exit(main())
