"""``pipeline.cli.run``'s figures, pinned: per token and in total, what a set of runs found.

``moestream.pipeline.cli.run`` is the first client of the public API (issue 15): its setup, fetches,
releases and token lines go through ``moestream.Session`` (``moestream.pipeline.proxy.loop``,
``pipeline.proxy.decode``). That rewrite had to leave the figures as they were, but two: in
``--prefetch predict`` runs a guess's reads now count in ``file_bytes`` and its admission's
evictions in ``evictions``, as the API always counted them (re-recorded at the move; the
runs before it, from commit 9732fe2 on, found the same hits, misses, experts, prefetch
outcomes, verification, peak and allocations, token by token). Every run here must find
the same figures as ``tests/data/run_figures.json``, token by token.

A change that means to alter these figures (a new policy, another synthetic preset)
records them again and says why in its commit::

    .venv/bin/python tests/cli/test_run_figures.py tests/data/run_figures.json
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from moestream.pipeline.cli.run import run
from moestream.pipeline.foundation.config import Budget, ComputeSpec
from moestream.pipeline.makers.modelgen import spec_for, write_model
from moestream.pipeline.proxy.config import RunConfig

FIGURES = Path(__file__).resolve().parents[1] / "data" / "run_figures.json"

# each run's settings beside the defaults (16 tokens, seed 3, host backend, auto mode,
# every expert cached, no prefetch, lru, real compute); budgets in experts
RUNS: dict[str, dict[str, Any]] = {
    "direct": {"mode": "direct"},
    "resident-oracle": {"mode": "resident", "prefetch": "oracle", "lookahead": 2},
    "budget-lru": {"budget": 12},
    "budget-predict": {"budget": 9, "prefetch": "predict"},
    "budget-oracle": {"budget": 12, "prefetch": "oracle", "lookahead": 2},
    "budget-freq-fixed": {"budget": 12, "policy": "freq", "compute": "fixed"},
    "devices-predict": {"budget": 16, "prefetch": "predict", "devices": (0, 1)},
    "devices-oracle-digest": {"budget": 32, "prefetch": "oracle", "lookahead": 2,
                              "devices": (0, 1), "compute": "digest"},
}

SUMMARY = ("tokens", "hits", "misses", "evictions", "file_bytes", "cache_bytes", "verified",
           "mismatches", "unverified", "peak_device_bytes", "budget_bytes", "allocations",
           "frees", "exit")
TOKEN = ("token", "hits", "misses", "evictions", "file_bytes", "cache_bytes", "experts",
         "prefetch")


def _config(model: Path, log: Path, spec: dict[str, Any]) -> RunConfig:
    compute = spec.get("compute", "real")
    return RunConfig(
        model=model, tokens=16, seed=3, backend="host", mode=spec.get("mode", "auto"),
        budget=Budget(experts=spec["budget"]) if "budget" in spec else None,
        prefetch=spec.get("prefetch", "none"), lookahead=spec.get("lookahead", 1),
        devices=spec.get("devices"), policy=spec.get("policy", "lru"),
        compute=ComputeSpec("fixed", 0.0) if compute == "fixed" else ComputeSpec(compute),
        log=log)


def figures(model: Path, workdir: Path, name: str) -> dict[str, Any]:
    """Run ``RUNS[name]`` on ``model``; its summary's and its token events' figures."""
    log = workdir / f"{name}.jsonl"
    summary = asyncio.run(run(_config(model, log, RUNS[name])))
    totals = summary.as_dict()
    tokens = []
    for line in log.read_text().splitlines():
        event = json.loads(line)
        if event["event"] != "token":
            continue
        token = {k: event[k] for k in TOKEN if k in event}
        if "devices" in event:
            token["devices"] = [{k: d[k] for k in ("device", "hits", "misses", "file_bytes")}
                                for d in event["devices"]]
        tokens.append(token)
    return {"summary": {k: totals[k] for k in SUMMARY}, "tokens": tokens}


def _tiny(workdir: Path) -> Path:
    """The conftest's tiny model (4 layers, 3 MoE, 16 experts, F16)."""
    return write_model(spec_for("tiny", layers=4, experts=16), workdir / "tiny.gguf")


class TestFiguresPinned:
    """Each run finds, token by token, what the run found before it was rebuilt on the
    session and its leases."""

    @pytest.mark.parametrize("name", sorted(RUNS))
    def test_same_figures(self, name: str, tiny_model: Path, tmp_path: Path) -> None:
        expected = json.loads(FIGURES.read_text())[name]
        found = figures(tiny_model, tmp_path, name)
        assert found["summary"] == expected["summary"]
        for got, want in zip(found["tokens"], expected["tokens"], strict=True):
            assert got == want, f"token {want['token']}"


if __name__ == "__main__":
    # record the figures: python tests/cli/test_run_figures.py tests/data/run_figures.json
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = _tiny(work)
        out = {name: figures(model, work, name) for name in sorted(RUNS)}
    Path(sys.argv[1]).write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
