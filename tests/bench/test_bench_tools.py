"""The issue-14 bench tools on the host backend, small: they run, and they report what they
say (the figures themselves are measured on the GPU machine, never in tests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.copytimes import busy_and_span
from bench.pipeline import _median_round
from bench.pipeline import main as pipeline_main
from bench.profile import main as profile_main
from moestream.gpu.cuda import unavailable_reason


def test_pipeline_verify_ab_when_nothing_misses(tiny_model: Path, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """The warm phase with ``--ab-verify``: both rounds ran, on and off. The tiny model
    fits the sweep's budget whole (it has 64 MiB of slack), so nothing misses and there is
    no cost to compare: the figure says so (None), it does not divide by zero."""
    out = tmp_path / "bench.json"
    assert pipeline_main(["--model", str(tiny_model), "--backend", "host", "--skip",
                          "cold,cache,all", "--ab-verify", "2", "--passes", "2",
                          "--sweep-tokens", "2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    ab = result["verify_ab"]["resident_miss"]
    assert len(ab["on"]) == len(ab["off"]) == 2
    assert ab["median_on"] == ab["median_off"] == 0.0 and ab["cost"] is None
    assert result["figures"]["6_verify_cost_resident_miss"] is None
    assert result["figures"]["5_budget_never_exceeded"] is True
    assert "nothing to compare" in capsys.readouterr().out


def test_pipeline_figures_are_the_median_round(tiny_model: Path, tmp_path: Path) -> None:
    """``--rounds 3``: the warm-miss run three times; its figure is the median round's,
    with every round's rate beside it, and the host's speed around each round (a fixed
    Python workload timed on the loop's thread)."""
    out = tmp_path / "bench.json"
    assert pipeline_main(["--model", str(tiny_model), "--backend", "host", "--skip",
                          "cold,cache,all", "--rounds", "3", "--passes", "2",
                          "--sweep-tokens", "2", "--out", str(out)]) == 0
    miss = json.loads(out.read_text())["resident_miss"]
    assert len(miss["rounds"]) == 3
    assert miss["delivered_gbps"] == pytest.approx(sorted(miss["rounds"])[1], abs=1e-4)
    assert len(miss["rounds_host_ref_ms"]) == 3 and min(miss["rounds_host_ref_ms"]) > 0
    assert miss["host_ref_ms"] in miss["rounds_host_ref_ms"]


@given(st.lists(st.floats(0.0, 100.0), min_size=1, max_size=7))
def test_median_round_picks_a_middle_round(rates: list[float]) -> None:
    rounds = [{"rate": r, "round": i} for i, r in enumerate(rates)]
    chosen = _median_round(rounds, "rate")
    below = sum(r < chosen["rate"] for r in rates)
    above = sum(r > chosen["rate"] for r in rates)
    assert below <= len(rates) // 2 and above <= len(rates) // 2
    assert chosen["rounds"] == [round(r, 4) for r in rates]


@given(st.lists(st.tuples(st.floats(0.0, 100.0), st.floats(0.0, 10.0)), max_size=12))
def test_copy_busy_time_is_the_union_of_the_intervals(starts: list[tuple[float, float]]) -> None:
    """bench.copytimes: overlapping copies (two streams) count once, gaps not at all;
    checked against a 0.01-step sampling of the same intervals (whole-step values)."""
    intervals = [(round(b, 0), round(b, 0) + round(n, 0)) for b, n in starts]
    busy, span = busy_and_span(intervals)
    covered = {t for b, e in intervals for t in range(int(b * 100), int(e * 100))}
    assert busy == pytest.approx(len(covered) / 100)
    if intervals:
        assert span == max(e for _, e in intervals) - min(b for b, _ in intervals)
        assert 0 <= busy <= span
    else:
        assert (busy, span) == (0.0, 0.0)


def test_copy_timeline_is_a_gpu_view_only(tiny_model: Path, tmp_path: Path) -> None:
    """``--copy-timeline`` on the stand-in device: accepted, and no device figures made up."""
    out = tmp_path / "bench.json"
    assert pipeline_main(["--model", str(tiny_model), "--backend", "host", "--skip",
                          "cold,cache,all", "--rounds", "1", "--passes", "2",
                          "--sweep-tokens", "2", "--copy-timeline", "--out", str(out)]) == 0
    miss = json.loads(out.read_text())["resident_miss"]
    assert "copy_device_gbps" not in miss and "h2d_ref_gbps" not in miss


@pytest.mark.gpu
@pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))
def test_copy_timeline_times_gathers_and_batches_not_digests() -> None:
    """On a GPU: a gather and a batched copy of 64 MiB each are timed, at a plausible rate
    (under 80 GB/s: PCIe gen5 moves ~55); an in-place launch (a digest) is not."""
    import cupy

    from bench.copytimes import copy_timeline
    from moestream.gpu.cuda import CudaPinned, CudaStream, CupyBackend
    from moestream.gpu.kernels import NO_FLIP, CudaKernels, copy_rows

    n = 64 << 20
    host = CudaPinned(n)
    host.array[:] = 7
    dst = cupy.cuda.Memory(2 * n)
    backend, kernels, stream = CupyBackend(0), CudaKernels(), CudaStream()
    with copy_timeline() as timeline:
        kernels.gather(copy_rows([host.array.ctypes.data, dst.ptr, n, 0, NO_FLIP]), stream)
        backend.copy_h2d_batch(np.array([[host.array.ctypes.data], [dst.ptr + n], [n]],
                                        dtype=np.uint64), stream)
        kernels.gather(copy_rows([dst.ptr, dst.ptr, n, 0, NO_FLIP]), stream)  # in place
    assert [nbytes for _, _, nbytes in timeline.calls] == [n, n]
    summary = timeline.summary()
    assert 5.0 < summary["copy_device_gbps"] < 80.0
    assert 0.0 < summary["copy_busy_share"] <= 1.0


@pytest.mark.parametrize("phase", ["all-cached", "resident-miss", "direct-miss"])
def test_profile_on_the_stand_in_device(tiny_model: Path, phase: str,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert profile_main(["--model", str(tiny_model), "--null", "--phase", phase,
                         "--tokens", "4", "--top", "5"]) == 0
    out = capsys.readouterr().out
    assert f"{phase}: " in out and "us/layer under the profiler" in out
    assert "Ordered by: internal time" in out


def test_profile_puts_the_devices_back(tiny_model: Path) -> None:
    """``--null`` swaps the session's devices for the stand-in for its own run only: a run
    after it in the same process verifies against real digests again."""
    import moestream.pipeline.streaming.session as session

    before = (session.open_backends, session.make_kernels)  # type: ignore[attr-defined]
    assert profile_main(["--model", str(tiny_model), "--null", "--tokens", "2",
                         "--top", "1"]) == 0
    assert (session.open_backends, session.make_kernels) == before  # type: ignore[attr-defined]


def test_gaps_times_both_kinds_and_puts_everything_back(tiny_model: Path,
                                                        tmp_path: Path) -> None:
    """``bench.gaps`` on the host backend: every layer after the first of a token is a gap
    within it, every token's first one a boundary gap after ``end_token``; the run counted
    only hits in its second pass, and the classes it wrapped are themselves again after."""
    from bench.gaps import main as gaps_main
    from moestream.gpu.kernels import HostKernels
    from moestream.pipeline.proxy.decode import Decoder
    from moestream.pipeline.streaming.session import StreamSession

    before = (Decoder.wait_for_layer, HostKernels.busy, StreamSession.end_token)
    out = tmp_path / "gaps.json"
    assert gaps_main(["--model", str(tiny_model), "--backend", "host", "--tokens", "6",
                      "--layer-ms", "0.01", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    layers = len(result["model"]["moe_layers"])
    # the second half of 12 tokens: 11 boundaries (none before the first token) -> 6, and
    # 12 x (layers - 1) gaps within tokens -> 6 x (layers - 1)
    assert result["boundary"]["n"] == 6 and result["end_token"]["n"] == 6
    assert result["within"]["n"] == 6 * (layers - 1)
    assert result["emit"]["n"] >= 6
    assert result["idle_us_per_token"] > 0 and result["wall_ms_per_token"] > 0
    assert (Decoder.wait_for_layer, HostKernels.busy, StreamSession.end_token) == before


@pytest.mark.parametrize("module", ["pipeline", "profile", "hostpath", "gaps", "soak",
                                    "controller", "log"])
def test_bench_command_names_a_missing_model_in_one_line(module: str, tmp_path: Path) -> None:
    """Run as a command, a bench module turns bad input into one line and exit code 2."""
    missing = tmp_path / "absent.gguf"
    done = subprocess.run([sys.executable, "-m", f"bench.{module}", "--model", str(missing)],
                          capture_output=True, text=True, timeout=120, check=False,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert lines == [f"python -m bench.{module}: error: {missing}: no such file"]


@pytest.mark.skipif(unavailable_reason() is None, reason="a CUDA device is here")
@pytest.mark.parametrize("module", ["dmaload", "strided", "register", "launch_cost"])
def test_gpu_only_probe_without_a_device_says_so_in_one_line(module: str,
                                                             tmp_path: Path) -> None:
    """The GPU-only probes, run where there is no CUDA device: one line, exit code 2."""
    args = [] if module == "dmaload" else ["--out", str(tmp_path / "out.json")]
    done = subprocess.run([sys.executable, "-m", f"bench.{module}", *args],
                          capture_output=True, text=True, timeout=120, check=False,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith(f"python -m bench.{module}: error: bench.{module} needs a "
                               "CUDA device (")
    assert not (tmp_path / "out.json").exists()


def test_scratch_mapping_lives_only_in_its_block(tmp_path: Path) -> None:
    """``bench.register``'s and ``bench.strided``'s scratch file: its bytes mapped while the
    block runs, unmapped and deleted after it, an error inside included."""
    from bench.register import scratch_mapping

    path, nbytes = tmp_path / "scratch.bin", 64 << 20
    with pytest.raises(RuntimeError, match="inside"), \
            scratch_mapping(path, nbytes) as (fd, addr, mapping):
        assert mapping.ctypes.data == addr and mapping.size == nbytes
        assert mapping[:4096].tobytes() == os.pread(fd, 4096, 0)
        raise RuntimeError("inside")
    assert not path.exists()


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="needs CPU affinity")
def test_cpus_times_every_cpu_and_gives_the_mask_back(tmp_path: Path) -> None:
    """``bench.cpus``: one time a round for every CPU the process may use, and the
    caller's thread runs where it could before."""
    from bench.cpus import main as cpus_main

    before = os.sched_getaffinity(0)
    out = tmp_path / "cpus.json"
    assert cpus_main(["--rounds", "2", "--misses", "2000", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert os.sched_getaffinity(0) == before
    assert sorted(map(int, result["ms"])) == sorted(before)
    assert all(len(times) == 2 and min(times) > 0 for times in result["ms"].values())
    assert result["spread"] >= 1.0


def test_plan_table_bench_plans_every_expert(tmp_path: Path) -> None:
    """``bench.plan_table`` on one shape: every expert planned, its memory and time given."""
    from bench import plan_table

    out = tmp_path / "plan.json"
    assert plan_table.main(["--shapes", "qwen3-235b-a22b", "--repeats", "1",
                            "--out", str(out)]) == 0
    figures = json.loads(out.read_text())["qwen3-235b-a22b"]
    assert figures["experts"] == 94 * 128
    assert 100 < figures["kept_bytes_per_expert"] < 10_000
    assert figures["open_ms"] > 0 and figures["one_plan_us"] > 0


def test_sync_wake_bench_times_blocked_misses(tmp_path: Path) -> None:
    """``bench.sync_wake`` in this tree: every miss blocked the engine, each wake timed."""
    from bench import sync_wake

    out = tmp_path / "wake.json"
    assert sync_wake.main(["--rounds", "12", "--runs", "1", "--out", str(out)]) == 0
    (run,) = json.loads(out.read_text())["runs"].values()
    assert run[0]["blocked"] == 12
    assert 0 < run[0]["median_us"] <= run[0]["p90_us"]
