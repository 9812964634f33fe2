"""Block sizes of the ragged paged attention kernel, kept out of the kernel file.

`block_tokens` packed query tokens per program: a multiple of 8 (the TPU sublane count) so the
`[block_tokens * G, H]` query tile fills whole vregs; large enough to amortize each page copy
over many query rows in prefill, small enough that decode-heavy steps (one token per
sequence) do not walk many sequences per tile. `pages_per_block` pages per copy-and-compute
step: ~128 keys per block keeps the `[rows, S]` score tile lane-dense on TPU.

The table is by page size; it has not been tuned on hardware yet (no TPU was lent to this
project so far), the values follow the arithmetic above.
"""

from __future__ import annotations

# page_size -> pages per block (~128 keys per block)
PAGES_PER_BLOCK = {8: 16, 16: 8, 32: 4, 64: 2, 128: 1}
DEFAULT_BLOCK_TOKENS = 32


def block_sizes(num_tokens: int, page_size: int, head_dim: int) -> tuple[int, int]:
    """`(block_tokens, pages_per_block)` for a step of `num_tokens` packed tokens.

    Args:
        num_tokens: T, the step's packed (padded) token count.
        page_size: Tokens per page.
        head_dim: H (bigger heads halve the keys per block to keep VMEM use flat).
    """
    block_tokens = min(DEFAULT_BLOCK_TOKENS, max(8, -(-num_tokens // 8) * 8))
    pages = PAGES_PER_BLOCK.get(page_size, max(1, 128 // page_size))
    if head_dim > 128:
        pages = max(1, pages // 2)
    return block_tokens, pages
