"""moestream.transformers._gguf_tensors: a GGUF tensor's bytes are gguf-py's float32 values
of its shape, and what gguf-py cannot read is refused in one line naming the tensor."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")

import moestream  # noqa: E402
from moestream.pipeline.foundation.errors import ModelFileError  # noqa: E402
from moestream.transformers._gguf_tensors import dequantized  # noqa: E402

PATH = Path("model.gguf")


class TestDequantized:
    """One routine for both GGUF builders' dense tensors (transformers' mapping, ds4's)."""

    def test_q8_0_is_gguf_pys_values(self) -> None:
        values = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)
        raw = gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0)
        spec = moestream.TensorSpec("blk.0.attn_q.weight", "Q8_0", (3, 64), raw.nbytes)
        got = dequantized(PATH, spec, bytearray(raw.tobytes()))
        want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q8_0)
        assert got.dtype == np.float32 and got.shape == (3, 64)
        assert np.array_equal(got, want)

    def test_f16_keeps_its_shape(self) -> None:
        values = np.arange(24, dtype=np.float16).reshape(2, 3, 4)
        spec = moestream.TensorSpec("output_norm.weight", "F16", (2, 3, 4), values.nbytes)
        got = dequantized(PATH, spec, bytearray(values.tobytes()))
        assert np.array_equal(got, values.astype(np.float32))

    @pytest.mark.parametrize(("dtype", "nbytes"), [("NOPE", 8), ("Q8_0", 5)])
    def test_what_gguf_cannot_read_is_refused(self, dtype: str, nbytes: int) -> None:
        spec = moestream.TensorSpec("blk.1.ffn_norm.weight", dtype, (1, 32), nbytes)
        with pytest.raises(ModelFileError, match=r"blk\.1\.ffn_norm\.weight: a .* tensor gguf "
                                                 r"cannot dequantize") as caught:
            dequantized(PATH, spec, bytearray(nbytes))
        assert "model.gguf" in str(caught.value)
