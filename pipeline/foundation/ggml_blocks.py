"""Where each GGUF quantized type keeps its float16 scales inside a block.

Any byte of these types' blocks is a valid quant index or scale except the float16 scale
fields (``d``, ``dmin``), which random bytes can make infinite or NaN; whoever makes valid
random blocks sets those to finite values. Two layers make such blocks: the model makers
(``pipeline.makers``: the expert bytes of the files they write) and the transformers
integration's benchmark and tests (blocks to dequantize), and the makers cannot import
``moestream.transformers``, so the one table lives here.
"""

from __future__ import annotations

from gguf import GGMLQuantizationType as Q

__all__ = ["F16_SCALES"]

F16_SCALES: dict[int, tuple[int, ...]] = {
    Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,),
    Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,),
    Q.IQ2_XXS: (0,), Q.IQ2_XS: (0,), Q.IQ3_XXS: (0,), Q.IQ4_XS: (0,), Q.MXFP4: (),
}
"""ggml type id -> its float16 scale fields, as byte offsets in its block (gguf-py's
``quants.py`` layouts; MXFP4's one scale is an E8M0 byte at 0, finite whatever it holds)."""
