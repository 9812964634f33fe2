"""Default block sizes for the quantized matmul kernels, and how they fit a given shape.

The table holds the preferred `(block_m, block_n, block_k)` per weight format (formats
without a row use `GENERIC_BLOCK_SIZES`). They are starting points sized for TPU VMEM (a
few MiB per step with double buffering), not yet measured on hardware; replace them with
benchmark results when there are some.

`default_block_sizes` shrinks each preferred size to one that fits the problem: block_m
to the (padded) token count, so a decode step with 8 tokens does not pad to 128 rows;
block_n and block_k to the largest multiple of the hardware tile (and of the int4 group
size) that divides the dimension, or to the whole dimension when none does (a block that
spans the full dimension is always a legal Pallas block). An int4 group larger than the
preferred block_k is split instead: block_k divides the group (every block then lies in one
group), as a block of whole large groups (one group of all 14336 rows, say) needs more VMEM
than a TPU gives a kernel by default.
"""

from __future__ import annotations

import math

# format -> (block_m, block_n, block_k)
DEFAULT_BLOCK_SIZES: dict[str, tuple[int, int, int]] = {
    "int8": (128, 256, 512),
    "int4": (128, 256, 512),
    "w8a8": (128, 256, 512),
}
# A format with no row in the table (a newly registered one) starts from these.
GENERIC_BLOCK_SIZES = (128, 256, 512)

# Rows of a block are a multiple of the sublane tile: 8 for 32-bit, 16 for bfloat16 and
# 32 for int8. 32 satisfies all three, which matters for W8A8 with int8 activations.
ROW_MULTIPLE = 32
# Columns (and I, which is a column dimension of x) are a multiple of the 128-lane tile.
LANE_MULTIPLE = 128


def round_up(value: int, multiple: int) -> int:
    """The smallest multiple of `multiple` that is at least `value`."""
    return -(-value // multiple) * multiple


def _largest_dividing_block(dimension: int, preferred: int, multiple: int) -> int:
    """The largest multiple of `multiple` up to `preferred` dividing `dimension`, else it."""
    for block in range(preferred - preferred % multiple, 0, -multiple):
        if dimension % block == 0:
            return block
    return dimension


def default_block_sizes(
    weight_format: str, m: int, k: int, n: int, group_size: int | None = None
) -> tuple[int, int, int]:
    """The `(block_m, block_n, block_k)` the kernels use when none are given.

    Args:
        weight_format: A weight format name; one not in `DEFAULT_BLOCK_SIZES` starts from
            `GENERIC_BLOCK_SIZES`.
        m: Tokens (rows of x).
        k: Input features.
        n: Output features.
        group_size: The int4 scale group; block_k is kept a multiple of it, or a divisor
            of it when the group is larger than the preferred block_k and a multiple of the
            128-lane tile.

    Returns:
        Block sizes; block_n divides n and block_k divides k, block_m may need padding.
    """
    block_m, block_n, block_k = DEFAULT_BLOCK_SIZES.get(weight_format, GENERIC_BLOCK_SIZES)
    block_m = min(block_m, round_up(m, ROW_MULTIPLE))
    block_n = _largest_dividing_block(n, block_n, LANE_MULTIPLE)
    if group_size and group_size > block_k and group_size % LANE_MULTIPLE == 0:
        # A divisor of the group divides I too (I is a multiple of the group).
        return block_m, block_n, _largest_dividing_block(group_size, block_k, LANE_MULTIPLE)
    k_multiple = math.lcm(LANE_MULTIPLE, group_size) if group_size else LANE_MULTIPLE
    block_k = _largest_dividing_block(k, max(block_k, k_multiple), k_multiple)
    return block_m, block_n, block_k
