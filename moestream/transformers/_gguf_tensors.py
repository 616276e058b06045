"""A GGUF tensor's bytes as values on the host, as transformers loads a GGUF file: gguf-py's
numpy dequantization to float32.

One routine for both GGUF model builders' non-routed tensors: transformers' own mapping
(``_gguf.dense_tensors``) and ds4's DeepSeek V4 layout (``_gguf_ds4.ds4_dense_tensors``).
The routed experts are dequantized on the device instead (``_gguf_dequant``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

import moestream
from moestream.pipeline.foundation.errors import ModelFileError
from moestream.transformers._arguments import first_line

__all__ = ["dequantized"]


def dequantized(path: Path, spec: moestream.TensorSpec, data: bytearray) -> Any:
    """A tensor's bytes as gguf-py's float32 values of its shape (a numpy array).

    Raises:
        ModelFileError: a tensor type gguf-py cannot dequantize, or bytes that are not its
            shape's (the message names the tensor and ``path``).
    """
    try:
        kind = GGMLQuantizationType[spec.dtype]
        rows = np.frombuffer(data, dtype=np.uint8).reshape(*spec.shape[:-1], -1)
        return np.asarray(gguf_dequantize(rows, kind), dtype=np.float32).reshape(spec.shape)
    except (KeyError, ValueError, NotImplementedError) as exc:
        raise ModelFileError(path, f"{spec.name[:120]}: a {spec.dtype[:20]} tensor gguf cannot "
                             f"dequantize ({first_line(exc)[:120]})") from exc
