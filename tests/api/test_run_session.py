"""``moestream.open_config`` and ``RunSession``: a client that builds the library's settings
itself and runs its own decode (the proxy run) gets what it needs through the API.
(``log_error`` after a log the file system refuses: ``tests/test_outputs.py``, through the
command line, which reads it there.)"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import moestream
from moestream.pipeline.foundation.config import ComputeSpec, StreamConfig
from moestream.pipeline.foundation.faults import parse_faults
from moestream.pipeline.foundation.table import open_table
from moestream.pipeline.proxy.config import RunConfig
from moestream.pipeline.streaming.summary import RunSummary
from moestream.pipeline.streaming.verify import Digests


def _events(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def _config(model: Path, log: Path | None = None, **kw: Any) -> StreamConfig:
    return StreamConfig(model=model, backend="host", mode="direct", log=log, **kw)


class TestSettings:
    """The library's settings are a ``StreamConfig``; a client's config extends it."""

    def test_refuses_anything_but_a_stream_config(self, tiny_model: Path) -> None:
        with pytest.raises(moestream.UsageTypeError, match="StreamConfig"):
            moestream.open_config({"model": tiny_model})  # type: ignore[arg-type]

    def test_library_settings_hold_no_client_options(self) -> None:
        fields = set(StreamConfig.__dataclass_fields__)
        assert not fields & {"tokens", "json", "debug", "prefetch", "lookahead", "compute",
                             "router", "trace", "limits"}
        assert fields < set(RunConfig.__dataclass_fields__)

    def test_layers_ahead_names_prefetch_in_the_library_terms(self, tiny_model: Path) -> None:
        assert RunConfig(model=tiny_model).layers_ahead == 0
        assert RunConfig(model=tiny_model, prefetch="predict").layers_ahead == 1
        assert RunConfig(model=tiny_model, prefetch="oracle", lookahead=3).layers_ahead == 3


class TestRunSession:
    """What a client running its own decode hands over and reads back."""

    async def test_client_details_in_the_header_and_its_exit_in_run_end(
            self, tiny_model: Path, tmp_path: Path) -> None:
        log = tmp_path / "run.jsonl"
        summary = RunSummary()
        session = moestream.open_config(
            RunConfig(model=tiny_model, backend="host", mode="direct", log=log, tokens=3),
            summary=summary, table=open_table(tiny_model), compute=ComputeSpec("digest"),
            run_details={"limits": {"source": "told", "read_bytes_per_s": 1e9}})
        assert isinstance(session, moestream.RunSession)
        async with session:
            layer = session.model.moe_layers[0]
            async with session.fetch(layer, [0, 1]) as lease:
                await lease.gather()
            await session.end_token()
            session.log_event("engine_note", layer=layer)
            await session.settle()
            assert session.compute == ComputeSpec("digest")
            assert len(session.device_backends) == len(session.devices) == 1
            await session.aclose(outcome="stopped by the client", check=False)
        assert session.log_error is None
        events = _events(log)
        start = events[0]
        assert start["event"] == "run_start" and start["config"]["tokens"] == 3
        assert start["limits"]["read_bytes_per_s"] == 1e9 and start["compute"] == "digest"
        assert any(e["event"] == "engine_note" and e["layer"] == layer for e in events)
        assert events[-1]["event"] == "run_end"
        assert events[-1]["exit"] == summary.exit == "stopped by the client"
        assert summary.tokens == 1 and summary.verified == 2

    async def test_an_engine_header_names_no_client_options(self, tiny_model: Path,
                                                            tmp_path: Path) -> None:
        log = tmp_path / "engine.jsonl"
        async with moestream.open(tiny_model, backend="host", mode="direct", log=log):
            pass
        start = _events(log)[0]
        assert start["compute"] == "engine" and start["config"]["compute"] == "engine"
        assert not {"tokens", "json", "debug", "prefetch"} & set(start["config"])

    async def test_handed_digests_that_differ_are_counted_as_mismatches(
            self, tiny_model: Path) -> None:
        summary = RunSummary()
        async with moestream.open_config(_config(tiny_model), summary=summary) as session:
            layer = session.model.moe_layers[0]
            async with session.fetch(layer, [0]) as lease:
                await lease.gather()
            session.check_digests(Digests([(layer, 0)], np.zeros((1, 3), dtype=np.uint64)))
            with contextlib.suppress(moestream.VerificationError):  # raised here or at settle
                await session.end_token()
            await session.settle()  # a file without digests: its manifest compares them now
            await session.aclose(outcome="mismatch", check=False)
        assert summary.mismatches >= 1 and summary.exit == "mismatch"

    async def test_the_fault_plan_stays_the_callers(self, tiny_model: Path) -> None:
        faults = parse_faults("truncate@1")
        summary = RunSummary()
        session = moestream.open_config(_config(tiny_model), faults=faults, summary=summary)
        with pytest.raises(moestream.MoestreamError):
            async with session, session.fetch(session.model.moe_layers[0], [0]) as lease:
                await lease.gather()
        assert faults.fired["truncate"] >= 1
        assert summary.budget_bytes > 0  # the totals outlive the error
