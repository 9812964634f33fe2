"""Sliding-window perplexity: window layout by hand, and the batched, padded computation
against a direct per-window forward pass."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest

from jaxinfer.config import get_preset
from jaxinfer.models import create_model
from jaxinfer.perplexity import perplexity, sliding_windows


def test_windows_by_hand_score_every_token_once():
    # window 4, stride 2 over 10 tokens: inputs [0,4) [2,6) [4,8) [6,9).
    assert sliding_windows(10, 4, 2) == [(0, 5, 1), (2, 7, 5), (4, 9, 7), (6, 10, 9)]
    assert sliding_windows(9, 4, 4) == [(0, 5, 1), (4, 9, 5)]
    for tokens, window, stride in ((100, 16, 16), (100, 16, 5), (17, 16, 1), (2, 8, 8)):
        scored = [index for _, end, first in sliding_windows(tokens, window, stride)
                  for index in range(first, end)]
        assert scored == list(range(1, tokens))
    with pytest.raises(ValueError, match="stride"):
        sliding_windows(10, 4, 5)


@pytest.mark.parametrize(("window", "stride"), [(32, 32), (32, 12)])
def test_batched_perplexity_equals_a_direct_forward_per_window(window, stride):
    model = create_model(get_preset("tiny"), seed=0)
    ids = np.random.default_rng(0).integers(3, 512, size=101)  # [N]
    result = perplexity(model, ids, window=window, stride=stride, batch_size=3)
    total, count = 0.0, 0
    for begin, end, first in sliding_windows(ids.size, window, stride):
        logits, _ = model(ids[None, begin:end - 1])  # [1, L, V], unpadded
        log_probs = np.asarray(jax.nn.log_softmax(logits[0], axis=-1), np.float64)  # [L, V]
        for index in range(first, end):
            total -= log_probs[index - begin - 1, ids[index]]
            count += 1
    assert result.tokens == count == ids.size - 1
    assert result.nll == pytest.approx(total, rel=1e-5)
    assert result.ppl == pytest.approx(math.exp(total / count), rel=1e-5)


def test_paged_path_with_a_float_cache_equals_the_cacheless_forward():
    model = create_model(get_preset("tiny"), seed=0)
    ids = np.random.default_rng(1).integers(3, 512, size=80)  # [N]
    plain = perplexity(model, ids, window=24, batch_size=2)
    paged = perplexity(model, ids, window=24, batch_size=2, kv_cache_dtype="float32")
    assert paged.tokens == plain.tokens
    assert paged.nll == pytest.approx(plain.nll, rel=1e-5)
