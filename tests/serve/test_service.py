"""InferenceService's checks without a server: every bad field is named, the key is enforced."""

from __future__ import annotations

import pytest

from serve.service import InferenceService, InvalidRequestError, UnauthenticatedError
from tests.serve.conftest import make_service


@pytest.fixture(scope="module")
def service() -> InferenceService:
    return make_service(api_key="secret")


@pytest.mark.parametrize(("fields", "field"), [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 10_000}, "max_tokens"),
    ({"temperature": -1.0}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": 2.5}, "top_k"),
    ({"n": 0}, "n"),
    ({"stop_token_ids": [10**9]}, "stop_token_ids"),
    ({"logit_bias": {"7": "x"}}, "logit_bias"),
    ({"logit_bias": {str(10**9): 1.0}}, "logit_bias"),
    ({"ignore_eos": 1}, "ignore_eos"),
    ({"best_of": 2}, "best_of"),
])
def test_bad_sampling_fields_are_named(service, fields, field):
    with pytest.raises(InvalidRequestError) as raised:
        service.sampling_params(fields, prompt_len=4)
    assert raised.value.field == field
    assert field in raised.value.message


def test_max_tokens_defaults_and_is_bounded_by_the_context(service):
    assert service.sampling_params({}, prompt_len=4).max_tokens == 16
    room = service.max_model_len - 250
    assert service.sampling_params({}, prompt_len=250).max_tokens == room
    assert service.sampling_params({}, 4, default_max_tokens=None).max_tokens == (
        service.max_model_len - 4)
    params = service.sampling_params({"temperature": 0, "logit_bias": {"5": 2}, "seed": 3}, 4)
    assert params.logit_bias == {5: 2.0} and params.seed == 3 and params.is_greedy


@pytest.mark.parametrize(("prompt", "fragment"), [
    ("", "must not be empty"),
    ([], "at least one token"),
    ([1, 10**9], "outside the vocabulary"),
    ([1, True], "string or a list of token ids"),
    (None, "string or a list of token ids"),
    ("word " * 400, "leaves no room for output"),
])
def test_bad_prompts_are_named(service, prompt, fragment):
    with pytest.raises(InvalidRequestError, match=fragment) as raised:
        service.encode_prompt(prompt)
    assert raised.value.field == "prompt"


def test_api_key(service):
    service.check_api_key("Bearer secret")
    service.check_api_key("bearer secret")
    # Non-ASCII tokens (and the lone surrogates aiohttp's surrogateescape decoding leaves)
    # are wrong keys like any other, not a TypeError from compare_digest.
    for header in (None, "", "Bearer wrong", "secret", "Basic secret", "Bearer s\xe9cret",
                   "Bearer \udce9", "Bearer \ud800", "Bearer \u043a\u043b\u044e\u0447"):
        with pytest.raises(UnauthenticatedError):
            service.check_api_key(header)
    make_service().check_api_key(None)  # no key configured: open
    non_ascii = make_service(api_key="cl\xe9")
    non_ascii.check_api_key("Bearer cl\xe9")
    with pytest.raises(UnauthenticatedError):
        non_ascii.check_api_key("Bearer cle")


def test_admission_counts_the_samples_of_a_request():
    # A request with n samples waits as n sequences: with room for 4, n = 5 is refused at
    # once (it counted as one before), n = 4 is admitted.
    import asyncio

    from jaxinfer.engine.sampling_params import SamplingParams
    from serve.service import OverloadedError

    service = make_service(max_queued_requests=4)

    async def first_output(n: int) -> None:
        params = service.sampling_params({"n": n, "max_tokens": 2}, 3)
        async for _ in service.generate([1, 2, 3], params, f"n{n}"):
            return

    service.engine.start()
    try:
        with pytest.raises(OverloadedError, match="adds 5"):
            asyncio.run(first_output(5))
        asyncio.run(first_output(4))
        assert isinstance(service.sampling_params({"n": 4}, 3), SamplingParams)
    finally:
        service.engine.shutdown()
