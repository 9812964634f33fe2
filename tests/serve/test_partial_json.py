"""The scanner of JSON that is still being generated (`serve.partial_json`): every prefix of
a valid document is partial, the whole is complete with the spans `json` agrees with, and
over random short strings it accepts exactly what `json.loads` accepts, while every partial
verdict can still be completed."""

from __future__ import annotations

import json
import random

import pytest

from serve.partial_json import Scanner, Span, scan

DOCUMENTS = [
    '{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2.5e-3, -0.0]}}',
    '[{"name":"f","parameters":{}}, {"name": "g", "parameters": {"x": [ ], "y": null}}]',
    '{"text": "quote \\" backslash \\\\ unicode \\u00e9 \\ud83d\\ude00 tab \\t", "ok": true}',
    '{"deep": [[[[{"a": false}]]]], "e": 1E+5, "z": 0}',
    '"just a string"',
    "[]",
    "{}",
]


@pytest.mark.parametrize("document", DOCUMENTS)
def test_prefixes_are_partial_and_the_whole_is_complete(document):
    for end in range(len(document)):
        assert scan(document[:end]).status == "partial", document[:end]
    scanned = scan(document)
    assert scanned.status == "complete" and scanned.end == len(document)
    value = json.loads(document)
    for path, span in scanned.spans.items():
        node = value
        for key in path:
            node = node[key]
        assert json.loads(document[span.start:span.end]) == node, path


def test_open_spans_run_to_the_end_and_grow_into_the_closed_value():
    text = '{"name": "get_weather", "arguments": {"city": "Par'
    scanned = scan(text)
    assert scanned.spans[("name",)] == Span(9, 22)
    assert scanned.string_at(text, ("name",)) == "get_weather"
    assert scanned.spans[("arguments",)] == Span(37, None)
    assert scanned.text_of(text, ("arguments",)) == '{"city": "Par'
    assert not scanned.closed(("arguments",))
    whole = text + 'is"}}'
    assert scan(whole).text_of(whole, ("arguments",)) == '{"city": "Paris"}'


@pytest.mark.parametrize(("text", "status"), [
    ("", "partial"), ("   ", "partial"), ("-", "partial"), ("1.", "partial"), ("2e+", "partial"),
    ("tr", "partial"), ('"\\u00', "partial"), ('"a\\', "partial"), ("[1, ", "partial"),
    ("[01]", "invalid"), ("[1.e5]", "invalid"), ("[1,]", "invalid"), ('{"a" 1}', "invalid"),
    ("{'a': 1}", "invalid"), ('"\\x"', "invalid"), ('"a\nb"', "invalid"), ("nul1", "invalid"),
    ('{"a": 1} trailing', "complete"),
])
def test_verdicts(text, status):
    assert scan(text).status == status


@pytest.mark.parametrize("document", [*DOCUMENTS, '{"a": "ok", "b": [1, 2] x', '["\\q"]'])
def test_a_resumed_scan_is_a_fresh_scan(document):
    # One scanner fed the text as it grows (a stream) sees what a fresh scan of each prefix
    # sees, including when the text ends inside a string, an escape or a number.
    for step in (1, 3):
        scanner = Scanner(0, depth=2)
        for end in [*range(0, len(document), step), len(document)]:
            resumed, fresh = scanner.scan(document[:end]), scan(document[:end])
            assert (resumed.status, resumed.end, resumed.kind, resumed.spans) == (
                fresh.status, fresh.end, fresh.kind, fresh.spans), document[:end]


def _completable(text: str, depth: int = 0) -> bool:
    """Whether some short continuation makes `text` valid JSON (a brute-force search)."""
    try:
        json.loads(text)
        return True
    except ValueError:
        pass
    if depth == 5:
        return False
    for piece in ('"', "0", "]", "}", ":0", ",", "e", "u0000\"", '"a"', "rue", "ue", "ull",
                  "ll", "l", "alse", "lse", "se"):
        longer = text + piece
        scanned = scan(longer)
        if scanned.status == "invalid" or (scanned.status == "complete"
                                            and longer[scanned.end:].strip()):
            continue
        if _completable(longer, depth + 1):
            return True
    return False


def test_random_strings_agree_with_json():
    generator = random.Random(0)
    alphabet = '{}[]",:0123456789-.eEtrufalsn ab\\'
    partial = []
    for _ in range(20_000):
        text = "".join(generator.choice(alphabet) for _ in range(generator.randint(1, 8)))
        scanned = scan(text)
        try:
            json.loads(text)
            valid = True
        except ValueError:
            valid = False
        complete = scanned.status == "complete" and not text[scanned.end:].strip()
        # A valid document is complete, or partial when it ends in a number (it may grow).
        assert not valid or complete or scanned.status == "partial", text
        assert valid or not complete, text
        if scanned.status == "partial" and not valid:
            partial.append(text)
    assert len(partial) > 200
    for text in partial[:300]:
        assert _completable(text), text
