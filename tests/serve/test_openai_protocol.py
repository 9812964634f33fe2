"""openai_protocol.decode_json_body without a server: each malformed body is refused with the
problem (and the field, where there is one) named; good bodies pass unchanged."""

from __future__ import annotations

import json

import pytest

from serve.openai_protocol import MAX_JSON_DEPTH, decode_json_body
from serve.service import InvalidRequestError


def _nested(depth: int) -> bytes:
    return b'{"user": ' + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}"


@pytest.mark.parametrize(("raw", "field", "fragment"), [
    (b'{"prompt": "\xff"}', None, "not valid UTF-8"),
    (b'{"prompt": "\xed\xa0\x80"}', None, "not valid UTF-8"),  # a surrogate, UTF-8 encoded
    (b"{nope", None, "not valid JSON"),
    (b"[1]", None, "JSON object"),
    (b"null", None, "JSON object"),
    (_nested(MAX_JSON_DEPTH + 1), None, "nested deeper"),
    (_nested(100_000), None, "nested deeper"),  # beyond the parser's recursion limit
    (b'{"seed": ' + b"9" * 5000 + b"}", None, "4300 digits"),
    (b'{"temperature": NaN}', "temperature", "temperature: NaN is not a finite"),
    (b'{"a": [1, {"b": -Infinity}]}', "a", "a[1].b: -Infinity"),
    (b'{"top_p": 1e999}', "top_p", "top_p: 1e999 is not a finite"),
    (b'{"prompt": "ok \\ud800"}', "prompt", "prompt: a string holds a lone UTF-16 surrogate"),
    (b'{"messages": [{"role": "user", "content": "\\udfff"}]}', "messages",
     "messages[0].content: a string"),
    (b'{"logit_bias": {"\\ud800": 1}}', "logit_bias", "a key in logit_bias: a string"),
    (b'{"\\ud800": 1}', None, "a key in the body: a string"),
    (b'{"stop": ["fine", "\\uDBFF"]}', "stop", "stop[1]: a string"),
])
def test_malformed_bodies_are_refused_naming_the_problem(raw, field, fragment):
    with pytest.raises(InvalidRequestError) as raised:
        decode_json_body(raw)
    assert raised.value.field == field
    assert fragment in raised.value.message


def test_good_bodies_pass_unchanged():
    body = {"prompt": [[1, 2]] * 100, "messages": [{"content": "caf\u00e9 \U0001f600"}],
            "temperature": 0.5, "seed": 10**30, "nested": [[[[1]]]] * 50}
    assert decode_json_body(json.dumps(body).encode()) == body
    # A surrogate pair written as escapes is one astral character, not a lone surrogate;
    # an escaped backslash before "ud800" is no escape at all.
    raw = rb'{"prompt": "\ud83d\ude00", "stop": ["\\ud800"]}'
    assert decode_json_body(raw) == {"prompt": "\U0001f600", "stop": ["\\ud800"]}
    deep = _nested(MAX_JSON_DEPTH)
    assert decode_json_body(deep)["user"] is not None
