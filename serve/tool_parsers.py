"""Tool calls in a model's own output format, parsed whole or as the text streams in.

    parser = get_tool_parser("hermes")        # the name `jaxinfer serve --tool-call-parser` takes
    content, calls = parser.extract(text)     # the finished text: (str | None, [ToolCall])
    stream = parser.stream()                  # one per streamed choice
    delta = stream.feed(text_delta)           # {"content": ..., "tool_calls": [...]} (or {})
    delta = stream.finish()                   # the last one, once the output ended

The formats, named as vLLM names their parsers:

    hermes       <tool_call>{"name": "f", "arguments": {...}}</tool_call> (Hermes 2 Pro, Qwen2.5,
                 Qwen3), one tag per call; text around the tags is content
    llama3_json  {"name": "f", "parameters": {...}} at the start of the output (after an
                 optional <|python_tag|>), several joined by ";" (Llama 3.1-3.3)
    mistral      [TOOL_CALLS][{"name": "f", "arguments": {...}}, ...] (Mistral 7B v0.3, Mixtral
                 8x22B); text before the marker is content; ids are 9 letters and digits, which
                 Mistral's templates insist on

Each parser is one function `parse(text, final, scans)` from the text so far to the content and
the calls (a call's name once complete, and the raw text of its arguments so far), built on
`serve.partial_json` (`scans` resumes the JSON scanners of a growing text, so a stream reads
each character about once). `extract` is `parse(text, final=True)`; `ToolCallStream` re-parses
the text on every delta and sends what grew: a call's first delta carries its index, id, type and
name, the following ones fragments of its arguments, and content outside the calls streams as
content. A call's arguments are the model's own JSON text (checked to parse, not re-encoded),
so the fragments concatenate to exactly what `extract` returns.

Malformed output is content, never an error: a call that is not valid JSON of the right shape
(name a string, arguments any JSON, also under "parameters") turns, with all the text after it,
into content; the calls before it stand (in an array of calls, as mistral writes them, the
elements before it). While streaming, a possible start of a marker at the end of the
text is held back, and so is content that is only whitespace until the output shows whether it
holds calls (whitespace-only content beside calls is None, as in vLLM). One thing streaming
cannot undo: a call whose name was sent and whose JSON then breaks (or is cut short by
max_tokens) stays sent, while `extract` would make that text content; the content streamed
still concatenates to what `extract` returns.

`NamedCallFormat` and `RequiredCallsFormat` are the output formats that `tool_choice` forces
with a JSON schema (`serve.tool_calling`): the arguments alone, and an array of
`{"name", "parameters"}` objects.
"""

from __future__ import annotations

import abc
import dataclasses
import random
import re
import string
import uuid
from collections.abc import Callable
from typing import Any, ClassVar

from serve.partial_json import Path, Scan, Scans, loads_complete

_WHITESPACE = re.compile(r"[ \t\n\r]*")
_ALPHANUMERIC = string.ascii_letters + string.digits
# Keys a call's arguments come under, in order of preference ("parameters" is Llama 3's).
ARGUMENT_KEYS = ("arguments", "parameters")


def openai_tool_call_id() -> str:
    """vLLM's tool call id: `chatcmpl-tool-` and 32 hex digits."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def mistral_tool_call_id() -> str:
    """A Mistral tool call id: 9 letters and digits (Mistral's chat templates refuse others)."""
    return "".join(random.choices(_ALPHANUMERIC, k=9))


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One finished call: its id, the function's name, its arguments as JSON text."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        """The `tool_calls` entry of a chat message."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclasses.dataclass
class ParsedCall:
    """A call in text that may still grow: the name once it is complete, the arguments'
    raw JSON text so far ("{}" for a finished call that gave none)."""

    name: str | None
    arguments: str


@dataclasses.dataclass
class Parsed:
    """The text split into content (outside the calls) and calls."""

    content: str
    calls: list[ParsedCall]


def _skip_whitespace(text: str, pos: int) -> int:
    return _WHITESPACE.match(text, pos).end()


def _hold_back(text: str, marker: str) -> str:
    """`text` without an ending that may be the start of `marker` (still being generated)."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return text[:-length]
    return text


def call_of(scanned: Scan, text: str, base: Path, complete: bool,
            argument_keys: tuple[str, ...] = ARGUMENT_KEYS) -> ParsedCall | None:
    """The call in the object at `base` of a scan (() for the scanned value itself).

    Args:
        scanned: A scan whose spans reach `base` + one key.
        text: The scanned text.
        base: The object's path.
        complete: Whether the object is complete; then it must be a call (an object with a
            string name and, if any, complete arguments) or None is returned.
        argument_keys: The keys the arguments may come under.

    Returns:
        The call so far, or None for a complete object that is not a call.
    """
    # "" for the scanned value itself: nothing but whitespace yet.
    is_object = (text[scanned.spans[base].start] if base else scanned.kind) in ("{", "")
    name = scanned.string_at(text, (*base, "name"))
    key = next((key for key in argument_keys if (*base, key) in scanned.spans), None)
    arguments = "" if key is None else scanned.text_of(text, (*base, key))
    if not complete:
        return ParsedCall(name, arguments or "") if is_object else None
    if not is_object or name is None:
        return None
    if key is None:
        return ParsedCall(name, "{}")
    valid, _ = loads_complete(arguments)  # the scanner found it complete: a cross-check
    return ParsedCall(name, arguments) if valid else None


class ToolParser(abc.ABC):
    """One model family's tool-call format. Stateless: one instance serves every request.

    Attributes:
        name: The `--tool-call-parser` name (vLLM's).
        keeps_special_tokens: The format's markers are special tokens, so requests parsed with
            it are detokenized with `skip_special_tokens=False` (as vLLM's parser does).
    """

    name: ClassVar[str]
    keeps_special_tokens: ClassVar[bool] = False

    @staticmethod
    def new_id() -> str:
        """A fresh tool call id in this format's style."""
        return openai_tool_call_id()

    @abc.abstractmethod
    def parse(self, text: str, final: bool, scans: Scans) -> Parsed:
        """Splits the text into content and calls.

        Args:
            text: The output so far.
            final: The output ended: no call may be left open, and no marker held back.
            scans: The JSON scanners of this text (resumed as a stream's text grows).

        Returns:
            Content and calls; while not final, the last call may be incomplete (a name of
            None, arguments cut short).
        """

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The finished output's content (None when it is only whitespace beside calls)
        and calls."""
        parsed = self.parse(text, True, Scans())
        calls = [ToolCall(self.new_id(), call.name, call.arguments)
                 for call in parsed.calls if call.name is not None]
        if calls and not parsed.content.strip():
            return None, calls
        return parsed.content, calls

    def stream(self) -> ToolCallStream:
        """A new incremental parse for one streamed choice."""
        return ToolCallStream(self)


@dataclasses.dataclass
class _SentCall:
    id: str
    name: str
    arguments: str = ""


class ToolCallStream:
    """Turns one choice's streamed text into OpenAI deltas, re-parsing the text so far.

    Args:
        parser: The format.
    """

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self._sent_content = ""
        self._sent_calls: list[_SentCall] = []
        self._scans = Scans()

    @property
    def called(self) -> bool:
        """Whether any call has been sent (the finish reason becomes "tool_calls")."""
        return bool(self._sent_calls)

    def feed(self, text_delta: str) -> dict[str, Any]:
        """The delta for new text: {"content": str} and/or {"tool_calls": [...]}, or {}."""
        self.text += text_delta
        return self._advance(final=False)

    def finish(self, text_delta: str = "") -> dict[str, Any]:
        """The last delta, once the output ended (flushes what was held back)."""
        self.text += text_delta
        return self._advance(final=True)

    def _advance(self, final: bool) -> dict[str, Any]:
        parsed = self.parser.parse(self.text, final, self._scans)
        delta: dict[str, Any] = {}
        has_calls = bool(parsed.calls or self._sent_calls)
        content = parsed.content
        if not content.strip() and (has_calls or not final):
            content = ""  # whitespace beside calls is no content; before them, not yet known
        if content.startswith(self._sent_content) and len(content) > len(self._sent_content):
            delta["content"] = content[len(self._sent_content):]
            self._sent_content = content
        entries = []
        for index, call in enumerate(parsed.calls):
            entry: dict[str, Any] = {"index": index}
            if index == len(self._sent_calls):
                if call.name is None:
                    break  # announced once its name is complete
                sent = _SentCall(self.parser.new_id(), call.name)
                self._sent_calls.append(sent)
                entry.update(id=sent.id, type="function",
                             function={"name": call.name, "arguments": ""})
            sent = self._sent_calls[index]
            if sent.name == call.name and call.arguments.startswith(sent.arguments) and len(
                    call.arguments) > len(sent.arguments):
                entry.setdefault("function", {})["arguments"] = call.arguments[
                    len(sent.arguments):]
                sent.arguments = call.arguments
            if len(entry) > 1:
                entries.append(entry)
        if entries:
            delta["tool_calls"] = entries
        return delta


class HermesToolParser(ToolParser):
    """`<tool_call>{"name": ..., "arguments": ...}</tool_call>`: Hermes 2 Pro, Qwen2.5/Qwen3.

    The closing tag of the last call may be missing (the model stopped right after the JSON),
    as vLLM accepts.
    """

    name = "hermes"
    keeps_special_tokens = True  # Hermes 2 Pro's tags are special tokens (Qwen's are not)
    start_tag, end_tag = "<tool_call>", "</tool_call>"

    def parse(self, text: str, final: bool, scans: Scans) -> Parsed:
        content: list[str] = []
        calls: list[ParsedCall] = []
        pos = 0
        while True:
            start = text.find(self.start_tag, pos)
            # Whitespace between and after calls is layout, not content.
            between = text[pos:] if start < 0 else text[pos:start]
            if start < 0 and not final:
                between = _hold_back(between, self.start_tag)
            if calls and not between.strip():
                between = ""
            content.append(between)
            if start < 0:
                break
            scanned = scans.scan(text, start + len(self.start_tag), depth=1)
            if scanned.status == "complete":
                call = call_of(scanned, text, (), complete=True)
                after = _skip_whitespace(text, scanned.end)
                if call is not None and text.startswith(self.end_tag, after):
                    calls.append(call)
                    pos = after + len(self.end_tag)
                    continue
                end_coming = not final and self.end_tag.startswith(text[after:])
                if call is not None and (after == len(text) or end_coming):
                    calls.append(call)  # unclosed at the end, or its end tag on the way
                    break
            elif scanned.status == "partial" and not final:
                call = call_of(scanned, text, (), complete=False)
                if call is not None:
                    calls.append(call)
                break
            content.append(text[start:])  # malformed: it and all after it are content
            break
        return Parsed("".join(content), calls)


class Llama3JsonToolParser(ToolParser):
    """`{"name": ..., "parameters": ...}` at the start of the output, after an optional
    `<|python_tag|>`, several separated by ";"; text after the last call is content."""

    name = "llama3_json"
    python_tag = "<|python_tag|>"

    def parse(self, text: str, final: bool, scans: Scans) -> Parsed:
        if text.startswith(self.python_tag):
            pos = len(self.python_tag)
        elif text.startswith("{"):
            pos = 0
        elif not final and self.python_tag.startswith(text):
            return Parsed("", [])  # the tag, or nothing yet
        else:
            return Parsed(text, [])
        calls: list[ParsedCall] = []
        while True:
            call_start = _skip_whitespace(text, pos)
            scanned = scans.scan(text, pos, depth=1)
            if scanned.status == "complete" and scanned.kind == "{":
                call = call_of(scanned, text, (), complete=True)
                if call is not None:
                    calls.append(call)
                    after = _skip_whitespace(text, scanned.end)
                    if after < len(text) and text[after] == ";":
                        pos = after + 1
                        if _skip_whitespace(text, pos) == len(text):
                            return Parsed("", calls)  # the next call may follow
                        continue
                    rest = text[scanned.end:]  # prose after the calls, if any
                    return Parsed(rest if rest.strip() else "", calls)
            elif scanned.status == "partial" and not final and scanned.kind in ("", "{"):
                call = call_of(scanned, text, (), complete=False)
                return Parsed("", [*calls, call] if call is not None else calls)
            # Malformed: this call and all after it are content (the whole text if first).
            return Parsed(text[call_start:] if calls else text, calls)


def _array_calls(text: str, start: int, final: bool, argument_keys: tuple[str, ...],
                 scans: Scans) -> tuple[list[ParsedCall], int] | None:
    """The calls in a JSON array of call objects (or one call object) at `start`.

    Returns:
        (the calls, where the text after them begins): past the array once it is complete;
        at the first malformed element (or, when final, one cut short) when calls came
        before it; the end of the text while the array is open. None when no call can come
        of it: the text is content.
    """
    scanned = scans.scan(text, start, depth=2)
    if scanned.kind == "{":  # one call without the brackets
        complete = scanned.status == "complete"
        call = call_of(scanned, text, (), complete, argument_keys)
        if call is None or scanned.status == "invalid" or (final and not complete):
            return None
        return [call], scanned.end
    if scanned.kind not in ("", "["):
        return None
    calls: list[ParsedCall] = []
    for element in sorted(path[0] for path in scanned.spans if len(path) == 1):
        closed = scanned.closed((element,))
        call = call_of(scanned, text, (element,), closed, argument_keys)
        if call is None or (not closed and (final or scanned.status == "invalid")):
            # This element and all after it are content; the calls before it stand.
            return (calls, scanned.spans[(element,)].start) if calls else None
        calls.append(call)
    if scanned.status == "complete":
        return calls, scanned.end
    if scanned.status == "invalid" or final:  # broken, or cut short, between elements
        return (calls, scanned.end) if calls else None
    return calls, len(text)


class MistralToolParser(ToolParser):
    """`[TOOL_CALLS][{"name": ..., "arguments": ...}, ...]`; text before the marker (and
    after the array) is content; so is the array from its first malformed element on, and
    the whole text when no element is a call."""

    name = "mistral"
    keeps_special_tokens = True  # [TOOL_CALLS] is a special token
    marker = "[TOOL_CALLS]"
    new_id = staticmethod(mistral_tool_call_id)

    def parse(self, text: str, final: bool, scans: Scans) -> Parsed:
        start = text.find(self.marker)
        if start < 0:
            return Parsed(text if final else _hold_back(text, self.marker), [])
        found = _array_calls(text, start + len(self.marker), final, ARGUMENT_KEYS, scans)
        if found is None:
            return Parsed(text, [])
        calls, rest = found
        after = text[rest:]
        return Parsed(text[:start] + (after if after.strip() else ""), calls)


class NamedCallFormat(ToolParser):
    """The output forced by a named `tool_choice`: the function's arguments, nothing else.

    Args:
        function: The function's name.
        new_id: Makes the call's id (the configured parser's style).
    """

    name = "named"

    def __init__(self, function: str, new_id: Callable[[], str] = openai_tool_call_id) -> None:
        self.function = function
        self.new_id = new_id  # type: ignore[method-assign]

    def parse(self, text: str, final: bool, scans: Scans) -> Parsed:
        # Whatever the output holds is the arguments (even cut short by max_tokens, as vLLM).
        return Parsed("", [ParsedCall(self.function, text.lstrip())])


class RequiredCallsFormat(ToolParser):
    """The output forced by `tool_choice: "required"`: `[{"name": ..., "parameters": ...}]`.

    Args:
        new_id: Makes each call's id (the configured parser's style).
    """

    name = "required"

    def __init__(self, new_id: Callable[[], str] = openai_tool_call_id) -> None:
        self.new_id = new_id  # type: ignore[method-assign]

    def parse(self, text: str, final: bool, scans: Scans) -> Parsed:
        found = _array_calls(text, 0, final, ("parameters",), scans)
        if found is None:
            return Parsed(text, [])
        calls, rest = found
        after = text[rest:]
        return Parsed(after if after.strip() else "", calls)


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesToolParser, Llama3JsonToolParser,
                                       MistralToolParser)}


def get_tool_parser(name: str) -> ToolParser:
    """The parser registered under `name`.

    Raises:
        ValueError: No parser has that name (the message lists those that exist).
    """
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of "
                         f"{', '.join(sorted(TOOL_PARSERS))}") from None
