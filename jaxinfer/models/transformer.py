"""The decoder-only transformer shared by reference generation, the engine and training.

`Transformer(config, rngs=...)` builds the Llama-family model described by a `ModelConfig`
(dense SwiGLU or Mixtral MoE blocks, tied or untied embeddings; with `harp_alphas`, HARP
blocks on top whose attention has no q/k projections and no KV cache). `create_model` builds it
directly onto a device mesh under a sharding layout. The forward pass takes token ids and
their positions and, optionally, a contiguous KV cache (`KVCache`) or the engine's page pool
(`PagedKVCache`) that it updates. `jaxinfer.models.scan.stack_layers` gives the copy of a
model whose blocks run as one `lax.scan` (the engine's runner uses it).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jaxinfer.config import ModelConfig
from jaxinfer.kv_formats import KIVI_BITS, SCALED_KV_DTYPES, kivi_value_group
from jaxinfer.models.attention import Attention, LayerCache, PagedBatch, PagedLayerCache
from jaxinfer.models.harp_attention import HarpAttention
from jaxinfer.models.layers import MLP, Embedding, dtype_of, make_linear, make_norm
from jaxinfer.models.moe import MoEBlock
from jaxinfer.models.scan import scan_blocks
from jaxinfer.sharding import LogicalRules, activate, constrain, parameter_shardings
from pallas_kernels.ragged_paged_attention import (
    QUANTIZED_KV_DTYPES,
    KiviPool,
    create_kivi_pool,
)


class KVCache(NamedTuple):
    """Contiguous KV cache: one `LayerCache` per block with a cache (`config.num_cache_layers`:
    HARP blocks have none)."""

    layers: tuple[LayerCache, ...]

    @classmethod
    def create(cls, config: ModelConfig, batch_size: int, max_length: int,
               dtype: str | None = None) -> KVCache:
        """Allocates a zeroed cache of `[B, S, K, H]` keys and values per layer."""
        shape = (batch_size, max_length, config.num_kv_heads, config.head_dim)  # [B, S, K, H]
        cache_dtype = dtype_of(dtype or config.dtype)
        return cls(tuple(LayerCache(jnp.zeros(shape, cache_dtype), jnp.zeros(shape, cache_dtype))
                         for _ in range(config.num_cache_layers)))


class PagedKVCache(NamedTuple):
    """The engine's page pool, every layer's pages stacked in one `[L, P, Z, 2K, H]` array
    (page p is the same slot of the same tokens in every layer), plus the step's `PagedBatch`.
    L is `config.num_cache_layers`: the blocks below the HARP ones, block i using layer i.

    An 8-bit pool (int8, float8_e4m3fn or float8_e5m2 pages: `kv_cache_dtype` "int8",
    "fp8_e4m3", "fp8_e5m2") also holds float32 scales `[L, P, Z, 2K]`: one scale per token and
    (interleaved) key or value head over head_dim, symmetric absmax / the dtype's max
    (`pallas_kernels.ragged_paged_attention.write_to_quantized_pages`). A KIVI pool
    ("int4", "int2") holds packed uint8 pages `[L, P, Z, 2K, H * bits / 8]` and, as `scales`,
    a `KiviPool` (key and value scales and zero points, and the float32 residual pool whose
    seats `batch.residual_slots` names; `pallas_kernels.ragged_paged_attention.kivi`).
    Layer l reads and writes `pages[l]` through the ops' `layer=` index, never a slice of the
    pool.
    """

    pages: jax.Array  # [L, P, Z, 2K, H]
    batch: PagedBatch
    scales: jax.Array | KiviPool | None = None  # [L, P, Z, 2K], or a KIVI pool's arrays

    @classmethod
    def create(cls, config: ModelConfig, num_pages: int, page_size: int,
               batch: PagedBatch, dtype: str | None = None,
               num_residual: int = 1) -> PagedKVCache:
        """Allocates a zeroed pool of `num_pages` pages per layer; `dtype` "int8", "fp8_e4m3"
        or "fp8_e5m2" (`jaxinfer.kv_formats.SCALED_KV_DTYPES`) gives the quantized pool with
        its scales, "int4" or "int2" KIVI's pool with `num_residual` residual seats (one per
        sequence that can run at once)."""
        shape = (config.num_cache_layers, num_pages, page_size, 2 * config.num_kv_heads,
                 config.head_dim)  # [L, P, Z, 2K, H]
        name = dtype or config.dtype
        if name in KIVI_BITS:
            pages, pool = create_kivi_pool(
                config.num_cache_layers, num_pages, page_size, config.num_kv_heads,
                config.head_dim, KIVI_BITS[name], kivi_value_group(config.head_dim),
                num_residual)
            return cls(pages, batch, pool)  # [L, P, Z, 2K, H*bits/8], KiviPool
        cache_dtype = dtype_of(SCALED_KV_DTYPES.get(name, name))
        scales = None
        if cache_dtype in QUANTIZED_KV_DTYPES:
            scales = jnp.zeros(shape[:4], jnp.float32)  # [L, P, Z, 2K]
        return cls(jnp.zeros(shape, cache_dtype), batch, scales)


AnyCache = KVCache | PagedKVCache


def _layer_cache(cache: AnyCache | None, index: int,
                 config: ModelConfig) -> LayerCache | PagedLayerCache | None:
    """Block `index`'s view of `cache`: its layer (block i is cache layer i), or None for a
    HARP block, which has no cache layer."""
    if cache is None or index >= config.num_cache_layers:
        return None
    if isinstance(cache, PagedKVCache):
        return PagedLayerCache(cache.pages, cache.batch, cache.scales, index)
    return cache.layers[index]


def _with_layer(cache: AnyCache | None, index: int,
                layer_cache: LayerCache | PagedLayerCache | None) -> AnyCache | None:
    """`cache` after block `index` updated it (a paged layer returns the whole pool)."""
    if cache is None or layer_cache is None:
        return cache
    if isinstance(cache, PagedKVCache):
        return cache._replace(pages=layer_cache.pages, scales=layer_cache.scales)
    layers = list(cache.layers)
    layers[index] = layer_cache
    return KVCache(tuple(layers))


class DecoderBlock(nnx.Module):
    """Pre-norm block: x + attn(norm(x)), then h + mlp(norm(h)).

    Block `layer` of a HARP model (`config.harp_alpha(layer)` set) has a `HarpAttention`:
    x + alpha * W_o W_v norm(x), no cache; with alpha = 0 the attention sub-block is skipped.
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, layer: int = 0) -> None:
        self.input_norm = make_norm(config, rngs=rngs)
        harp_alpha = config.harp_alpha(layer)
        self.attention: Attention | HarpAttention = (
            Attention(config, rngs=rngs) if harp_alpha is None
            else HarpAttention(config, harp_alpha, rngs=rngs))
        self.post_attention_norm = make_norm(config, rngs=rngs)
        self.mlp = MoEBlock(config, rngs=rngs) if config.is_moe else MLP(config, rngs=rngs)

    def __call__(
        self, x: jax.Array, positions: jax.Array, cache: LayerCache | PagedLayerCache | None
    ) -> tuple[jax.Array, LayerCache | PagedLayerCache | None]:
        if isinstance(self.attention, HarpAttention):
            if cache is not None:
                raise ValueError("a HARP block has no KV cache; it was given one")
            # alpha = 0 drops the sub-block, except under activation hooks: calibration
            # (GPTQ, Wanda, SparseGPT) captures every block's four linear-input sites, so
            # the sub-block runs and adds exactly 0 * W_o W_v norm(x).
            if self.attention.alpha != 0.0 or self.attention.activation_hooks is not None:
                x = x + self.attention(self.input_norm(x))  # [B, T, D]
        else:
            attended, cache = self.attention(self.input_norm(x), positions, cache)  # [B, T, D]
            x = x + attended  # [B, T, D]
        return self.feed_forward(x), cache

    def feed_forward(self, x: jax.Array) -> jax.Array:
        """The MLP sub-block on the `[B, T, D]` residual stream after attention:
        `x + mlp(norm(x))`, `[B, T, D]`."""
        x = constrain(x, ("batch", "length", "act_embed"))  # [B, T, D]
        x = x + self.mlp(self.post_attention_norm(x))  # [B, T, D]
        return constrain(x, ("batch", "length", "act_embed"))


class Transformer(nnx.Module):
    """Llama-family decoder-only language model.

    With `config.embedding_projection` (OSP's EmbProj), two orthogonally initialized `[D, D]`
    maps sit after the embedding lookup (`input_projection`) and between the final norm and
    the LM head (`output_projection`); `train_distill.osp.fold_osp` folds them into the
    embedding and the head for export.
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs) -> None:
        self.config = config
        param_dtype, dtype = dtype_of(config.param_dtype), dtype_of(config.dtype)
        self.embed = Embedding(config.vocab_size, config.hidden_size, param_dtype=param_dtype,
                               dtype=dtype, rngs=rngs)
        self.layers = nnx.List([DecoderBlock(config, rngs=rngs, layer=layer)
                                for layer in range(config.num_layers)])
        # Set only on the scanning copy `jaxinfer.models.scan.stack_layers` makes: one block
        # whose variables hold the arrays of every block with a cache; `layers` then keeps
        # only the HARP blocks above them (none for a dense model), run one by one.
        self.stacked_layers: DecoderBlock | None = None
        self.final_norm = make_norm(config, rngs=rngs)
        if config.embedding_projection:
            orthogonal = jax.nn.initializers.orthogonal()
            d = config.hidden_size
            self.input_projection = make_linear(rngs, (d, d), ("embed", None), param_dtype,
                                                init=orthogonal)
            self.output_projection = make_linear(rngs, (d, d), ("embed", None), param_dtype,
                                                 init=orthogonal)
        else:
            self.input_projection = self.output_projection = None
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = make_linear(rngs, (config.hidden_size, config.vocab_size),
                                       ("embed", "vocab"), param_dtype)

    def embed_tokens(self, token_ids: jax.Array) -> jax.Array:
        """`[B, T]` token ids to the `[B, T, D]` residual stream entering the first block
        (the embedding, then OSP's input projection if the model has one)."""
        x = self.embed(token_ids)  # [B, T, D]
        if self.input_projection is not None:
            x = self.input_projection(x)  # [B, T, D]
        return constrain(x, ("batch", "length", "act_embed"))  # [B, T, D]

    def hidden_states(
        self,
        token_ids: jax.Array,
        positions: jax.Array,
        cache: AnyCache | None = None,
        *,
        intermediates: list[jax.Array] | None = None,
    ) -> tuple[jax.Array, AnyCache | None]:
        """Runs the blocks and the final norm.

        Args:
            token_ids: `[B, T]` int32.
            positions: `[B, T]` int32 absolute positions (also the cache slots written).
            cache: A contiguous cache, or the engine's paged cache (then B = 1: the tokens
                are a packed ragged batch), to read and update; or None.
            intermediates: If given, receives every hidden state the outlier metrics look
                at, each `[B, T, D]`: the embedding output, each block's residual-stream
                output, and the final normed output (L + 2 arrays).

        Returns:
            `([B, T, D]` final hidden states, the updated cache or None`)`.

        Raises:
            ValueError: A model with stacked layers was given a contiguous cache or
                `intermediates` (its scan serves the paged cache and no cache only).
        """
        x = self.embed_tokens(token_ids)  # [B, T, D]
        if intermediates is not None:
            intermediates.append(x)
        if self.stacked_layers is not None:
            if intermediates is not None or isinstance(cache, KVCache):
                raise ValueError("a model with stacked layers runs with a paged cache or none,"
                                 " without intermediates")
            pages, scales, batch = (None, None, None) if cache is None else (
                cache.pages, cache.scales, cache.batch)  # [L, P, Z, 2K, H], [L, P, Z, 2K]
            x, pages, scales = scan_blocks(self.stacked_layers, x, positions, pages, scales,
                                           batch)  # [B, T, D]
            if cache is not None:
                cache = cache._replace(pages=pages, scales=scales)
        # In the stacked copy, `layers` starts at the first HARP block.
        first = 0 if self.stacked_layers is None else self.config.num_cache_layers
        for index, block in enumerate(self.layers, start=first):
            x, layer_cache = block(x, positions,
                                   _layer_cache(cache, index, self.config))  # [B, T, D]
            cache = _with_layer(cache, index, layer_cache)
            if intermediates is not None:
                intermediates.append(x)
        x = self.final_norm(x)  # [B, T, D]
        if intermediates is not None:
            intermediates.append(x)
        return self._project_output(x), cache

    def final_hidden(self, x: jax.Array) -> jax.Array:
        """The `[B, T, D]` residual stream leaving the last block to the hidden states the
        LM head reads (the final norm, then OSP's output projection if any): `[B, T, D]`."""
        return self._project_output(self.final_norm(x))

    def _project_output(self, x: jax.Array) -> jax.Array:
        if self.output_projection is not None:
            x = self.output_projection(x)  # [B, T, D]
        return x

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Projects `[B, T, D]` hidden states to `[B, T, V]` float32 logits."""
        if self.lm_head is None:  # tied: the embedding table is the head
            logits = self.embed.attend(hidden)  # [B, T, V]
        else:
            logits = self.lm_head(hidden, out_dtype=jnp.float32)  # [B, T, V]
        return constrain(logits, ("batch", "length", "act_vocab"))

    def __call__(self, token_ids: jax.Array, positions: jax.Array | None = None,
                 cache: AnyCache | None = None) -> tuple[jax.Array, AnyCache | None]:
        """Returns `([B, T, V]` float32 logits, the updated cache or None`)`.

        `positions` defaults to 0..T-1 for every row (no cache, or an empty one).
        """
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(token_ids.shape[1], dtype=jnp.int32),
                                         token_ids.shape)  # [B, T]
        hidden, cache = self.hidden_states(token_ids, positions, cache)  # [B, T, D]
        return self.logits(hidden), cache


def abstract_model(config: ModelConfig) -> Transformer:
    """The model with shapes and logical axes only (no memory allocated)."""
    return nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))


def model_shardings(config: ModelConfig, mesh: Mesh,
                    layout: str | LogicalRules = "tensor_parallel", *,
                    model: Transformer | None = None) -> nnx.State:
    """The NamedSharding of every parameter of a `config` model on `mesh` under `layout`.

    Args:
        config: The model's config.
        mesh: The device mesh.
        layout: The sharding layout.
        model: The (abstract) model when it is not the config's float model, e.g. a
            quantized one, whose integer arrays carry their own logical axes.

    Raises:
        ShardingError: A parameter cannot be split as the layout asks on this mesh.
    """
    return parameter_shardings(nnx.state(model or abstract_model(config)), mesh, layout)


def create_model(
    config: ModelConfig,
    *,
    seed: int = 0,
    mesh: Mesh | None = None,
    layout: str | LogicalRules = "tensor_parallel",
) -> Transformer:
    """Builds a randomly initialized model, placed on `mesh` under `layout` if given.

    With a mesh, the parameter shardings are computed (and checked) from the abstract model
    first, and one jitted initializer creates each parameter directly on its shards, so no
    device ever holds a full copy of a split parameter.

    Raises:
        ShardingError: A parameter cannot be split as the layout asks on this mesh.
    """
    if mesh is None:
        return Transformer(config, rngs=nnx.Rngs(seed))
    graphdef = nnx.graphdef(abstract_model(config))
    shardings = model_shardings(config, mesh, layout)

    @functools.partial(jax.jit, out_shardings=shardings)
    def initialize() -> nnx.State:
        return nnx.state(Transformer(config, rngs=nnx.Rngs(seed)))

    with activate(mesh, layout):
        state = initialize()
    return nnx.merge(graphdef, state)
