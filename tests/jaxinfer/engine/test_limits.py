"""RequestLimits: each bound refuses the first value past it with an error naming the field,
accepts the value at it, and can be moved by its option; the fixed rules (top_k clamped to the
vocabulary, the 64-bit seed range) hold. No jax."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import jaxinfer
from jaxinfer.config import get_preset
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.errors import RequestError
from jaxinfer.engine.input_processor import InputProcessor
from jaxinfer.engine.limits import MAX_SEED, MIN_SEED, RequestLimits
from jaxinfer.engine.sampling_params import SamplingParams
from jaxinfer.tokenizer import load_tokenizer

DEMO = Path(jaxinfer.__file__).parent / "builtin_models" / "demo"
VOCAB = 4096
MAX_MODEL_LEN = 64
MODEL = dataclasses.replace(get_preset("tiny"), vocab_size=VOCAB)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(DEMO)


def _processor(tokenizer=None, **options):
    config = EngineConfig.from_options(max_model_len=MAX_MODEL_LEN, max_num_seqs=200,
                                       max_num_batched_tokens=256, **options)
    return InputProcessor(MODEL, config.resolved(MODEL.max_position_embeddings), tokenizer)


def _check(processor, **params):
    return processor.process("r", [1, 2, 3], SamplingParams(**params))


# (field, the largest accepted params, the smallest refused params, a message fragment)
BOUNDS = [
    ("n", dict(n=128), dict(n=129), "at most 128 samples"),
    ("stop", dict(stop=["s"] * 16), dict(stop=["s"] * 17), "17 stop strings, at most 16"),
    ("stop", dict(stop=["x" * 256]), dict(stop=["y", "x" * 257]), "stop[1]: 257 characters"),
    ("stop_token_ids", dict(stop_token_ids=[5] * 256), dict(stop_token_ids=[5] * 257),
     "257 stop token ids, at most 256"),
    ("logit_bias", dict(logit_bias={i: 1.0 for i in range(300)}),
     dict(logit_bias={i: 1.0 for i in range(301)}), "301 logit bias entries, at most 300"),
    ("logit_bias", dict(logit_bias={7: -100.0}), dict(logit_bias={7: -100.5}),
     "logit_bias[7] = -100.5: must be in [-100, 100]"),
    ("logit_bias", dict(logit_bias={7: 100.0}), dict(logit_bias={7: 3.4e39}),
     "logit_bias[7] = 3.4e+39"),
    ("temperature", dict(temperature=100.0), dict(temperature=1e39), "must be <= 100"),
    ("repetition_penalty", dict(repetition_penalty=100.0), dict(repetition_penalty=101.0),
     "must be in [0.01, 100]"),
    ("repetition_penalty", dict(repetition_penalty=0.01), dict(repetition_penalty=1e-40),
     "must be in [0.01, 100]"),
    ("seed", dict(seed=MAX_SEED), dict(seed=MAX_SEED + 1), "64-bit integer"),
    ("seed", dict(seed=MIN_SEED), dict(seed=MIN_SEED - 1), "64-bit integer"),
    ("seed", dict(seed=MAX_SEED - 1, n=2), dict(seed=MAX_SEED, n=2), "2^64 - n"),
]


@pytest.mark.parametrize(("field", "accepted", "refused", "fragment"), BOUNDS,
                         ids=[f"{row[0]}-{index}" for index, row in enumerate(BOUNDS)])
def test_each_bound_accepts_its_value_and_refuses_the_next(field, accepted, refused, fragment,
                                                           tokenizer):
    processor = _processor(tokenizer)
    _check(processor, **accepted)
    with pytest.raises(RequestError) as raised:
        _check(processor, **refused)
    assert raised.value.field == field
    assert fragment in raised.value.message


@pytest.mark.parametrize(("option", "value", "params", "field"), [
    ("max_n", 4, dict(n=5), "n"),
    ("max_stop_strings", 2, dict(stop=["a", "b", "c"]), "stop"),
    ("max_stop_string_chars", 3, dict(stop="abcd"), "stop"),
    ("max_stop_token_ids", 1, dict(stop_token_ids=[1, 2]), "stop_token_ids"),
    ("max_logit_bias_entries", 1, dict(logit_bias={1: 1.0, 2: 1.0}), "logit_bias"),
    ("max_logit_bias", 1.0, dict(logit_bias={1: 1.5}), "logit_bias"),
    ("max_temperature", 2.0, dict(temperature=2.5), "temperature"),
    ("max_repetition_penalty", 2.0, dict(repetition_penalty=2.5), "repetition_penalty"),
])
def test_each_limit_is_an_option(option, value, params, field, tokenizer):
    _check(_processor(tokenizer), **params)  # within the default
    with pytest.raises(RequestError) as raised:
        _check(_processor(tokenizer, **{option: value}), **params)
    assert raised.value.field == field
    assert "--" + option.replace("_", "-") in raised.value.message


def test_n_is_also_bounded_by_the_running_sequences():
    config = EngineConfig.from_options(max_model_len=MAX_MODEL_LEN, max_num_seqs=8,
                                       max_num_batched_tokens=64)
    processor = InputProcessor(MODEL, config.resolved(MODEL.max_position_embeddings), None)
    _check(processor, n=8)
    with pytest.raises(RequestError, match="max_num_seqs = 8") as raised:
        _check(processor, n=9)
    assert raised.value.field == "n"


def test_top_k_past_the_vocabulary_keeps_every_token():
    # 2^31 overflowed the int32 top-k array and killed the engine thread.
    processed = _check(_processor(), top_k=2 ** 31)
    assert processed.params.top_k == 0 and processed.samples[0].sampling_params.top_k == 0
    assert _check(_processor(), top_k=VOCAB - 1).params.top_k == VOCAB - 1


def test_text_too_long_to_fit_is_refused_before_tokenizing(tokenizer, monkeypatch):
    processor = _processor(tokenizer)
    limit = processor.max_prompt_chars
    longest = max(len(tokenizer.id_to_token(i) or "") for i in range(tokenizer.vocab_size))
    assert limit == MAX_MODEL_LEN * longest
    calls = []
    monkeypatch.setattr(tokenizer, "encode", lambda text, *a, **k: calls.append(text) or [1])
    with pytest.raises(RequestError, match=f"at most {limit} characters") as raised:
        processor.process("r", "a" * (limit + 1))
    assert raised.value.field == "prompt" and calls == []
    processor.process("r", "a" * limit)  # tokenized (and then fits: the fake says 1 token)
    assert len(calls) == 1
    with pytest.raises(RequestError, match="--max-prompt-chars"):
        _processor(tokenizer, max_prompt_chars=10).process("r", "a" * 11)


def test_a_huge_token_list_is_refused_without_converting_it():
    class Untouchable(list):
        def __iter__(self):
            raise AssertionError("converted")

    with pytest.raises(RequestError, match="no room for output") as raised:
        _processor().process("r", Untouchable([1] * MAX_MODEL_LEN))
    assert raised.value.field == "prompt"


def test_prompts_per_request():
    limits = RequestLimits(max_prompts_per_request=2)
    limits.check_prompts(2)
    with pytest.raises(RequestError, match="3 prompts in one request, at most 2") as raised:
        limits.check_prompts(3)
    assert raised.value.field == "prompt"


@pytest.mark.parametrize("options", [dict(max_n=0), dict(max_temperature=-1.0),
                                     dict(max_repetition_penalty=0.5), dict(max_n=True)])
def test_limits_themselves_are_checked(options):
    with pytest.raises(ValueError):
        RequestLimits(**options)
