"""Files this project did not write: expert slices at any offset and of any size.

``gguf.GGUFWriter`` places tensors at its own alignment after tensors of any size, so an
expert's gate, up and down slices can each straddle one more page than expert 0's. Direct
mode reads the aligned covers into staging slots; resident mode copies from the mapping.
Both must deliver the file's bytes exactly, which ``--compute digest`` checks for every
consumed expert against a digest of the file's own bytes.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFWriter
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moestream.pipeline.foundation.table import open_table
from moestream.pipeline.run import main
from moestream.stages.layout import PAGE, plan_expert, plan_table
from tests.conftest import BACKENDS
from tests.gguf_files import finish_gguf

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


REPORTED_PAD = 1
"""With this padding each slice of expert 0 fits in one page and each of expert 1's straddles
two: expert 1's covers are three pages larger."""


def _write_model(path: Path, *, hidden: int, ffn: int, experts: int, pad_elems: int,
                 alignment: int, seed: int) -> Path:
    """Two MoE layers of F16 experts (with routers) after a tensor of ``pad_elems`` values."""
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(path, "deepseek2")
    writer.add_uint32("deepseek2.block_count", 3)
    writer.add_uint32("deepseek2.expert_used_count", 2)
    writer.add_custom_alignment(alignment)
    tensors = {"blk.0.attn_norm.weight": rng.standard_normal(pad_elems).astype(np.float16),
               "token_embd.weight": rng.standard_normal((6, hidden)).astype(np.float16)}
    for layer in (1, 2):
        tensors[f"blk.{layer}.ffn_gate_inp.weight"] = (
            rng.standard_normal((experts, hidden)).astype(np.float32))
    for layer in (1, 2):
        for matrix, shape in (("gate", (ffn, hidden)), ("up", (ffn, hidden)),
                              ("down", (hidden, ffn))):
            tensors[f"blk.{layer}.ffn_{matrix}_exps.weight"] = (
                rng.standard_normal((experts, *shape)).astype(np.float16))
    return finish_gguf(writer, path, tensors)


class TestLargestSlot:
    """Every expert is planned, its reads covering its covers: the staging slot fits the
    largest aligned cover of any expert, not expert 0's."""

    @settings(max_examples=40, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(hidden=st.integers(4, 72), ffn=st.integers(4, 72), experts=st.integers(2, 24),
           pad=st.integers(1, 5000), alignment=st.sampled_from([32, 64, 128, 4096]))
    def test_exact_over_every_expert(self, tmp_path: Path, hidden: int, ffn: int,
                                     experts: int, pad: int, alignment: int) -> None:
        path = _write_model(tmp_path / "m.gguf", hidden=hidden, ffn=ffn, experts=experts,
                            pad_elems=pad, alignment=alignment, seed=pad)
        table = open_table(path)
        chunk = PAGE * (1 + pad % 3)
        plans = plan_table(table)
        assert len(plans) == sum(moe.n_experts for moe in table.layers.values())
        for (layer, e), plan in plans.items():
            alone = plan_expert(table.slices((layer, e)))
            assert (plan.ranges, plan.slot_bytes, plan.copies) == (
                alone.ranges, alone.slot_bytes, alone.copies)
            reads = [(s.cover_start + at - s.slot_offset, at, n) for s in plan.ranges
                     for at in range(s.slot_offset, s.slot_offset + s.cover_bytes, chunk)
                     for n in [min(chunk, s.slot_offset + s.cover_bytes - at)]]
            assert plan.reads(chunk) == reads  # the covers, each slot byte read once

    def test_expert_zero_is_not_the_largest(self, tmp_path: Path) -> None:
        """The reported shape: 2 KiB matrices; odd experts straddle three more pages.

        The old sizing (expert 0's cover of the largest layer plus two pages) was short.
        """
        path = _write_model(tmp_path / "m.gguf", hidden=32, ffn=32, experts=16,
                            pad_elems=REPORTED_PAD, alignment=32, seed=1)
        table = open_table(path)
        first = max(plan_expert(table.slices((layer, 0))).slot_bytes for layer in table.layers)
        largest = max(plan.slot_bytes for plan in plan_table(table).values())
        assert largest == first + 3 * PAGE


class TestModesDeliverTheFileBytes:
    """Direct and resident decodes of writer-made files consume exactly the file's bytes."""

    @settings(max_examples=12, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(hidden=st.integers(8, 80), ffn=st.integers(8, 80), pad=st.integers(1, 9000),
           alignment=st.sampled_from([32, 64, 4096]), mode=st.sampled_from(["direct",
                                                                            "resident"]))
    def test_digest_compute_matches(self, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                    hidden: int, ffn: int, pad: int, alignment: int,
                                    mode: str) -> None:
        path = _write_model(tmp_path / "m.gguf", hidden=hidden, ffn=ffn, experts=16,
                            pad_elems=pad, alignment=alignment, seed=pad)
        code = main(["-m", str(path), "-n", "6", "--mode", mode, "--compute", "digest",
                     "--cache-budget", "6", "--staging-slots", "3", "--chunk", "8KiB",
                     "--backend", "host", "--json"])
        out, _ = capsys.readouterr()
        summary = json.loads(out)
        assert code == 0
        assert summary["mismatches"] == 0 and summary["verified"] > 0

    @pytest.mark.parametrize("backend", BACKENDS)
    @pytest.mark.parametrize("mode", ["direct", "resident"])
    def test_reported_file_on_each_backend(self, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str], backend: str,
                                           mode: str) -> None:
        """The reported file, on the host backend and on CuPy (staging, streams, events)."""
        path = _write_model(tmp_path / "m.gguf", hidden=32, ffn=32, experts=16,
                            pad_elems=REPORTED_PAD, alignment=32, seed=1)
        code = main(["-m", str(path), "-n", "8", "--mode", mode, "--compute", "digest",
                     "--cache-budget", "6", "--backend", backend, "--json"])
        summary = json.loads(capsys.readouterr()[0])
        assert code == 0
        assert summary["mismatches"] == 0 and summary["verified"] > 0

    def test_real_compute_without_verification(self, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
        """The reported case: ``--compute real --no-verify`` exited 0 on wrong bytes.

        The live router routes on the hidden state the experts computed, so its recorded
        routing must equal the resident run's, which copies from the mapping and never
        touches a staging slot.
        """
        path = _write_model(tmp_path / "m.gguf", hidden=32, ffn=32, experts=16,
                            pad_elems=REPORTED_PAD, alignment=32, seed=1)
        traces = []
        for mode in ("direct", "resident"):
            trace = tmp_path / f"{mode}.npz"
            code = main(["-m", str(path), "-n", "6", "--mode", mode, "--compute", "real",
                         "--router", "live", "--no-verify", "--cache-budget", "6",
                         "--backend", "host", "--json", "--record-trace", str(trace)])
            capsys.readouterr()
            assert code == 0
            with np.load(trace) as npz:
                traces.append({name: npz[name].copy() for name in npz.files})
        assert traces[0].keys() == traces[1].keys()
        for name, array in traces[0].items():
            np.testing.assert_array_equal(array, traces[1][name], err_msg=name)
