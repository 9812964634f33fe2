"""Default tile sizes for the MoE grouped-matmul kernel.

Kept apart from `kernel.py` so retuning never touches kernel code. The numbers are untuned
starting points that satisfy the TPU tiling rules (rows a multiple of the sublane packing,
columns a multiple of 128 lanes); the wrapper clamps each block to its dimension.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

# (lhs dtype name, int8 weights) -> (block_m, block_k, block_n).
_BLOCKS: dict[tuple[str, bool], tuple[int, int, int]] = {
    ("float32", False): (128, 128, 128),
    ("bfloat16", False): (128, 256, 256),
    ("float32", True): (128, 128, 128),
    ("bfloat16", True): (128, 256, 256),
}
_FALLBACK = (128, 128, 128)


def default_blocks(lhs_dtype: jnp.dtype, quantized: bool = False) -> tuple[int, int, int]:
    """The `(block_m, block_k, block_n)` to use for an lhs dtype and weight format.

    Args:
        lhs_dtype: Activation dtype.
        quantized: Whether the weights are int8 with per-channel scales.

    Returns:
        `(block_m, block_k, block_n)` before clamping to the problem shape.
    """
    return _BLOCKS.get((np.dtype(lhs_dtype).name, quantized), _FALLBACK)
