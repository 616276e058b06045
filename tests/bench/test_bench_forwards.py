"""bench.forwards: a tiny run's report holds every figure it promises, and every streamed
forward and speculative generate gave the resident model's greedy tokens."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from bench.forwards import main

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning",
                                        "ignore::FutureWarning")

TOKENS, K, REPEAT = 6, 3, 2


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    where = tmp_path_factory.mktemp("forwards")
    out = where / "report.json"
    code = main(["--make", str(where / "m"), "--shape", "tiny", "--prompt-tokens", "24",
                 "--verify-tokens", str(K), "--tokens", str(TOKENS), "--warmup", "1",
                 "--repeat", str(REPEAT), "--cache-share", "0.25", "--device", "cpu",
                 "--out", str(out)])
    assert code == 0
    result: dict[str, Any] = json.loads(out.read_text())
    return result


class TestReport:
    """The JSON a run writes."""

    def test_provenance(self, report: dict[str, Any]) -> None:
        """The machine, commit, command and versions are recorded."""
        assert report["machine"]["device"] == "cpu" and report["commit"]
        assert report["command"].startswith("python -m bench.forwards --make")
        assert {"torch", "transformers", "commit"} <= set(report["versions"])
        assert report["cache_budget_bytes"] == report["expert_bytes"] // 4

    def test_prefill(self, report: dict[str, Any]) -> None:
        """Both prefills timed --repeat times in turns; the streamed one misses (a quarter of the
        experts cached), fetches its union in several groups and gives the same tokens."""
        prefill = report["prefill"]
        for run in ("resident", "moestream"):
            assert len(prefill[run]["seconds_runs"]) == REPEAT and prefill[run]["spread"] >= 0
            assert prefill[run]["cpu_seconds"] > 0
        assert len(prefill["x_resident_paired"]) == REPEAT and prefill["x_resident_cpu"] > 0
        streamed = prefill["moestream"]
        assert streamed["same_tokens"] and prefill["x_resident"] > 0
        assert prefill["missed_bytes"] > 0 and prefill["missed_seconds_at_page_cache_rate"] > 0
        assert max(streamed["groups_per_layer"]) > 1
        assert report["page_cache"]["bytes"] > 0

    def test_verify(self, report: dict[str, Any]) -> None:
        """A K-token and a 1-token forward, resident and streamed, with their ratio; the
        streamed greedy tokens equal the resident ones."""
        for run in ("resident", "moestream"):
            pair = report["verify"][run]
            assert len(pair["one"]["seconds_runs"]) == len(pair["k"]["seconds_runs"]) == REPEAT
            assert pair["k_x_one"] == pytest.approx(pair["k"]["seconds"] / pair["one"]["seconds"],
                                                    rel=1e-2)
        assert report["verify"]["moestream"]["same_tokens"]
        assert report["verify"]["moestream"]["k"]["misses"] > 0

    def test_speculative(self, report: dict[str, Any]) -> None:
        """Plain, prompt-lookup and assisted generates all give the resident plain
        generate's tokens; plain takes a forward a token and drafts nothing, the assistant
        drafts K a round."""
        spec = report["speculative"]
        for name in ("plain", "prompt_lookup", "assistant"):
            assert spec[name]["same_tokens"] and len(spec[name]["tokens_per_s_runs"]) == REPEAT
        assert spec["plain"]["forwards"] == TOKENS and spec["plain"]["drafted"] == 0
        assert spec["plain"]["acceptance"] is None
        assistant = spec["assistant"]
        assert assistant["drafted"] > 0 and 0 <= assistant["acceptance"] <= 1
        assert assistant["forwards"] + assistant["accepted"] == TOKENS
        assert "x_plain" in spec["prompt_lookup"] and "x_plain" in assistant
        assert report["identical_tokens"]


def test_a_one_token_verification_is_refused(tmp_path: Path) -> None:
    assert main(["--make", str(tmp_path / "m"), "--verify-tokens", "1", "--device", "cpu"]) == 2
