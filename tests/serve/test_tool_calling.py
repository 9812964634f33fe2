"""Tool calling in `/v1/chat/completions` (`serve.tool_calling`), end to end with the official
`openai` client on the demo model: a named and a "required" `tool_choice` are forced by a JSON
schema and come back as `tool_calls` whose arguments validate against the tool's parameters,
the same streamed as not (greedy); tools and tool messages reach the chat template as
transformers renders them (token counts compared with transformers' own rendering); every
malformed field is a 400 naming it. The demo model never calls tools by itself, so "auto"'s
parsing is `test_tool_parsers`'; here it is served and refused as configured."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from serve.server import BackgroundServer
from serve.service import ServiceConfig
from serve.tool_calling import ToolRequest, parse_tools, tool_messages
from tests.serve.conftest import make_service
from tests.serve.test_structured_output_serving import _post

WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
         "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}}]
PARAMETERS = {"get_weather": WEATHER, "get_time": CLOCK}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
# The demo model pads JSON with whitespace until max_tokens unless told not to; a
# `structured_outputs` object that only sets options applies to the forced schema.
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}
# A template that renders tools, tool calls and tool results (Qwen2.5's shape, shortened).
TOOLS_TEMPLATE = (
    "{% if tools %}system: call a tool as <tool_call>{\"name\": ..., \"arguments\": ...}"
    "</tool_call>. Tools:\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}{% endif %}"
    "{% for message in messages %}"
    "{% if message.tool_calls is defined %}{{ message.role }}:"
    "{% for call in message.tool_calls %} <tool_call>{\"name\": \"{{ call.function.name }}\", "
    "\"arguments\": {{ call.function.arguments | tojson }}}</tool_call>{% endfor %}\n"
    "{% elif message.role == 'tool' %}tool {{ message.tool_call_id }}: {{ message.content }}\n"
    "{% else %}{{ message.role }}: {{ message.content }}\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="unused")


def _calls(message) -> list[tuple[str, str]]:
    return [(call.function.name, call.function.arguments) for call in message.tool_calls or []]


def _streamed(client, **kwargs) -> tuple[str | None, list[tuple[str, str]], str, list[str]]:
    """(content, calls, finish reason, ids) of a streamed chat, accumulated as a client
    does; each call's first delta must carry its id, type and name."""
    content, calls, finish, ids = "", {}, None, []
    for chunk in client.chat.completions.create(model="demo", stream=True, **kwargs):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                if delta.index not in calls:
                    assert delta.id and delta.type == "function" and delta.function.name
                    calls[delta.index] = [delta.function.name, ""]
                    ids.append(delta.id)
                calls[delta.index][1] += delta.function.arguments or ""
    return content or None, [tuple(call) for _, call in sorted(calls.items())], finish, ids


@pytest.mark.parametrize("tool", ["get_weather", "get_time"])
def test_a_named_tool_choice_is_a_call_of_that_tool(client, tool):
    request = dict(messages=MESSAGES, tools=TOOLS, temperature=0, max_tokens=60,
                   tool_choice={"type": "function", "function": {"name": tool}},
                   extra_body=COMPACT)
    answer = client.chat.completions.create(model="demo", **request)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [(name, arguments)] = _calls(choice.message)
    assert name == tool
    jsonschema.validate(json.loads(arguments), PARAMETERS[tool])
    assert choice.message.tool_calls[0].id.startswith("chatcmpl-tool-")
    assert _streamed(client, **request)[:3] == (None, [(name, arguments)], "tool_calls")


def test_required_is_at_least_one_call_of_the_tools(client):
    # parallel_tool_calls: false caps the forced array at one call.
    request = dict(messages=MESSAGES, tools=TOOLS, tool_choice="required", temperature=0,
                   max_tokens=80, parallel_tool_calls=False, extra_body=COMPACT)
    choice = client.chat.completions.create(model="demo", **request).choices[0]
    assert choice.finish_reason == "tool_calls"
    [(name, arguments)] = _calls(choice.message)
    jsonschema.validate(json.loads(arguments), PARAMETERS[name])
    assert _streamed(client, **request)[:3] == (None, [(name, arguments)], "tool_calls")
    # Without the cap the demo model goes on calling until max_tokens: the calls it finished
    # stand (each valid), the one cut short is content, and the finish reason says "length".
    request.pop("parallel_tool_calls")
    choice = client.chat.completions.create(model="demo", **request).choices[0]
    calls = _calls(choice.message)
    assert calls and choice.finish_reason in ("length", "tool_calls")
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), PARAMETERS[name])
    content, streamed, finish, ids = _streamed(client, **request)
    assert (content, finish) == (choice.message.content, choice.finish_reason)
    assert streamed[:len(calls)] == calls and len(set(ids)) == len(ids)


@pytest.fixture(scope="module")
def tools_server():
    """A server whose template renders tools, with auto tool choice and the hermes parser."""
    service = make_service(chat_template=TOOLS_TEMPLATE, tool_call_parser="hermes",
                           enable_auto_tool_choice=True, max_queued_requests=1000)
    with BackgroundServer(service, grpc=False) as running:
        yield running, service.tokenizer


def _prompt_tokens(port: int, body: dict) -> int:
    status, answer = _post(port, "chat/completions", {"max_tokens": 1, **body})
    assert status == 200, answer
    return answer["usage"]["prompt_tokens"]


def _transformers_tokens(tokenizer, messages, tools=None) -> int:
    [text], _ = render_jinja_template(conversations=[messages], tools=tools,
                                      chat_template=TOOLS_TEMPLATE, add_generation_prompt=True)
    return len(tokenizer.encode(text, add_special_tokens=False))


def test_tools_and_tool_messages_render_as_transformers_renders_them(tools_server):
    server, tokenizer = tools_server
    port = server.http_port
    tools = TOOLS[1:]  # the context is 256 tokens
    with_tools = _prompt_tokens(port, {"messages": MESSAGES, "tools": tools})
    assert with_tools == _transformers_tokens(tokenizer, MESSAGES, tools)
    assert with_tools > _prompt_tokens(port, {"messages": MESSAGES}) + 20
    # As vLLM: "none" still renders the tools (unless --exclude-tools-when-tool-choice-none).
    assert _prompt_tokens(port, {"messages": MESSAGES, "tools": tools,
                                 "tool_choice": "none"}) == with_tools
    # A history with a call and its result: the arguments reach the template as a dict.
    call = {"id": "chatcmpl-tool-1", "type": "function",
            "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}}
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": "12:00"}]
    expected_history = [*MESSAGES, {"role": "assistant", "tool_calls": [
        {**call, "function": {"name": "get_time", "arguments": {"zone": "CET"}}}]},
        history[2]]
    assert _prompt_tokens(port, {"messages": history, "tools": tools}) == (
        _transformers_tokens(tokenizer, expected_history, tools))


def test_auto_runs_the_parser_over_free_text(tools_server):
    server, _ = tools_server
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1",
                           api_key="unused")
    request = dict(messages=MESSAGES, tools=TOOLS[1:], temperature=0, max_tokens=24)
    choice = client.chat.completions.create(model="demo", **request).choices[0]
    # The demo model writes no <tool_call>: its text is the content.
    assert not choice.message.tool_calls and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert _streamed(client, **request)[:3] == (choice.message.content, [],
                                                choice.finish_reason)


@pytest.mark.parametrize(("body", "param", "fragment"), [
    ({"tools": TOOLS}, "tool_choice", "--enable-auto-tool-choice"),  # auto by default
    ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", "--tool-call-parser"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "not in tools"),
    ({"tools": TOOLS, "tool_choice": {"function": {"name": "get_time"}}}, "tool_choice",
     '"type": "function"'),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "'sometimes'"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": "get_time"}, "tools", "list of function tools"),
    ({"tools": [{"type": "code_interpreter"}], "tool_choice": "required"}, "tools",
     "only function tools"),
    ({"tools": [{"type": "function", "function": {"description": "x"}}]}, "tools",
     "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]},
     "tools", "tools[0].function.parameters"),
    ({"tools": [TOOLS[0], TOOLS[0]], "tool_choice": "required"}, "tools", "given twice"),
    ({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": "no"},
     "parallel_tool_calls", "boolean"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}},
     "tool_choice", "response_format cannot constrain it too"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "nope"}}}], "tool_choice": "required"}, "tools", "does not compile"),
    ({"functions": [{"name": "f"}]}, "functions", "not supported"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {
        "name": "f", "arguments": "{oops"}}]}]}, "messages", "arguments is not JSON"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"type": "function"}]}]}, "messages",
     "tool_calls[0]"),
    ({"messages": [{"role": "tool", "tool_call_id": 7, "content": "x"}]}, "messages",
     "tool_call_id"),
])
def test_a_malformed_tool_field_is_a_400_naming_it(server, body, param, fragment):
    status, answer = _post(server.http_port, "chat/completions", {"messages": MESSAGES, **body})
    error = answer.get("error", {})
    assert status == 400 and error.get("param") == param, answer
    assert fragment in error["message"] and error["type"] == "invalid_request_error"


# ---------------------------------------------------------------------- the request, unit


def test_the_forced_schemas_are_vllms():
    config = ServiceConfig(model_name="m")
    named = parse_tools({"tools": TOOLS, "tool_choice": {
        "type": "function", "function": {"name": "get_time"}}}, config)
    assert named == ToolRequest(TOOLS, "named", "get_time")
    assert named.schema() == CLOCK
    no_parameters = [{"type": "function", "function": {"name": "now"}}]
    required = parse_tools({"tools": no_parameters, "tool_choice": "required"}, config)
    assert required.schema() == {"type": "array", "minItems": 1, "items": {
        "type": "object", "anyOf": [{
            "type": "object", "required": ["name", "parameters"],
            "additionalProperties": False,
            "properties": {"name": {"type": "string", "enum": ["now"]},
                           "parameters": {"type": "object", "properties": {}}}}]}}
    # $defs move to the root, where their references point; the tools are not changed.
    with_definitions = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"$ref": "#/$defs/X"}},
        "$defs": {"X": {"type": "integer"}}}}}]
    schema = parse_tools({"tools": with_definitions, "tool_choice": "required",
                          "parallel_tool_calls": False}, config).schema()
    assert schema["$defs"] == {"X": {"type": "integer"}} and schema["maxItems"] == 1
    assert "$defs" in with_definitions[0]["function"]["parameters"]
    assert "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"]
    jsonschema.validate([{"name": "f", "parameters": {"x": 3}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "f", "parameters": {"x": "3"}}], schema)


def test_none_and_empty_tools():
    config = ServiceConfig(model_name="m", exclude_tools_when_tool_choice_none=True)
    assert parse_tools({}, config) is None
    assert parse_tools({"tools": [], "tool_choice": "required"}, config) is None
    none = parse_tools({"tools": TOOLS, "tool_choice": "none"}, config)
    assert none.template_tools(config) is None and none.schema() is None
    assert none.output_format(config) is None
    assert none.template_tools(ServiceConfig(model_name="m")) == TOOLS


def test_tool_messages_decode_arguments_and_leave_the_request_alone():
    call = {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    empty = {"id": "2", "type": "function", "function": {"name": "g", "arguments": ""}}
    messages = [{"role": "assistant", "content": None, "tool_calls": [call, empty]}]
    [prepared] = tool_messages(messages)
    assert [one["function"]["arguments"] for one in prepared["tool_calls"]] == [{"a": 1}, {}]
    assert call["function"]["arguments"] == '{"a": 1}'  # the body is not changed
