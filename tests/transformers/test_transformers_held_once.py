"""What the transformers experts path works out once and keeps, and when it works it out again.

``WholeLayers`` (the CUDA path of a model held whole) asks the session whether every
expert is cached: never past a budget below every expert, and while the cache fills it
asks the layer that was not ready last time first; a layer's table is made once and
carries the shapes its calls need. ``NextRouter``'s float32 copy of a DeepSeek-style
router's weight is made once and made again when the weight is replaced, cast, moved or
written in place. All on the host, with a stand-in session where only the questions asked
matter.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers.integrations.moe")

from moestream.transformers import _routing  # noqa: E402
from moestream.transformers._prefetch import NextRouter  # noqa: E402
from moestream.transformers._table import LayerTable  # noqa: E402

EXPERT_BYTES = 100


class _Session:
    """What ``WholeLayers`` asks of a session: its devices, model, budget and readiness;
    each ``ready`` question recorded."""

    def __init__(self, layers: list[int], budget_bytes: int, devices: tuple[int, ...] = (0,),
                 config: dict[str, int] | None = None) -> None:
        self.devices = devices
        self.model = SimpleNamespace(
            moe_layers=layers, config=config or {},
            layers={layer: SimpleNamespace(n_experts=4, expert_bytes=EXPERT_BYTES)
                    for layer in layers})
        self.budget_bytes = budget_bytes
        self.not_ready: set[int] = set()
        self.lacking: set[int] = set()  # the experts of a layer in ``not_ready`` not cached
        self.cached = True  # what ``used`` answers: every expert told was cached
        self.asked: list[int] = []

    def counters(self) -> Any:
        self.counted = getattr(self, "counted", 0) + 1
        return SimpleNamespace(budget_bytes=self.budget_bytes, mode="resident")

    def prefetch(self, layer: int, experts: list[int]) -> int:
        self.hinted = [*getattr(self, "hinted", []), (layer, experts)]
        return len(experts)

    def used(self, uses: list[tuple[int, list[int]]], after: Any = None) -> bool:
        self.told = [*getattr(self, "told", []), uses]
        return self.cached

    def ready(self, layer: int, experts: range | list[int]) -> bool:
        if len(experts) == 1:  # one expert, while the fill looks for the lacking ones
            self.asked_experts = [*getattr(self, "asked_experts", []), experts[0]]
            return layer not in self.not_ready or experts[0] not in self.lacking
        assert list(experts) == [0, 1, 2, 3]
        self.asked.append(layer)
        return layer not in self.not_ready


def _whole(session: _Session) -> Any:
    return _routing.WholeLayers(session, "cpu")


def _call() -> tuple[Any, Any, Any]:
    """An experts module of 4 experts (gate_up 16 x 16, down 16 x 8, bf16), one token's
    hidden state and its routing to experts 0 and 2."""
    module = SimpleNamespace(num_experts=4, has_gate=True,
                             gate_up_proj=torch.zeros(4, 16, 16, dtype=torch.bfloat16),
                             down_proj=torch.zeros(4, 16, 8, dtype=torch.bfloat16))
    return module, torch.zeros(1, 16, dtype=torch.bfloat16), torch.tensor([[0, 2]])


class TestHoldsEveryExpert:
    """The session is asked as little as gives the same answer."""

    def test_a_budget_below_every_expert_asks_no_layer(self) -> None:
        session = _Session([1, 2, 3], budget_bytes=3 * 4 * EXPERT_BYTES - 1)
        assert not _whole(session)._holds_every_expert()
        assert session.asked == []

    def test_a_budget_below_every_expert_is_asked_once_a_session(self) -> None:
        """A budget only shrinks (a device's out of memory): once below every expert, the
        tokens after ask nothing (the host path's every token ends in ``account``)."""
        session = _Session([1, 2, 3], budget_bytes=3 * 4 * EXPERT_BYTES - 1)
        whole = _whole(session)
        for _ in range(3):
            assert whole.holding() == 0
            whole.settle(whole.take())
        assert session.counted == 1 and session.asked == []

    def test_several_devices_ask_nothing(self) -> None:
        session = _Session([1, 2, 3], budget_bytes=1 << 30, devices=(0, 1))
        assert not _whole(session)._holds_every_expert()
        assert session.asked == []

    def test_the_layer_not_ready_last_time_is_asked_first(self) -> None:
        session = _Session([1, 2, 3, 4], budget_bytes=1 << 30)
        whole = _whole(session)
        session.not_ready = {3}
        assert not whole._holds_every_expert()
        assert session.asked == [1, 2, 3]
        session.asked.clear()
        assert not whole._holds_every_expert()  # still filling: one question
        assert session.asked == [3]
        session.asked.clear()
        session.not_ready = {1}  # 3 landed, 1 was evicted meanwhile
        assert not whole._holds_every_expert()
        assert session.asked == [3, 4, 1]
        session.asked.clear()
        session.not_ready = set()
        assert whole._holds_every_expert()  # every layer asked before a yes
        assert sorted(session.asked) == [1, 2, 3, 4]


    def test_a_multi_token_prediction_layer_is_not_waited_for(self) -> None:
        """A checkpoint's MTP layer (DeepSeek-V3's ``num_nextn_predict_layers``) is never
        fetched, since the model has none: the model is held whole once its own layers
        are, within a budget for its own layers' experts, and the fill hints none of the
        MTP layer's experts."""
        session = _Session([1, 2, 3], budget_bytes=2 * 4 * EXPERT_BYTES,
                           config={"num_hidden_layers": 3, "num_nextn_predict_layers": 1})
        session.not_ready, session.lacking = {3}, {0, 1, 2, 3}
        whole = _routing.WholeLayers(session, "cpu", fill=2)
        assert whole.holding() == 1
        assert 3 not in session.asked and not hasattr(session, "hinted")


class TestAccount:
    """A token's routing is told to the session once, each layer's experts once and in
    order; a session that found one of them no longer cached ends the held period."""

    def test_each_layer_told_once_and_the_period_kept(self) -> None:
        session = _Session([0, 1], budget_bytes=1 << 30)
        whole = _whole(session)
        assert whole.holding() == 1
        whole.remember(0, torch.tensor([[3, 1], [1, 0]]))
        whole.remember(1, torch.tensor([[2, 2]]))
        whole.settle(whole.take())
        assert session.told == [[(0, [0, 1, 3]), (1, [2])]]
        assert whole.holding() == 1 and session.counted == 1  # no question a token

    def test_an_expert_not_cached_ends_the_period(self) -> None:
        session = _Session([0], budget_bytes=1 << 30)
        whole = _whole(session)
        assert whole.holding() == 1
        session.cached = False  # an expert the tables name was evicted
        whole.remember(0, torch.tensor([[1, 2]]))
        whole.settle(whole.take())
        assert whole.holding() == 2  # asked again: a new period, views of the last untrusted


class TestFill:
    """While a budget that holds every expert fills, each token hints up to ``fill`` of
    the layer's lacking experts, asking about no expert it has seen cached."""

    def test_each_token_asks_only_what_it_has_not_seen_cached(self) -> None:
        session = _Session([0], budget_bytes=1 << 30)
        session.not_ready, session.lacking = {0}, {1, 2, 3}
        whole = _routing.WholeLayers(session, "cpu", fill=2)
        assert not whole._holds_every_expert()
        assert session.hinted == [(0, [1, 2])] and session.asked_experts == [0, 1, 2, 3]
        session.lacking = {2, 3}  # 1 landed
        session.asked_experts = []
        assert not whole._holds_every_expert()
        assert session.hinted[-1] == (0, [2, 3]) and session.asked_experts == [1, 2, 3]
        whole.forget()  # an expert seen cached may have been evicted since: asked again
        session.asked_experts = []
        whole._holds_every_expert()
        assert session.asked_experts[0] == 0


class TestTables:
    """A layer's table is made once a dtype; its calls take their shapes from it."""

    def test_made_once_with_its_shapes(self, monkeypatch: pytest.MonkeyPatch) -> None:
        session = _Session([0], budget_bytes=1 << 30)
        whole = _whole(session)
        made: list[int] = []
        served: list[tuple[Any, Any]] = []

        def make(self: Any, layer: int, n: int, dtype: Any) -> Any:
            made.append(layer)
            # 4 experts, gate and up (8, 16) and down (16, 8) in bfloat16
            return LayerTable(torch.zeros(n, 3, dtype=torch.int64), (256, 256, 256))

        def grouped(self: Any, layer: int, table: Any, module: Any, hidden: Any,
                    index: Any, weights: Any) -> Any:
            served.append((table.first_shape, table.down_shape))
            return hidden

        monkeypatch.setattr(_routing.WholeLayers, "_make", make)
        monkeypatch.setattr(_routing.WholeLayers, "grouped", grouped)
        module, hidden, index = _call()
        for _ in range(3):
            assert whole.forward(0, module, hidden, index, index.float()) is hidden
        assert made == [0]
        assert served == [((16, 16), (16, 8))] * 3
        assert session.asked == [0]  # asked once, for the table

    def test_a_layout_the_copies_do_not_serve_is_refused_once(
            self, monkeypatch: pytest.MonkeyPatch) -> None:
        session = _Session([0], budget_bytes=1 << 30)
        whole = _whole(session)
        made: list[int] = []

        def make(self: Any, layer: int, n: int, dtype: Any) -> Any:
            made.append(layer)
            return LayerTable(torch.zeros(n, 3, dtype=torch.int64), (10, 10, 10))

        monkeypatch.setattr(_routing.WholeLayers, "_make", make)
        module, hidden, index = _call()
        for _ in range(2):
            assert whole.forward(0, module, hidden, index, index.float()) is None
        assert made == [0]

    def test_grid_from_the_largest_matrix(self) -> None:
        table = LayerTable(torch.zeros(2, 3, dtype=torch.int64), (4096, 4096, 8192))
        assert table.experts == 2
        assert table.blocks == 2  # 8192 bytes in 16-byte words over 256 threads
        big = LayerTable(torch.zeros(2, 3, dtype=torch.int64), (1 << 30, 1, 1))
        assert big.blocks == 128


class _Router(torch.nn.Module):
    """A DeepSeek-V3-style router: a bias-free linear map scored as sigmoid plus a
    correction bias."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.weight = torch.nn.Parameter(torch.randn(8, 16, generator=g, dtype=torch.bfloat16))
        self.register_buffer("e_score_correction_bias", torch.zeros(8))


def _expected(router: Any, hidden: Any, top_k: int) -> Any:
    scores = torch.nn.functional.linear(hidden.float(), router.weight.float()).sigmoid()
    return torch.topk(scores + router.e_score_correction_bias, top_k, dim=-1).indices


class TestRouterCast:
    """The float32 weight is held while the weight is unchanged, made again when not."""

    def test_held_while_unchanged(self) -> None:
        router = _Router()
        following = NextRouter(3, router)
        hidden = torch.randn(5, 16, dtype=torch.bfloat16)
        with torch.no_grad():
            first = following._float32.of(router.weight)
            assert torch.equal(following.guess(hidden, 2), _expected(router, hidden, 2))
            assert following._float32.of(router.weight) is first
            assert first.dtype == torch.float32

    @pytest.mark.parametrize("change", ["written", "replaced", "cast"])
    def test_made_again_when_changed(self, change: str) -> None:
        router = _Router()
        following = NextRouter(3, router)
        hidden = torch.randn(5, 16, dtype=torch.bfloat16)
        with torch.no_grad():
            before = following._float32.of(router.weight)
            following.guess(hidden, 2)
            if change == "written":  # a load into the same parameter
                router.weight.copy_(torch.flip(router.weight, dims=[0]))
            elif change == "replaced":  # the loader puts another parameter
                router.weight = torch.nn.Parameter(-router.weight.detach())
            else:  # the model cast: the same parameter object, other storage and dtype
                router.to(torch.float16)
            assert following._float32.of(router.weight) is not before
            assert torch.equal(following.guess(hidden, 2), _expected(router, hidden, 2))

    def test_inference_tensors_cast_each_call(self) -> None:
        """A weight made under ``inference_mode`` keeps no version counter, so an in-place
        write could not be seen: it is cast each call, never held."""
        following = NextRouter(3, _Router())
        with torch.inference_mode():
            weight = torch.randn(8, 16, dtype=torch.bfloat16)
            first = following._float32.of(weight)
            weight.mul_(2)
            second = following._float32.of(weight)
        assert second is not first and torch.equal(second, weight.float())
