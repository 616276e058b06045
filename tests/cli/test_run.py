"""``python -m pipeline.run`` end to end on the host backend: output, log, errors, traces."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from moestream.pipeline.foundation.table import open_table
from moestream.pipeline.run import main

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


class TestDefaultRun:
    """With no model the embedded tiny model is made once and decoded, verified."""

    def test_no_arguments(self, capsys: pytest.CaptureFixture[str], tmp_path: Path,
                          monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
        code, out, _ = _run(capsys, "-n", "4", "--backend", "host")
        assert code == 0
        assert "verified: " in out and ", 0 mismatches" in out
        assert list((tmp_path / "moestream").glob("tiny-*.gguf"))


class TestModesAndCompute:
    """Every mode and compute kind decodes and verifies."""

    @pytest.mark.parametrize("mode", ["direct", "resident", "auto"])
    @pytest.mark.parametrize("compute", ["real", "digest", "fixed:0.05"])
    def test_verified(self, capsys: pytest.CaptureFixture[str], tiny_model: Path,
                      mode: str, compute: str) -> None:
        code, out, _ = _run(capsys, "-m", str(tiny_model), "-n", "6", "--mode", mode,
                            "--compute", compute, "--cache-budget", "12", "--json",
                            "--backend", "host")
        summary = json.loads(out)
        assert code == 0
        assert summary["mismatches"] == 0 and summary["verified"] >= summary["misses"]
        assert summary["hits"] + summary["misses"] == 6 * 3 * 4
        assert summary["peak_device_bytes"] <= summary["budget_bytes"]
        assert summary["allocations"] == summary["frees"]

    def test_oracle_prefetch_verifies(self, capsys: pytest.CaptureFixture[str],
                                      tiny_model: Path) -> None:
        code, out, _ = _run(capsys, "-m", str(tiny_model), "-n", "8", "--mode", "direct",
                            "--prefetch", "oracle", "--lookahead", "2", "--cache-budget", "14",
                            "--json", "--backend", "host")
        assert code == 0 and json.loads(out)["mismatches"] == 0


class TestGarbageCollector:
    """Decode runs with a young threshold above a token's objects, set-up frozen; a run
    leaves the collector as it found it, also when it fails."""

    @pytest.mark.parametrize("fails", [False, True])
    def test_restored(self, capsys: pytest.CaptureFixture[str], tiny_model: Path,
                      monkeypatch: pytest.MonkeyPatch, fails: bool) -> None:
        import gc

        from moestream.pipeline.cli.run import DECODE_GC_YOUNG
        from moestream.pipeline.proxy import loop

        seen: list[tuple[int, int]] = []
        token = loop.DecodeLoop.token

        async def watched(self: loop.DecodeLoop, t: int) -> object:
            seen.append((gc.get_threshold()[0], gc.get_freeze_count()))
            if fails:
                raise KeyboardInterrupt
            return await token(self, t)

        monkeypatch.setattr(loop.DecodeLoop, "token", watched)
        before = gc.get_threshold()
        code = _run(capsys, "-m", str(tiny_model), "-n", "2", "--backend", "host")[0]
        assert code == (130 if fails else 0)  # 130: interrupted
        assert gc.get_threshold() == before and gc.get_freeze_count() == 0
        assert seen and all(young == max(before[0], DECODE_GC_YOUNG) and frozen > 0
                            for young, frozen in seen)


class TestRoutingAndPrefetch:
    """The live router and predicted prefetch decode, verify and log their accuracy."""

    @pytest.mark.parametrize("args", [
        ["--router", "live"],
        ["--router", "live", "--prefetch", "predict"],
        ["--router", "live", "--prefetch", "predict", "--compute", "fixed:0.1"],
        ["--router", "live", "--compute", "digest"],
        ["--prefetch", "predict", "--mode", "direct"],
    ])
    def test_verified_and_logged(self, capsys: pytest.CaptureFixture[str], tiny_model: Path,
                                 tmp_path: Path, args: list[str]) -> None:
        log = tmp_path / "run.jsonl"
        code, out, _ = _run(capsys, "-m", str(tiny_model), "-n", "8", "--cache-budget", "12",
                            "--json", "--backend", "host", "--log", str(log), *args)
        summary = json.loads(out)
        assert code == 0 and summary["mismatches"] == 0
        assert summary["peak_device_bytes"] <= summary["budget_bytes"]
        tokens = [json.loads(x) for x in log.read_text().splitlines() if '"token"' in x]
        if "predict" in args:
            stats = [e["prefetch"] for e in tokens if e.get("event") == "token"]
            assert all(s["correct"] <= s["predicted"] for s in stats)
            assert all(s["loaded"] <= s["predicted"] for s in stats)
            assert sum(s["predicted"] for s in stats) > 0

    def test_live_routing_round_trips_as_a_trace(self, capsys: pytest.CaptureFixture[str],
                                                 tiny_model: Path, tmp_path: Path) -> None:
        trace = tmp_path / "live.npz"
        base = ["-m", str(tiny_model), "-n", "6", "--cache-budget", "12", "--json",
                "--backend", "host"]
        _, a, _ = _run(capsys, *base, "--router", "live", "--record-trace", str(trace))
        _, b, _ = _run(capsys, *base, "--trace", str(trace))
        assert json.loads(a)["hits"] == json.loads(b)["hits"]

    def test_oracle_needs_a_trace(self, capsys: pytest.CaptureFixture[str],
                                  tiny_model: Path) -> None:
        code, _, err = _run(capsys, "-m", str(tiny_model), "--router", "live", "--prefetch",
                            "oracle", "--backend", "host")
        assert code == 2 and "oracle" in err


class TestLog:
    """The JSON-lines log has a header, one event per token and a closing summary."""

    def test_events(self, capsys: pytest.CaptureFixture[str], tiny_model: Path,
                    tmp_path: Path) -> None:
        log = tmp_path / "run.jsonl"
        code, _, _ = _run(capsys, "-m", str(tiny_model), "-n", "5", "--log", str(log),
                          "--cache-budget", "12", "--backend", "host", "--log-level", "debug")
        assert code == 0
        events = [json.loads(line) for line in log.read_text().splitlines()]
        kinds = [e["event"] for e in events]
        assert kinds.count("run_start") == 1 and kinds[-1] == "run_end"
        tokens = [e for e in events if e["event"] == "token"]
        assert [e["token"] for e in tokens] == list(range(5))
        assert kinds.count("layer") == 5 * 3
        assert all(e["schema"] == 2 for e in events)
        assert all(sum(e["time"].values()) == pytest.approx(e["wall_ms"], abs=0.003)
                   for e in events if e["event"] == "token")
        first = tokens[0]
        assert len(first["experts"]) == 3 and len(first["experts"][0]) == 4
        assert first["hits"] + first["misses"] == 12


class TestTraceRoundTrip:
    """Recording a run's routing and replaying it gives the same hit counts."""

    def test_record_then_replay(self, capsys: pytest.CaptureFixture[str], tiny_model: Path,
                                tmp_path: Path) -> None:
        trace = tmp_path / "t.npz"
        base = ["-m", str(tiny_model), "-n", "7", "--cache-budget", "12", "--json",
                "--backend", "host"]
        _, first, _ = _run(capsys, *base, "--seed", "3", "--record-trace", str(trace))
        _, second, _ = _run(capsys, *base, "--trace", str(trace))
        a, b = json.loads(first), json.loads(second)
        assert (a["hits"], a["misses"], a["evictions"]) == (b["hits"], b["misses"],
                                                             b["evictions"])


class TestErrors:
    """Bad input: one line on stderr, a non-zero exit, no traceback."""

    @pytest.mark.parametrize(("args", "code", "words"), [
        (["--cache-budget", "lots"], 2, "cannot read cache budget"),
        (["--cache-budget", "1"], 2, "cannot hold one layer"),
        (["--compute", "quantum"], 2, "--compute"),
        (["--queue-depth", "0"], 2, "--queue-depth"),
        (["--chunk", "1000"], 2, "multiple of 4096"),
        # the transformers engine's options, never dropped by the proxy without a word
        (["--prompt", "hello"], 2, "--prompt given without --engine transformers"),
        (["--prompt-ids", "1,2", "--chat"], 2, "--prompt-ids, --chat given without"),
        (["--experts", "eager"], 2, "--experts given without --engine transformers"),
    ])
    def test_bad_options(self, capsys: pytest.CaptureFixture[str], tiny_model: Path,
                         args: list[str], code: int, words: str) -> None:
        got, _, err = _run(capsys, "-m", str(tiny_model), "-n", "1", "--backend", "host",
                           *args)
        assert got == code
        assert err.count("\n") == 1 and err.startswith("moestream: error:") and words in err

    def test_missing_model(self, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
        got, _, err = _run(capsys, "-m", str(tmp_path / "nope.gguf"), "--backend", "host")
        assert got == 2 and "nope.gguf" in err and err.count("\n") == 1

    def test_trace_for_a_bigger_model(self, capsys: pytest.CaptureFixture[str],
                                      tiny_model: Path, tmp_path: Path) -> None:
        from moestream.pipeline.foundation.trace import save_trace
        from moestream.pipeline.proxy.synthetic import synthetic_trace

        big = tmp_path / "big.npz"
        save_trace(synthetic_trace("ds4-flash", 3, n_layers=3, n_experts=64, top_k=4), big)
        got, _, err = _run(capsys, "-m", str(tiny_model), "--trace", str(big),
                           "--backend", "host")
        assert got == 2 and "64" in err and err.count("\n") == 1


class TestVerification:
    """A corrupted expert byte is caught: exit 3 naming the expert."""

    def test_corrupt_expert(self, capsys: pytest.CaptureFixture[str], tiny_model: Path,
                            tmp_path: Path) -> None:
        bad = tmp_path / "bad.gguf"
        shutil.copy(tiny_model, bad)
        table = open_table(bad)
        r = table.slices((table.moe_layers[0], 0)).up
        with bad.open("r+b") as f:
            f.seek(r.offset + 1000)
            byte = f.read(1)
            f.seek(r.offset + 1000)
            f.write(bytes([byte[0] ^ 0xFF]))
        trace_path = tmp_path / "t.npz"
        import numpy as np

        from moestream.pipeline.foundation.trace import Trace, save_trace

        experts = np.tile(np.arange(4, dtype=np.int32), (2, 3, 1))
        weights = np.full(experts.shape, 0.25, dtype=np.float32)
        save_trace(Trace(experts, weights, 16, "test"), trace_path)
        got, out, err = _run(capsys, "-m", str(bad), "-n", "2", "--trace", str(trace_path),
                             "--backend", "host", "--mode", "direct")
        assert got == 3
        assert "1 mismatch " in out  # one, in the singular
        assert f"layer {table.moe_layers[0]} expert 0 up" in err
