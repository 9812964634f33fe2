"""Ragged paged attention (mixed prefill + decode over a paged KV cache): the public op.

The page layout and the ragged-batch description are documented in `reference.py`. Only the
XLA reference exists so far; the Pallas kernels (TPU, GPU) slot in behind
`ragged_paged_attention` without changing its callers.
"""

from __future__ import annotations

import jax

from pallas_kernels.ragged_paged_attention.reference import (
    ragged_paged_attention_reference,
    write_to_pages,
)

__all__ = ["ragged_paged_attention", "ragged_paged_attention_reference", "write_to_pages"]

IMPLEMENTATIONS = ("reference",)


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
    implementation: str = "reference",
) -> jax.Array:
    """`[T, N, H]` attention of packed query tokens to their sequences' paged keys.

    See `reference.ragged_paged_attention_reference` for the arguments.

    Raises:
        ValueError: An unknown implementation.
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"unknown ragged paged attention implementation {implementation!r}; "
                         f"known: {IMPLEMENTATIONS}")
    return ragged_paged_attention_reference(queries, kv_pages, kv_lens, page_indices,
                                            cu_q_lens, num_seqs, sm_scale=sm_scale,
                                            sliding_window=sliding_window)
