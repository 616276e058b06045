"""Tests for tools.whatif and tools.whatif_replay: exact replay, Belady's ceiling, budgets."""

from __future__ import annotations

import functools
import json
import resource
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import structlog
from hypothesis import given, settings
from hypothesis import strategies as st

from moestream.pipeline.foundation.errors import TraceError, UsageError
from moestream.pipeline.runlog.read import read_log
from moestream.tools.analyze.cli import main
from moestream.tools.analyze.whatif import default_budgets, parse_budget, smallest_budget, what_if
from moestream.tools.analyze.whatif_replay import (
    NEVER,
    AccessTrace,
    BeladyPolicy,
    next_use_positions,
    replay,
)
from tests.synthetic_logs import SyntheticRun, write_synthetic_log

UNIT = 1000  # bytes of one expert in the small logs
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _reset_structlog() -> Iterator[None]:
    yield
    structlog.reset_defaults()


def small_run(policy: str = "lru", **overrides: object) -> SyntheticRun:
    fields: dict[str, object] = dict(tokens=300, moe_layers=4, n_experts=32, top_k=4,
                                     expert_bytes=UNIT, budget_experts=40, policy=policy,
                                     switch_at=150, seed=3)
    fields.update(overrides)
    return SyntheticRun(**fields)  # type: ignore[arg-type]


def trace_of(experts: list[list[list[int]]], size: int = UNIT) -> AccessTrace:
    array = np.array(experts, dtype=np.int32)
    layers = array.shape[1]
    return AccessTrace(tuple(range(layers)), (size,) * layers, array,
                       np.full(array.shape[0], np.nan))


def brute_force_hits(experts: np.ndarray, capacity: int) -> int:
    """Most hits any victim choice can get under CacheIndex's rules (equal sizes, in experts).

    Per layer: hits are looked up first; each miss is admitted if it fits, else one
    unprotected held key is evicted (every choice tried), else it is served uncached.
    """
    steps = [(layer, tuple(int(e) for e in experts[t, layer] if e >= 0))
             for t in range(experts.shape[0]) for layer in range(experts.shape[1])]

    @functools.cache
    def best(i: int, held: frozenset[tuple[int, int]]) -> int:
        if i == len(steps):
            return 0
        layer, ids = steps[i]
        keys = [(layer, e) for e in ids]
        hits = sum(k in held for k in keys)
        misses = [k for k in keys if k not in held]
        outcomes: list[int] = []

        def admit(j: int, state: frozenset[tuple[int, int]]) -> None:
            if j == len(misses):
                outcomes.append(best(i + 1, state))
                return
            key = misses[j]
            if capacity < 1:
                admit(j + 1, state)
            elif len(state) < capacity:
                admit(j + 1, state | {key})
            else:
                victims = [v for v in state if v not in keys]
                if not victims:
                    admit(j + 1, state)
                for victim in victims:
                    admit(j + 1, (state - {victim}) | {key})

        admit(0, held)
        return hits + max(outcomes)

    return best(0, frozenset())


Case = tuple[list[list[list[int]]], int]


@st.composite
def routing_cases(draw: st.DrawFn, max_tokens: int = 40) -> Case:
    """Expert lists (tokens x layers x k, distinct ids per layer) and a capacity in experts."""
    layers = draw(st.integers(1, 3))
    k = draw(st.integers(1, 3))
    layer_ids = st.permutations(list(range(k + 3))).map(lambda p: list(p[:k]))
    tokens = draw(st.lists(st.lists(layer_ids, min_size=layers, max_size=layers),
                           min_size=1, max_size=max_tokens))
    return tokens, draw(st.integers(0, 12))


class TestExactness:
    """Replaying a log at its own budget and policy reproduces the live hit count exactly."""

    @pytest.mark.parametrize("policy", ["lru", "freq"])
    def test_replay_matches_logged_hits_token_by_token(self, tmp_path: Path,
                                                       policy: str) -> None:
        path = tmp_path / "run.jsonl"
        totals = write_synthetic_log(path, small_run(policy))
        run = read_log(path)
        trace = AccessTrace.from_log(run)
        result = replay(trace, policy, totals["budget_bytes"])
        assert result.hits == totals["hits"] == int(np.nansum(run.tokens["hits"]))
        assert np.array_equal(result.token_hits, run.tokens["hits"])
        assert result.evictions == totals["evictions"]

    def test_report_names_the_check_exact(self, tmp_path: Path) -> None:
        path = tmp_path / "run.jsonl"
        totals = write_synthetic_log(path, small_run("freq"))
        run = read_log(path)
        report = what_if(AccessTrace.from_log(run), [20 * UNIT, totals["budget_bytes"]],
                         run_budget=totals["budget_bytes"], run_policy="freq")
        assert report.exact is not None
        assert report.exact.hits == report.logged_hits == totals["hits"]
        assert report.first_divergence is None

    def test_divergence_is_located(self, tmp_path: Path) -> None:
        path = tmp_path / "run.jsonl"
        write_synthetic_log(path, small_run())
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            obj = json.loads(line)
            if obj["event"] == "token" and obj["token"] == 57:
                obj["hits"] += 1
                obj["misses"] -= 1
                lines[i] = json.dumps(obj)
        path.write_text("\n".join(lines) + "\n")
        report = what_if(AccessTrace.from_log(read_log(path)), [40 * UNIT],
                         policies=["lru"], run_budget=40 * UNIT, run_policy="lru")
        assert report.first_divergence == 57

    def test_cli_reports_exact(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        path = tmp_path / "run.jsonl"
        write_synthetic_log(path, small_run())
        assert main([str(path), "--what-if", "--budgets", "10,40,80", "--target", "0.5"]) == 0
        out = capsys.readouterr().out
        assert "replay check: lru" in out
        assert ": exact" in out
        assert "smallest budget reaching 0.5" in out

    def test_log_without_header_cannot_be_replayed(self, tmp_path: Path) -> None:
        path = tmp_path / "headless.jsonl"
        path.write_text('{"event": "token", "schema": 1, "token": 0, "experts": [[1]]}\n')
        with pytest.raises(TraceError, match="no run_start"):
            AccessTrace.from_log(read_log(path))


class TestBelady:
    """Belady's rule is never beaten by the live policies and is optimal on tiny cases."""

    @settings(max_examples=60, deadline=None)
    @given(routing_cases())
    def test_belady_at_least_lru_and_freq(self, case: Case) -> None:
        experts, capacity = case
        trace = trace_of(experts)
        belady = replay(trace, "belady", capacity * UNIT).hits
        assert belady >= replay(trace, "lru", capacity * UNIT).hits
        assert belady >= replay(trace, "freq", capacity * UNIT).hits

    @settings(max_examples=60, deadline=None)
    @given(routing_cases(max_tokens=6))
    def test_belady_equals_brute_force_optimum(self, case: Case) -> None:
        experts, capacity = case
        trace = trace_of(experts)
        optimum = brute_force_hits(trace.experts, capacity)
        assert replay(trace, "belady", capacity * UNIT).hits == optimum

    def test_known_sequence(self) -> None:
        # Capacity 2, accesses 1 2 3 1 2. Admission is on demand (3 must enter), so Belady
        # evicts 2, used later than 1, and hits on 1; LRU evicts 1, then 2, and never hits.
        trace = trace_of([[[1]], [[2]], [[3]], [[1]], [[2]]])
        assert replay(trace, "belady", 2 * UNIT).hits == 1
        assert replay(trace, "lru", 2 * UNIT).hits == 0

    def test_next_use_positions(self) -> None:
        experts = np.array([[[1, 2], [5, -1]], [[2, 3], [5, 6]], [[1, 2], [6, 5]]],
                           dtype=np.int32)
        nxt = next_use_positions(experts)
        layers = 2
        assert nxt[0, 0].tolist() == [2 * layers + 0, 1 * layers + 0]
        assert nxt[0, 1].tolist() == [1 * layers + 1, NEVER]
        assert nxt[1, 0].tolist() == [2 * layers + 0, NEVER]
        assert nxt[1, 1].tolist() == [2 * layers + 1, 2 * layers + 1]
        assert (nxt[2] == NEVER).all()

    def test_heap_stays_bounded(self) -> None:
        policy = BeladyPolicy()
        keys = [(0, e) for e in range(8)]
        for step in range(20_000):
            policy.upcoming = {key: step + i for i, key in enumerate(keys)}
            for key in keys:
                if step == 0:
                    policy.insert(key)
                else:
                    policy.touch(key)
        assert len(policy._heap) <= 4 * len(keys) + 1024 + 1


class TestBudgets:
    """Budgets parse as sizes or expert counts; defaults span the working set."""

    def test_parse(self) -> None:
        assert parse_budget("2GiB", UNIT) == 2 * 2**30
        assert parse_budget("11GB", UNIT) == 11 * 10**9
        assert parse_budget("40", UNIT) == 40 * UNIT
        with pytest.raises(UsageError):
            parse_budget("lots", UNIT)

    def test_defaults(self, tmp_path: Path) -> None:
        path = tmp_path / "run.jsonl"
        totals = write_synthetic_log(path, small_run())
        trace = AccessTrace.from_log(read_log(path))
        budgets = default_budgets(trace, totals["budget_bytes"])
        assert budgets == sorted(set(budgets))
        assert totals["budget_bytes"] in budgets
        assert budgets[-1] == trace.working_set_bytes()
        assert all(b % UNIT == 0 for b in budgets)

    def test_smallest_budget_is_tight(self, tmp_path: Path) -> None:
        path = tmp_path / "run.jsonl"
        write_synthetic_log(path, small_run())
        trace = AccessTrace.from_log(read_log(path))
        grid = [replay(trace, "lru", b * UNIT) for b in (8, 32, 128)]
        best = smallest_budget(trace, "lru", 0.5, grid)
        assert best is not None and best.hit_rate >= 0.5
        below = replay(trace, "lru", best.capacity_bytes - UNIT)
        assert below.hit_rate < 0.5

    def test_unreachable_target(self, tmp_path: Path) -> None:
        trace = trace_of([[[1]], [[2]], [[3]]])
        report = what_if(trace, [UNIT, 3 * UNIT], policies=["lru"], target=0.9)
        assert report.smallest["lru"] is None

    @pytest.mark.parametrize(
        ("kwargs", "message"),
        [({"policies": ["mru"]}, "unknown policy"), ({"target": 1.5}, "target"),
         ({"target": 0.0}, "target")],
    )
    def test_usage_errors(self, kwargs: dict[str, object], message: str) -> None:
        trace = trace_of([[[1]], [[2]]])
        with pytest.raises(UsageError, match=message):
            what_if(trace, [UNIT], **kwargs)  # type: ignore[arg-type]

    def test_repeated_id_in_a_layer_is_a_trace_error(self) -> None:
        trace = trace_of([[[1, 1]]])
        with pytest.raises(TraceError, match="token 0"):
            replay(trace, "lru", 4 * UNIT)


class TestWorkers:
    """Replays in worker processes give the same report as replays in this process."""

    def test_same_report(self, tmp_path: Path) -> None:
        path = tmp_path / "run.jsonl"
        totals = write_synthetic_log(path, small_run(tokens=120))
        trace = AccessTrace.from_log(read_log(path))
        budgets = [10 * UNIT, 40 * UNIT, 100 * UNIT]
        kwargs = dict(target=0.5, run_budget=totals["budget_bytes"], run_policy="lru")
        serial = what_if(trace, budgets, jobs=1, **kwargs)  # type: ignore[arg-type]
        parallel = what_if(trace, budgets, jobs=2, **kwargs)  # type: ignore[arg-type]
        assert [(r.policy, r.capacity_bytes, r.hits) for r in serial.results] == [
            (r.policy, r.capacity_bytes, r.hits) for r in parallel.results]
        assert {p: r and r.capacity_bytes for p, r in serial.smallest.items()} == {
            p: r and r.capacity_bytes for p, r in parallel.smallest.items()}
        assert parallel.exact is not None and parallel.exact.hits == totals["hits"]

    def test_jobs_must_be_positive(self) -> None:
        with pytest.raises(UsageError, match="jobs"):
            what_if(trace_of([[[1]]]), [UNIT], jobs=0)


def _hostile_log(path: Path, *, experts: str = "[[1, 2], [2, 3]]", wall: str = "10.0",
                 n_experts: int = 8, tokens: int = 4) -> Path:
    """A 2-layer x top-2 log: ``tokens`` tokens, then one whose ``experts`` and ``wall_ms``
    are the texts given."""
    def line(name: str, **fields: object) -> str:
        return json.dumps({"event": name, "schema": 1, **fields})

    def token(t: int, ids: object) -> str:
        return line("token", token=t, wall_ms=10.5, read_ms=1.0, stage_ms=0.5,
                    upload_ms=0.25, install_ms=0.125, stall_ms=2.5, compute_ms=5.0, hits=2,
                    misses=2, evictions=2, file_bytes=2 * UNIT, cache_bytes=2 * UNIT,
                    storage_bytes=UNIT, mode="direct", ram_available_bytes=4 * 10**9,
                    cache_live_bytes=4 * UNIT, cache_parked_bytes=0, experts=ids)

    lines = [line("run_start", config={}, budget_bytes=8 * UNIT, policy="lru",
                  model={"moe_layers": [1, 2], "n_experts": n_experts, "top_k": 2,
                         "expert_bytes": [UNIT, UNIT]}, machine={})]
    lines += [token(t, [[t % 8, (t + 1) % 8], [2, 3]]) for t in range(tokens)]
    lines.append(token(tokens, "EXPERTS").replace('"EXPERTS"', experts)
                 .replace('"wall_ms": 10.5', f'"wall_ms": {wall}'))
    path.write_text("\n".join(lines) + "\n")
    return path


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))


class TestHostileLogs:
    """Memory follows the log's size, never a value in it; a bad value is a counted bad line
    or one line and exit 2, never a traceback (each under a 2 GiB address space)."""

    @pytest.mark.parametrize(("change", "words"), [
        ({}, "log lines skipped"),
        ({"experts": "[[2147483647, 1], [2, 3]]"}, "expert ids >= n_experts"),
        ({"experts": "[" + json.dumps(list(range(40_000))) + ", [2, 3]]"},
         "list more than 8 experts in a layer"),
        ({"wall": "9" * 4000}, "lines: out_of_range 1"),
    ], ids=["plain", "id-2**31-1", "40000-experts", "4000-digit-wall"])
    def test_bounded_run(self, tmp_path: Path, change: dict[str, Any], words: str) -> None:
        path = _hostile_log(tmp_path / "run.jsonl", **change)
        for extra in (["--what-if", "--jobs", "1"], []):
            done = subprocess.run([sys.executable, "-m", "tools.analyze", str(path), *extra],
                                  cwd=REPO, capture_output=True, text=True, check=False,
                                  preexec_fn=_limited, timeout=120)
            assert done.returncode == 0, done.stderr[-2000:]
            assert "Traceback" not in done.stderr
            assert words in done.stdout
            assert ("what-if:" in done.stdout) == bool(extra)

    def test_a_huge_number_in_run_start_refuses_the_log(
            self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        path = _hostile_log(tmp_path / "run.jsonl")
        text = path.read_text().replace('"budget_bytes": 8000', '"budget_bytes": ' + "9" * 4000)
        path.write_text(text)
        assert main([str(path), "--what-if"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "holds an integer no int64 holds" in err[0]

    def test_wide_lists_past_what_the_log_allows_are_refused(
            self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """One prefill-like token of 1000 experts a layer pads every token to 1000."""
        monkeypatch.setattr("moestream.pipeline.runlog.expert_ids._HELD_FLOOR_BYTES", 1 << 20)
        monkeypatch.setattr("moestream.pipeline.runlog.expert_ids._HELD_PER_LOG_BYTE", 1)
        wide = "[" + json.dumps(list(range(1000))) + ", [2, 3]]"
        path = _hostile_log(tmp_path / "run.jsonl", experts=wide, n_experts=1000, tokens=300)
        with pytest.raises(TraceError, match=r"would take \d+ bytes to replay"):
            read_log(path)
        assert len(read_log(path, experts=False).tokens) == 301  # no ids kept: no bound

    def test_replay_keys_only_the_ids_used(self) -> None:
        trace = trace_of([[[2**31 - 1, 5]], [[5, 2**31 - 1]]])
        result = replay(trace, "lru", 4 * UNIT)
        assert (result.hits, result.misses) == (2, 2)
