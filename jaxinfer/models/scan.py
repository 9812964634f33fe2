"""Scan over layers: the engine's forward compiles one copy of the decoder block, not L.

A `Transformer` keeps its blocks as an `nnx.List` (checkpoints, quantization, hooks and the
parity tests address them one by one). Unrolled, the engine's step program holds L copies of
the block, and its compile time grows with depth (bench-30m's step: ~6 s at 8 layers, ~17 s
at 32). When every block has the same graph definition (no per-layer sliding windows, no
mixed quantization) and no activation hooks, `stack_layers` returns a copy of the model whose
blocks are one *stacked* block: each of its variables holds the L blocks' arrays along a new
leading axis (logical axis "layers", replicated). The copy's forward over a paged cache
(`scan_blocks`) runs `jax.lax.scan` over that axis, merging one block per iteration.

Stacking copies every block's weights, so it happens once, outside the jitted step: the
engine's runner stacks when it is built and keeps the stacked model's state as its own.

Inside the scan, each iteration's float linear weights are `StackedLayer` views (the whole
stack and the layer index) rather than slices: the matmul (`pallas_kernels.dense_matmul`)
reads the layer in place, where slicing made XLA:CPU copy every weight of the layer before its
dot each step (about 10 ms of a 30 ms batch-1 decode step of bench-30m). Quantized layers'
arrays are views too (`jaxinfer.quant.linear.QuantizedArray`): the CPU quantized-matmul
kernel reads them in place, and other paths slice them. Other variables (norm gains,
biases) are sliced.

A HARP model (`ModelConfig.harp_alphas`) has two kinds of blocks: the bottom
`num_cache_layers` with attention and a KV cache, and the HARP blocks above them, without
q/k projections or cache (each a graph of its own, its alpha being static). Only the first
kind is stacked and scanned; the copy keeps the HARP blocks as its `layers`, which the forward
runs one by one after the scan (a few top blocks, so unrolling them costs little compile time).

The page pool `[L, P, Z, 2K, H]` (int8: plus scales `[L, P, Z, 2K]`) is the scan's carry,
not a scanned input or output (a stacked output would be a new pool every step). Each block
writes and reads `pool[layer]` by passing the layer index into the attention ops, which index
the stacked pool directly: slicing `pool[layer]` out of the carry made XLA copy that layer's
whole pool before every write (`pallas_kernels.ragged_paged_attention.reference`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxinfer.models.attention import PagedBatch, PagedLayerCache
from jaxinfer.models.layers import ReadInPlace, StackedLayer

LAYERS_AXIS = "layers"  # the stacked variables' leading logical axis (no rule: replicated)


def uniform_block_graphdef(blocks: Sequence[nnx.Module]) -> nnx.GraphDef | None:
    """The blocks' shared graph definition, or None when they differ or when any of their
    modules holds activation hooks (`jaxinfer.models.hooks`; a capturing hook sows per
    block, which a scan cannot)."""
    if not blocks:
        return None
    for block in blocks:
        for _, module in nnx.iter_modules(block):
            if getattr(module, "activation_hooks", None) is not None:
                return None
    graphdefs = [nnx.graphdef(block) for block in blocks]
    if any(graphdef != graphdefs[0] for graphdef in graphdefs[1:]):
        return None
    return graphdefs[0]


def _with_layers_axis(variable: nnx.Variable) -> nnx.Variable:
    """A stacked variable's logical axes: "layers", then the block's own."""
    axes = variable.get_metadata().get("out_sharding")
    if axes is None:
        return variable
    return variable.replace(variable.get_value(), out_sharding=(LAYERS_AXIS, *axes))


def stack_block_states(blocks: Sequence[nnx.Module]) -> nnx.State:
    """The blocks' states stacked leaf by leaf: `[L, ...]` per variable (a copy)."""
    states = [nnx.state(block) for block in blocks]
    stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *states)  # [L, ...] each
    return jax.tree.map(_with_layers_axis, stacked,
                        is_leaf=lambda x: isinstance(x, nnx.Variable))


def cached_blocks(model: Any) -> list[nnx.Module]:
    """The blocks of `model` (a `Transformer` with unstacked layers) that have a KV cache:
    all but the HARP blocks on top."""
    return list(model.layers)[:model.config.num_cache_layers]


def can_stack_layers(model: Any) -> bool:
    """Whether `stack_layers(model)` gives a scanning copy (see `uniform_block_graphdef`)."""
    return uniform_block_graphdef(cached_blocks(model)) is not None


def stack_layers(model: Any) -> Any | None:
    """A copy of `model` (a `Transformer`) whose blocks with a KV cache are one stacked
    block, or None when they cannot be scanned (see `uniform_block_graphdef`).

    The copy shares every array but those blocks' (which it stacks, a copy of their
    weights); its `stacked_layers` holds the stacked block and its `layers` only the HARP
    blocks above (empty for a model without them). Its forward runs the stacked blocks with
    `scan_blocks` (no cache or a paged cache), then the HARP blocks.
    """
    blocks = cached_blocks(model)
    graphdef = uniform_block_graphdef(blocks)
    if graphdef is None:
        return None
    stacked = nnx.merge(graphdef, stack_block_states(blocks))
    copy = nnx.merge(*nnx.split(model))
    copy.layers = nnx.List(list(copy.layers)[len(blocks):])
    copy.stacked_layers = nnx.data(stacked)  # declared None (static) in `Transformer`
    return copy


def _layer_state(state: nnx.State, layer: jax.Array) -> nnx.State:
    """One iteration's block state: linear weights (float, and quantized layers' arrays) as
    `StackedLayer` views of their stacks (read in place by the matmul), every other variable
    sliced to `layer`."""

    def view(variable: nnx.Variable) -> nnx.Variable:
        stack = variable.get_value()  # [L, ...]
        if isinstance(variable, ReadInPlace):
            return variable.replace(StackedLayer(stack, layer))
        return variable.replace(jax.lax.dynamic_index_in_dim(stack, layer, keepdims=False))

    return jax.tree.map(view, state, is_leaf=lambda leaf: isinstance(leaf, nnx.Variable))


def scan_blocks(stacked: nnx.Module, x: jax.Array, positions: jax.Array,
                pages: jax.Array | None, scales: jax.Array | None, batch: PagedBatch | None
                ) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
    """Runs the stacked blocks over `x`, one `lax.scan` iteration per layer.

    Args:
        stacked: A block whose variables hold every layer's arrays, `[L, ...]`.
        x: `[B, T, D]` the residual stream entering the first block.
        positions: `[B, T]` int32 positions.
        pages: `[L, P, Z, 2K, H]` the stacked page pool, or None (no cache).
        scales: `[L, P, Z, 2K]` the int8 pool's scales, or None.
        batch: Where the step's tokens live in the pool (with `pages`).

    Returns:
        `([B, T, D]` the last block's output, the updated pool, its scales`)`.
    """
    graphdef, state = nnx.split(stacked)
    num_layers = jax.tree.leaves(state)[0].shape[0]

    def layer_body(carry: tuple[jax.Array, jax.Array | None, jax.Array | None],
                   layer: jax.Array
                   ) -> tuple[tuple[jax.Array, jax.Array | None, jax.Array | None], None]:
        x, pages, scales = carry  # [B, T, D], [L, P, Z, 2K, H], [L, P, Z, 2K]
        block = nnx.merge(graphdef, _layer_state(state, layer))
        cache = None if pages is None else PagedLayerCache(pages, batch, scales, layer)
        x, cache = block(x, positions, cache)  # [B, T, D]
        if cache is not None:
            pages, scales = cache.pages, cache.scales
        return (x, pages, scales), None

    (x, pages, scales), _ = jax.lax.scan(
        layer_body, (x, pages, scales), jnp.arange(num_layers, dtype=jnp.int32))
    return x, pages, scales
