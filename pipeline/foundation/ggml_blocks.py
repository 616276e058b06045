"""Where each GGUF quantized type keeps its float16 scales inside a block.

Any byte of these types' blocks is a valid quant index or scale except the float16 scale
fields (``d``, ``dmin``), which random bytes can make infinite or NaN; whoever makes valid
random blocks sets those to finite values. Two layers make such blocks: the model makers
(``pipeline.makers``: the expert bytes of the files they write) and the transformers
integration's benchmark and tests (blocks to dequantize), and the makers cannot import
``moestream.transformers``, so the one table lives here.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as Q

__all__ = ["F16_SCALES", "put_scales", "scale_count"]

F16_SCALES: dict[int, tuple[int, ...]] = {
    Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,),
    Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,),
    Q.IQ1_S: (0,), Q.IQ2_XXS: (0,), Q.IQ2_XS: (0,), Q.IQ2_S: (0,), Q.IQ3_XXS: (0,),
    Q.IQ3_S: (0,), Q.IQ4_NL: (0,), Q.IQ4_XS: (0,), Q.MXFP4: (), Q.NVFP4: (),
}
"""ggml type id -> its float16 scale fields, as byte offsets in its block (gguf-py's
``quants.py`` layouts; MXFP4's one scale is an E8M0 byte at 0 and NVFP4's four are UE4M3
bytes, finite whatever they hold).
IQ1_M is not here: its one float16 scale is split (``put_scales``)."""

_IQ1_M_WORDS = 48
"""IQ1_M's four scale words: the top nibble of word ``k`` is bits ``4k..4k+3`` of its
float16 scale, the rest 3-bit sub-block scales."""


def scale_count(qtype: int) -> int:
    """How many float16 scales a block of ``qtype`` holds."""
    return 1 if qtype == Q.IQ1_M else len(F16_SCALES[qtype])


def put_scales(blocks: np.ndarray, qtype: int, halves: np.ndarray) -> None:
    """Write float16 scales into ``blocks`` (``(n, block bytes)`` uint8, in place):
    ``halves`` ``(n, scale_count(qtype))``, their bits as uint16."""
    halves = np.asarray(halves, dtype=np.uint16)
    if qtype == Q.IQ1_M:
        for k in range(4):
            at = _IQ1_M_WORDS + 2 * k + 1  # the word's high byte
            nibble = ((halves[:, 0] >> (4 * k)) & 15).astype(np.uint8)
            blocks[:, at] = (blocks[:, at] & 0x0F) | (nibble << 4)
        return
    for j, at in enumerate(F16_SCALES[qtype]):
        blocks[:, at : at + 2] = halves[:, j].astype("<u2").view(np.uint8).reshape(-1, 2)
