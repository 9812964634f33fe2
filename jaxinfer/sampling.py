"""Token sampling from logits: greedy, temperature, top-k and top-p, with explicit keys.

Every parameter is a traced array, so one compiled program serves every setting (the engine
passes per-request `[B]` arrays; reference generation broadcasts scalars).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def filter_logits(logits: jax.Array, temperature: jax.Array, top_k: jax.Array,
                  top_p: jax.Array) -> jax.Array:
    """Applies temperature, top-k and top-p (nucleus) filtering.

    Args:
        logits: `[B, V]` float32.
        temperature: `[B]`; must be > 0 here (greedy is handled by `sample`).
        top_k: `[B]` int32; 0 (or >= V) keeps every token.
        top_p: `[B]` float32 in (0, 1]; 1 keeps every token.

    Returns:
        `[B, V]` float32 scaled logits, -inf outside the kept set. The most likely token is
        always kept.
    """
    vocab = logits.shape[-1]
    scaled = logits / temperature[:, None]  # [B, V]
    descending = jnp.sort(scaled, axis=-1)[:, ::-1]  # [B, V]
    k = jnp.where((top_k <= 0) | (top_k > vocab), vocab, top_k)  # [B]
    kth_largest = jnp.take_along_axis(descending, (k - 1)[:, None], axis=-1)  # [B, 1]
    # Nucleus: keep the smallest prefix of the sorted tokens whose mass reaches top_p, counting
    # only tokens that survived top-k.
    ranks = jnp.arange(vocab)[None, :]  # [1, V]
    kept_by_k = jnp.where(ranks < k[:, None], descending, -jnp.inf)  # [B, V]
    probabilities = jax.nn.softmax(kept_by_k, axis=-1)  # [B, V]
    mass_before = jnp.cumsum(probabilities, axis=-1) - probabilities  # [B, V]
    inside_nucleus = mass_before < top_p[:, None]  # [B, V]; rank 0 always inside
    last_kept = jnp.sum(inside_nucleus & (ranks < k[:, None]), axis=-1) - 1  # [B]
    threshold = jnp.take_along_axis(descending, last_kept[:, None], axis=-1)  # [B, 1]
    threshold = jnp.maximum(threshold, kth_largest)  # [B, 1]
    return jnp.where(scaled >= threshold, scaled, -jnp.inf)  # [B, V]


def sample(logits: jax.Array, keys: jax.Array, temperature: jax.Array, top_k: jax.Array,
           top_p: jax.Array) -> jax.Array:
    """Draws one token per row; rows with temperature 0 take the argmax.

    Args:
        logits: `[B, V]` float32.
        keys: `[B]` PRNG keys, one per row, so a row's draw does not depend on the others.
        temperature: `[B]` float32.
        top_k: `[B]` int32.
        top_p: `[B]` float32.

    Returns:
        `[B]` int32 token ids.
    """
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B]
    safe_temperature = jnp.where(temperature > 0, temperature, 1.0)  # [B]
    filtered = filter_logits(logits, safe_temperature, top_k, top_p)  # [B, V]
    drawn = jax.vmap(jax.random.categorical)(keys, filtered).astype(jnp.int32)  # [B]
    return jnp.where(temperature > 0, drawn, greedy)
