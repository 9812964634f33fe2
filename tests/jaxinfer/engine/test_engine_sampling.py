"""The engine's sampling features end to end: penalties, logit bias and min_tokens against a
slow full-forward reference, stop tokens and stop strings (also across streamed steps), n > 1
samples sharing the prompt's pages, logprobs and prompt logprobs with the prefix cache on."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.config import get_preset
from jaxinfer.engine.core import Engine, EngineConfig
from jaxinfer.engine.sampling_params import SamplingParams
from jaxinfer.model_loading import load_model, resolve_model_path
from jaxinfer.models import create_model
from jaxinfer.tokenizer import load_tokenizer

PROMPT = [1, 17, 230, 45, 45, 9, 301, 17, 88, 412, 5, 61]


@pytest.fixture(scope="module")
def model():
    return create_model(get_preset("tiny"), seed=0)


def _engine(model, tokenizer=None, **overrides):
    config = dict(page_size=4, max_num_batched_tokens=32, max_num_seqs=8, max_model_len=128,
                  enable_prompt_logprobs=True)
    return Engine(model, EngineConfig.from_options(**{**config, **overrides}), tokenizer)


def _finish(engine):
    """Steps until idle; returns the last output of each request and every output seen."""
    final, history = {}, []
    while engine.has_unfinished_requests():
        for output in engine.step():
            final[output.request_id] = output
            history.append(output)
    assert engine.num_free_pages == engine.config.num_pages - 1  # nothing leaked
    return final, history


def _reference_greedy(model, prompt, max_tokens, processed):
    """Greedy decoding by full forward passes, with `processed(logits, outputs)` applied."""
    outputs = []
    for _ in range(max_tokens):
        logits, _ = model(jnp.asarray([prompt + outputs]))  # [1, L, V]
        row = np.asarray(logits[0, -1], np.float64)  # [V]
        outputs.append(int(np.argmax(processed(row, outputs))))
    return outputs


def test_penalties_and_bias_equal_a_slow_reference(model):
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True,
                            repetition_penalty=1.3, frequency_penalty=0.4,
                            presence_penalty=0.3, logit_bias={45: 2.5, 17: -1.0})

    def processed(row, outputs):
        row = row.copy()
        row[45] += 2.5
        row[17] -= 1.0
        for token in set(PROMPT) | set(outputs):
            row[token] = row[token] / 1.3 if row[token] > 0 else row[token] * 1.3
        for token in set(outputs):
            row[token] -= 0.4 * outputs.count(token) + 0.3
        return row

    expected = _reference_greedy(model, PROMPT, 10, processed)
    engine = _engine(model)
    engine.add_request("penalized", PROMPT, params)
    engine.add_request("plain", PROMPT, SamplingParams(temperature=0.0, max_tokens=10,
                                                       ignore_eos=True))
    final, _ = _finish(engine)
    assert final["penalized"].outputs[0].token_ids == expected
    assert final["plain"].outputs[0].token_ids != expected  # the penalties changed something


def test_min_tokens_stop_token_ids_and_eos(model):
    eos = model.config.eos_token_ids[0]
    engine = _engine(model)
    # EOS is made overwhelmingly likely; min_tokens holds it off for three tokens.
    engine.add_request("min", PROMPT, SamplingParams(temperature=0.0, max_tokens=10,
                                                     min_tokens=3, logit_bias={eos: 100.0}))
    engine.add_request("eos", PROMPT, SamplingParams(temperature=0.0, max_tokens=10,
                                                     logit_bias={eos: 100.0}))
    engine.add_request("ignored", PROMPT, SamplingParams(temperature=0.0, max_tokens=5,
                                                         ignore_eos=True,
                                                         logit_bias={eos: 100.0}))
    final, _ = _finish(engine)
    short = final["min"].outputs[0]
    assert len(short.token_ids) == 4 and short.token_ids[-1] == eos
    assert eos not in short.token_ids[:3] and short.finish_reason == "stop"
    assert final["eos"].outputs[0].token_ids == [eos]
    assert final["ignored"].outputs[0].token_ids == [eos] * 5
    assert final["ignored"].outputs[0].finish_reason == "length"

    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    engine.add_request("free", PROMPT, greedy)
    free = _finish(engine)[0]["free"].outputs[0].token_ids
    stop_id = free[3]
    engine.add_request("stopped", PROMPT, SamplingParams(
        temperature=0.0, max_tokens=8, ignore_eos=True, stop_token_ids=[stop_id]))
    stopped = _finish(engine)[0]["stopped"].outputs[0]
    assert stopped.token_ids == free[:free.index(stop_id) + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_id


def test_n_samples_share_the_prompt_pages_and_reproduce_alone(model):
    prompt = [1] + list(range(100, 160))  # 61 tokens: 15 full pages of 4
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=6, ignore_eos=True)
    engine = _engine(model)
    engine.add_request("group", prompt, params)
    final, _ = _finish(engine)
    samples = final["group"].outputs
    assert [sample.index for sample in samples] == [0, 1, 2]
    assert len({tuple(sample.token_ids) for sample in samples}) == 3
    # Samples 1 and 2 found all 15 full prompt pages (60 tokens) of sample 0 in the cache.
    assert engine.prefix_cache_hit_rate == pytest.approx(2 * 60 / (3 * 61))
    for index, sample in enumerate(samples):
        alone = _engine(model, enable_prefix_caching=False)
        alone.add_request("one", prompt, SamplingParams(temperature=1.0, seed=11 + index,
                                                        max_tokens=6, ignore_eos=True))
        assert _finish(alone)[0]["one"].outputs[0].token_ids == sample.token_ids


def test_logprobs_and_prompt_logprobs_with_the_prefix_cache_on(model):
    engine = _engine(model)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3,
                            prompt_logprobs=2)
    engine.add_request("first", PROMPT, SamplingParams(temperature=0.0, max_tokens=2))
    _finish(engine)
    engine.add_request("second", PROMPT, params)  # its prompt blocks are cached by now
    output = _finish(engine)[0]["second"]
    sample = output.outputs[0]
    logits, _ = model(jnp.asarray([PROMPT + sample.token_ids]))  # [1, L, V]
    logprobs = np.asarray(jax.nn.log_softmax(logits[0], axis=-1))  # [L, V]
    assert len(sample.logprobs) == 4
    for step, (token, entry) in enumerate(zip(sample.token_ids, sample.logprobs)):
        row = logprobs[len(PROMPT) - 1 + step]
        assert entry[token] == pytest.approx(row[token], abs=1e-5)
        assert set(entry) == set(np.argsort(-row)[:3].tolist()) | {token}
    assert output.prompt_logprobs[0] is None and len(output.prompt_logprobs) == len(PROMPT)
    for position in range(1, len(PROMPT)):
        entry = output.prompt_logprobs[position]
        row = logprobs[position - 1]
        assert entry[PROMPT[position]] == pytest.approx(row[PROMPT[position]], abs=1e-5)
        assert len(entry) <= 3


def test_abort_of_a_group_frees_every_sample(model):
    engine = _engine(model)
    engine.add_request("group", PROMPT * 3, SamplingParams(n=4, max_tokens=20,
                                                           ignore_eos=True))
    engine.add_request("other", PROMPT, SamplingParams(temperature=0.0, max_tokens=5,
                                                       ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert engine.abort_request("group") and not engine.abort_request("group")
    final, _ = _finish(engine)
    assert len(final["other"].outputs[0].token_ids) == 5


@pytest.fixture(scope="module")
def demo():
    return load_model("builtin:demo"), load_tokenizer(resolve_model_path("builtin:demo"))


def test_stop_strings_across_streamed_steps(demo):
    model, tokenizer = demo
    prompt = "The list type"
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    engine = _engine(model, tokenizer, max_model_len=256, enable_prompt_logprobs=False)
    engine.add_request("free", prompt, greedy)
    free = _finish(engine)[0]["free"].outputs[0]
    assert free.text == tokenizer.decode(free.token_ids)
    # A stop string that starts inside one token and ends in a later one.
    text = free.text
    start = len(text) // 3
    stop = text[start:start + 7]
    assert stop.strip() and text.find(stop) == start
    for include in (False, True):
        engine.add_request(f"stop{include}", prompt, SamplingParams(
            temperature=0.0, max_tokens=40, ignore_eos=True, stop=["never seen", stop],
            include_stop_str_in_output=include))
        final, history = _finish(engine)
        output = final[f"stop{include}"].outputs[0]
        assert output.text == text[:start + (len(stop) if include else 0)]
        assert output.finish_reason == "stop" and output.stop_reason == stop
        assert free.token_ids[:len(output.token_ids)] == output.token_ids
        shown = [item.outputs[0].text for item in history]
        # Streamed text only ever grows: nothing shown is taken back.
        assert all(later.startswith(earlier) for earlier, later in itertools.pairwise(shown))
