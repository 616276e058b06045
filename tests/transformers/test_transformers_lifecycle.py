"""A served model's life as docs/TRANSFORMERS.md tells it: a context manager (the model and
``model.moestream``), a warning and a close when collected unclosed, ``save_pretrained``
refused in one line, each ``generate`` call's own figures beside the session's totals."""

from __future__ import annotations

import gc
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.integrations.moe")

from moestream import transformers as mt  # noqa: E402
from moestream.pipeline.foundation.errors import UsageError  # noqa: E402
from tests.transformers.test_transformers_trust import CONFIG, IDS, _save  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

BUDGET = 2 * CONFIG["num_experts_per_tok"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save(tmp_path_factory.mktemp("life") / "qwen3_moe", seed=0)


def _load(checkpoint: Path) -> Any:
    return mt.from_pretrained(checkpoint, budget=BUDGET, device="cpu")


def _generate(model: Any, new: int = 3) -> Any:
    with torch.no_grad():
        return model.generate(torch.tensor(IDS), max_new_tokens=new, do_sample=False)


class TestContextManagers:
    """``with`` closes the session on leaving, normally or by an exception."""

    def test_the_model(self, checkpoint: Path) -> None:
        with _load(checkpoint) as model:
            _generate(model)
            session = model.moestream.session
            assert not session.closed
        assert session.closed

    def test_the_model_on_an_error(self, checkpoint: Path) -> None:
        with pytest.raises(KeyError), _load(checkpoint) as model:
            raise KeyError("the caller's own")
        assert model.moestream.session.closed

    def test_model_moestream(self, checkpoint: Path) -> None:
        model = _load(checkpoint)
        with model.moestream as experts_stream:
            _generate(model)
        assert experts_stream.session.closed

    def test_still_the_models_class(self, checkpoint: Path) -> None:
        with _load(checkpoint) as model:
            assert isinstance(model, transformers.Qwen3MoeForCausalLM)
            assert type(model).__name__ == "Qwen3MoeForCausalLM"
            assert model.can_generate()


class TestCollectedUnclosed:
    """A model dropped unclosed warns as an unclosed file does, and its session closes."""

    def test_warns_and_closes(self, checkpoint: Path) -> None:
        model = _load(checkpoint)
        session = model.moestream.session
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            del model
            gc.collect()
        said = [w for w in seen if issubclass(w.category, ResourceWarning)]
        assert len(said) == 1 and "unclosed moestream session" in str(said[0].message)
        assert session.closed

    def test_closed_is_quiet(self, checkpoint: Path) -> None:
        model = _load(checkpoint)
        model.moestream.close()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            del model
            gc.collect()
        assert not [w for w in seen if issubclass(w.category, ResourceWarning)]


    def test_exit_with_the_model_open(self, checkpoint: Path) -> None:
        """A program that ends with its model open exits (nothing waits on the session's
        thread, which no longer runs then)."""
        program = ("import sys, torch; from moestream import transformers as mt; "
                   f"m = mt.from_pretrained({str(checkpoint)!r}, budget={BUDGET}, "
                   "device='cpu'); m.generate(torch.tensor([[3, 17]]), max_new_tokens=1); "
                   "print('done')")
        done = subprocess.run([sys.executable, "-c", program], capture_output=True,
                              text=True, timeout=300, check=False)
        assert (done.returncode, done.stdout) == (0, "done\n"), done.stderr[-2000:]


class TestSaving:
    """``save_pretrained`` (and ``push_to_hub``, which calls it) is refused in one line
    that says why, and writes nothing."""

    @pytest.mark.parametrize("method", ["save_pretrained", "push_to_hub"])
    def test_refused(self, checkpoint: Path, tmp_path: Path, method: str) -> None:
        with _load(checkpoint) as model, pytest.raises(UsageError) as caught:
            getattr(model, method)(str(tmp_path / "saved"))
        text = str(caught.value)
        assert "\n" not in text and str(checkpoint) in text and "never loads" in text
        assert not (tmp_path / "saved").exists()


class TestMoving:
    """``to``/``cpu``/``cuda``: a dtype, or the device it computes on, as transformers does;
    another device refused in one line (the experts stream to this one)."""

    def test_its_own_device_and_a_dtype(self, checkpoint: Path) -> None:
        with _load(checkpoint) as model:
            assert model.to("cpu") is model and model.cpu() is model
            assert model.to(torch.device("cpu"), torch.float32) is model
            assert model.dtype == torch.float32
            assert _generate(model).shape[1] == len(IDS[0]) + 3

    @pytest.mark.parametrize("move", [lambda m: m.to("cuda:0"), lambda m: m.cuda(),
                                      lambda m: m.to("meta"), lambda m: m.to(device="cuda")])
    def test_another_device(self, checkpoint: Path, move: Any) -> None:
        with _load(checkpoint) as model:
            with pytest.raises(UsageError) as caught:
                move(model)
            assert "\n" not in str(caught.value) and "computes on cpu" in str(caught.value)
            assert _generate(model).shape[1] == len(IDS[0]) + 3  # still whole


class TestPerGenerate:
    """``model.moestream.last_generate``: one call's hits, misses, bytes and stall time;
    the calls add up to the session's totals."""

    def test_before_any_call(self, checkpoint: Path) -> None:
        with _load(checkpoint) as model:
            assert model.moestream.last_generate is None

    def test_calls_add_up_to_the_totals(self, checkpoint: Path) -> None:
        with _load(checkpoint) as model:
            first = _generate(model, 3)
            one = model.moestream.last_generate
            _generate(model, 5)
            two = model.moestream.last_generate
            totals = model.moestream.session.counters()
        assert first.shape[1] == len(IDS[0]) + 3
        assert (one.tokens, two.tokens) == (3, 5)  # the prefill, then a forward a new token
        assert one.hits + one.misses > 0 and one.misses > 0 and one.file_bytes > 0
        for name in ("tokens", "hits", "misses", "evictions", "file_bytes", "cache_bytes"):
            assert getattr(one, name) + getattr(two, name) == getattr(totals, name), name
        assert one.stall_ms + two.stall_ms == pytest.approx(totals.stall_ms)
        assert 0 <= one.stall_ms <= one.wall_ms
        assert 0.0 <= two.hit_rate <= 1.0

    def test_a_call_that_fails_still_counts(self, checkpoint: Path) -> None:
        with _load(checkpoint) as model:
            with pytest.raises((ValueError, TypeError)):
                model.generate(torch.tensor(IDS), max_new_tokens=-1)
            assert model.moestream.last_generate is not None
            assert model.moestream.last_generate.tokens == 0


_DOC = Path(__file__).resolve().parents[2] / "docs" / "TRANSFORMERS.md"


class TestDocs:
    """docs/TRANSFORMERS.md: its quick start runs as written on a CPU, and it lists every
    argument ``from_pretrained`` takes."""

    def test_quick_start_runs(self, checkpoint: Path,
                              capsys: pytest.CaptureFixture[str]) -> None:
        text = _DOC.read_text(encoding="utf-8")
        program = text.split("```python\n", 1)[1].split("```", 1)[0]
        assert '"cuda"' not in program  # it runs wherever it is (the CPU here, a GPU there)
        exec(program.replace("path/to/checkpoint", str(checkpoint)), {})
        out = capsys.readouterr().out
        assert "GenerateStats(" in out and "Counters(" in out

    def test_every_argument_listed(self, checkpoint: Path) -> None:
        import inspect

        text = _DOC.read_text(encoding="utf-8")
        named = [p for p in inspect.signature(mt.from_pretrained).parameters
                 if p != "words"]
        with pytest.raises(TypeError) as caught:
            mt.from_pretrained(checkpoint, not_a_word=1)
        taken = str(caught.value).split("it takes ", 1)[1].split(", ")
        assert set(named) <= set(taken)
        missing = [name for name in taken if f"`{name}`" not in text]
        assert missing == []
