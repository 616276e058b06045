"""``python -m pipeline.run --engine transformers``'s output as docs/TRANSFORMERS.md shows
it: ``--json`` holds the generated token ids, sizes print in a unit that reads, counts in
the right number, a budget of nothing names the model's least."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.integrations.moe")

from moestream import transformers as mt  # noqa: E402
from moestream.pipeline import run as pipeline_run  # noqa: E402
from moestream.tools.analyze.cli import main as analyze_main  # noqa: E402
from tests.transformers.test_transformers_hub_memory import REPO, write_hub_cache  # noqa: E402
from tests.transformers.test_transformers_trust import CONFIG, IDS, _save  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

LEAST = 2 * CONFIG["num_experts_per_tok"]
NEW = 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save(tmp_path_factory.mktemp("cli-out") / "qwen3_moe", seed=0)


def _run(capsys: pytest.CaptureFixture[str], checkpoint: Path,
         *extra: str) -> tuple[int, str, str]:
    code = pipeline_run.main(["--engine", "transformers", "-m", str(checkpoint),
                              "--prompt-ids", ",".join(map(str, IDS[0])), "--tokens", str(NEW),
                              "--backend", "host", *extra])
    out, err = capsys.readouterr()
    return code, out, err


class TestJson:
    """``--json``: one object, the summary's fields with the prompt's and the generated
    token ids."""

    def test_token_ids(self, capsys: pytest.CaptureFixture[str], checkpoint: Path) -> None:
        code, out, _ = _run(capsys, checkpoint, "--cache-budget", str(LEAST), "--json")
        assert code == 0
        got = json.loads(out)
        assert got["prompt_ids"] == IDS[0]
        assert len(got["token_ids"]) == got["tokens"] == NEW
        assert "text" not in got  # the checkpoint has no tokenizer
        with mt.from_pretrained(checkpoint, budget=LEAST, device="cpu") as model, \
                torch.no_grad():
            ids = model.generate(torch.tensor(IDS), max_new_tokens=NEW, min_new_tokens=NEW,
                                 do_sample=False)
        assert got["token_ids"] == ids[0, len(IDS[0]):].tolist()


class TestText:
    """The plain summary: sizes in the unit they reach, counts in the right number."""

    def test_units_and_counts(self, capsys: pytest.CaptureFixture[str],
                              checkpoint: Path) -> None:
        code, out, _ = _run(capsys, checkpoint, "--cache-budget", str(LEAST))
        assert code == 0
        assert "0.00 GiB" not in out and "0.00 MiB" not in out
        assert re.search(r"budget \d+\.\d\d KiB", out)
        assert re.search(r"experts \w+, \d+\.\d\d KiB an expert as stored", out)
        verified = re.search(r"verified: (\d+) (experts?), (\d+) (mismatch(?:es)?)", out)
        assert verified is not None
        assert (verified.group(2) == "expert") == (verified.group(1) == "1")
        assert (verified.group(4) == "mismatch") == (verified.group(3) == "1")


class TestLeastBudget:
    """``--cache-budget 0``: one line naming the model's least."""

    @pytest.mark.parametrize("budget", ["0", "-1"])
    def test_names_the_least(self, capsys: pytest.CaptureFixture[str], checkpoint: Path,
                             budget: str) -> None:
        code, out, err = _run(capsys, checkpoint, f"--cache-budget={budget}")
        assert code == 2 and out == ""
        assert err.count("\n") == 1 and f"at least {LEAST} experts" in err


class TestPrefillInTheLog:
    """The prefill is one forward: its token line lists every expert the prompt routed to
    in a layer, more than top-k; ``tools.analyze`` reads it as it is, without a warning."""

    def test_analyzed_as_it_is(self, capsys: pytest.CaptureFixture[str], checkpoint: Path,
                               tmp_path: Path) -> None:
        log = tmp_path / "run.jsonl"
        code, _, _ = _run(capsys, checkpoint, "--cache-budget", str(LEAST), "--log", str(log))
        assert code == 0
        tokens = [json.loads(line) for line in log.read_text().splitlines()
                  if json.loads(line).get("event") == "token"]
        widest = max(len(layer) for layer in tokens[0]["experts"])
        assert widest > CONFIG["num_experts_per_tok"]  # the prefill's union
        assert all(len(layer) == CONFIG["num_experts_per_tok"]
                   for token in tokens[1:] for layer in token["experts"])
        assert analyze_main([str(log)]) == 0
        out, err = capsys.readouterr()
        assert err == ""
        assert re.search(r"consistency problems\s+0\n", out)
        hits = sum(t["hits"] for t in tokens)
        assert re.search(rf"\nhits\s+{hits}\n", out)
        # a tiny model's sizes in the unit they reach, not 0.00 GB
        assert re.search(r"\nbudget\s+\d+\.\d\d KiB\n", out)
        assert re.search(r"\npeak device \(run_end\)\s+\d+\.\d\d KiB\n", out)


class TestHubId:
    """``-m org/name``: the hub id's snapshot in the local hub cache, as the API reads it."""

    def test_generates_as_the_directory(self, capsys: pytest.CaptureFixture[str],
                                        checkpoint: Path, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
        code, out, _ = _run(capsys, checkpoint, "--cache-budget", str(LEAST), "--json")
        assert code == 0
        write_hub_cache(checkpoint, tmp_path / "hub", monkeypatch)
        code, by_id, _ = _run(capsys, Path(REPO), "--cache-budget", str(LEAST), "--json")
        assert code == 0
        assert json.loads(by_id)["token_ids"] == json.loads(out)["token_ids"]


class TestPrefetch:
    """``--prefetch predict`` reaches ``from_pretrained``: the same tokens, its guesses
    counted in the log; ``oracle`` (a trace's routing, the proxy engine's) refused."""

    def test_predict_same_tokens(self, capsys: pytest.CaptureFixture[str], checkpoint: Path,
                                 tmp_path: Path) -> None:
        runs = {}
        for prefetch in ("none", "predict"):
            log = tmp_path / f"{prefetch}.jsonl"
            code, out, _ = _run(capsys, checkpoint, "--cache-budget", str(LEAST), "--json",
                                "--prefetch", prefetch, "--log", str(log))
            assert code == 0
            lines = [json.loads(line) for line in log.read_text().splitlines()]
            guessed = sum(line.get("prefetch", {}).get("predicted", 0) for line in lines)
            runs[prefetch] = (json.loads(out)["token_ids"], guessed)
        assert runs["none"][0] == runs["predict"][0]
        assert runs["none"][1] == 0 < runs["predict"][1]

    def test_oracle_refused(self, capsys: pytest.CaptureFixture[str], checkpoint: Path) -> None:
        code, out, err = _run(capsys, checkpoint, "--prefetch", "oracle")
        assert code == 2 and out == ""
        assert len(err.strip().splitlines()) == 1 and "none or predict" in err


def test_in_place_reaches_from_pretrained(capsys: pytest.CaptureFixture[str], checkpoint: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """``--in-place`` is ``from_pretrained(in_place=True)`` (on the host backend it changes
    nothing: the same tokens)."""
    import moestream.transformers as mt

    seen: list[bool] = []
    original = mt.from_pretrained

    def spied(*args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs["in_place"])
        return original(*args, **kwargs)

    monkeypatch.setattr(mt, "from_pretrained", spied)
    runs = []
    for extra in ((), ("--in-place",)):
        code, out, _ = _run(capsys, checkpoint, "--cache-budget", str(LEAST), "--json",
                            "--mode", "resident", *extra)
        assert code == 0
        runs.append(json.loads(out)["token_ids"])
    assert seen == [False, True] and runs[0] == runs[1]
