"""Reference generation: a contiguous KV cache, jitted prefill and decode, one batch at a time.

This is the slow, obviously correct path that the engine is tested against. A batch of prompts
is right-padded into one prefill; every row then decodes one token per step at its own
position (see `jaxinfer.models.attention` for why right padding needs no mask). Generation of
a row stops at any EOS id (the EOS token is included in its output, as in transformers) or
after `max_new_tokens`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfer.models import KVCache, Transformer
from jaxinfer.sampling import sample


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """How to pick each next token.

    Attributes:
        temperature: 0 means greedy.
        top_k: Keep the k most likely tokens; 0 keeps all.
        top_p: Keep the smallest set of tokens whose probability reaches p; 1 keeps all.
        seed: Seeds the sampling keys; the same seed gives the same tokens.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature = {self.temperature}: must be >= 0")
        if self.top_k < 0:
            raise ValueError(f"top_k = {self.top_k}: must be >= 0 (0 disables it)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p = {self.top_p}: must be in (0, 1]")


def _bucket(length: int, minimum: int = 16) -> int:
    # Powers of two bound the number of compiled prefill shapes.
    return max(minimum, 1 << (length - 1).bit_length())


@functools.partial(jax.jit, static_argnums=0, donate_argnames="cache")
def _forward_last(graphdef: nnx.GraphDef, state: nnx.State, token_ids: jax.Array,
                  positions: jax.Array, last_index: jax.Array,
                  cache: KVCache) -> tuple[jax.Array, KVCache]:
    """Runs the model over `[B, T]` tokens; returns the logits at `last_index` `[B, V]`."""
    model = nnx.merge(graphdef, state)
    hidden, cache = model.hidden_states(token_ids, positions, cache)  # [B, T, D]
    rows = jnp.arange(token_ids.shape[0])
    last_hidden = hidden[rows, last_index][:, None, :]  # [B, 1, D]
    return model.logits(last_hidden)[:, 0, :], cache  # [B, V]


@jax.jit
def _sample_step(logits: jax.Array, base_key: jax.Array, step: jax.Array,
                 temperature: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    batch = logits.shape[0]
    step_key = jax.random.fold_in(base_key, step)
    keys = jax.vmap(lambda row: jax.random.fold_in(step_key, row))(jnp.arange(batch))  # [B]
    full = lambda value, dtype: jnp.full((batch,), value, dtype)  # noqa: E731
    return sample(logits, keys, full(temperature, jnp.float32), full(top_k, jnp.int32),
                  full(top_p, jnp.float32))  # [B]


def generate(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    sampling: SamplingConfig | None = None,
    eos_token_ids: Sequence[int] | None = None,
) -> list[list[int]]:
    """Continues each prompt.

    Args:
        model: The model.
        prompts: Token ids per prompt (non-empty, any lengths).
        max_new_tokens: Most tokens to generate per prompt.
        sampling: Sampling settings; greedy by default.
        eos_token_ids: Stop ids; defaults to the model config's. Pass `()` to never stop early.

    Returns:
        The generated token ids per prompt (prompt excluded, EOS included when hit).

    Raises:
        ValueError: An empty prompt, a token id outside the vocabulary, or a total length
            past the model's maximum.
    """
    config = model.config
    sampling = sampling or SamplingConfig()
    stop_ids = set(config.eos_token_ids if eos_token_ids is None else eos_token_ids)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens = {max_new_tokens}: must be >= 1")
    for index, prompt in enumerate(prompts):
        if not prompt:
            raise ValueError(f"prompt {index} is empty")
        bad = [t for t in prompt if not 0 <= t < config.vocab_size]
        if bad:
            raise ValueError(f"prompt {index}: token ids {bad[:5]} outside the vocabulary "
                             f"[0, {config.vocab_size})")
        if len(prompt) + max_new_tokens > config.max_position_embeddings:
            raise ValueError(
                f"prompt {index}: {len(prompt)} prompt + {max_new_tokens} new tokens exceed "
                f"max_position_embeddings = {config.max_position_embeddings}")

    batch = len(prompts)
    lengths = np.array([len(prompt) for prompt in prompts], np.int32)  # [B]
    prompt_width = _bucket(int(lengths.max()))
    token_ids = np.zeros((batch, prompt_width), np.int32)  # [B, T], right-padded
    for row, prompt in enumerate(prompts):
        token_ids[row, : len(prompt)] = prompt
    positions = np.broadcast_to(np.arange(prompt_width, dtype=np.int32), token_ids.shape)
    cache = KVCache.create(config, batch, _bucket(prompt_width + max_new_tokens))

    graphdef, state = nnx.split(model)
    base_key = jax.random.key(sampling.seed)
    params = (sampling.temperature, sampling.top_k, sampling.top_p)
    logits, cache = _forward_last(graphdef, state, jnp.asarray(token_ids),
                                  jnp.asarray(positions), jnp.asarray(lengths - 1), cache)
    next_tokens = _sample_step(logits, base_key, 0, *params)  # [B]

    outputs: list[list[int]] = [[] for _ in prompts]
    finished = np.zeros(batch, bool)
    for step in range(max_new_tokens):
        host_tokens = np.asarray(next_tokens)
        for row in np.flatnonzero(~finished):
            outputs[row].append(int(host_tokens[row]))
            finished[row] |= int(host_tokens[row]) in stop_ids
        if finished.all() or step == max_new_tokens - 1:
            break
        step_positions = jnp.asarray(lengths + step)[:, None]  # [B, 1]
        logits, cache = _forward_last(graphdef, state, next_tokens[:, None], step_positions,
                                      jnp.zeros(batch, jnp.int32), cache)
        next_tokens = _sample_step(logits, base_key, step + 1, *params)
    return outputs
