"""moestream.transformers' ``prefetch="predict"``: each MoE layer hints the experts the next
layer's router picks for its input.

Tiny random-init checkpoints (transformers' own ``save_pretrained``) on the host backend at
a budget that evicts: the hints change what is resident, never the arithmetic (logits and
greedy tokens identical to a run without them), and the log's token lines count the
guesses, the right ones and the wasted bytes as the proxy engine's ``--prefetch predict``
does.
"""

from __future__ import annotations

import json
import threading
import traceback
import warnings
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.integrations.moe")

from moestream import UsageError  # noqa: E402
from moestream import transformers as mt  # noqa: E402

ATTENTION = dict(num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
                 max_position_embeddings=128)
ARCHS: dict[str, dict[str, Any]] = {
    # softmax routing: the guess is the top-k of the next router's logits
    "qwen3_moe": dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                      num_experts=16, num_experts_per_tok=2, num_hidden_layers=4, head_dim=16,
                      **ATTENTION),
    # sigmoid scores plus the correction bias, a dense first layer (no router before it)
    "deepseek_v3": dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                        n_routed_experts=16, num_experts_per_tok=2, n_shared_experts=1,
                        first_k_dense_replace=1, n_group=1, topk_group=1,
                        num_hidden_layers=4, q_lora_rank=None, kv_lora_rank=16,
                        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                        **{**ATTENTION, "num_key_value_heads": 4}),
    # an affine router named router (its bias counts), sliding and full attention
    "gpt_oss": dict(hidden_size=64, intermediate_size=32, num_local_experts=16,
                    num_experts_per_tok=2, num_hidden_layers=4, head_dim=16,
                    layer_types=["sliding_attention", "full_attention"] * 2, **ATTENTION),
}
PROMPT = [[3, 17, 42, 5, 9, 11]]
BUDGET = "8"  # experts: a decode step's two layers in flight fit, the model's 48 do not
TOKENS = 8


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("prefetch")
    made = {}
    for kind, words in ARCHS.items():
        config = transformers.AutoConfig.for_model(kind, **words)
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        with torch.no_grad():  # routers' biases start at zero: make them count
            for name, tensor in [*model.named_buffers(), *model.named_parameters()]:
                if name.endswith(("e_score_correction_bias", "router.bias")):
                    tensor.normal_(0.0, 0.05)
        model.save_pretrained(root / kind)
        made[kind] = root / kind
    return made


def _run(path: Path, log: Path, prefetch: str, device: str = "cpu") -> tuple[Any, Any, Any]:
    """The first forward's logits, the greedy tokens, and the model's session counters."""
    model = mt.from_pretrained(path, device=device, budget=BUDGET, log=log, prefetch=prefetch)
    try:
        ids = torch.tensor(PROMPT, device=device)
        with torch.no_grad():
            logits = model(ids).logits
        tokens = model.generate(ids, attention_mask=torch.ones_like(ids),
                                max_new_tokens=TOKENS, min_new_tokens=TOKENS, do_sample=False)
        return logits, tokens, model.moestream.session.counters()
    finally:
        model.moestream.close()


def _token_lines(log: Path) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    return [line for line in lines if line["event"] == "token"]


@pytest.mark.parametrize("kind", list(ARCHS))
def test_same_tokens_and_counted_guesses(checkpoints: dict[str, Path], tmp_path: Path,
                                         kind: str) -> None:
    """Logits torch.equal and tokens identical with and without the hints; with them the
    token lines count guesses (right ones at most all of them, wasted bytes at most the
    loaded guesses' bytes) and the session loaded experts for them; without, nothing."""
    plain_logits, plain_tokens, plain = _run(checkpoints[kind], tmp_path / "none.jsonl", "none")
    logits, tokens, counters = _run(checkpoints[kind], tmp_path / "predict.jsonl", "predict")
    assert torch.equal(plain_logits, logits)
    assert torch.equal(plain_tokens, tokens)

    assert plain.prefetched == 0
    assert not any("prefetch" in line for line in _token_lines(tmp_path / "none.jsonl"))
    # per token: the guesses made in it, the right ones, those loaded, the bytes of loaded
    # guesses the next layer did not pick (the prompt's forwards, too many experts for one
    # group, hint nothing)
    counted = [line["prefetch"] for line in _token_lines(tmp_path / "predict.jsonl")
               if "prefetch" in line]
    largest = max(layer.expert_bytes for layer in _info(checkpoints[kind]).layers.values()
                  if layer.n_experts)
    assert counted and sum(c["predicted"] for c in counted) > 0
    for c in counted:
        assert 0 <= c["correct"] <= c["predicted"]
        assert 0 <= c["loaded"] <= c["predicted"]
        assert 0 <= c["wasted_bytes"] <= c["loaded"] * largest
    assert sum(c["loaded"] for c in counted) == counters.prefetched > 0


def _info(path: Path) -> Any:
    import moestream

    with moestream.open_sync(path, backend="host") as session:
        return session.model


@pytest.mark.parametrize("kind", list(ARCHS))
def test_guess_is_the_next_router_choice(checkpoints: dict[str, Path], kind: str) -> None:
    """Given the hidden state the next layer's router sees, the guess is that router's
    own top-k (the guess differs from the next layer's choice only by its input)."""
    model = mt.from_pretrained(checkpoints[kind], device="cpu", prefetch="predict")
    try:
        routers = model.moestream.next_routers
        moe = model.moestream.session.model.moe_layers
        assert sorted(routers) == list(moe[:-1])
        assert [routers[layer].layer for layer in sorted(routers)] == list(moe[1:])
        torch.manual_seed(1)
        hidden = torch.randn(5, 64, dtype=torch.bfloat16)
        for layer in routers:
            block = model.model.layers[routers[layer].layer].mlp
            router = getattr(block, "gate", None) or block.router  # the block's own
            assert routers[layer].router is router
            with torch.no_grad():
                got = routers[layer].guess(hidden, 2).sort(dim=-1).values
                own = router(hidden)[2]  # (logits, weights, indices) as the block takes them
            assert torch.equal(got, own.sort(dim=-1).values)
    finally:
        model.moestream.close()


def test_unknown_prefetch_refused(checkpoints: dict[str, Path]) -> None:
    """An unknown value is refused in one line naming the known ones, before a session
    opens."""
    with pytest.raises(UsageError) as refused:
        mt.from_pretrained(checkpoints["qwen3_moe"], device="cpu", prefetch="oracle")
    message = str(refused.value)
    assert "\n" not in message
    assert "none, predict" in message and "'oracle'" in message


def _syncs(path: Path, prefetch: str) -> list[str]:
    """The host synchronizations torch sees in one decode-sized forward (one token: one
    group, so the hint is made), after a first forward of the same: where each was made
    (the stack's moestream and model frames, innermost first; where it has none, the
    thread's name and its innermost frames), so that a count that differs says from where."""
    model = mt.from_pretrained(path, device="cuda", budget=BUDGET, prefetch=prefetch)
    seen: list[str] = []

    def show(message: Any, *args: Any, **kwargs: Any) -> None:
        # torch's sync warning, not the once-a-process one that the debug mode is a prototype
        if "called a synchronizing" in str(message):
            stack = traceback.extract_stack()[:-1]
            ours = [f for f in stack if "moestream" in f.filename or "/models/" in f.filename]
            where = " <- ".join(f"{Path(f.filename).name}:{f.lineno}:{f.name}"
                                for f in reversed((ours or stack)[-4:]))
            seen.append(where if ours else f"[{threading.current_thread().name}] {where}")

    try:
        ids = torch.tensor([[3]], device="cuda")
        with torch.no_grad():
            model(ids)
            torch.cuda.synchronize()
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = show
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    model(ids)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
        return seen
    finally:
        model.moestream.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")
@pytest.mark.parametrize("kind", list(ARCHS))
def test_gpu_same_tokens_no_extra_sync(checkpoints: dict[str, Path], tmp_path: Path,
                                       kind: str) -> None:
    """On a GPU at a budget that evicts: tokens and logits identical with and without the
    hints, guesses loaded, and no host synchronization beyond the call's own read of its
    expert ids (the guess is read in the same copy)."""
    plain_logits, plain_tokens, _ = _run(checkpoints[kind], tmp_path / "n.jsonl", "none", "cuda")
    logits, tokens, counters = _run(checkpoints[kind], tmp_path / "p.jsonl", "predict", "cuda")
    assert torch.equal(plain_logits, logits)
    assert torch.equal(plain_tokens, tokens)
    assert counters.prefetched > 0
    hinted, plain = _syncs(checkpoints[kind], "predict"), _syncs(checkpoints[kind], "none")
    assert len(hinted) == len(plain) > 0, (hinted, plain)


class _Lease:
    remaining = 0

    def __init__(self, order: list[str]) -> None:
        self.order = order

    def release(self, after: object = None) -> None:
        self.order.append("release")


class _Session:
    def __init__(self, order: list[str]) -> None:
        self.order = order

    def fetch(self, layer: int, experts: object) -> _Lease:
        self.order.append("fetch")
        return _Lease(self.order)


@pytest.mark.parametrize("device, expected", [
    ("cpu", ["fetch", "hint", "compute", "release"]),
    ("cuda", ["fetch", "compute", "hint", "release"]),
])
def test_hint_runs_while_pinned_and_after_the_compute_is_queued_on_a_gpu(
        device: str, expected: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The next layer's hint: on the host before the layer computes (reads run meanwhile);
    on a GPU after its compute is queued (the device starts it while the host queues the
    hint's copies); always before the lease's release, and not when the block fails."""
    from moestream.transformers import _leases

    monkeypatch.setattr(_leases, "current_stream", lambda device: "stream")
    order: list[str] = []
    session: Any = _Session(order)
    with _leases.leased(session, torch.device(device), 0, [1],
                        lambda: order.append("hint")) as batches:
        assert list(batches) == []
        order.append("compute")
    assert order == expected
    order.clear()
    with pytest.raises(RuntimeError), _leases.leased(session, torch.device(device), 0, [1],
                                                      lambda: order.append("hint")):
        raise RuntimeError("the compute failed")
    assert order[-1] == "release" and ("hint" in order) == (device == "cpu")
