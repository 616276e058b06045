"""``moestream.transformers.tokenizer``: a checkpoint's tokenizer from its files read once
into a private directory, the same as transformers' own from the checkpoint, whether asked of
the directory before the load or of the model after it; none is one line."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.integrations.moe")
tokenizers = pytest.importorskip("tokenizers")

from moestream import transformers as mt  # noqa: E402
from moestream.pipeline.foundation.errors import UsageError  # noqa: E402
from moestream.pipeline.makers.checkpointgen import write_checkpoint  # noqa: E402
from moestream.pipeline.makers.modelspec import spec_for  # noqa: E402

WORDS = ["[UNK]", "hello", "world", "moe"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny checkpoint with a word-level tokenizer saved by transformers beside it."""
    path = write_checkpoint(spec_for("tiny", 2, 8, 0),
                            tmp_path_factory.mktemp("tok") / "ckpt").path
    model = tokenizers.models.WordLevel({w: i for i, w in enumerate(WORDS)},
                                        unk_token="[UNK]")
    made = tokenizers.Tokenizer(model)
    made.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=made, unk_token="[UNK]")
    fast.save_pretrained(path)
    return path


def test_the_directory_and_the_model_give_transformers_tokenizer(checkpoint: Path) -> None:
    theirs = transformers.AutoTokenizer.from_pretrained(checkpoint)("hello moe world")
    assert theirs["input_ids"] == [1, 3, 2]
    assert mt.tokenizer(checkpoint)("hello moe world")["input_ids"] == theirs["input_ids"]
    with mt.from_pretrained(checkpoint, device="cpu") as model:
        ours = mt.tokenizer(model)
        assert ours("hello moe world")["input_ids"] == theirs["input_ids"]
        assert mt.held_scale_bytes(model) == 0  # no quantized experts: no scales held


def test_a_checkpoint_without_one(tmp_path: Path) -> None:
    path = write_checkpoint(spec_for("tiny", 2, 8, 0), tmp_path / "plain").path
    with pytest.raises(UsageError, match="no tokenizer"):
        mt.tokenizer(path)


def test_not_a_moestream_model() -> None:
    with pytest.raises(UsageError, match="not served by moestream"):
        mt.tokenizer(object())
