"""``bench.timeline``: a profiler trace reduced to the device's busy times a token."""

from __future__ import annotations

import itertools
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from bench.timeline import busy, overlap, summarize

_spans = st.lists(st.tuples(st.integers(0, 1000), st.integers(0, 100)).map(
    lambda p: (float(p[0]), float(p[0] + p[1]))), max_size=30)


@given(_spans)
def test_busy_is_the_union(spans: list[tuple[float, float]]) -> None:
    """Disjoint, sorted, and covering exactly the integer points the spans cover."""
    merged = busy(spans)
    assert all(a[1] < b[0] for a, b in itertools.pairwise(merged))
    covered = {x for s, e in spans for x in range(int(s), int(e))}
    assert covered == {x for s, e in merged for x in range(int(s), int(e))}


@given(_spans, _spans)
def test_overlap_is_the_intersection(a: list[tuple[float, float]],
                                     b: list[tuple[float, float]]) -> None:
    one = {x for s, e in a for x in range(int(s), int(e))}
    two = {x for s, e in b for x in range(int(s), int(e))}
    assert overlap(busy(a), busy(b)) == len(one & two)


def test_summarize_per_token() -> None:
    """Kernels 0-40 and 60-100 us, a copy 30-70 us of 2 MB, a sync call of 20 us, two
    tokens: the device idle 0, copies overlapping 20 us."""
    events = [
        {"ph": "X", "cat": "kernel", "name": "k", "ts": 0, "dur": 40},
        {"ph": "X", "cat": "kernel", "name": "k", "ts": 60, "dur": 40},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": 30,
         "dur": 40, "args": {"bytes": 2_000_000}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "ts": 100,
         "dur": 5},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 10, "dur": 20},
        {"ph": "i", "cat": "kernel", "name": "marker", "ts": 500},
    ]
    found = summarize({"traceEvents": events}, tokens=2)
    assert found == {"device_window_ms": 0.05, "kernels_ms": 0.04, "h2d_ms": 0.02,
                     "h2d_mb": 1.0, "overlap_ms": 0.01, "idle_ms": 0.0,
                     "host_sync_calls_ms": 0.01}


def test_experts_profile_timeline_with_prediction(tmp_path: Path) -> None:
    """``bench.experts_profile --timeline --prefetch predict``: the summary line, and the
    trace kept beside ``--out``."""
    from bench.experts_profile import main
    from bench.transformers import make_checkpoint

    make_checkpoint(tmp_path / "m", "tiny", 2, "cpu", spread=True)
    out = tmp_path / "profile.txt"
    assert main(["-m", str(tmp_path / "m"), "--device", "cpu", "--tokens", "3", "--top", "5",
                 "--budget", "16", "--fresh", "--timeline", "--prefetch", "predict",
                 "--out", str(out)]) == 0
    assert "-- timeline (ms a token;" in out.read_text()
    assert (tmp_path / "profile.trace.json.gz").stat().st_size > 0
