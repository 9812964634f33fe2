"""Ragged paged attention (mixed prefill + decode over a paged KV cache): the public op.

The page layout and the ragged-batch description are documented in `reference.py`. Two
implementations exist so far: `xla` (the default: streams over pages with merged softmax
statistics, no per-token gathers; `xla.py`) and `reference` (readable, gathers every token's
whole page table). The Pallas kernels (TPU, GPU) slot in behind `ragged_paged_attention`
without changing its callers.
"""

from __future__ import annotations

import jax

from pallas_kernels.ragged_paged_attention.reference import (
    ragged_paged_attention_reference,
    write_to_pages,
)
from pallas_kernels.ragged_paged_attention.xla import ragged_paged_attention_xla

__all__ = ["ragged_paged_attention", "ragged_paged_attention_reference",
           "ragged_paged_attention_xla", "write_to_pages"]

IMPLEMENTATIONS = {"xla": ragged_paged_attention_xla,
                   "reference": ragged_paged_attention_reference}


def ragged_paged_attention(
    queries: jax.Array,
    kv_pages: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    implementation: str = "xla",
) -> jax.Array:
    """`[T, N, H]` attention of packed query tokens to their sequences' paged keys.

    See `reference.ragged_paged_attention_reference` for the arguments.

    Raises:
        ValueError: An unknown implementation.
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"unknown ragged paged attention implementation {implementation!r}; "
                         f"known: {sorted(IMPLEMENTATIONS)}")
    return IMPLEMENTATIONS[implementation](queries, kv_pages, kv_lens, page_indices, cu_q_lens,
                                           num_seqs, sm_scale=sm_scale,
                                           sliding_window=sliding_window)
