"""SamplingParams: vLLM defaults, normalization, and a validation message per field."""

from __future__ import annotations

import dataclasses

import pytest

from jaxinfer.engine.sampling_params import SamplingParams


def test_defaults_match_vllm():
    params = SamplingParams()
    assert (params.n, params.temperature, params.top_p, params.top_k, params.min_p) == (
        1, 1.0, 1.0, 0, 0.0)
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (
        0.0, 0.0, 1.0)
    assert (params.max_tokens, params.min_tokens, params.seed, params.logit_bias) == (
        16, 0, None, None)
    assert (params.stop, params.stop_token_ids, params.logprobs, params.prompt_logprobs) == (
        None, None, None, None)
    assert not params.include_stop_str_in_output and not params.ignore_eos
    assert params.skip_special_tokens
    assert not params.is_greedy


def test_keyword_only_and_frozen():
    with pytest.raises(TypeError):
        SamplingParams(1)  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        SamplingParams().temperature = 0.5  # type: ignore[misc]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"n": 0}, "n = 0: must be >= 1"),
    ({"n": 1.5}, "n = 1.5: must be an integer"),
    ({"temperature": -1.0}, "temperature = -1.0: must be >= 0"),
    ({"temperature": float("inf")}, "temperature = inf: must be >= 0"),
    ({"temperature": float("nan")}, "temperature = nan: must be a number"),
    ({"temperature": "hot"}, "temperature = 'hot': must be a number"),
    ({"temperature": True}, "temperature = True: must be a number"),
    ({"top_p": 0.0}, "top_p = 0.0: must be in (0, 1]"),
    ({"top_p": 1.01}, "top_p = 1.01: must be in (0, 1]"),
    ({"top_k": -2}, "top_k = -2: must be 0 or -1"),
    ({"min_p": -0.1}, "min_p = -0.1: must be in [0, 1]"),
    ({"min_p": 1.5}, "min_p = 1.5: must be in [0, 1]"),
    ({"seed": 1.5}, "seed = 1.5: must be an integer"),
    ({"presence_penalty": 2.5}, "presence_penalty = 2.5: must be in [-2, 2]"),
    ({"frequency_penalty": -2.01}, "frequency_penalty = -2.01: must be in [-2, 2]"),
    ({"repetition_penalty": 0.0}, "repetition_penalty = 0.0: must be > 0"),
    ({"repetition_penalty": -1.0}, "repetition_penalty = -1.0: must be > 0"),
    ({"max_tokens": 0}, "max_tokens = 0: must be >= 1"),
    ({"min_tokens": 17}, "min_tokens = 17: must be in [0, max_tokens = 16]"),
    ({"min_tokens": -1}, "min_tokens = -1: must be in [0, max_tokens = 16]"),
    ({"logprobs": 21}, "logprobs = 21: must be None or in [0, 20]"),
    ({"logprobs": -1}, "logprobs = -1: must be None or in [0, 20]"),
    ({"prompt_logprobs": 30}, "prompt_logprobs = 30: must be None or in [0, 20]"),
    ({"stop": ""}, "stop = '': stop strings must be non-empty"),
    ({"stop": ["a", 3]}, "stop[1] = 3: stop strings must be non-empty strings"),
    ({"stop": 3}, "stop = 3: must be a string, a list of strings, or None"),
    ({"stop_token_ids": [1, -4]}, "stop_token_ids[1] = -4: token ids must be >= 0"),
    ({"stop_token_ids": ["a"]}, "stop_token_ids[0] = 'a': must be an integer"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias token id = -1: token ids must be >= 0"),
    ({"logit_bias": {5: float("inf")}}, "logit_bias[5] = inf: must be a finite number"),
    ({"logit_bias": [1.0]}, "logit_bias = [1.0]: must be a dict"),
    ({"ignore_eos": "yes"}, "ignore_eos = 'yes': must be a bool"),
    ({"skip_special_tokens": 1}, "skip_special_tokens = 1: must be a bool"),
])
def test_validation_names_field_value_and_range(kwargs, message):
    with pytest.raises(ValueError) as error:
        SamplingParams(**kwargs)
    assert message in str(error.value)


def test_boundary_values_are_accepted():
    SamplingParams(temperature=0.0, top_p=1.0, min_p=1.0, presence_penalty=-2.0,
                   frequency_penalty=2.0, repetition_penalty=0.01, min_tokens=16,
                   logprobs=20, prompt_logprobs=0, top_k=1, seed=-3)


def test_top_k_minus_one_means_off_like_zero():
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(top_k=-1) == SamplingParams(top_k=0)


def test_is_greedy():
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(temperature=0.8, top_k=1).is_greedy
    assert not SamplingParams(temperature=0.8, top_k=2).is_greedy
    assert not SamplingParams(temperature=0.01).is_greedy


def test_stop_strings_normalized():
    assert SamplingParams().stop_strings == ()
    assert SamplingParams(stop="###").stop_strings == ("###",)
    stops = ["a", "bc"]
    params = SamplingParams(stop=stops)
    stops.append("later")  # the request keeps its own copy
    assert params.stop_strings == ("a", "bc")


def test_containers_are_copied_and_normalized():
    bias = {3: 1}
    ids = [7, 2]
    params = SamplingParams(logit_bias=bias, stop_token_ids=ids)
    bias[4] = 2.0
    ids.append(9)
    assert params.logit_bias == {3: 1.0}
    assert isinstance(params.logit_bias[3], float)
    assert params.stop_token_ids == (7, 2)


def test_min_tokens_stop_ids_include_eos_unless_ignored():
    params = SamplingParams(stop_token_ids=[9, 4])
    assert params.min_tokens_stop_ids([2]) == (2, 4, 9)
    assert SamplingParams(stop_token_ids=[9], ignore_eos=True).min_tokens_stop_ids([2]) == (9,)
    assert SamplingParams().min_tokens_stop_ids([2, 2]) == (2,)
