"""The runner scans over stacked layers: its step holds one copy of the block whatever the
depth, and a model whose blocks differ falls back to the layer loop with the same tokens."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfer.config import get_preset
from jaxinfer.engine.device.runner import ModelRunner, RunnerConfig
from jaxinfer.engine.device.step_io import STEP
from jaxinfer.engine.host.scheduler import ScheduledRequest
from jaxinfer.models import abstract_model, create_model

SIZES = dict(num_pages=24, page_size=4, max_num_batched_tokens=16, max_num_seqs=4,
             max_model_len=32, enable_prompt_logprobs=False)


def _step_text(model) -> str:
    """The lowered StableHLO of the runner's (16 tokens, 4 sequences) step."""
    runner = ModelRunner(model, RunnerConfig(**SIZES), abstract=True)
    return runner.lower(STEP, 16).as_text()


def _with_one_other_window(model, window: int):
    """The model with layer 1's sliding window set apart (another block graph)."""
    model = nnx.clone(model)
    model.layers[1].attention.sliding_window = window
    return model


def test_the_step_holds_one_block_whatever_the_depth():
    shallow = _step_text(abstract_model(get_preset("tiny").replace(num_layers=8)))
    deep = _step_text(abstract_model(get_preset("tiny").replace(num_layers=16)))
    assert abs(len(deep) - len(shallow)) < 0.1 * len(shallow), (len(shallow), len(deep))
    # Unrolled (blocks that differ), the step grows with depth: the check above would see it.
    unrolled = _step_text(_with_one_other_window(
        abstract_model(get_preset("tiny").replace(num_layers=16)), 1000))
    assert len(unrolled) > 2 * len(deep)


def _decode_tokens(runner: ModelRunner, prompts: list[list[int]], new_tokens: int) -> list:
    """Greedy tokens: every prompt prefilled in one step, then decoded together."""
    tables = [[1 + 5 * s + page for page in range(5)] for s in range(len(prompts))]
    sequences = [ScheduledRequest(str(s), prompt, list(range(len(prompt))), tables[s], True, 0,
                                  None, tuple(prompt)) for s, prompt in enumerate(prompts)]
    outputs = [[] for _ in prompts]
    for step in range(new_tokens):
        result = runner.execute(sequences)
        for s, sequence in enumerate(sequences):
            token = result.sampled[sequence.request_id].token_id
            outputs[s].append(token)
            position = len(prompts[s]) + step
            sequences[s] = ScheduledRequest(sequence.request_id, [token], [position], tables[s],
                                            True, step + 1, None, tuple(prompts[s]))
    return outputs


def test_blocks_that_differ_run_unrolled_with_the_same_tokens():
    config = get_preset("tiny").replace(num_layers=3)
    model = create_model(config, seed=4)
    scanned = ModelRunner(model, RunnerConfig(**SIZES))
    # A window longer than any sequence changes no result, only the block's graph.
    unrolled = ModelRunner(_with_one_other_window(model, 1000), RunnerConfig(**SIZES))
    assert "stacked_layers" in scanned.state and "layers" not in scanned.state
    assert "stacked_layers" not in unrolled.state and len(unrolled.state["layers"]) == 3
    assert scanned.pages.shape == unrolled.pages.shape == (3, 24, 4, 2 * config.num_kv_heads,
                                                           config.head_dim)
    prompts = [[5, 9, 13], [7, 2, 8, 21, 30, 4], [11]]
    assert _decode_tokens(scanned, prompts, 4) == _decode_tokens(unrolled, prompts, 4)
    np.testing.assert_allclose(np.asarray(scanned.pages), np.asarray(unrolled.pages), rtol=0,
                               atol=1e-5)
    # The model the runner stacked from is untouched.
    assert len(model.layers) == 3 and model.stacked_layers is None
    assert all(isinstance(leaf, jax.Array) and leaf.dtype == jnp.float32
               for leaf in jax.tree.leaves(nnx.state(model.layers)))
