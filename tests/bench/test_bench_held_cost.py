"""bench.held_cost: the resident and held runs alternated in one process, each token's
experts calls and moestream's token start and end timed apart from the rest."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from bench.held_cost import main

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def test_tiny_run_times_each_part(tmp_path: Path) -> None:
    out = tmp_path / "held.json"
    assert main(["--make", str(tmp_path / "m"), "--shape", "tiny", "--tokens", "4",
                 "--rounds", "2", "--device", "cpu", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    resident, held = report["resident"], report["held"]
    assert len(resident["each_tok_s"]) == len(held["each_tok_s"]) == 2
    # both models' experts calls are timed; only the held one has moestream's token end
    assert resident["experts_us"] > 0 and held["experts_us"] > 0
    assert resident["end_us"] == 0 and held["end_us"] > 0
    assert held["end_us"] >= max(held["take_us"], held["account_us"], held["session_us"])
    assert held["rest_us"] > 0 and report["x_resident"] > 0
    # every held token ended through the session (2 rounds of 4): none lost to the timing
    assert report["whole_tokens"][1] == 8


def test_split_calls_adds_the_call_parts(tmp_path: Path) -> None:
    """``--split-calls`` reports the whole-layer path's parts (on the host its calls take
    another path: nothing is spent there), and the run still ends every token."""
    out = tmp_path / "held.json"
    assert main(["--make", str(tmp_path / "m"), "--shape", "tiny", "--tokens", "2",
                 "--rounds", "1", "--device", "cpu", "--split-calls", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["setup"]["split_calls"] is True
    for run in (report["resident"], report["held"]):
        assert run["whole_us"] == run["gather_us"] == 0
    assert report["whole_tokens"][1] == 2


def test_held_tokens_arms_alternate(tmp_path: Path) -> None:
    """``--held-tokens`` adds an arm a value, each with its ratio to the same rounds'
    resident runs, every token still ended."""
    out = tmp_path / "held.json"
    assert main(["--make", str(tmp_path / "m"), "--shape", "tiny", "--tokens", "2",
                 "--rounds", "2", "--device", "cpu", "--held-tokens", "0,3",
                 "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["setup"]["held_tokens"] == [0, 3]
    for arm in ("held", "held_0", "held_3"):
        assert len(report[arm]["each_tok_s"]) == 2 and report[arm]["x_resident"] > 0
    assert report["x_resident"] == report["held"]["x_resident"]
    assert report["whole_tokens"][1] == 12  # 3 arms, 2 rounds of 2 tokens
    with pytest.raises(SystemExit):
        main(["-m", str(tmp_path / "m"), "--held-tokens", "-1"])


def test_one_model_source_is_asked(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        main(["--device", "cpu"])
