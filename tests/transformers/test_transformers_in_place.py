"""Misses read in place: at a budget below the model's experts, the whole-layer path's
table names the cached experts by their cache addresses and the others by their addresses
in the registered page-cache mapping (``SyncSession.in_place``), so a decode step needs no
host read of the routing and no load.

On the host backend (its "device" memory is host memory, and it reads the mapping in
place), the kernel's copies done on the host by the same table (``_host_gather``): the
arithmetic equals transformers' own, the cached experts count as hits and the others as
misses of their file bytes with nothing loaded or evicted, the tables go when the mapping
does (a switch to direct mode) and for a token that takes the lease path. On a GPU (``gpu``
marker): a generate at a budget below the experts gives the resident model's tokens.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
hf_moe = pytest.importorskip("transformers.integrations.moe")

from moestream import UsageError  # noqa: E402
from moestream import transformers as mt  # noqa: E402
from moestream.transformers import _routing  # noqa: E402
from tests.transformers.test_transformers_nosync import (  # noqa: E402
    _CUDA,
    _experts,
    _host_gather,
    _model,
    _routing_of,
)


@contextlib.contextmanager
def batched_calls() -> Iterator[list[int]]:
    """The layers of the calls ``WholeLayers.batched`` serves meanwhile (a GPU's decode
    steps served by the tables)."""
    served: list[int] = []
    batched = _routing.WholeLayers.batched

    def counted(self: Any, layer: int, *args: Any) -> Any:
        served.append(layer)
        return batched(self, layer, *args)

    _routing.WholeLayers.batched = counted  # type: ignore[method-assign]
    try:
        yield served
    finally:
        _routing.WholeLayers.batched = batched  # type: ignore[method-assign]


BUDGET = "6"  # of the 16 experts (2 layers of 8): the least is 2 layers of top-2


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("in-place") / "qwen3_moe"
    _model("qwen3_moe").save_pretrained(root)
    return root


def _filled(path: Path, mode: str = "resident") -> Any:
    """The model on the host backend with its cache full (experts 0.. of each layer)."""
    model = mt.from_pretrained(path, device="cpu", budget=BUDGET, mode=mode)
    session = model.moestream.session
    for layer in session.model.moe_layers:
        for expert in range(3):
            with session.fetch(layer, [expert]) as lease:
                lease.gather()
    session.end_token()
    return model


def _cached(session: Any) -> dict[int, list[int]]:
    return {layer: [e for e in range(session.model.layers[layer].n_experts)
                    if session.ready(layer, [e])] for layer in session.model.moe_layers}


def _one_call(model: Any, whole: Any) -> Any:
    """Whether ``whole`` serves one token's call of the model's first MoE layer."""
    module = _experts(model)[0]
    index, weights = _routing_of(1, 8, 2, seed=0)
    with torch.no_grad():
        return whole.forward(module.moestream_layer, module,
                             torch.zeros(1, 64, dtype=torch.bfloat16), index,
                             weights) is not None


class TestInPlaceOnTheHost:

    @pytest.mark.parametrize("batched", [False, True])
    def test_equals_transformers_and_counts_misses_in_place(
            self, checkpoint: Path, batched: bool, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(_routing.WholeLayers, "_gather", _host_gather)
        reference = (hf_moe.batched_mm_experts_forward if batched
                     else hf_moe.grouped_mm_experts_forward)
        resident = transformers.AutoModelForCausalLM.from_pretrained(
            checkpoint, experts_implementation="grouped_mm")
        model = _filled(checkpoint)
        try:
            session = model.moestream.session
            cached = _cached(session)
            assert all(0 < len(e) < 8 for e in cached.values())  # full, not whole
            whole = _routing.WholeLayers(session, "cpu", in_place=True)
            pairs = list(zip(_experts(model), _experts(resident), strict=True))
            # the first token makes the tables (a lease of each layer's cached experts)
            for rounds in range(2):
                before = session.counters()
                hits = misses = file_bytes = 0
                for i, (ours, theirs) in enumerate(pairs):
                    layer = ours.moestream_layer
                    index, weights = _routing_of(5, 8, 2, seed=i + rounds)
                    hidden = torch.randn(5, 64, dtype=torch.bfloat16,
                                         generator=torch.Generator().manual_seed(i))
                    with torch.no_grad():
                        got = whole.forward(layer, ours, hidden, index, weights,
                                            batched=batched)
                        expected = reference(theirs, hidden, index, weights)
                    assert got is not None and torch.equal(got, expected)
                    distinct = set(index.flatten().tolist())
                    hits += len(distinct & set(cached[layer]))
                    read = distinct - set(cached[layer])
                    misses += len(read)
                    file_bytes += len(read) * session.model.layers[layer].expert_bytes
                whole.settle(whole.take())
                session.end_token()
            after = session.counters()
            assert (after.hits - before.hits, after.misses - before.misses) == (hits, misses)
            assert after.file_bytes - before.file_bytes == file_bytes
            assert after.evictions == before.evictions and _cached(session) == cached
        finally:
            model.moestream.close()

    def test_the_tables_go_with_the_mapping(self, checkpoint: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
        """A switch to direct mode releases the mapping: the next token's first call
        drops the tables and takes the lease path (no mapping to read in place)."""
        monkeypatch.setattr(_routing.WholeLayers, "_gather", _host_gather)
        model = _filled(checkpoint)
        try:
            session = model.moestream.session
            whole = _routing.WholeLayers(session, "cpu", in_place=True)
            layer = session.model.moe_layers[0]
            assert _one_call(model, whole)
            view = session.in_place(layer, [7])
            assert view is not None and session.in_place_current(view)
            whole.settle(whole.take())
            session.end_token()
            streamer = session._session._streaming.streamers[0]
            session._thread.run(streamer.set_mode("direct"))  # as the controller would
            assert not session.in_place_current(view)
            assert session.in_place(layer, [7]) is None
            whole.begin()
            assert not _one_call(model, whole)
        finally:
            model.moestream.close()

    def test_a_lease_drops_the_tables_for_the_token(self, checkpoint: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
        """A call that leases (a prompt of more experts) may evict what the tables name:
        the token's later calls take the lease path, the next token makes them again."""
        monkeypatch.setattr(_routing.WholeLayers, "_gather", _host_gather)
        model = _filled(checkpoint)
        try:
            session = model.moestream.session
            whole = _routing.WholeLayers(session, "cpu", in_place=True)
            assert _one_call(model, whole)
            whole.leasing()
            assert not _one_call(model, whole)
            whole.settle(whole.take())
            session.end_token()
            assert _one_call(model, whole)
        finally:
            model.moestream.close()

    def test_the_cache_follows_the_routing(self, checkpoint: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
        """Every ``_REFRESH_TOKENS`` tokens one token takes the lease path: its misses are
        loaded over the least recently used experts, and the next token's tables name the
        cache as it is then."""
        monkeypatch.setattr(_routing.WholeLayers, "_gather", _host_gather)
        monkeypatch.setattr(_routing, "_REFRESH_TOKENS", 1)
        model = _filled(checkpoint)
        try:
            session = model.moestream.session
            layer = session.model.moe_layers[0]
            assert 7 not in _cached(session)[layer]
            whole = _routing.WholeLayers(session, "cpu", in_place=True)
            served = []
            for _ in range(3):
                whole.begin()
                served.append(_one_call(model, whole))
                if not served[-1]:  # the lease path, as the experts call takes it
                    with session.fetch(layer, [7]) as lease:
                        lease.gather()
                whole.settle(whole.take())
                session.end_token()
            assert served == [True, True, False]
            assert 7 in _cached(session)[layer]
            whole.begin()
            assert _one_call(model, whole) and 7 in whole._cached[layer]
        finally:
            model.moestream.close()

    def test_not_before_the_cache_is_full_nor_in_direct_mode(
            self, checkpoint: Path) -> None:
        for model in (mt.from_pretrained(checkpoint, device="cpu", budget=BUDGET,
                                         mode="resident"), _filled(checkpoint, "direct")):
            try:
                whole = _routing.WholeLayers(model.moestream.session, "cpu", in_place=True)
                assert not _one_call(model, whole)
            finally:
                model.moestream.close()

    def test_a_layout_the_tables_do_not_serve_turns_it_off(
            self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """gpt-oss's transposed, biased experts: no in-place table, and in-place mode off
        for the session (not asked again each token)."""
        monkeypatch.setattr(_routing.WholeLayers, "_gather", _host_gather)
        _model("gpt_oss").save_pretrained(tmp_path / "gpt_oss")
        model = _filled(tmp_path / "gpt_oss")
        try:
            whole = _routing.WholeLayers(model.moestream.session, "cpu", in_place=True)
            assert not _one_call(model, whole) and not whole.in_place
        finally:
            model.moestream.close()

    def test_in_place_is_a_bool(self, checkpoint: Path) -> None:
        with pytest.raises(UsageError, match="in_place must be True or False"):
            mt.from_pretrained(checkpoint, device="cpu", in_place="yes")


@pytest.mark.gpu
@pytest.mark.skipif(not _CUDA, reason="torch sees no CUDA device")
def test_gpu_generate_in_place_gives_the_resident_tokens(checkpoint: Path) -> None:
    """Decode steps served by tables of cached and in-place experts: the resident model's
    greedy tokens."""
    resident = transformers.AutoModelForCausalLM.from_pretrained(
        checkpoint, experts_implementation="grouped_mm").to("cuda")
    prompt = torch.tensor([[3, 17, 42, 5, 9, 11]], device="cuda")
    expected = resident.generate(prompt, max_new_tokens=12, do_sample=False)
    with mt.from_pretrained(checkpoint, device="cuda", budget=BUDGET, mode="resident",
                            in_place=True) as model:
        model.generate(prompt, max_new_tokens=12, do_sample=False)  # fills the cache
        with batched_calls() as served:
            got = model.generate(prompt, max_new_tokens=12, do_sample=False)
        assert torch.equal(got, expected)
        assert served  # the decode steps took the in-place tables
