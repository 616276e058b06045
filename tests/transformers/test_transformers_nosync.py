"""A model held whole on a GPU computes its experts with no host read of the routing.

On the host: the arithmetic that numbers the call's distinct experts on the device
(``slotted_grouped``) gives transformers' ``grouped_mm_experts_forward``'s bits, for
routings with repeated experts, over gated and transposed-with-biases experts; and
``WholeLayers`` over a host session, its kernel's copies done on the host by the same table
of addresses, gives the same and counts each call's distinct experts as the token's hits.
On a GPU (``gpu`` marker): a model whose every expert is cached gives the resident
model's logits and tokens through the whole-layer path, its experts calls synchronize
nothing (``torch.cuda.set_sync_debug_mode("error")``), and its hits are still counted.
"""

from __future__ import annotations

import ctypes
import json
import time
import warnings
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
hf_moe = pytest.importorskip("transformers.integrations.moe")

from moestream import transformers as mt  # noqa: E402
from moestream.transformers import _experts as experts_module  # noqa: E402
from moestream.transformers import _routing  # noqa: E402
from moestream.transformers._expert_compute import slotted_grouped  # noqa: E402
from moestream.transformers._layout import first_projection  # noqa: E402

ATTENTION = dict(num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
                 max_position_embeddings=128, head_dim=16)
ARCHS: dict[str, dict[str, Any]] = {
    "qwen3_moe": dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                      num_experts=8, num_experts_per_tok=2, num_hidden_layers=2, **ATTENTION),
    # transposed gate_up, per-expert biases, its own clamped gate
    "gpt_oss": dict(hidden_size=64, intermediate_size=32, num_local_experts=8,
                    num_experts_per_tok=2, num_hidden_layers=2, swiglu_limit=0.001,
                    layer_types=["sliding_attention", "full_attention"], **ATTENTION),
}
PROMPT = [[3, 17, 42, 5, 9, 11]]


def _model(kind: str, dtype: Any = torch.bfloat16) -> Any:
    config = transformers.AutoConfig.for_model(kind, **ARCHS[kind])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype,
                                                          experts_implementation="grouped_mm")
    with torch.no_grad():  # gpt-oss's experts' biases start at zero: make them count
        for name, param in model.named_parameters():
            if ".experts." in name and name.endswith("_bias"):
                param.normal_(0.0, 0.02)
    return model


def _experts(model: Any) -> list[Any]:
    return [m for m in model.modules() if hasattr(m, "has_gate") and hasattr(m, "down_proj")]


def _routing_of(tokens: int, experts: int, top_k: int, seed: int) -> tuple[Any, Any]:
    """A router's choice: ``top_k`` distinct experts a token, few experts so that tokens
    share them (groups of several rows)."""
    g = torch.Generator().manual_seed(seed)
    index = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, top_k, generator=g), dim=-1)
    return index, weights


class TestSlottedArithmetic:
    """The device-numbered grouped product is transformers' grouped product, bit for bit."""

    @pytest.mark.parametrize("tokens", [1, 3, 8, 40])
    @pytest.mark.parametrize("kind", list(ARCHS))
    def test_equals_grouped_mm(self, kind: str, tokens: int) -> None:
        module = _experts(_model(kind))[0]
        first, down = first_projection(module), module.down_proj

        def gather(slots: Any, first_out: Any, down_out: Any) -> None:
            held = slots >= 0  # the empty slots are left as they are (garbage)
            first_out[held] = first.detach()[slots[held]]
            down_out[held] = down.detach()[slots[held]]

        hidden = torch.randn(tokens, ARCHS[kind]["hidden_size"],
                             generator=torch.Generator().manual_seed(tokens),
                             dtype=torch.bfloat16)
        index, weights = _routing_of(tokens, module.num_experts, 2, seed=tokens)
        with torch.no_grad():
            expected = hf_moe.grouped_mm_experts_forward(module, hidden, index, weights)
            got = slotted_grouped(module, hidden, index, weights, module.num_experts, gather,
                                  tuple(first.shape[1:]), tuple(down.shape[1:]))
        assert torch.equal(expected, got)


_CUDA = torch.cuda.is_available()


def _host_gather(self: Any, table: Any, slots: Any, first: Any, down: Any) -> None:
    """The kernel's copies on the host, by the same table: each slot's gate and up into
    ``first``, its down into ``down``."""
    rows = table.addresses.tolist()
    g, u, d = table.gate_bytes, table.up_bytes, table.down_bytes
    for j, expert in enumerate(slots.tolist()):
        if expert < 0:
            continue
        gate, up, down_at = rows[expert]
        ctypes.memmove(first.data_ptr() + j * (g + u), gate, g)
        ctypes.memmove(first.data_ptr() + j * (g + u) + g, up, u)
        ctypes.memmove(down.data_ptr() + j * d, down_at, d)


class TestWholeLayersOnTheHost:
    """The whole-layer path over a host session, the kernel's copies done on the host from
    the same table: the table's addresses and layout, the arithmetic, the hits counted."""

    @pytest.mark.parametrize("batched", [False, True])
    @pytest.mark.parametrize("kind", list(ARCHS))
    def test_equals_grouped_mm_and_counts_hits(self, checkpoints: dict[str, Path], kind: str,
                                                batched: bool,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
        """In grouped_mm's arithmetic, or batched_mm's (each pair's expert gathered, an
        expert two pairs route to twice)."""
        monkeypatch.setattr(_routing.WholeLayers, "_gather", _host_gather)
        reference = (hf_moe.batched_mm_experts_forward if batched
                     else hf_moe.grouped_mm_experts_forward)
        resident = transformers.AutoModelForCausalLM.from_pretrained(
            checkpoints[kind], experts_implementation="grouped_mm")
        model = _held_whole(checkpoints[kind], "cpu")
        try:
            session = model.moestream.session
            whole = _routing.WholeLayers(session, "cpu")
            pairs = list(zip(_experts(model), _experts(resident), strict=True))
            # the first token makes the tables: one lease of each layer, every expert a hit
            for rounds in range(2):
                before, distinct = session.counters().hits, 0
                for i, (ours, theirs) in enumerate(pairs):
                    index, weights = _routing_of(5, ours.num_experts, 2, seed=i + rounds)
                    hidden = torch.randn(5, ARCHS[kind]["hidden_size"], dtype=torch.bfloat16,
                                         generator=torch.Generator().manual_seed(i))
                    with torch.no_grad():
                        got = whole.forward(ours.moestream_layer, ours, hidden, index, weights,
                                            batched=batched)
                        expected = reference(theirs, hidden, index, weights)
                    assert got is not None and torch.equal(got, expected)
                    distinct += len(set(index.flatten().tolist()))
                whole.settle(whole.take())
                session.end_token()
            # the next token's hits: each call's distinct experts, counted once a layer
            assert session.counters().hits - before == distinct
        finally:
            model.moestream.close()

    def test_experts_the_routing_never_picks_are_filled(
            self, checkpoints: dict[str, Path]) -> None:
        """A budget holding every expert is filled ``fill`` experts a token beyond what the
        routing asks (an expert never routed to would keep the model from being held whole),
        then held whole; the fill's loads counted as prefetched."""
        model = mt.from_pretrained(checkpoints["qwen3_moe"], device="cpu", budget=None,
                                   mode="resident")
        try:
            session = model.moestream.session
            info = session.model
            total = sum(info.layers[layer].n_experts for layer in info.moe_layers)
            whole = _routing.WholeLayers(session, "cpu", fill=3)
            tokens = 0
            while not whole.holding():
                assert tokens < 2 * total  # 3 a token, and loads may still be landing
                whole.settle(whole.take())
                session.end_token()
                tokens += 1
                _landed(session)
            assert tokens >= -(-total // 3) and session.counters().prefetched == total
            assert session.counters().misses == 0  # nothing was asked for
        finally:
            model.moestream.close()

    def test_no_fill_in_direct_mode(self, checkpoints: dict[str, Path]) -> None:
        """In direct mode the fill's loads would be disk reads ahead of the token's own
        misses: the routing alone fills the cache."""
        model = mt.from_pretrained(checkpoints["qwen3_moe"], device="cpu", budget=None,
                                   mode="direct")
        try:
            session = model.moestream.session
            whole = _routing.WholeLayers(session, "cpu", fill=3)
            for _ in range(4):
                assert not whole.holding()
                whole.settle(whole.take())
                session.end_token()
            assert session.counters().prefetched == 0
        finally:
            model.moestream.close()

    def test_a_budget_below_every_expert_takes_the_lease_path(
            self, checkpoints: dict[str, Path]) -> None:
        model = mt.from_pretrained(checkpoints["qwen3_moe"], device="cpu", budget="4")
        try:
            whole = _routing.WholeLayers(model.moestream.session, "cpu")
            module = _experts(model)[0]
            index, weights = _routing_of(1, module.num_experts, 2, seed=0)
            hidden = torch.zeros(1, 64, dtype=torch.bfloat16)
            assert whole.forward(module.moestream_layer, module, hidden, index, weights) is None
        finally:
            model.moestream.close()


def _landed(session: Any, seconds: float = 10.0) -> None:
    """Until every expert the hints loaded has landed (this test asks for nothing else, so
    the ready experts are the hints' once they all have), or ``seconds`` passed."""
    info = session.model
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        ready = sum(session.ready(layer, [e]) for layer in info.moe_layers
                    for e in range(info.layers[layer].n_experts))
        if ready >= session.counters().prefetched:
            return
        time.sleep(0.001)


def _fetches(model: Any, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The layers the model's session leased (each ``fetch``), as they are asked."""
    session = model.moestream.session
    asked: list[int] = []
    fetch = session.fetch

    def counted(layer: int, *args: Any, **kwargs: Any) -> Any:
        asked.append(layer)
        return fetch(layer, *args, **kwargs)

    monkeypatch.setattr(session, "fetch", counted)
    return asked


def _greedy(model: Any, tokens: int = 6) -> tuple[list[int], list[Any]]:
    """Greedy tokens and the per-token stats moestream counted for them."""
    stats: list[Any] = []
    model.moestream.on_token = stats.append
    with torch.no_grad():
        out = model.generate(torch.tensor(PROMPT), max_new_tokens=tokens, do_sample=False)
    return out[0].tolist(), stats


class TestHostHeldWhole:
    """On the host backend a model held whole computes its calls from views of the cache
    with no lease (``HostWeights.trusted``), its hits told at the token's end: the same
    tokens as the resident model, the same counts as leasing every call."""

    @pytest.mark.parametrize("kind", list(ARCHS))
    def test_no_lease_same_tokens_and_counts(self, checkpoints: dict[str, Path], kind: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
        resident = transformers.AutoModelForCausalLM.from_pretrained(
            checkpoints[kind], experts_implementation="grouped_mm")
        with torch.no_grad():
            want = resident.generate(torch.tensor(PROMPT), max_new_tokens=6,
                                     do_sample=False)[0].tolist()
        counted = []
        for lease_free in (True, False):
            model = _held_whole(checkpoints[kind], "cpu")
            try:
                if not lease_free:
                    monkeypatch.setattr(model.moestream._whole, "holding", lambda: 0)
                _greedy(model)  # each expert the run routes to seen under a lease, once
                asked = _fetches(model, monkeypatch)
                tokens, stats = _greedy(model)
                assert tokens == want
                assert (asked == []) is lease_free
                counted.append([(s.hits, s.misses, s.experts) for s in stats])
            finally:
                model.moestream.close()
        assert counted[0] == counted[1]

    def test_a_new_period_trusts_only_views_seen_in_it(
            self, checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
        """A period ended (``forget``, as when the budget shrinks below every expert): the
        views kept from it are not trusted in the next; the calls lease until each expert
        was seen again where the cache holds it now, then none does."""
        resident = transformers.AutoModelForCausalLM.from_pretrained(
            checkpoints["qwen3_moe"], experts_implementation="grouped_mm")
        with torch.no_grad():
            want = resident.generate(torch.tensor(PROMPT), max_new_tokens=6,
                                     do_sample=False)[0].tolist()
        model = _held_whole(checkpoints["qwen3_moe"], "cpu")
        try:
            whole = model.moestream._whole
            _greedy(model)
            period = whole.holding()
            assert period
            whole.forget()
            asked = _fetches(model, monkeypatch)
            tokens, _ = _greedy(model)  # the views seen again under leases, in a new period
            assert tokens == want
            assert set(asked) == set(model.moestream.session.model.moe_layers)
            assert whole.holding() == period + 1
            asked.clear()
            tokens, _ = _greedy(model)
            assert tokens == want and asked == []
        finally:
            model.moestream.close()


class _Event:
    """A CUDA event's stand-in on the host: its waits counted."""

    waits = 0

    def __init__(self, enable_timing: bool = False) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        type(self).waits += 1

    def elapsed_time(self, other: Any) -> float:
        return 1.0


class _Whole:
    """WholeLayers' stand-in: the calls a token served, and which were accounted when."""

    def __init__(self) -> None:
        self.pending: list[Any] = []
        self.accounted: list[list[Any]] = []
        self.landed: list[int] = []  # how many tokens' routing each transfer carried

    def take(self) -> list[Any]:
        pending, self.pending = self.pending, []
        return pending

    def land(self, routings: list[Any], after: Any) -> list[Any]:
        self.landed.append(len(routings))
        return [[] for _ in routings]

    def account(self, routing: list[Any], calls: Any) -> None:
        self.accounted.append(routing)

    def settle(self, routing: list[Any], after: Any = None) -> None:
        self.account(routing, self.land([routing], after)[0])

    def forget(self) -> None:
        pass

    def begin(self) -> None:
        pass

    def leasing(self) -> None:
        pass


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not _CUDA, reason="torch sees no CUDA device")])])
def test_routing_lands_as_taken(checkpoints: dict[str, Path], device: str) -> None:
    """A forward's routing is taken into a tensor of its own (a router's output written
    again later, as a CUDA graph's replay writes it, changes nothing taken), and tokens'
    routing lands on the host in one transfer (on a GPU behind the last one's event, then
    again through the same pinned buffer), each token's calls apart, in order, a token with
    no call among them."""
    model = mt.from_pretrained(checkpoints["qwen3_moe"], device=device)
    whole = model.moestream._whole
    try:
        for shift in (0, 10):  # the pinned buffer reused
            first = torch.tensor([[3, 1]], device=device) + shift
            second = torch.tensor([[0, 5], [5, 2]], device=device) + shift
            whole.remember(1, first)
            whole.remember(2, second)
            a = whole.take()
            empty = whole.take()
            whole.remember(1, first)
            first.add_(100)  # the router's buffer written again after the take
            c = whole.take()
            first.add_(100)
            after = None
            if device == "cuda":
                after = torch.cuda.Event()
                after.record()
            assert whole.land([a, empty, c], after) == [
                [[3 + shift, 1 + shift], [shift, 5 + shift, 5 + shift, 2 + shift]], [],
                [[103 + shift, 101 + shift]]]
        assert whole.land([]) == []
    finally:
        model.moestream.close()


class TestDeferredTokenEnds:
    """``ExpertStream.defer``'s order on the host, its CUDA events stood in for: tokens the
    whole-layer path served are held and end together, in order, once more than
    ``held_tokens`` wait (the newest, maybe still on the device, kept), each with its own
    calls and its forward's wall time; a token that leases ends the held ones first;
    ``flush`` ends the rest."""

    def test_order(self, checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch
                   ) -> None:
        monkeypatch.setattr(torch.cuda, "Event", _Event)
        monkeypatch.setattr(experts_module, "current_stream", lambda device: None)
        model = mt.from_pretrained(checkpoints["qwen3_moe"], device="cpu")
        stream = model.moestream
        stream.held_tokens = 2
        real, end_token = stream._whole, stream.session.end_token
        walls: list[float | None] = []

        def told(**words: Any) -> Any:
            walls.append(words["wall_ms"])
            return end_token(**words)

        monkeypatch.setattr(stream.session, "end_token", told)
        try:
            whole = _Whole()
            stream._cuda, stream._whole, stream.defer = True, whole, True
            ended = []
            stream.on_token = lambda stats: ended.append(len(whole.accounted))
            tokens, waits = stream.tokens, _Event.waits
            for call in ("a", "b"):  # held: none ended, no wait
                stream.begin_step()
                whole.pending.append(call)
                stream.end_step()
            assert stream.tokens == tokens and _Event.waits == waits
            stream.begin_step()
            whole.pending.append("c")
            stream.end_step()  # three held: the two before it end, after one wait
            assert stream.tokens - tokens == 2 and whole.accounted == [["a"], ["b"]]
            # no host wait for an event: the transfer waits for the last one's on the device
            assert _Event.waits == waits and whole.landed == [2]
            assert [h.routing for h in stream._held] == [["c"]]
            stream.begin_step()  # a token that leases: the held one ends first
            whole.pending.append("d")
            for _ in stream.arrivals(stream.session.model.moe_layers[0], [0]):
                assert stream._held == [] and len(whole.accounted) == 3
            stream.end_step()
            assert whole.accounted == [["a"], ["b"], ["c"], ["d"]]
            assert stream.tokens - tokens == 4 and ended == [1, 2, 3, 4]
            stream.begin_step()
            whole.pending.append("e")
            stream.end_step()  # held again
            stream.flush()  # the decode context's end
            stream.flush()  # nothing held: nothing done
            assert whole.accounted[-1] == ["e"] and stream.tokens - tokens == 5
            assert stream._held == []
            assert whole.landed == [2, 1, 1, 1]  # tokens ended together: one transfer
            # the held tokens' wall times are their forwards', measured at their ends; the
            # leased token's is the session's own clock
            assert [w is None for w in walls] == [False, False, False, True, False]
            assert all(w is None or w >= 0 for w in walls)
            assert stream.last is not None and stream.last.wall_ms == round(walls[-1] or 0, 3)
        finally:
            stream._whole = real
            model.moestream.close()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("nosync")
    out = {}
    for kind in ARCHS:
        _model(kind).save_pretrained(root / kind)
        out[kind] = root / kind
    return out


def _spied(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[int]]:
    """The layers the whole-layer path served, by arithmetic (``grouped``, ``batched``)."""
    served: dict[str, list[int]] = {"grouped": [], "batched": []}
    for name in served:
        method = getattr(_routing.WholeLayers, name)

        def counted(self: Any, layer: int, *args: Any, _name: str = name,
                    _method: Any = method) -> Any:
            served[_name].append(layer)
            return _method(self, layer, *args)

        monkeypatch.setattr(_routing.WholeLayers, name, counted)
    return served


def _held_whole(path: Path, device: str = "cuda", **words: Any) -> Any:
    """The model through moestream with every expert fetched once: held whole."""
    model = mt.from_pretrained(path, device=device, budget=None, **words)
    session = model.moestream.session
    for layer in session.model.moe_layers:
        with session.fetch(layer, list(range(session.model.layers[layer].n_experts))) as lease:
            lease.gather()
    session.end_token()
    if device == "cuda":
        torch.cuda.synchronize()  # every upload done: the next token finds the model whole
    return model


@pytest.mark.gpu
@pytest.mark.skipif(not _CUDA, reason="torch sees no CUDA device")
class TestGpuWholeLayers:
    """Every expert cached on the GPU: the whole-layer path, exact, with no host sync."""

    @pytest.mark.parametrize("graphs", [False, True])
    @pytest.mark.parametrize("kind", list(ARCHS))
    def test_logits_tokens_and_hits(self, checkpoints: dict[str, Path], kind: str,
                                    graphs: bool, monkeypatch: pytest.MonkeyPatch) -> None:
        """The prompt in grouped_mm's arithmetic, the decode steps in batched_mm's (as
        generate switches the resident model on a GPU), launched as they are or replayed
        as CUDA graphs: logits and tokens equal."""
        whole = transformers.AutoModelForCausalLM.from_pretrained(
            checkpoints[kind], experts_implementation="grouped_mm").to("cuda")
        served = _spied(monkeypatch)
        model = _held_whole(checkpoints[kind])
        model.moestream.graphs.on = graphs
        try:
            ids = torch.tensor(PROMPT, device="cuda")
            before = model.moestream.session.counters()
            tokens, whole_tokens = model.moestream.tokens, model.moestream.whole_tokens
            with torch.no_grad():
                assert torch.equal(whole(ids).logits, model(ids).logits)
                args = dict(attention_mask=torch.ones_like(ids), max_new_tokens=8,
                            min_new_tokens=8, do_sample=False)
                assert torch.equal(whole.generate(ids, **args).cpu(),
                                   model.generate(ids, **args).cpu())
            after = model.moestream.session.counters()
            layers = len(model.moestream.session.model.moe_layers)
            assert len(served["grouped"]) >= 2 * layers  # the forward and the prompt's
            assert len(served["batched"]) >= 7 * layers  # the decode steps
            # each layer's first decode step as it is, the next captured, all replayed
            assert model.moestream.graphs.replays >= graphs * 6 * layers
            assert model.moestream.graphs.on == graphs  # no capture failed
            calls = len(served["grouped"]) + len(served["batched"])
            assert after.misses == before.misses and after.hits - before.hits >= calls
            stream = model.moestream  # no token leased
            assert stream.whole_tokens - whole_tokens == stream.tokens - tokens > 0
        finally:
            model.moestream.close()

    def test_decode_tokens_end_together_and_all_are_counted(
            self, checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
        """Under generate's decode context whole-layer tokens are held and end together
        (``defer``: no wait for the device a token); when generate returns every forward
        has ended, once, with every call's hits counted and the tokens the resident's."""
        whole = transformers.AutoModelForCausalLM.from_pretrained(
            checkpoints["qwen3_moe"], experts_implementation="grouped_mm").to("cuda")
        served = _spied(monkeypatch)
        model = _held_whole(checkpoints["qwen3_moe"])
        stream = model.moestream
        held = []
        flush = type(stream).flush

        def seen(self: Any, keep: int = 0) -> None:
            held.append(len(self._held))
            flush(self, keep)

        monkeypatch.setattr(type(stream), "flush", seen)
        forwards = []
        model.register_forward_hook(lambda *_: forwards.append(1))
        try:
            ids = torch.tensor(PROMPT, device="cuda")
            args = dict(attention_mask=torch.ones_like(ids), max_new_tokens=8,
                        min_new_tokens=8, do_sample=False)
            tokens, hits = stream.tokens, stream.session.counters().hits
            with torch.no_grad():
                assert torch.equal(whole.generate(ids, **args).cpu(),
                                   model.generate(ids, **args).cpu())
            assert stream._held == [] and stream.defer is False
            assert stream.tokens - tokens == len(forwards)
            assert sum(held) >= 6  # decode tokens held, ended together or at the exit
            calls = len(served["grouped"]) + len(served["batched"])
            assert stream.session.counters().hits - hits >= calls
        finally:
            model.moestream.close()

    def test_decode_tokens_log_their_own_wall_time(self, checkpoints: dict[str, Path],
                                                   tmp_path: Path) -> None:
        """Tokens ended after they ran (held, their hits told at the end) log their
        forwards' wall time, not the moment of the telling: the decode's token lines add
        up to most of the generate's wall time, each line's parts within its wall time."""
        log = tmp_path / "held.jsonl"
        model = _held_whole(checkpoints["qwen3_moe"], log=log)
        stream = model.moestream
        try:
            ids = torch.tensor(PROMPT, device="cuda")
            with torch.no_grad():
                model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
                first = stream.tokens
                t0 = time.perf_counter()
                model.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False)
                wall_ms = (time.perf_counter() - t0) * 1000.0
            assert stream.whole_tokens > 0
        finally:
            model.moestream.close()
        lines = [json.loads(line) for line in log.read_text().splitlines()]
        tokens = [line for line in lines if line.get("event") == "token"][-24:]
        assert stream.tokens - first == 24  # one a forward: the prompt's and 23 decode steps
        assert sum(t["wall_ms"] for t in tokens) >= 0.5 * wall_ms, (tokens[-1], wall_ms)
        for t in tokens:
            assert t["compute_ms"] + t["stall_ms"] <= t["wall_ms"] + 0.01, t

    def test_experts_call_synchronizes_nothing(self, checkpoints: dict[str, Path],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
        served = _spied(monkeypatch)
        model = _held_whole(checkpoints["qwen3_moe"])
        model.moestream.graphs.on = True
        try:
            experts = _experts(model)
            index, weights = _routing_of(4, experts[0].num_experts, 2, seed=1)
            index, weights = index.cuda(), weights.cuda().to(torch.bfloat16)
            hidden = torch.randn(4, 64, device="cuda", dtype=torch.bfloat16)
            with torch.no_grad():
                for module in experts:  # the first call of a layer makes its table
                    module(hidden, index, weights)
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
                try:
                    outs = [module(hidden, index, weights) for module in experts]
                    model.moestream.batched = True  # a decode step's arithmetic: as it
                    for _ in range(3):  # is, then captured in a graph, then replayed
                        outs += [module(hidden, index, weights) for module in experts]
                finally:
                    torch.cuda.set_sync_debug_mode(0)
            # every call through the whole-layer path, in either arithmetic
            assert len(served["grouped"]) == 2 * len(experts)
            assert len(served["batched"]) == 3 * len(experts)
            graphs = model.moestream.graphs
            assert graphs.on and graphs.replays == 2 * len(experts)
            assert all(o.shape == hidden.shape and torch.isfinite(o).all() for o in outs)
        finally:
            model.moestream.close()

    def test_graphs_captured_in_inference_mode_serve_generate(
            self, checkpoints: dict[str, Path]) -> None:
        """A decode captured under ``torch.inference_mode`` replays for ``generate`` under
        its own ``no_grad``: the same tokens, the graphs still on."""
        model = _held_whole(checkpoints["qwen3_moe"])
        try:
            ids = torch.tensor(PROMPT, device="cuda")
            args = dict(attention_mask=torch.ones_like(ids), max_new_tokens=6,
                        min_new_tokens=6, do_sample=False)
            with torch.inference_mode():
                first = model.generate(ids, **args)
            replays = model.moestream.graphs.replays
            assert torch.equal(model.generate(ids, **args), first)
            graphs = model.moestream.graphs
            assert graphs.on and graphs.replays > replays > 0
        finally:
            model.moestream.close()

    def test_a_forward_synchronizes_as_the_resident_one(self,
                                                        checkpoints: dict[str, Path]) -> None:
        """The decoder's forward (the model's token hooks left out: their end reads the
        logits anyway) synchronizes as often through moestream as resident: the whole-layer
        path adds no synchronization per layer (the lease path adds one a layer)."""
        path = checkpoints["qwen3_moe"]
        whole = transformers.AutoModelForCausalLM.from_pretrained(
            path, experts_implementation="grouped_mm").to("cuda")
        model = _held_whole(path)
        ids = torch.tensor(PROMPT, device="cuda")

        def syncs(decoder: Any) -> int:
            with torch.no_grad():
                decoder(ids)  # warm: the first call of a layer makes its table
                torch.cuda.synchronize()
                with warnings.catch_warnings(record=True) as seen:
                    warnings.simplefilter("always")
                    torch.cuda.set_sync_debug_mode("warn")
                    try:
                        decoder(ids)
                    finally:
                        torch.cuda.set_sync_debug_mode(0)
            return sum("called a synchronizing" in str(w.message) for w in seen)

        try:
            assert syncs(model.model) == syncs(whole.model)
        finally:
            model.moestream.close()

