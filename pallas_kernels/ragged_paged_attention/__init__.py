"""Ragged paged attention (mixed prefill + decode over a paged KV cache): the public op.

The page layout and the ragged-batch description are documented in `reference.py`.
Implementations (chosen by `implementation=`, see `pallas_kernels.dispatch`):

- "pallas" / "interpret": the Pallas TPU kernel (`kernel.py`; `kivi_kernel.py` for KIVI
  pools; pages copied HBM -> VMEM asynchronously, double-buffered, online softmax in f32),
  compiled on TPU or interpreted;
- "xla": streams over pages with merged softmax statistics, no per-token gathers (`xla.py`),
  the default off-TPU; on XLA:CPU its decode walk is a C++ kernel (`cpu.py`, built on first
  use);
- "reference": readable, gathers every token's whole page table (`reference.py`), the oracle.

"auto" (the default) is the kernel on TPU and "xla" elsewhere, unless forced.
"""

from __future__ import annotations

import jax

from pallas_kernels import dispatch
from pallas_kernels.ragged_paged_attention.kernel import ragged_paged_attention_kernel
from pallas_kernels.ragged_paged_attention.kivi import (
    KiviPool,
    create_kivi_pool,
    dequantize_pool,
    write_to_kivi_pages,
)
from pallas_kernels.ragged_paged_attention.kivi_kernel import ragged_paged_attention_kivi_kernel
from pallas_kernels.ragged_paged_attention.reference import (
    QUANTIZED_KV_DTYPES,
    dequantize_pages,
    quantize_kv_rows,
    ragged_paged_attention_reference,
    write_to_pages,
    write_to_quantized_pages,
)
from pallas_kernels.ragged_paged_attention.tuning import block_sizes
from pallas_kernels.ragged_paged_attention.xla import ragged_paged_attention_xla

__all__ = [
    "QUANTIZED_KV_DTYPES",
    "KiviPool",
    "create_kivi_pool",
    "dequantize_pages",
    "dequantize_pool",
    "quantize_kv_rows",
    "ragged_paged_attention",
    "ragged_paged_attention_kernel",
    "ragged_paged_attention_reference",
    "ragged_paged_attention_xla",
    "write_to_kivi_pages",
    "write_to_pages",
    "write_to_quantized_pages",
]


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
    soft_cap: float | None = None,
    kv_scales: jax.Array | KiviPool | None = None,
    layer: jax.Array | int | None = None,
    residual_slots: jax.Array | None = None,
    implementation: str = "auto",
) -> jax.Array:
    """`[T, N, H]` attention of packed query tokens to their sequences' paged keys.

    See `reference.ragged_paged_attention_reference` for the arguments; `soft_cap` caps the
    logits as `cap * tanh(s / cap)`; `kv_scales` (`[P, Z, 2K]` float32) marks an 8-bit
    pool written by `write_to_quantized_pages`. With `layer` (an int32 scalar, e.g. a scan's
    layer index), `kv_pages` is the stacked `[L, P, Z, 2K, H]` pool of every layer (scales
    `[L, P, Z, 2K]`) and that layer's pages are read in place. A KIVI pool (packed uint8
    pages) passes its `KiviPool` as `kv_scales` and each sequence's residual seat as
    `residual_slots` `[Q]` (`kivi.py`); "auto" gives it the XLA path on TPU, where its
    Pallas kernel does not compile yet.

    Raises:
        ValueError: An unknown implementation.
    """
    choice = dispatch.resolve(implementation)
    if implementation == "auto" and choice == "pallas" and isinstance(kv_scales, KiviPool):
        # Mosaic cannot lower the KIVI kernel's code unpacking yet (the TPU AOT cases record
        # the compiler's errors); it runs in interpret mode only, and on TPU a KIVI pool
        # takes the XLA path.
        choice = "xla"
    arguments = (queries, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    if choice in ("pallas", "interpret"):
        page_size = kv_pages.shape[1 if layer is None else 2]
        block_tokens, pages_per_block = block_sizes(queries.shape[0], page_size,
                                                    queries.shape[2])
        if isinstance(kv_scales, KiviPool):
            return ragged_paged_attention_kivi_kernel(
                *arguments, sm_scale=sm_scale, kv_scales=kv_scales,
                residual_slots=residual_slots, sliding_window=sliding_window,
                soft_cap=soft_cap, layer=layer, block_tokens=block_tokens,
                pages_per_block=pages_per_block, interpret=dispatch.interpret_mode(choice))
        return ragged_paged_attention_kernel(
            *arguments, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
            kv_scales=kv_scales, layer=layer, block_tokens=block_tokens,
            pages_per_block=pages_per_block,
            interpret=dispatch.interpret_mode(choice))
    implementations = {"xla": ragged_paged_attention_xla,
                       "reference": ragged_paged_attention_reference}
    return implementations[choice](*arguments, sm_scale=sm_scale,
                                   sliding_window=sliding_window, soft_cap=soft_cap,
                                   kv_scales=kv_scales, layer=layer,
                                   residual_slots=residual_slots)
