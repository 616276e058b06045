"""``moestream.transformers.tokenizer``: a checkpoint's tokenizer from its files read once
into a private directory, the same as transformers' own from the checkpoint, whether asked of
the directory before the load or of the model after it; none is one line. And
``pipeline.run --engine transformers --chat``: the prompt in the tokenizer's chat template,
the reply stopped at the model's end of turn, as transformers' own."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.integrations.moe")
tokenizers = pytest.importorskip("tokenizers")

from moestream import transformers as mt  # noqa: E402
from moestream.pipeline import run as pipeline_run  # noqa: E402
from moestream.pipeline.foundation.errors import UsageError  # noqa: E402
from moestream.pipeline.makers.checkpointgen import write_checkpoint  # noqa: E402
from moestream.pipeline.makers.modelspec import spec_for  # noqa: E402

WORDS = ["[UNK]", "hello", "world", "moe", "user", ":", "assistant"]
TEMPLATE = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}assistant :{% endif %}")
"""A chat template of the words above: ``user : hello moe assistant :``."""
NEW = 4


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


@pytest.fixture(scope="module")
def chat(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``checkpoint`` again, its tokenizer given a chat template."""
    path = tmp_path_factory.mktemp("chat") / "ckpt"
    shutil.copytree(checkpoint, path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(path)
    return path


def _cli(capsys: pytest.CaptureFixture[str], path: Path, *args: str) -> tuple[int, str, str]:
    code = pipeline_run.main(["--engine", "transformers", "-m", str(path), "--tokens", str(NEW),
                              "--backend", "host", *args])
    out, err = capsys.readouterr()
    return code, out, err


def _theirs(path: Path, ids: list[int]) -> list[int]:
    """transformers' own greedy reply to ``ids`` (at most NEW tokens, stopped at the
    generation config's end of turn)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    prompt = torch.tensor([ids])
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW,
                         do_sample=False)
    return [int(t) for t in out[0, len(ids):]]


def test_chat_is_transformers_template_and_reply(chat: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _cli(capsys, chat, "--prompt", "hello moe", "--chat", "--json")
    assert code == 0
    got = json.loads(out)
    tokenizer = transformers.AutoTokenizer.from_pretrained(chat)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hello moe"}],
                                        add_generation_prompt=True, return_dict=True)["input_ids"]
    assert ids == [4, 5, 1, 3, 6, 5]  # user : hello moe assistant :
    assert got["prompt_ids"] == ids
    assert got["token_ids"] == _theirs(chat, ids)


def test_chat_stops_at_the_end_of_turn(chat: Path, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    """The model's first reply token made its end of turn: the chat reply is that token
    alone, where a run without --chat generates --tokens of them all the same."""
    path = tmp_path / "eos"
    shutil.copytree(chat, path)
    ids = [4, 5, 1, 3, 6, 5]
    first = _theirs(path, ids)[0]
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": first}))
    code, out, _ = _cli(capsys, path, "--prompt", "hello moe", "--chat", "--json")
    assert code == 0 and json.loads(out)["token_ids"] == [first]
    code, out, _ = _cli(capsys, path, "--prompt", "hello moe", "--json")
    assert code == 0 and len(json.loads(out)["token_ids"]) == NEW


@pytest.mark.parametrize(("args", "says"), [
    (["--prompt", "hello", "--chat"], "--chat: the checkpoint's tokenizer has no chat template"),
    (["--prompt-ids", "1,2", "--chat"], "--chat puts --prompt TEXT in the chat template"),
])
def test_chat_refused_in_one_line(checkpoint: Path, capsys: pytest.CaptureFixture[str],
                                  args: list[str], says: str) -> None:
    code, out, err = _cli(capsys, checkpoint, *args)
    assert code == 2 and out == ""
    assert err.startswith("moestream: error: ") and err.count("\n") == 1 and says in err
