"""The proxy engine's CUDA dequantizer (``moestream.gpu.dequant.CudaDequantizer``) on a
device: every type bitwise gguf-py's float32 values on random valid blocks (every finite
float16 scale among them), every IQ grid point and sign pattern, every MXFP4 scale and code,
several matrices a launch; then ``real`` compute on a quantized model on CuPy: one launch
per type per batch, its layer sums close to the host's (cuBLAS and numpy add in their own
orders), and ``pipeline.run --backend cupy --compute real`` decoding a quantized model,
verified."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from moestream.gpu.cuda import unavailable_reason
from moestream.pipeline.foundation.compute import DEQUANTIZED
from tests.gguf_blocks import (
    every_pattern,
    random_blocks,
    reference,
    same_bits,
    write_quantized_moe,
)

_NO_CUDA = unavailable_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_NO_CUDA is not None, reason=str(_NO_CUDA)),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]
TYPES = sorted(DEQUANTIZED, key=lambda q: q.name)
LAYERS = [(Q.IQ2_XXS, Q.Q2_K), (Q.Q4_K, Q.Q6_K), (Q.F16, Q.Q5_K), (Q.Q8_0, Q.Q4_0)]


@pytest.fixture(scope="module")
def cuda() -> Any:
    """(cupy, backend, dequantizer) on device 0."""
    import cupy

    from moestream.gpu.cuda import CupyBackend
    from moestream.gpu.dequant import CudaDequantizer

    backend = CupyBackend()
    yield cupy, backend, CudaDequantizer()
    backend.close()


def _dequantize(cuda: Any, qtype: Q, mats: list[np.ndarray]) -> list[np.ndarray]:
    cupy, backend, dequantizer = cuda
    stream = backend.new_stream()
    sources = [cupy.asarray(m.reshape(-1)) for m in mats]
    total = sum(m.shape[0] for m in mats) * reference(qtype, mats[0][:1]).size
    out = cupy.full(total + 5, cupy.nan, dtype=cupy.float32)
    cupy.cuda.Device().synchronize()  # made on the legacy stream, unordered with ``stream``
    views = dequantizer.dequantize(qtype, sources, out, stream)
    stream.synchronize()
    assert bool(cupy.isnan(out[total:]).all())  # nothing written past the values
    return [cupy.asnumpy(v) for v in views]


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("extreme", [True, False], ids=["extreme", "small"])
def test_bitwise_gguf(cuda: Any, qtype: Q, extreme: bool) -> None:
    mats = [random_blocks(qtype, n, seed, extreme) for seed, n in enumerate((4099, 1, 37))]
    for m, values in zip(mats, _dequantize(cuda, qtype, mats), strict=True):
        assert same_bits(values, reference(qtype, m))


@pytest.mark.parametrize("qtype", [Q.IQ2_XXS, Q.IQ2_XS, Q.IQ3_XXS, Q.MXFP4],
                         ids=lambda q: q.name)
def test_every_code(cuda: Any, qtype: Q) -> None:
    blocks = every_pattern(qtype)
    (values,) = _dequantize(cuda, qtype, [blocks])
    assert same_bits(values, reference(qtype, blocks))


def test_a_whole_ds4_expert_matrix(cuda: Any) -> None:
    """ds4-flash-q2's expert shape (2048 x 4096): the grid-stride loop over 8M values."""
    for qtype in (Q.IQ2_XXS, Q.Q2_K):
        blocks = random_blocks(qtype, 2048 * 4096 // 256, seed=11)
        (values,) = _dequantize(cuda, qtype, [blocks])
        assert same_bits(values, reference(qtype, blocks))


@pytest.fixture(scope="module")
def quantized_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_quantized_moe(tmp_path_factory.mktemp("quantized") / "q.gguf", LAYERS,
                               experts=8, hidden=512, ffn=256)


class _Spy:
    """A dequantizer that records each call's type and hands it on."""

    def __init__(self, real: Any, calls: list[Q]) -> None:
        self._real, self._calls = real, calls

    def dequantize(self, qtype: Q, *rest: Any) -> Any:
        self._calls.append(qtype)
        return self._real.dequantize(qtype, *rest)


async def _layer(path: Path, layer: int, backend_name: str,
                 calls: list[Q] | None = None) -> np.ndarray:
    """A layer's weighted SwiGLU sum on ``backend_name`` (device 0), its experts one batch
    (the decoder's stream waits on their uploads, as the proxy's does)."""
    import moestream
    from moestream.gpu.kernels import make_kernels
    from moestream.gpu.selection import select_backend
    from moestream.pipeline.foundation.config import ComputeSpec
    from moestream.pipeline.foundation.table import open_table
    from moestream.pipeline.proxy.decoder import Decoder

    device = select_backend(backend_name)
    decoder = Decoder(ComputeSpec("real"), open_table(path), device, make_kernels(device.name),
                      seed=5)
    if calls is not None:
        decoder._dequant = _Spy(decoder._dequant, calls)
    try:
        async with moestream.open(path, backend=backend_name, mode="direct") as ms, \
                ms.fetch(layer, [6, 1, 2]) as lease:
            handles = await lease.gather()
            decoder.begin()
            with decoder.ctx:
                for h, w in zip(handles, (0.5, 0.3, 0.2), strict=True):
                    decoder.consume(h, w, 0.0)
                decoder.flush()
            decoder.stream.synchronize()
            acc = decoder.acc
            return np.asarray(acc.get() if hasattr(acc, "get") else acc)
    finally:
        device.close()


@pytest.mark.parametrize("layer", range(len(LAYERS)), ids=[f"{a.name}-{b.name}"
                                                           for a, b in LAYERS])
async def test_real_compute_matches_the_host(quantized_model: Path, layer: int) -> None:
    calls: list[Q] = []
    on_gpu = await _layer(quantized_model, layer, "cupy", calls)
    on_host = await _layer(quantized_model, layer, "host")
    assert sorted(calls, key=int) == sorted({t for t in LAYERS[layer] if t != Q.F16}, key=int)
    assert np.isfinite(on_gpu).all() and np.abs(on_host).max() > 0
    np.testing.assert_allclose(on_gpu, on_host, rtol=1e-4, atol=1e-5 * np.abs(on_host).max())


def test_pipeline_run_real_on_cupy(quantized_model: Path, tmp_path: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    from moestream.pipeline.run import main

    log = tmp_path / "run.jsonl"
    code = main(["-m", str(quantized_model), "-n", "4", "--backend", "cupy", "--compute",
                 "real", "--router", "live", "--cache-budget", "6", "--json", "--log", str(log)])
    summary = json.loads(capsys.readouterr().out)
    assert code == 0 and summary["mismatches"] == 0 and summary["misses"] > 0
    assert json.loads(log.read_text().splitlines()[0])["compute"] == "real"
