"""The proxy engine's ``real`` compute on GGUF quantized experts: each expert's matrices
dequantized (``moestream.gpu.dequant``) and its SwiGLU computed in float32, equal bit for bit
on the host to a numpy SwiGLU on gguf-py's own dequantization of the file's tensors; one
dequantization per type per batch of experts; a type it does not dequantize refused (or,
when no layer can be computed, the run falls back to digest compute, logged)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader

import moestream
from moestream.gpu.host import HostBackend
from moestream.gpu.kernels import HostKernels
from moestream.pipeline.foundation.config import ComputeSpec
from moestream.pipeline.foundation.table import open_table
from moestream.pipeline.proxy.decoder import Decoder
from moestream.pipeline.run import main as run_main
from tests.gguf_blocks import reference, write_quantized_moe

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

LAYERS = [(Q.IQ2_XXS, Q.Q2_K), (Q.Q4_K, Q.Q6_K), (Q.Q8_0, Q.Q4_0), (Q.F16, Q.Q5_K),
          (Q.Q5_0, Q.Q3_K), (Q.Q4_1, Q.Q5_1), (Q.IQ2_XS, Q.IQ3_XXS), (Q.IQ4_XS, Q.MXFP4)]
"""ds4's pair first, then every other type, one of them beside F16 in one expert."""
EXPERTS = [5, 0, 3]
WEIGHTS = [0.5, 0.25, 0.125]


@pytest.fixture(scope="module")
def quantized_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_quantized_moe(tmp_path_factory.mktemp("quantized") / "q.gguf", LAYERS)


def _swiglu(x: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> np.ndarray:
    g = gate @ x
    u = up @ x
    with np.errstate(over="ignore"):  # exp(-g) to inf: SiLU's limit, 0, as the kernel's
        silu = g / (1.0 + np.exp(-g))
    out: np.ndarray = down @ (silu * u)
    return out


def _reference_layer(path: Path, layer: int, x: np.ndarray, experts: Sequence[int],
                     weights: Sequence[float]) -> np.ndarray:
    """The layer's weighted SwiGLU sum from the file's tensors, dequantized by gguf-py."""
    tensors = {t.name: t for t in GGUFReader(path).tensors}
    acc = np.zeros_like(x)
    for e, w in zip(experts, weights, strict=True):
        mats = []
        for name in ("gate", "up", "down"):
            t = tensors[f"blk.{layer}.ffn_{name}_exps.weight"]
            rows, cols = (int(t.shape[1]), int(t.shape[0]))  # GGUF lists dims innermost first
            mats.append(reference(t.tensor_type, t.data[e]).reshape(rows, cols))
        acc += w * _swiglu(x, *mats)
    return acc


class _Spy:
    """A dequantizer that records each call's (type, matrices) and hands it on."""

    def __init__(self, real: Any, calls: list[tuple[Q, int]]) -> None:
        self._real, self._calls = real, calls

    def dequantize(self, qtype: Q, sources: Any, out: Any, stream: Any) -> Any:
        self._calls.append((qtype, len(sources)))
        return self._real.dequantize(qtype, sources, out, stream)


async def _layer_sum(path: Path, layer: int, spy: list[tuple[Q, int]] | None = None) -> tuple[
        np.ndarray, np.ndarray, list[int]]:
    """(hidden, the layer's sum, the experts in the order consumed) from one ``Decoder`` on
    the host backend: the layer's experts fetched and consumed as one batch."""
    table = open_table(path)
    decoder = Decoder(ComputeSpec("real"), table, HostBackend(), HostKernels(), seed=3)
    if spy is not None:
        decoder._dequant = _Spy(decoder._dequant, spy)
    async with moestream.open(path, backend="host", mode="direct") as ms, \
            ms.fetch(layer, EXPERTS) as lease:
        handles = await lease.gather()
        weight_of = dict(zip(EXPERTS, WEIGHTS, strict=True))
        decoder.begin()
        with decoder.ctx:
            for h in handles:
                decoder.consume(h, weight_of[h.expert], 0.0)
            decoder.flush()
        return decoder.hidden, decoder.acc, [h.expert for h in handles]


class TestExact:
    """A layer's real compute on quantized experts equals numpy's SwiGLU on gguf-py's values."""

    @pytest.mark.parametrize("layer", range(len(LAYERS)),
                             ids=[f"{a.name}-{b.name}" for a, b in LAYERS])
    async def test_bitwise_the_numpy_reference(self, quantized_model: Path, layer: int) -> None:
        hidden, acc, order = await _layer_sum(quantized_model, layer)
        weight_of = dict(zip(EXPERTS, WEIGHTS, strict=True))
        expected = _reference_layer(quantized_model, layer, hidden, order,
                                    [weight_of[e] for e in order])
        assert acc.dtype == np.float32 and np.isfinite(acc).all() and np.abs(acc).max() > 0
        assert np.array_equal(acc, expected)

    async def test_one_dequantization_per_type_per_batch(self, quantized_model: Path) -> None:
        calls: list[tuple[Q, int]] = []
        await _layer_sum(quantized_model, 0, calls)  # IQ2_XXS gate/up, Q2_K down
        assert sorted(calls) == sorted([(Q.IQ2_XXS, 2 * len(EXPERTS)), (Q.Q2_K, len(EXPERTS))])
        calls.clear()
        await _layer_sum(quantized_model, 3, calls)  # F16 gate/up: only down dequantized
        assert calls == [(Q.Q5_K, len(EXPERTS))]


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = run_main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


class TestRun:
    """``pipeline.run --compute real`` on a quantized model computes, verifies, and routes
    live from the state its arithmetic made."""

    def test_real_compute_decodes(self, quantized_model: Path, tmp_path: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
        traces = {}
        for compute in ("real", "digest"):
            log, trace = tmp_path / f"{compute}.jsonl", tmp_path / f"{compute}.npz"
            code, out, _ = _run(capsys, "-m", str(quantized_model), "-n", "3", "--backend",
                                "host", "--router", "live", "--compute", compute, "--json",
                                "--log", str(log), "--record-trace", str(trace))
            assert code == 0 and json.loads(out)["mismatches"] == 0
            start = json.loads(log.read_text().splitlines()[0])
            assert start["event"] == "run_start" and start["compute"] == compute
            traces[compute] = dict(np.load(trace))
        # digest compute never changes the hidden state; real compute does, layer by layer
        assert any(not np.array_equal(traces["real"][k], traces["digest"][k])
                   for k in traces["real"])


class TestRefusal:
    """A type real compute does not dequantize: refused in one line beside layers it can
    compute; a model it can compute nothing of falls back to digest compute."""

    @pytest.fixture(scope="class")
    def models(self, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
        where = tmp_path_factory.mktemp("refusal")
        return {"mixed": _with_tq1_0(where / "mixed.gguf", [True, False]),
                "none": _with_tq1_0(where / "none.gguf", [True, True])}

    def test_mixed_refused_in_one_line(self, models: dict[str, Path],
                                       capsys: pytest.CaptureFixture[str]) -> None:
        code, _, err = _run(capsys, "-m", str(models["mixed"]), "-n", "2", "--backend", "host",
                            "--compute", "real")
        lines = err.strip().splitlines()
        assert code == 2 and sum("error:" in line for line in lines) == 1
        assert "real compute cannot run layer 0's TQ1_0/TQ1_0 experts" in lines[-1]
        assert "Q2_K" in lines[-1] and "--compute digest" in lines[-1]

    def test_nothing_computable_falls_back(self, models: dict[str, Path],
                                           capsys: pytest.CaptureFixture[str],
                                           tmp_path: Path) -> None:
        log = tmp_path / "run.jsonl"
        code, out, _ = _run(capsys, "-m", str(models["none"]), "-n", "2", "--backend", "host",
                            "--compute", "real", "--json", "--log", str(log))
        assert code == 0 and json.loads(out)["mismatches"] == 0
        assert json.loads(log.read_text().splitlines()[0])["compute"] == "digest"


def _with_tq1_0(path: Path, tq1_0: Sequence[bool]) -> Path:
    """A model whose layer ``i`` is TQ1_0 (a type real compute lacks; any bytes: never
    dequantized) where ``tq1_0[i]``, else Q8_0."""
    from gguf import GGUFWriter

    from tests.gguf_blocks import random_blocks
    from tests.gguf_files import finish_gguf

    rng = np.random.default_rng(1)
    writer = GGUFWriter(path, "qwen3moe")
    writer.add_uint32("qwen3moe.block_count", len(tq1_0))
    writer.add_uint32("qwen3moe.expert_used_count", 2)
    writer.add_embedding_length(256)
    writer.add_tensor("token_embd.weight", rng.standard_normal((8, 256)).astype(np.float16))
    for layer, other in enumerate(tq1_0):
        writer.add_tensor(f"blk.{layer}.ffn_gate_inp.weight",
                          rng.standard_normal((4, 256)).astype(np.float32))
        for matrix in ("gate", "up", "down"):
            name = f"blk.{layer}.ffn_{matrix}_exps.weight"
            if other:  # TQ1_0: 256 values in 54 bytes
                raw = rng.integers(0, 256, (4, 256, 54), dtype=np.uint8)
                writer.add_tensor(name, raw, raw_dtype=Q.TQ1_0)
            else:
                blocks = random_blocks(Q.Q8_0, 4 * 256 * 8, seed=layer, extreme=False)
                writer.add_tensor(name, blocks.reshape(4, 256, 8 * 34), raw_dtype=Q.Q8_0)
    return finish_gguf(writer, path, {})
