"""The tool-call parsers (`serve.tool_parsers`), table-driven: each case's finished text gives
the expected content and calls, and streaming it (one character at a time, and in two pieces
split at every boundary) gives deltas of OpenAI's shape that concatenate to the same content
and calls. Malformed calls stay content; the one place streaming cannot match (a call
announced before its JSON broke) is pinned down as such."""

from __future__ import annotations

import json
import re
import time

import pytest

from serve.tool_parsers import (
    TOOL_PARSERS,
    NamedCallFormat,
    RequiredCallsFormat,
    ToolParser,
    get_tool_parser,
)

WEATHER = '{"city": "Paris", "days": [1, 2]}'
# (parser, text, content, [(name, arguments)])
CASES = [
    # hermes (Hermes 2 Pro, Qwen2.5): tags around each call, content around the tags.
    ("hermes", f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>',
     None, [("get_weather", WEATHER)]),
    ("hermes", 'Let me check.\n<tool_call>{"name": "a", "arguments": {}}</tool_call>\n'
               '<tool_call>{"arguments": {"x": "<tool_call>"}, "name": "b"}</tool_call>\n',
     "Let me check.\n", [("a", "{}"), ("b", '{"x": "<tool_call>"}')]),
    ("hermes", '<tool_call>{"name": "f"}</tool_call> Done.', " Done.", [("f", "{}")]),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"q": "\\u00e9\\"}"}}',  # unclosed tag
     None, [("f", '{"q": "\\u00e9\\"}"}')]),
    ("hermes", "The answer is 4.", "The answer is 4.", []),
    ("hermes", "a < b and <tool_ca", "a < b and <tool_ca", []),
    ("hermes", "", "", []),
    ("hermes", '<tool_call>{"name": oops}</tool_call>',  # malformed: content
     '<tool_call>{"name": oops}</tool_call>', []),
    ("hermes", "<tool_call>not json</tool_call> after", "<tool_call>not json</tool_call> after",
     []),
    ("hermes", '<tool_call>{"name": "a", "arguments": {}}</tool_call>'  # the second is bad
               '<tool_call>{"name": 7}</tool_call>',
     '<tool_call>{"name": 7}</tool_call>', [("a", "{}")]),
    ("hermes", '<tool_call>["name", "f"]</tool_call>', '<tool_call>["name", "f"]</tool_call>',
     []),
    # llama3_json (Llama 3.1-3.3): JSON at the start, after an optional <|python_tag|>.
    ("llama3_json", f'{{"name": "get_weather", "parameters": {WEATHER}}}', None,
     [("get_weather", WEATHER)]),
    ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {"n": 1}}; '
                    '{"name": "b", "arguments": {"m": [true, null]}}',
     None, [("a", '{"n": 1}'), ("b", '{"m": [true, null]}')]),
    ("llama3_json", '{"name": "a", "parameters": {}}\n\nI called a.', "\n\nI called a.",
     [("a", "{}")]),
    ("llama3_json", "Paris is sunny {today}.", "Paris is sunny {today}.", []),
    ("llama3_json", "<|python", "<|python", []),
    ("llama3_json", "{not json", "{not json", []),
    ("llama3_json", '{"nome": "a"}', '{"nome": "a"}', []),
    ("llama3_json", '{"name": "a", "parameters": {}}; {"name": 1}', '{"name": 1}',
     [("a", "{}")]),
    # mistral: [TOOL_CALLS] and an array of calls; 9-character ids.
    ("mistral", f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {WEATHER}}}, '
                '{"name": "b", "arguments": {}}]',
     None, [("get_weather", WEATHER), ("b", "{}")]),
    ("mistral", 'Sure. [TOOL_CALLS] {"name": "a", "arguments": {"x": -1.5e3}}', "Sure. ",
     [("a", '{"x": -1.5e3}')]),
    ("mistral", "No tools [TOOL_CALL", "No tools [TOOL_CALL", []),
    ("mistral", "[TOOL_CALLS][{\"name\": 1}]", "[TOOL_CALLS][{\"name\": 1}]", []),
    ("mistral", '[TOOL_CALLS][{"name": "a", "arguments": {}}, {"name": "b',  # cut short
     '{"name": "b', [("a", "{}")]),
    ("mistral", "[TOOL_CALLS]oops", "[TOOL_CALLS]oops", []),
]


def _parser(name: str) -> ToolParser:
    if name == "named":
        return NamedCallFormat("get_weather")
    if name == "required":
        return RequiredCallsFormat()
    return get_tool_parser(name)


FORCED_CASES = [
    ("named", f"  {WEATHER}", None, [("get_weather", WEATHER)]),
    ("named", '{"city": "Par', None, [("get_weather", '{"city": "Par')]),  # cut short: kept
    ("required", f'[{{"name": "get_weather", "parameters": {WEATHER}}}, '
                 '{"name": "now", "parameters": {}}]',
     None, [("get_weather", WEATHER), ("now", "{}")]),
    ("required", '[{"name": "a", "parameters": {}},{"parameters": {"c": 1}, "na',  # cut short
     '{"parameters": {"c": 1}, "na', [("a", "{}")]),
]


class _Collected:
    """Streamed deltas of one choice, accumulated as a client does, with their shape
    checked."""

    def __init__(self) -> None:
        self.content = ""
        self.calls: dict[int, dict[str, str]] = {}

    def add(self, delta: dict) -> None:
        assert set(delta) <= {"content", "tool_calls"}, delta
        self.content += delta.get("content", "")
        for entry in delta.get("tool_calls", []):
            index = entry["index"]
            if index not in self.calls:
                # The first delta of a call: index, id, type, function name.
                assert index == len(self.calls) and entry["type"] == "function", entry
                assert isinstance(entry["id"], str) and entry["function"]["name"], entry
                self.calls[index] = {"id": entry["id"], "name": entry["function"]["name"],
                                     "arguments": ""}
            else:
                assert set(entry) == {"index", "function"}, entry  # arguments only
                assert set(entry["function"]) == {"arguments"} and entry["function"][
                    "arguments"], entry
            self.calls[index]["arguments"] += entry["function"].get("arguments", "")

    def result(self) -> tuple[str | None, list[tuple[str, str]]]:
        calls = [(call["name"], call["arguments"]) for _, call in sorted(self.calls.items())]
        return (self.content or None) if calls else self.content, calls


def _streamed(parser: ToolParser, pieces: list[str]) -> _Collected:
    collected = _Collected()
    stream = parser.stream()
    for piece in pieces:
        collected.add(stream.feed(piece))
    collected.add(stream.finish())
    assert stream.called == bool(collected.calls)
    return collected


@pytest.mark.parametrize(("name", "text", "content", "calls"), CASES + FORCED_CASES)
def test_extract_and_every_streamed_split_agree(name, text, content, calls):
    parser = _parser(name)
    extracted_content, extracted = parser.extract(text)
    assert extracted_content == content
    assert [(call.name, call.arguments) for call in extracted] == calls
    for call in extracted:
        if name != "named" or call.arguments == WEATHER:  # a cut-short call is not JSON
            json.loads(call.arguments)
    expected = (content, calls)
    assert _streamed(parser, list(text)).result() == expected  # one character at a time
    for split in range(len(text) + 1):
        assert _streamed(parser, [text[:split], text[split:]]).result() == expected, split


def test_ids_are_vllms():
    hermes_call = get_tool_parser("hermes").extract(
        '<tool_call>{"name": "a", "arguments": {}}</tool_call>')[1][0]
    assert re.fullmatch(r"chatcmpl-tool-[0-9a-f]{32}", hermes_call.id)
    mistral = get_tool_parser("mistral")
    ids = {call.id for call in mistral.extract(
        '[TOOL_CALLS][{"name": "a", "arguments": {}}, {"name": "b", "arguments": {}}]')[1]}
    assert len(ids) == 2 and all(re.fullmatch(r"[A-Za-z0-9]{9}", one) for one in ids)
    assert hermes_call.to_openai() == {"id": hermes_call.id, "type": "function",
                                       "function": {"name": "a", "arguments": "{}"}}
    # A forced format takes the configured parser's id style.
    forced = RequiredCallsFormat(mistral.new_id).extract('[{"name": "a", "parameters": {}}]')
    assert re.fullmatch(r"[A-Za-z0-9]{9}", forced[1][0].id)


def test_a_possible_marker_is_held_back_until_it_is_not_one():
    stream = get_tool_parser("hermes").stream()
    assert stream.feed("Hi <tool") == {"content": "Hi "}
    assert stream.feed("_c") == {}
    assert stream.feed("x") == {"content": "<tool_cx"}
    stream = get_tool_parser("mistral").stream()
    assert stream.feed("[TOOL") == {}
    assert stream.finish() == {"content": "[TOOL"}  # the end: nothing more can come


def test_whitespace_waits_to_see_whether_calls_follow():
    hermes = get_tool_parser("hermes")
    stream = hermes.stream()
    assert stream.feed("\n\n") == {}
    delta = stream.feed('<tool_call>{"name": "f", "arguments": {"a"')
    assert delta["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"a"'}
    assert "content" not in delta and stream.finish(": 1}}</tool_call>\n") == {
        "tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}
    # Without calls, whitespace is the content.
    assert hermes.extract("\n") == ("\n", [])
    stream = hermes.stream()
    assert stream.feed("\n") == {} and stream.finish() == {"content": "\n"}


@pytest.mark.parametrize(("name", "text", "content", "calls"), [
    ("hermes", '<tool_call>{"name": "f", "arguments": {"x": ]}</tool_call>',
     '<tool_call>{"name": "f", "arguments": {"x": ]}</tool_call>', []),
    ("required", '[{"name": "a", "parameters": {}}, {"name": "b", "parameters": {"c": ',
     '{"name": "b", "parameters": {"c": ', [("a", "{}")]),  # cut short by max_tokens
])
def test_a_call_announced_before_its_json_broke_stays_streamed(name, text, content, calls):
    # Streaming cannot take back a name it sent: the broken call stays in the stream, with
    # the arguments it got. The content and the calls before it match extract's.
    parser = _parser(name)
    extracted_content, extracted = parser.extract(text)
    assert (extracted_content, [(call.name, call.arguments) for call in extracted]) == (
        content, calls)
    streamed_content, streamed = _streamed(parser, list(text)).result()
    assert streamed_content == content and streamed[:len(calls)] == calls
    assert len(streamed) == len(calls) + 1


def test_registry():
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json", "mistral"}
    assert all(get_tool_parser(name).name == name for name in TOOL_PARSERS)
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral"):
        get_tool_parser("qwen")


def test_streaming_reads_the_text_about_once():
    # Every delta re-parses the text, resuming its JSON scanners: a 10 kB argument in 4-character
    # deltas takes milliseconds (a fresh scan per delta took seconds).
    text = "<tool_call>" + json.dumps({"name": "f", "arguments": {
        "code": "x = 1\n" * 1000, "numbers": list(range(500))}}) + "</tool_call>"
    stream = get_tool_parser("hermes").stream()
    began = time.perf_counter()
    for start in range(0, len(text), 4):
        stream.feed(text[start:start + 4])
    stream.finish()
    assert time.perf_counter() - began < 1.0
