"""A real pretrained model behind the server, asked through the official `openai` SDK:
SmolLM2-135M-Instruct, served straight from its Q4_1 GGUF file (`make test` fetches it; the
tests skip, saying how to fetch it, when it is missing).

- 20 different JSON schemas, each answered with JSON that `jsonschema` validates, streamed
  and not streamed alike (greedy, so both give the same text);
- a chat question answered in words, and the ChatML template taken from the GGUF metadata;
- a tools request whose `tool_calls` are parsed from the model's own generation.
"""

from __future__ import annotations

import concurrent.futures
import json

import jsonschema
import openai
import pytest

from jaxinfer.engine.async_engine import AsyncEngine
from jaxinfer.engine.factory import load_engine
from serve.server import BackgroundServer
from serve.service import InferenceService, ServiceConfig

MODEL = "smollm2"
# Enough sequences for the 20 schemas at once; a context long enough for a chat prompt.
ENGINE_OPTIONS = dict(max_num_seqs=24, max_num_batched_tokens=256, max_model_len=768,
                      min_token_bucket=16, bucket_growth=4)

_NAME = {"type": "string", "maxLength": 24}
SCHEMAS: list[tuple[str, dict]] = [
    ("Describe a person as JSON.", {
        "type": "object", "properties": {"name": _NAME, "age": {"type": "integer"}},
        "required": ["name", "age"]}),
    ("Give a city and its country as JSON.", {
        "type": "object", "properties": {"city": _NAME, "country": _NAME},
        "required": ["city", "country"], "additionalProperties": False}),
    ("Is the sky blue? Answer as JSON.", {
        "type": "object", "properties": {"answer": {"type": "boolean"}},
        "required": ["answer"]}),
    ("Rate the movie Titanic from 1 to 5 as JSON.", {
        "type": "object", "properties": {"rating": {"type": "integer", "minimum": 1,
                                                    "maximum": 5}},
        "required": ["rating"]}),
    ("What is the weather like? Answer as JSON.", {
        "type": "object", "properties": {"sky": {"enum": ["sunny", "cloudy", "rainy"]},
                                         "celsius": {"type": "number"}},
        "required": ["sky", "celsius"]}),
    ("List three fruits as JSON.", {
        "type": "object", "properties": {"fruits": {"type": "array", "items": _NAME,
                                                    "minItems": 3, "maxItems": 3}},
        "required": ["fruits"]}),
    ("Give a book with its author as JSON.", {
        "type": "object", "properties": {
            "book": {"type": "object", "properties": {"title": _NAME, "author": _NAME},
                     "required": ["title", "author"]}},
        "required": ["book"]}),
    ("Give the first three prime numbers as a JSON array.", {
        "type": "array", "items": {"type": "integer"}, "minItems": 3, "maxItems": 3}),
    ("Name a color as a JSON string.", {"type": "string", "maxLength": 16}),
    ("How many legs does a dog have? Answer with a JSON number.", {"type": "integer"}),
    ("Describe a product with a price as JSON.", {
        "type": "object", "properties": {"product": _NAME,
                                         "price": {"type": "number", "minimum": 0},
                                         "in_stock": {"type": "boolean"}},
        "required": ["product", "price", "in_stock"], "additionalProperties": False}),
    ("Give a date as JSON.", {
        "type": "object", "properties": {"year": {"type": "integer", "minimum": 1900,
                                                  "maximum": 2100},
                                         "month": {"type": "integer", "minimum": 1,
                                                   "maximum": 12}},
        "required": ["year", "month"]}),
    ("Describe a pet as JSON.", {
        "type": "object", "properties": {"kind": {"enum": ["cat", "dog", "fish"]},
                                         "name": _NAME, "nickname": {"type": ["string",
                                                                              "null"],
                                                                     "maxLength": 16}},
        "required": ["kind", "name", "nickname"]}),
    ("Give a phone number as JSON.", {
        "type": "object", "properties": {"phone": {"type": "string",
                                                   "pattern": "^[0-9]{3}-[0-9]{4}$"}},
        "required": ["phone"]}),
    ("Give a point on a map as JSON.", {
        "type": "object", "properties": {"lat": {"type": "number", "minimum": -90,
                                                 "maximum": 90},
                                         "lon": {"type": "number", "minimum": -180,
                                                 "maximum": 180}},
        "required": ["lat", "lon"], "additionalProperties": False}),
    ("List two planets with their order from the sun as JSON.", {
        "type": "object", "properties": {"planets": {"type": "array", "minItems": 2,
                                                     "maxItems": 2, "items": {
                                                         "type": "object",
                                                         "properties": {"name": _NAME,
                                                                        "order": {
                                                                            "type": "integer"}},
                                                         "required": ["name", "order"]}}},
        "required": ["planets"]}),
    ("Answer yes or no as JSON: is water wet?", {
        "type": "object", "properties": {"answer": {"const": "yes"}, "why": _NAME},
        "required": ["answer", "why"]}),
    ("Give a shape as JSON: a circle with a radius or a square with a side.", {
        "anyOf": [
            {"type": "object", "properties": {"circle": {"type": "number"}},
             "required": ["circle"], "additionalProperties": False},
            {"type": "object", "properties": {"square": {"type": "number"}},
             "required": ["square"], "additionalProperties": False}]}),
    ("Describe a user account as JSON.", {
        "type": "object", "properties": {"username": {"type": "string", "minLength": 3,
                                                      "maxLength": 16},
                                         "roles": {"type": "array",
                                                   "items": {"enum": ["admin", "user",
                                                                      "guest"]},
                                                   "minItems": 1, "maxItems": 3}},
        "required": ["username", "roles"]}),
    ("Translate 'hello' into French as JSON.", {
        "type": "object", "properties": {"source": {"const": "hello"},
                                         "french": _NAME},
        "required": ["source", "french"], "additionalProperties": False}),
]


def _closed(schema):
    """The schema with every object closed (`additionalProperties: false`, as OpenAI's strict
    mode has it): a small model left free to add keys may go on adding them."""
    if isinstance(schema, list):
        return [_closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {key: _closed(value) for key, value in schema.items()}
    if closed.get("type") == "object":
        closed.setdefault("additionalProperties", False)
    return closed


SCHEMAS = [(question, _closed(schema)) for question, schema in SCHEMAS]


@pytest.fixture(scope="module")
def server(smollm2_gguf):
    engine = AsyncEngine(load_engine(str(smollm2_gguf), **ENGINE_OPTIONS), warm_up=False)
    service = InferenceService(engine, ServiceConfig(model_name=MODEL))
    with BackgroundServer(service) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="unused",
                         timeout=600)


def _ask(client, question: str, schema: dict, stream: bool) -> tuple[str, str]:
    """The answer's text and finish reason, streamed or not."""
    request = dict(model=MODEL, messages=[{"role": "user", "content": question}],
                   max_tokens=160, temperature=0,
                   response_format={"type": "json_schema",
                                    "json_schema": {"name": "answer", "schema": schema}})
    if not stream:
        choice = client.chat.completions.create(**request).choices[0]
        return choice.message.content, choice.finish_reason
    text, finish = "", None
    for chunk in client.chat.completions.create(stream=True, **request):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, finish


def test_twenty_schemas_give_valid_json_streamed_and_not(client):
    jobs = [(question, schema, stream) for question, schema in SCHEMAS
            for stream in (False, True)]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(lambda job: _ask(client, *job), jobs))
    for index, (question, schema) in enumerate(SCHEMAS):
        (plain, plain_finish), (streamed, streamed_finish) = answers[2 * index:2 * index + 2]
        assert plain_finish == "stop", (question, plain)
        jsonschema.validate(json.loads(plain), schema)
        assert (streamed, streamed_finish) == (plain, plain_finish), question


def test_a_chat_question_is_answered_in_words(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24, temperature=0)
    assert "Paris" in reply.choices[0].message.content
    assert reply.usage.prompt_tokens > 20  # the template's system message came too


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "maxLength": 32},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                             "maxLength": 32}},
                   "required": ["city"], "additionalProperties": False}}}


@pytest.mark.parametrize("tool_choice", [
    "required", {"type": "function", "function": {"name": "get_weather"}}],
    ids=["required", "named"])
def test_a_tools_request_gets_tool_calls_parsed_from_the_models_generation(client,
                                                                          tool_choice):
    request = dict(model=MODEL, temperature=0, max_tokens=96,
                   messages=[{"role": "user", "content": "What is the weather in Paris?"}],
                   tools=[WEATHER_TOOL, TIME_TOOL], tool_choice=tool_choice)
    choice = client.chat.completions.create(**request).choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls
    assert calls and all(call.type == "function" for call in calls)
    tools = {tool["function"]["name"]: tool["function"]["parameters"]
             for tool in (WEATHER_TOOL, TIME_TOOL)}
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), tools[call.function.name])
    if isinstance(tool_choice, dict):
        assert [call.function.name for call in calls] == ["get_weather"]
    # Streamed: the same calls, assembled from the deltas as the SDK's users do.
    streamed: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **request):
        for delta_choice in chunk.choices:
            finish = delta_choice.finish_reason or finish
            for delta in delta_choice.delta.tool_calls or ():
                call = streamed.setdefault(delta.index, {"name": "", "arguments": ""})
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
    assert finish == "tool_calls"
    assert [(call["name"], call["arguments"]) for _, call in sorted(streamed.items())] == [
        (call.function.name, call.function.arguments) for call in calls]
