"""Structured output through both front ends on the shared demo-model server: OpenAI's
`response_format` (json_schema, json_object, text), vLLM's `structured_outputs` and older
`guided_*` fields in completions and chat, streamed and not, and gRPC's
`StructuredOutputs`; a schema, regex or grammar that does not compile is a 400 (or
INVALID_ARGUMENT) naming the field it came in."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request

import grpc
import jsonschema
import openai
import pytest

from serve.client import build_request
from serve.generated.jaxinfer.v1 import inference_pb2_grpc as pb_grpc
from serve.openai_protocol import parse_chat, parse_completion, structured_outputs_of
from serve.service import InvalidRequestError

SCHEMA = {"type": "object",
          "properties": {"count": {"type": "integer"},
                         "kind": {"enum": ["list", "dict", "tuple"]}},
          "required": ["count", "kind"], "additionalProperties": False}
PHONE = "[0-9]{3}-[0-9]{4}"
MESSAGES = [{"role": "user", "content": "Describe the list type as JSON."}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="unused")


def _post(port: int, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/{path}",
                                     json.dumps({"model": "demo", **body}).encode(),
                                     {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def _streamed_chat(client, **kwargs) -> tuple[str, str]:
    text, finish = "", None
    for chunk in client.chat.completions.create(model="demo", messages=MESSAGES, stream=True,
                                                **kwargs):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, finish


def test_response_format_json_schema_in_chat_streamed_and_not(client):
    response_format = {"type": "json_schema",
                       "json_schema": {"name": "kind", "schema": SCHEMA, "strict": True}}
    # The demo model pads JSON with whitespace until max_tokens unless told not to; a
    # `structured_outputs` object without a kind adds that option (as in vLLM).
    extra = {"structured_outputs": {"disable_any_whitespace": True}}
    answer = client.chat.completions.create(
        model="demo", messages=MESSAGES, temperature=0, max_tokens=60,
        response_format=response_format, extra_body=extra)
    choice = answer.choices[0]
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    assert choice.finish_reason == "stop"
    streamed, finish = _streamed_chat(client, temperature=0, max_tokens=60,
                                      response_format=response_format, extra_body=extra)
    assert (streamed, finish) == (choice.message.content, "stop")


def test_every_spelling_in_completions(client, server):
    cases = [
        ({"structured_outputs": {"choice": ["yes", "no"]}}, lambda text: text in ("yes", "no")),
        ({"guided_choice": ["alpha", "beta"]}, lambda text: text in ("alpha", "beta")),
        ({"guided_regex": PHONE}, lambda text: re.fullmatch(PHONE, text)),
        ({"guided_json": SCHEMA, "structured_outputs": {"disable_any_whitespace": True}},
         lambda text: jsonschema.validate(json.loads(text), SCHEMA) is None),
        ({"guided_grammar": 'start: "n = " /[0-9]/'}, lambda text: re.fullmatch(r"n = \d", text)),
        ({"structured_outputs": {"json_object": True, "disable_any_whitespace": True}},
         lambda text: isinstance(json.loads(text), dict)),
    ]
    for body, check in cases:
        answer = client.completions.create(model="demo", prompt="The list type", max_tokens=60,
                                           temperature=0, extra_body=body)
        text = answer.choices[0].text
        assert check(text), (body, text)
        streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
            model="demo", prompt="The list type", max_tokens=60, temperature=0, stream=True,
            extra_body=body) if chunk.choices)
        assert streamed == text, body
    # A text response_format is no constraint at all.
    status, plain = _post(server.http_port, "completions", {
        "prompt": "The list type", "max_tokens": 8, "temperature": 0,
        "response_format": {"type": "text"}})
    assert status == 200 and plain["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(("path", "body", "param", "fragment"), [
    ("chat/completions", {"messages": MESSAGES, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format", "does not compile"),
    ("chat/completions", {"messages": MESSAGES, "response_format": {"type": "xml"}},
     "response_format", "response_format.type"),
    ("chat/completions", {"messages": MESSAGES, "response_format": {"type": "json_schema"}},
     "response_format", "json_schema"),
    ("completions", {"prompt": "x", "guided_regex": "[0-9"}, "guided_regex",
     "does not compile"),
    ("completions", {"prompt": "x", "guided_json": {"type": "object", "required": 3}},
     "guided_json", "does not compile"),
    ("completions", {"prompt": "x", "structured_outputs": {"grammar": "start: nowhere"}},
     "structured_outputs", "does not compile"),
    ("completions", {"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["a"]}},
     "structured_outputs", "exactly one"),
    ("completions", {"prompt": "x", "guided_regex": "a", "guided_choice": ["a"]},
     "guided_choice", "only one structured-output field"),
])
def test_a_bad_constraint_is_a_400_naming_its_field(server, path, body, param, fragment):
    status, answer = _post(server.http_port, path, body)
    error = answer.get("error", {})
    assert status == 400 and error.get("param") == param, answer
    assert fragment in error["message"] and error["type"] == "invalid_request_error"


def test_grpc_structured_outputs(server):
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        stub = pb_grpc.InferenceStub(channel)

        def text_of(**sampling):
            chunks = stub.Generate(build_request("The list type", temperature=0,
                                                 max_tokens=40, **sampling), timeout=120)
            return "".join(delta.text for chunk in chunks for delta in chunk.outputs)

        assert re.fullmatch(PHONE, text_of(structured_outputs={"regex": PHONE}))
        assert text_of(structured_outputs={"choice": ["yes", "no"]}) in ("yes", "no")
        jsonschema.validate(json.loads(text_of(structured_outputs={
            "json": SCHEMA, "disable_any_whitespace": True})), SCHEMA)
        for bad in ({"regex": "[0-9"}, {"disable_any_whitespace": True}):
            with pytest.raises(grpc.RpcError) as error:
                text_of(structured_outputs=bad)
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert error.value.details().startswith("structured_outputs")


def test_protocol_mapping():
    assert structured_outputs_of({}) == (None, None)
    assert structured_outputs_of({"response_format": {"type": "text"}}) == (None, None)
    assert structured_outputs_of({"response_format": {"type": "json_object"}}) == (
        {"json_object": True}, "response_format")
    assert structured_outputs_of({"guided_json": '{"type": "object"}'}) == (
        {"json": '{"type": "object"}'}, "guided_json")
    assert structured_outputs_of({"guided_regex": "a", "structured_outputs": {
        "disable_any_whitespace": True}}) == (
        {"regex": "a", "disable_any_whitespace": True}, "guided_regex")
    parsed = parse_completion({"prompt": "x", "guided_choice": ["a", "b"]})
    assert parsed.fields["structured_outputs"] == {"choice": ["a", "b"]}
    assert parsed.structured_field == "guided_choice"
    _, chat = parse_chat({"messages": [{"role": "user", "content": "x"}],
                          "structured_outputs": {"regex": "a"}})
    assert chat.fields["structured_outputs"] == {"regex": "a"}
    with pytest.raises(InvalidRequestError) as raised:
        structured_outputs_of({"response_format": "json"})
    assert raised.value.field == "response_format"
