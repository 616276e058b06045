"""bench.transformers: a tiny run whose reference holds (the process warmed first, each run
timed ``--repeat`` times, every run's tokens checked against the warm-up's), with a cache of
a share of the experts' bytes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from bench.transformers import main

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def test_tiny_run_repeats_and_checks_tokens(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    code = main(["--make", str(tmp_path / "m"), "--shape", "tiny", "--tokens", "3",
                 "--warmup", "1", "--repeat", "2", "--cache-share", "0.25", "--device", "cpu",
                 "--runs", "resident,warm,predict,in_place,all", "--out", str(out)])
    report = json.loads(out.read_text())
    runs = report["runs"]
    assert code == 0 and report["identical_tokens"]
    for name in ("resident", "warm", "predict", "all"):
        assert runs[name]["same_tokens"] and runs[name]["tokens"] == report["reference_tokens"]
        assert len(runs[name]["tokens_per_s_runs"]) == 2 and runs[name]["spread"] >= 0
    assert runs["resident"]["x_resident"] == 1.0
    # a quarter of the experts' bytes, each timed generate from a fresh load (misses in both)
    assert report["cache_budget_bytes"] == report["expert_bytes"] // 4
    assert runs["warm"]["misses"] > 0 and runs["all"]["hit_rate"] == 1.0
    # the GPU's whole-layer path's share of the timed tokens: none on the host
    assert runs["all"]["whole_share"] == 0.0
    # the predict run hints the next layer's guesses (loaded), the warm run none
    assert runs["predict"]["prefetched"] > 0 and runs["warm"]["prefetched"] == 0
    # misses read in place are a GPU path: said, not timed as another warm run
    assert runs["in_place"] == {"skipped": "a GPU path: the host backend has no tables"}


def test_a_share_out_of_range_is_refused(tmp_path: Path) -> None:
    assert main(["--make", str(tmp_path / "m"), "--cache-share", "1.5", "--device", "cpu",
                 "--runs", "all"]) != 0


def test_sampled_tokens_are_the_reference_in_every_run(tmp_path: Path) -> None:
    """``--sample SEED``: every generate sampled under one seed, so the streamed runs still
    give the resident model's tokens; they are not the greedy ones."""
    model = tmp_path / "m"
    common = ["--make", str(model), "--shape", "tiny", "--tokens", "6", "--warmup", "1",
              "--repeat", "1", "--cache-share", "0.25", "--device", "cpu",
              "--runs", "resident,warm"]
    sampled, greedy = tmp_path / "sampled.json", tmp_path / "greedy.json"
    assert main([*common, "--sample", "7", "--out", str(sampled)]) == 0
    assert main([*common, "--out", str(greedy)]) == 0
    report = json.loads(sampled.read_text())
    assert report["identical_tokens"] and report["runs"]["warm"]["misses"] > 0
    assert report["reference_tokens"] != json.loads(greedy.read_text())["reference_tokens"]


def test_spread_scales_the_token_embeddings_only(tmp_path: Path) -> None:
    """``--spread``'s model is the plain one with its token embeddings scaled (the same
    seed: every other tensor equal)."""
    import torch
    from safetensors.torch import load_file

    from bench.transformers import SPREAD_EMBEDDINGS, make_checkpoint

    make_checkpoint(tmp_path / "plain", "tiny", 2, "cpu")
    make_checkpoint(tmp_path / "spread", "tiny", 2, "cpu", spread=True)
    plain = load_file(tmp_path / "plain" / "model.safetensors")
    spread = load_file(tmp_path / "spread" / "model.safetensors")
    name = "model.embed_tokens.weight"
    assert torch.equal(spread[name], (plain[name] * SPREAD_EMBEDDINGS).to(plain[name].dtype))
    assert all(torch.equal(spread[k], v) for k, v in plain.items() if k != name)


def test_disk_floor_is_the_missed_bytes_at_the_measured_rate(tmp_path: Path) -> None:
    """The cold run's storage floor: the disk's O_DIRECT rate measured on the checkpoint,
    the missed bytes' time at it, the run's seconds over that."""
    from bench.transformers import disk_floor, make_checkpoint

    make_checkpoint(tmp_path / "m", "tiny", 2, "cpu")
    missed = 10**10  # the figures are rounded to 3 places: large enough to compare
    floor = disk_floor(tmp_path / "m", {"file_bytes": missed, "seconds": [10.0, 20.0]})
    assert floor["disk_gbps"] > 0
    assert floor["disk_floor_s"] == pytest.approx(missed / (floor["disk_gbps"] * 1e9), rel=0.01)
    assert floor["x_disk_floor"] == pytest.approx(30.0 / floor["disk_floor_s"], rel=0.01)


def test_alternate_rounds(tmp_path: Path) -> None:
    """``alternate``: resident and moestream generates alternated, a ratio a round, their
    median the run's x_resident, tokens checked on both sides."""
    out = tmp_path / "report.json"
    assert main(["--make", str(tmp_path / "m"), "--shape", "tiny", "--tokens", "3",
                 "--warmup", "1", "--repeat", "3", "--device", "cpu", "--runs", "alternate",
                 "--out", str(out)]) == 0
    run = json.loads(out.read_text())["runs"]["alternate"]
    assert run["same_tokens"] and len(run["x_resident_rounds"]) == 3
    assert run["x_resident"] == sorted(run["x_resident_rounds"])[1]
    assert run["tokens_per_s"] > 0 and run["resident_tokens_per_s"] > 0


def test_rounds_take_x_resident_within_each(tmp_path: Path) -> None:
    """``--rounds 3``: the runs in turns three times, each run's x_resident the median of
    its rounds' (each against that round's resident run), every round kept."""
    out = tmp_path / "report.json"
    assert main(["--make", str(tmp_path / "m"), "--shape", "tiny", "--tokens", "3",
                 "--warmup", "1", "--repeat", "1", "--device", "cpu", "--runs", "resident,held",
                 "--rounds", "3", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    held = report["runs"]["held"]
    assert report["identical_tokens"] and held["same_tokens"] and len(held["rounds"]) == 3
    each = [r["tokens_per_s"] / resident["tokens_per_s"] for r, resident in
            zip(held["rounds"], report["runs"]["resident"]["rounds"], strict=True)]
    assert held["x_resident_rounds"] == [round(x, 3) for x in each]
    assert held["x_resident"] == sorted(held["x_resident_rounds"])[1]


def test_experts_profile_fresh_prompts_miss_at_a_budget(tmp_path: Path) -> None:
    """``bench.experts_profile --fresh``: each generate a prompt of its own (a budgeted run
    on a token-following model then misses); the profile names moestream's experts call."""
    from bench.experts_profile import _prompts, main
    from bench.transformers import make_checkpoint

    fresh, same = _prompts(True), _prompts(False)
    assert next(fresh).tolist() != next(fresh).tolist()
    assert next(same).tolist() == next(same).tolist()
    make_checkpoint(tmp_path / "m", "tiny", 2, "cpu", spread=True)
    out = tmp_path / "profile.txt"
    assert main(["-m", str(tmp_path / "m"), "--device", "cpu", "--tokens", "4", "--top", "80",
                 "--budget", "16", "--fresh", "--mode", "resident", "--out", str(out)]) == 0
    report = out.read_text()
    assert report.startswith("== moestream") and "experts_forward" in report


def test_no_gather_gives_the_copy_engines_tuning() -> None:
    """``--no-gather`` (every transformers bench): moestream's ``Tuning(gather=False)``."""
    import moestream
    from bench.transformers import build_parser, tuning_of

    assert tuning_of(build_parser().parse_args(["--no-gather"])) == moestream.Tuning(gather=False)
    assert tuning_of(build_parser().parse_args([])) is None


def test_dispatch_stages_time_the_resident_model_at_each(tmp_path: Path) -> None:
    from bench.dispatch import main as dispatch_main
    from bench.transformers import make_checkpoint

    model = tmp_path / "m"
    make_checkpoint(model, "tiny", 2, "cpu")
    out = tmp_path / "dispatch.json"
    assert dispatch_main(["-m", str(model), "--device", "cpu", "--tokens", "2",
                          "--out", str(out)]) == 0
    stages = json.loads(out.read_text())
    assert stages["bare_us_a_call"] > 0 and len(stages["moestream_tok_s"]) == 3
    for name in ("resident", "moestream_loaded", "after_moestream_generate", "moestream_closed"):
        stage = stages[name]
        assert stage["us_a_call"] > 0 and stage["resident_tok_s"] > 0
        assert any(thread.startswith("MainThread") for thread in stage["thread_cpu_s"])
    # the session's threads live while it is open, not after its close
    assert stages["moestream_loaded"]["threads"] > stages["moestream_closed"]["threads"]
