"""transformers' own loading words, passed to ``moestream.transformers.from_pretrained``:
taken where they mean something here, refused in one line naming what to use instead,
never a bare ``TypeError``."""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.integrations.moe")

import moestream  # noqa: E402
from moestream import transformers as mt  # noqa: E402
from moestream.pipeline.foundation.errors import UsageError, UsageTypeError  # noqa: E402
from tests.transformers.test_transformers_trust import CONFIG, IDS, _save  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

DEFAULT_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3-MoE in bfloat16, written by transformers' ``save_pretrained``."""
    return _save(tmp_path_factory.mktemp("args") / "qwen3_moe", seed=0)


@pytest.fixture
def never_opened(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Fail the test if a session is opened: a refusal comes before anything opens."""
    def opened(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a session was opened before the refusal")

    monkeypatch.setattr(moestream, "open_sync", opened)
    yield


def _load(path: Path, **kwargs: Any) -> Any:
    kwargs.setdefault("budget", "4")
    return mt.from_pretrained(path, **kwargs)


def _refused(path: Path, error: type[Exception], *words: str, **kwargs: Any) -> str:
    with pytest.raises(error) as caught:
        _load(path, **kwargs)
    text = str(caught.value)
    assert "\n" not in text
    for word in words:
        assert word in text
    return text


class TestTaken:
    """Words with a meaning here change what they say they change, and nothing else."""

    @pytest.mark.parametrize("value", [torch.float32, "float32"])
    def test_torch_dtype_is_dtype_without_a_warning(self, checkpoint: Path,
                                                    value: Any) -> None:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            model = _load(checkpoint, torch_dtype=value, device="cpu")
        try:
            assert model.dtype == torch.float32
            assert not [w for w in seen if "torch_dtype" in str(w.message)]
        finally:
            model.moestream.close()

    def test_torch_dtype_and_the_same_dtype(self, checkpoint: Path) -> None:
        model = _load(checkpoint, torch_dtype="bfloat16", dtype=torch.bfloat16, device="cpu")
        try:
            assert model.dtype == torch.bfloat16
        finally:
            model.moestream.close()

    @pytest.mark.parametrize("attention", ["eager", "sdpa"])
    def test_attn_implementation_reaches_the_model(self, checkpoint: Path,
                                                   attention: str) -> None:
        model = _load(checkpoint, attn_implementation=attention, device="cpu")
        try:
            assert model.config._attn_implementation == attention
            with torch.no_grad():
                assert model(torch.tensor(IDS)).logits.shape == (1, 4, CONFIG["vocab_size"])
        finally:
            model.moestream.close()

    @pytest.mark.parametrize("device_map", ["cpu", torch.device("cpu"), {"": "cpu"},
                                            {"": torch.device("cpu")}])
    def test_device_map_naming_one_device(self, checkpoint: Path, device_map: Any) -> None:
        model = _load(checkpoint, device_map=device_map)
        try:
            assert model.device.type == "cpu"
        finally:
            model.moestream.close()

    def test_device_map_auto_is_the_default_device(self, checkpoint: Path) -> None:
        model = _load(checkpoint, device_map="auto", low_cpu_mem_usage=True,
                      trust_remote_code=False)
        try:
            assert model.device.type == DEFAULT_DEVICE
        finally:
            model.moestream.close()


class TestRefused:
    """Words moestream replaces: one ``UsageError`` line naming the replacement, before any
    session opens."""

    @pytest.mark.parametrize("device_map", [{"model.embed_tokens": "cpu", "lm_head": "cpu"},
                                            "balanced", "sequential"])
    def test_device_map_that_splits(self, checkpoint: Path, never_opened: None,
                                    device_map: Any) -> None:
        _refused(checkpoint, UsageError, "does not split", "budget=", device_map=device_map)

    def test_device_and_another_device_map(self, checkpoint: Path, never_opened: None) -> None:
        _refused(checkpoint, UsageError, "give one", device="cpu", device_map="cuda:0")

    def test_trust_remote_code(self, checkpoint: Path, never_opened: None) -> None:
        _refused(checkpoint, UsageError, "never runs", trust_remote_code=True)

    def test_dtype_and_another_torch_dtype(self, checkpoint: Path, never_opened: None) -> None:
        _refused(checkpoint, UsageError, "give dtype alone", dtype="float16",
                 torch_dtype=torch.float32)

    @pytest.mark.parametrize("attention", ["bogus", "kernels-community/flash-attn"])
    def test_unknown_attention(self, checkpoint: Path, never_opened: None,
                               attention: str) -> None:
        _refused(checkpoint, UsageError, "attn_implementation", "sdpa",
                 attn_implementation=attention)

    def test_attention_not_a_name(self, checkpoint: Path, never_opened: None) -> None:
        _refused(checkpoint, UsageTypeError, "attn_implementation",
                 attn_implementation={"text_config": "sdpa"})

    @pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None,
                        reason="flash-attn is installed here")
    def test_attention_not_installed(self, checkpoint: Path) -> None:
        _refused(checkpoint, UsageError, "attn_implementation 'flash_attention_2'",
                 attn_implementation="flash_attention_2", device="cpu")


class TestUnknownWords:
    """Any other keyword: a ``UsageError`` (also a ``TypeError``) naming it and listing
    what ``from_pretrained`` takes."""

    def test_named_with_the_arguments(self, checkpoint: Path, never_opened: None) -> None:
        text = _refused(checkpoint, UsageTypeError, "unexpected argument subfolder",
                        "budget", "torch_dtype", "device_map", "max_memory", "revision",
                        subfolder="text")
        assert "arguments" not in text.split(";")[0]

    def test_several(self, checkpoint: Path, never_opened: None) -> None:
        with pytest.raises(TypeError, match="unexpected arguments force_download, token"):
            _load(checkpoint, token="x", force_download=True)
