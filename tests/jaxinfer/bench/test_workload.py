"""Benchmark workloads: seeded, lengths within their ranges, ordinary token ids only."""

from __future__ import annotations

import pytest

from jaxinfer.bench.workload import (
    FIRST_ORDINARY_TOKEN,
    make_requests,
    max_sequence_len,
    parse_length,
    total_output_tokens,
    total_prompt_tokens,
    with_output_len,
)


def test_lengths_and_token_ids_stay_in_range():
    requests = make_requests(200, vocab_size=50, input_len=(4, 9), output_len=(1, 3), seed=1)
    assert len(requests) == 200
    assert len({request.request_id for request in requests}) == 200
    assert {request.prompt_len for request in requests} == set(range(4, 10))  # both ends hit
    assert {request.output_len for request in requests} == {1, 2, 3}
    tokens = {token for request in requests for token in request.prompt_token_ids}
    assert tokens == set(range(FIRST_ORDINARY_TOKEN, 50))  # [3, vocab): no pad, BOS, EOS
    assert all(isinstance(token, int) for token in tokens)


def test_fixed_lengths_and_totals():
    requests = make_requests(6, vocab_size=1000, input_len=12, output_len=5, prefix="x")
    assert [request.request_id for request in requests] == [f"x-{i}" for i in range(6)]
    assert all(request.prompt_len == 12 and request.output_len == 5 for request in requests)
    assert total_prompt_tokens(requests) == 72
    assert total_output_tokens(requests) == 30
    assert max_sequence_len(requests) == 17


def test_seeded():
    a = make_requests(8, vocab_size=300, input_len=(1, 40), output_len=(2, 8), seed=7)
    assert a == make_requests(8, vocab_size=300, input_len=(1, 40), output_len=(2, 8), seed=7)
    assert a != make_requests(8, vocab_size=300, input_len=(1, 40), output_len=(2, 8), seed=8)


def test_with_output_len_keeps_the_prompts():
    requests = make_requests(3, vocab_size=100, input_len=(2, 6), output_len=9)
    single = with_output_len(requests, 1)
    assert [r.prompt_token_ids for r in single] == [r.prompt_token_ids for r in requests]
    assert [r.request_id for r in single] == [r.request_id for r in requests]
    assert {r.output_len for r in single} == {1}


def test_parse_length():
    assert parse_length("128") == 128
    assert parse_length("64,256") == (64, 256)
    assert parse_length(" 5 , 5 ") == (5, 5)
    for bad in ("", "a", "0", "3,2", "1,2,3", "-4"):
        with pytest.raises(ValueError, match="length"):
            parse_length(bad)


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_requests=0), "num_requests"),
    (dict(vocab_size=3), "vocab_size"),
    (dict(input_len=(5, 4)), "input_len"),
    (dict(output_len=0), "output_len"),
])
def test_bad_arguments(kwargs, match):
    arguments = dict(num_requests=2, vocab_size=100, input_len=4, output_len=4) | kwargs
    with pytest.raises(ValueError, match=match):
        make_requests(**arguments)
