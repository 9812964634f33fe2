"""A JSON scanner for text that is still being generated: where each value lies, and whether
the text so far can still become valid JSON.

    scanned = scan('{"name": "get_weather", "arguments": {"city": "Par')
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
no recursion. A `Scanner` resumes where the text ran out, so a stream that re-reads its text
on every delta (`Scans`) reads each character about once.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Literal

# A string's body (whole characters and escapes), and what may follow it at the end of the
# text while the string is open: part of an escape. Control characters are invalid inside
# strings, as `json.loads` (strict) holds.
_STRING_BODY = re.compile(r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*')
_OPEN_ESCAPE = re.compile(r"(?:\\(?:u[0-9a-fA-F]{0,3})?)?\Z")
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


def _scalar_end(text: str, pos: int, checked: int | None = None) -> tuple[Status, int]:
    """Where the string, number or literal at `pos` ends: ("complete", end), ("partial",
    len(text)) when the text ends inside it, or ("invalid", pos).

    Args:
        text: The text.
        pos: Where the scalar begins.
        checked: For a string: how far its body is already known to be valid (resuming).
    """
    char = text[pos]
    if char == '"':
        body = _STRING_BODY.match(text, checked or pos + 1)
        if body.end() < len(text) and text[body.end()] == '"':
            return "complete", body.end() + 1
        return ("partial", len(text)) if _OPEN_ESCAPE.match(text, body.end()) else (
            "invalid", pos)
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


class Scanner:
    """Scans the one JSON value that begins at `start` (after optional whitespace), and
    resumes where it stopped when called again with the text grown by appending.

    Streaming re-reads the text on every delta; resuming makes that linear in the text
    (a fresh scan each time would be quadratic: seconds for a 10 kB argument). When the
    text ends inside a token the state stays at the token's start (inside a string: at the
    last whole character), so the next call re-reads only that token.

    Args:
        start: Where the value may begin.
        depth: Record the spans of values nested up to this deep (1: the top-level object's
            members or array's elements; 2: theirs too).
    """

    def __init__(self, start: int = 0, depth: int = 2) -> None:
        self.depth = depth
        self.result = Scan("partial", start)
        self._pos = start
        self._stack: list[_Container] = []
        self._path: Path = ()  # the path of the value about to begin
        self._expecting_value = True
        self._string_checked: int | None = None  # an open string's body is valid up to here

    def scan(self, text: str) -> Scan:
        """The scan of `text` (the text of the previous call with more appended).

        Returns:
            The status, the end and the spans (see `Scan`); the same object on every call,
            updated. Text after a complete value is not looked at.
        """
        result = self.result
        if result.status != "partial":
            return result  # complete or invalid: more text changes neither
        while True:
            pos = self._pos = _WHITESPACE.match(text, self._pos).end()
            if pos == len(text):
                result.end = pos
                return result  # partial: the text ends before the value does
            char = text[pos]
            if not result.kind:
                result.kind = char
            if self._expecting_value:
                if 0 < len(self._path) <= self.depth:
                    result.spans[self._path] = Span(pos)
                if char in "{[":
                    self._stack.append(_Container(self._path, char == "{",
                                                  "key_or_end" if char == "{" else
                                                  "value_or_end"))
                    self._pos += 1
                    self._expecting_value = False
                    continue
                if not self._scalar(text, pos):
                    return result
                self._end_value(self._pos)
                self._expecting_value = False
                if not self._stack:
                    result.status, result.end = "complete", self._pos
                    return result
                self._stack[-1].expect = "comma_or_end"
            elif not self._structure(text, pos, char):
                return result
            elif not self._stack:
                result.status, result.end = "complete", self._pos
                return result

    def _scalar(self, text: str, pos: int) -> bool:
        """Reads the scalar at `pos`; False (the result says why) unless it is complete."""
        status, end = _scalar_end(text, pos, self._string_checked)
        if status == "complete":
            self._pos, self._string_checked = end, None
            return True
        self.result.status, self.result.end = status, end
        if status == "partial" and text[pos] == '"':
            # Resume inside the string at its last whole character, not at its start.
            self._string_checked = _STRING_BODY.match(text, self._string_checked or pos + 1
                                                      ).end()
        return False

    def _end_value(self, at: int) -> None:
        if 0 < len(self._path) <= self.depth:
            self.result.spans[self._path].end = at

    def _structure(self, text: str, pos: int, char: str) -> bool:
        """Reads a key, colon, comma or closing bracket; False (the result says why) when the
        text ends inside a key or the character cannot come here."""
        container = self._stack[-1]
        expect = container.expect
        if container.is_object and expect in ("key_or_end", "key") and char == '"':
            if not self._scalar(text, pos):
                return False
            container.key = json.loads(text[pos:self._pos])
            container.expect = "colon"
        elif container.is_object and expect == "colon" and char == ":":
            self._path = (*container.path, container.key)
            self._expecting_value = True
            self._pos += 1
        elif not container.is_object and expect in ("value_or_end", "value") and char != "]":
            self._path = (*container.path, container.count)
            container.count += 1
            self._expecting_value = True
        elif expect == "comma_or_end" and char == ",":
            container.expect = "key" if container.is_object else "value"
            self._pos += 1
        elif char == ("}" if container.is_object else "]") and expect in (
                "comma_or_end", "key_or_end", "value_or_end"):
            self._stack.pop()
            self._pos += 1
            self._path = container.path
            self._end_value(self._pos)
            if self._stack:
                self._stack[-1].expect = "comma_or_end"
        else:
            self.result.status, self.result.end = "invalid", pos
            return False
        return True


def scan(text: str, start: int = 0, depth: int = 2) -> Scan:
    """Scans the one JSON value that begins at `start` (after optional whitespace).

    Args:
        text: The text so far.
        start: Where the value may begin.
        depth: Record the spans of values nested up to this deep (see `Scanner`).

    Returns:
        The status, the end, and the spans (see `Scan`). Text after a complete value is not
        looked at.
    """
    return Scanner(start, depth).scan(text)


class Scans:
    """The scanners of one growing text, by where each value starts: `scan` resumes the one
    that began there (the text must only grow by appending, as a stream's does)."""

    def __init__(self) -> None:
        self._scanners: dict[tuple[int, int], Scanner] = {}

    def scan(self, text: str, start: int = 0, depth: int = 2) -> Scan:
        """`scan(text, start, depth)`, resumed from the previous call's state."""
        scanner = self._scanners.get((start, depth))
        if scanner is None:
            scanner = self._scanners[start, depth] = Scanner(start, depth)
        return scanner.scan(text)


def loads_complete(raw: str) -> tuple[bool, Any]:
    """(True, the value) when `raw` is one complete JSON value, else (False, None)."""
    try:
        return True, json.loads(raw)
    except (ValueError, RecursionError):
        return False, None
