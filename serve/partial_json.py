"""A JSON scanner for text that is still being generated: where each value lies, and whether
the text so far can still become valid JSON.

    scanned = scan('{"name": "get_weather", "arguments": {"city": "Par', 0)
    scanned.status                        # "partial": a valid prefix, not yet complete
    scanned.spans[("name",)]              # Span(9, 22): the complete string, quotes included
    scanned.spans[("arguments",)]         # Span(37, None): open until the text goes on

The tool-call parsers (`serve.tool_parsers`) read a call's name and the raw text of its
arguments off these spans, on every streamed delta as on the finished text. A span that is
still open runs to the end of the text, and that text is always a prefix of what the span
holds once it closes (nothing after an open value has been generated yet), so streaming the
arguments span by span concatenates to exactly the finished arguments.

Python's `json` cannot do this: `raw_decode` tells a truncated value from an invalid one only
by the wording of its error. Strings, numbers and literals are matched by regular expressions
(the bulk of the text, at C speed); the structure by an explicit stack, so deep nesting costs
no recursion.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Literal

# A complete string token, and a string still open at the end of the text (perhaps inside an
# escape). Control characters are invalid inside strings, as `json.loads` (strict) holds.
_STRING = re.compile(r'"(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*"')
_OPEN_STRING = re.compile(
    r'"(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*(?:\\(?:u[0-9a-fA-F]{0,3})?)?\Z')
_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
# A run of number characters reaching the end of the text that can still grow into a number
# ("-", "1.", "2e+").
_NUMBER_RUN = re.compile(r"[-+.eE0-9]*\Z")
_NUMBER_PREFIX = re.compile(r"-?(?:(?:0|[1-9]\d*)(?:\.(?:\d+(?:[eE][+-]?\d*)?)?|[eE][+-]?\d*)?)?\Z")
_LITERALS = ("true", "false", "null")
_WHITESPACE = re.compile(r"[ \t\n\r]*")

Status = Literal["complete", "partial", "invalid"]
Path = tuple[str | int, ...]


@dataclasses.dataclass
class Span:
    """Where one value lies in the text: `text[start:end]`, or `text[start:]` while open."""

    start: int
    end: int | None = None


@dataclasses.dataclass
class Scan:
    """What `scan` found.

    Attributes:
        status: "complete" (one whole value), "partial" (a valid prefix that the end of the
            text cut short; also no value at all yet) or "invalid" (no continuation can make
            it JSON).
        end: Complete: the index just past the value; otherwise the index where scanning
            stopped (the end of the text, or the first character that cannot belong).
        kind: The top-level value's opening character ("{", "[", '"', ...), "" before it.
        spans: The values at depth 1 and 2 (and deeper, as `depth` says), by their path of
            object keys and array indexes: ("arguments",), (0, "name"). The top-level value
            itself is not in it. A key still being written has no value yet.
    """

    status: Status
    end: int
    kind: str = ""
    spans: dict[Path, Span] = dataclasses.field(default_factory=dict)

    def text_of(self, text: str, path: Path) -> str | None:
        """The raw text of the value at `path` (up to the end of `text` while open)."""
        span = self.spans.get(path)
        if span is None:
            return None
        return text[span.start:span.end]

    def closed(self, path: Path) -> bool:
        """Whether the value at `path` exists and is complete."""
        span = self.spans.get(path)
        return span is not None and span.end is not None

    def string_at(self, text: str, path: Path) -> str | None:
        """The decoded string at `path` once it is complete (None otherwise, or not a string)."""
        span = self.spans.get(path)
        if span is None or span.end is None or text[span.start] != '"':
            return None
        return json.loads(text[span.start:span.end])


@dataclasses.dataclass
class _Container:
    """One open object or array on the stack."""

    path: Path
    is_object: bool
    # Object: "key_or_end" after "{", "key" after ",", "colon", "value", "comma_or_end".
    # Array: "value_or_end" after "[", "value" after ",", "comma_or_end".
    expect: str
    key: str | None = None  # the object key whose value comes next
    count: int = 0  # the array elements begun so far


def _scalar_end(text: str, pos: int) -> tuple[Status, int]:
    """Where the string, number or literal at `pos` ends: ("complete", end), ("partial",
    len(text)) when the text ends inside it, or ("invalid", pos)."""
    char = text[pos]
    if char == '"':
        match = _STRING.match(text, pos)
        if match:
            return "complete", match.end()
        return ("partial", len(text)) if _OPEN_STRING.match(text, pos) else ("invalid", pos)
    if char == "-" or char.isdigit():
        # The text ends inside it: "12" may yet become "125", "1." become "1.5".
        if _NUMBER_RUN.match(text, pos) and _NUMBER_PREFIX.match(text, pos):
            return "partial", len(text)
        match = _NUMBER.match(text, pos)
        return ("complete", match.end()) if match else ("invalid", pos)
    for literal in _LITERALS:
        if text.startswith(literal, pos):
            return "complete", pos + len(literal)
        if literal.startswith(text[pos:]):
            return "partial", len(text)
    return "invalid", pos


def scan(text: str, start: int = 0, depth: int = 2) -> Scan:
    """Scans the one JSON value that begins at `start` (after optional whitespace).

    Args:
        text: The text so far.
        start: Where the value may begin.
        depth: Record the spans of values nested up to this deep (1: the top-level object's
            members or array's elements; 2: theirs too).

    Returns:
        The status, the end, and the spans (see `Scan`). Text after a complete value is not
        looked at.
    """
    pos = _WHITESPACE.match(text, start).end()
    if pos == len(text):
        return Scan("partial", pos)
    result = Scan("partial", pos, kind=text[pos])
    stack: list[_Container] = []
    path: Path = ()  # the path of the value about to begin

    def begin_value(at: int) -> None:
        if 0 < len(path) <= depth:
            result.spans[path] = Span(at)

    def end_value(at: int) -> None:
        if 0 < len(path) <= depth:
            result.spans[path].end = at

    expecting_value = True
    while True:
        pos = _WHITESPACE.match(text, pos).end()
        if pos == len(text):
            result.end = pos
            return result  # partial: the text ends before the value does
        char = text[pos]
        if expecting_value:
            begin_value(pos)
            if char in "{[":
                stack.append(_Container(path, char == "{",
                                        "key_or_end" if char == "{" else "value_or_end"))
                pos += 1
                expecting_value = False
                continue
            status, end = _scalar_end(text, pos)
            if status != "complete":
                result.status, result.end = status, end
                return result
            end_value(end)
            pos = end
            expecting_value = False
            if not stack:
                result.status, result.end = "complete", pos
                return result
            stack[-1].expect = "comma_or_end"
            continue
        container = stack[-1]
        expect = container.expect
        if container.is_object and expect in ("key_or_end", "key") and char == '"':
            status, end = _scalar_end(text, pos)
            if status != "complete":
                result.status, result.end = status, end
                return result
            container.key = json.loads(text[pos:end])
            container.expect = "colon"
            pos = end
        elif container.is_object and expect == "colon" and char == ":":
            path = (*container.path, container.key)
            expecting_value = True
            pos += 1
        elif not container.is_object and expect in ("value_or_end", "value") and char not in "]":
            path = (*container.path, container.count)
            container.count += 1
            expecting_value = True
        elif expect == "comma_or_end" and char == ",":
            container.expect = "key" if container.is_object else "value"
            pos += 1
        elif char == ("}" if container.is_object else "]") and expect in (
                "comma_or_end", "key_or_end", "value_or_end"):
            stack.pop()
            pos += 1
            path = container.path
            end_value(pos)
            if not stack:
                result.status, result.end = "complete", pos
                return result
            stack[-1].expect = "comma_or_end"
        else:
            result.status, result.end = "invalid", pos
            return result


def loads_complete(raw: str) -> tuple[bool, Any]:
    """(True, the value) when `raw` is one complete JSON value, else (False, None)."""
    try:
        return True, json.loads(raw)
    except (ValueError, RecursionError):
        return False, None
