"""``DecodeGraphs``' bookkeeping, on the host: a stand-in for CUDA's graphs that keeps a
capture's work as replayable steps over the tensors it saw (what a real capture keeps: the
kernels and their addresses), so that inputs copied in before a replay and the output
copied out of it are checked, with the kind of call captured at its second call, the memory
pool shared by a stream's graphs, and a failed capture turning the graphs off. The real
graphs run in the GPU tests of the whole-layer path (``test_transformers_nosync.py``)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import pytest

torch = pytest.importorskip("torch")

from moestream.transformers import _graphs  # noqa: E402

_capturing: list[FakeGraph] = []


class FakeGraph:
    """A graph whose capture keeps each step's work to run again at ``replay``."""

    made: ClassVar[list[FakeGraph]] = []

    def __init__(self) -> None:
        self.work: list[Callable[[], None]] = []
        self.pool_given: Any = "unset"
        self.replays = 0
        FakeGraph.made.append(self)

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
        assert capture_error_mode == "thread_local"
        self.pool_given = pool
        _capturing.append(self)

    def capture_end(self) -> None:
        _capturing.remove(self)

    def pool(self) -> tuple[str, int]:
        return ("pool", id(self))

    def replay(self) -> None:
        self.replays += 1
        with torch.inference_mode():  # a replay writes memory, past autograd's checks
            for work in self.work:
                work()


class FakeStream:
    def wait_stream(self, other: Any) -> None:
        pass


def step(hidden: Any, index: Any, weights: Any) -> Any:
    """A call's work: each token's row scaled by its weights over its chosen ids. Under a
    capture, the work is kept to run again over the same tensors."""

    def compute(out: Any) -> None:
        out.copy_(hidden * (weights * index.to(weights.dtype)).sum(dim=1, keepdim=True))

    out = torch.empty_like(hidden)
    if _capturing:
        _capturing[-1].work.append(lambda: compute(out))
    else:
        compute(out)
    return out


@pytest.fixture
def graphs(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    FakeGraph.made.clear()
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(_graphs, "current_stream", lambda device: FakeStream())
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: bool(_capturing))
    made = _graphs.DecodeGraphs("cpu")
    assert not made.on  # on a CUDA device only
    made.on = True
    yield made


def _inputs(seed: int, tokens: int = 3) -> tuple[Any, Any, Any]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(tokens, 8, generator=g), torch.randint(0, 4, (tokens, 2), generator=g),
            torch.rand(tokens, 2, generator=g))


def test_captured_at_the_second_call_then_replayed(graphs: Any) -> None:
    outs = []
    for seed in range(4):
        inputs = _inputs(seed)
        out = graphs.call("layer 0", 7, step, *inputs)
        assert torch.equal(out, step(*inputs))  # each call's own inputs, not the capture's
        outs.append(out)
    assert len(FakeGraph.made) == 1 and FakeGraph.made[0].replays == 3 == graphs.replays
    assert outs[2] is not outs[3]  # the caller's own copy: the next replay rewrites it


def test_a_streams_graphs_share_one_pool(graphs: Any) -> None:
    for key, stream in (("layer 0", 7), ("layer 1", 7), ("layer 0 on 9", 9)):
        for seed in range(2):
            graphs.call(key, stream, step, *_inputs(seed))
    first, second, other = FakeGraph.made
    assert first.pool_given is None and second.pool_given == first.pool()
    assert other.pool_given is None  # another stream: a pool of its own


def test_a_failed_capture_turns_the_graphs_off(graphs: Any) -> None:
    def failing(hidden: Any, index: Any, weights: Any) -> Any:
        if _capturing:
            raise RuntimeError("operation not permitted when stream is capturing")
        return step(hidden, index, weights)

    inputs = _inputs(0)
    graphs.call("layer 0", 7, failing, *inputs)
    out = graphs.call("layer 0", 7, failing, *inputs)  # the capture fails: run as it is
    assert torch.equal(out, step(*inputs)) and not graphs.on and not _capturing
    graphs.call("layer 0", 7, failing, *inputs)
    assert len(FakeGraph.made) == 1 and graphs.replays == 0


def test_cleared_graphs_are_captured_again(graphs: Any) -> None:
    for seed in range(2):
        graphs.call("layer 0", 7, step, *_inputs(seed))
    graphs.clear()
    inputs = _inputs(5)
    assert torch.equal(graphs.call("layer 0", 7, step, *inputs), step(*inputs))
    assert len(FakeGraph.made) == 1  # uncaptured again: its first call after runs as it is
    graphs.call("layer 0", 7, step, *inputs)
    assert len(FakeGraph.made) == 2 and FakeGraph.made[1].pool_given is None


def test_within_the_callers_own_capture_nothing_is_captured(graphs: Any) -> None:
    """A call inside a graph the caller captures runs as it is, into the caller's."""
    outer = FakeGraph()
    outer.capture_begin(capture_error_mode="thread_local")
    try:
        for seed in range(3):
            graphs.call("layer 0", 7, step, *_inputs(seed))
    finally:
        outer.capture_end()
    assert FakeGraph.made == [outer] and len(outer.work) == 3


def test_past_the_most_graphs_new_kinds_run_as_they_are(graphs: Any,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Kinds past the limit (draft lengths without end) run as they are, three rounds of
    them never captured again, while the graphs kept replay."""
    monkeypatch.setattr(_graphs, "_MOST", 2)
    for _ in range(3):
        for tokens in (1, 2, 3, 4):
            inputs = _inputs(tokens, tokens)
            assert torch.equal(graphs.call(("layer 0", tokens), 7, step, *inputs),
                               step(*inputs))
    assert len(FakeGraph.made) == 2 and len(graphs._graphs) == 2
    assert graphs.replays == 2 * 2  # the kept kinds' calls after their first


def test_captured_in_inference_mode_replayed_outside_it(graphs: Any) -> None:
    """A kind captured under ``torch.inference_mode`` (a caller's decode) replays for a call
    under ``no_grad`` (``generate``'s): the graph's inputs are not inference tensors, which
    only inference mode may write."""
    with torch.inference_mode():
        for seed in range(2):
            graphs.call("layer 0", 7, step, *_inputs(seed))
    inputs = _inputs(3)
    with torch.no_grad():
        assert torch.equal(graphs.call("layer 0", 7, step, *inputs), step(*inputs))
    assert graphs.replays == 2


def test_past_the_most_bytes_new_kinds_run_as_they_are(graphs: Any,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The graphs' inputs and outputs are device memory outside the budget: past
    ``_MOST_BYTES`` of them a new kind runs as it is; a clear frees them."""
    one = sum(t.numel() * t.element_size() for t in _inputs(0)) + _inputs(0)[0].numel() * 4
    monkeypatch.setattr(_graphs, "_MOST_BYTES", one + 1)
    for key in ("layer 0", "layer 1", "layer 2"):
        for seed in range(2):
            graphs.call(key, 7, step, *_inputs(seed))
    assert len(FakeGraph.made) == 2 and graphs.kept_bytes == 2 * one
    graphs.clear()
    assert graphs.kept_bytes == 0
