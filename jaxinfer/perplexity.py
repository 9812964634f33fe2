"""Perplexity of a model on a token stream, with a sliding window (`jaxinfer eval ppl`).

The stream is cut into windows of `window` input tokens starting every `stride` tokens
(stride = window: disjoint windows; smaller: overlapping ones, so later tokens see more
context). Each token from the second on is scored exactly once, in the first window that
predicts it after the tokens the previous window already scored, from the tokens before it in
that window (transformers' sliding-window recipe, without its loss of each window's first
token). PPL = exp(mean negative log-likelihood).

    result = perplexity(model, token_ids, window=256, stride=128)
    result.ppl, result.tokens
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfer.models import Transformer


@dataclasses.dataclass(frozen=True)
class PerplexityResult:
    """`ppl` = exp(`nll` / `tokens`): the scored tokens and their summed NLL (nats)."""

    ppl: float
    tokens: int
    nll: float


def sliding_windows(num_tokens: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """`(begin, end, score_from)` per window: it feeds the `end - 1 - begin <= window` tokens
    [begin, end - 1) and scores the tokens with index in [score_from, end), each predicted
    from the tokens before it in the window.

    Consecutive windows start `stride` tokens apart; every token from index 1 on is scored
    exactly once (stride = window: disjoint windows, each token predicted from the ones
    before it in its own window).

    Raises:
        ValueError: window < 1, or stride outside [1, window] (tokens would go unscored).
    """
    if window < 1 or not 1 <= stride <= window:
        raise ValueError(f"window = {window}, stride = {stride}: need window >= 1 and "
                         "1 <= stride <= window")
    windows, scored_until, begin = [], 1, 0
    while scored_until < num_tokens:
        end = min(begin + window + 1, num_tokens)
        windows.append((begin, end, scored_until))
        scored_until = end
        begin += stride
    return windows


def perplexity(model: Transformer, token_ids: Sequence[int] | np.ndarray, *, window: int = 256,
               stride: int | None = None, batch_size: int = 8) -> PerplexityResult:
    """Sliding-window perplexity of `model` on one token stream.

    Args:
        model: Any model (float or quantized); run without a KV cache.
        token_ids: The stream, e.g. the tokenizer's encoding of a text (BOS first).
        window: Tokens per forward pass.
        stride: Tokens between window starts; default `window` (disjoint windows).
        batch_size: Windows per forward pass (all padded to `window`: one compilation).

    Returns:
        The perplexity, the number of scored tokens and their total NLL.

    Raises:
        ValueError: Fewer than two tokens, or a bad window/stride.
    """
    ids = np.asarray(token_ids, np.int32)  # [N]
    if ids.size < 2:
        raise ValueError(f"perplexity needs at least 2 tokens, got {ids.size}")
    spans = sliding_windows(ids.size, window, stride or window)
    inputs = np.zeros((len(spans), window), np.int32)  # [W, L]
    targets = np.zeros((len(spans), window), np.int32)  # [W, L]; position j predicts j + 1
    weights = np.zeros((len(spans), window), np.float32)  # [W, L]; 1 where scored
    for row, (begin, end, score_from) in enumerate(spans):
        inputs[row, :end - 1 - begin] = ids[begin:end - 1]
        targets[row, :end - 1 - begin] = ids[begin + 1:end]
        # Position j predicts token begin + j + 1, scored when it lies in [score_from, end);
        # score_from >= begin + 1 because stride <= window.
        weights[row, score_from - begin - 1:end - 1 - begin] = 1.0
    padding = -len(spans) % batch_size
    inputs, targets, weights = (np.pad(array, ((0, padding), (0, 0)))
                                for array in (inputs, targets, weights))
    graphdef, state = nnx.split(model)

    @jax.jit
    def batch_nll(state: nnx.State, inputs: jax.Array, targets: jax.Array,
                  weights: jax.Array) -> jax.Array:
        # Right padding needs no mask: no real token attends to a later position.
        logits, _ = nnx.merge(graphdef, state)(inputs)  # [B, L, V]
        log_probs = jax.nn.log_softmax(logits, axis=-1)  # [B, L, V]
        picked = jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]  # [B, L]
        return -jnp.sum(picked * weights)

    total = 0.0
    for start in range(0, inputs.shape[0], batch_size):
        rows = slice(start, start + batch_size)
        total += float(batch_nll(state, inputs[rows], targets[rows], weights[rows]))
    count = int(weights.sum())
    return PerplexityResult(math.exp(total / count), count, total)
