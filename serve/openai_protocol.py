"""OpenAI request parsing and response building for `/v1/completions` and `/v1/chat/completions`.

Pure functions over JSON-ready dicts and jaxinfer outputs, no I/O, so every field mapping is
testable without a server. Request fields take OpenAI's names, plus the extensions vLLM users
send (`top_k`, `min_p`, `repetition_penalty`, `min_tokens`, `ignore_eos`, `stop_token_ids`,
`include_stop_str_in_output`, `skip_special_tokens`), and structured output in all three
spellings clients send (`structured_outputs_of`): OpenAI's `response_format`, vLLM's
`structured_outputs` object and vLLM's older `guided_json` / `guided_regex` /
`guided_choice` / `guided_grammar` fields. A field of the wrong type or out of
range raises `InvalidRequestError` naming it (the types and values of sampling fields are
checked by `InferenceService.sampling_params`, which every body's fields go through); fields
OpenAI has and we do not serve (`echo`, `best_of` > n, `suffix`, the legacy `functions`) are
refused rather than silently ignored; chat's `tools` are checked by `serve.tool_calling`.

`decode_json_body` turns a request body into a dict or refuses it with a 400 naming the
problem: not UTF-8, not JSON, not an object, nested deeper than `MAX_JSON_DEPTH`, an integer
beyond Python's 4,300-digit conversion limit, NaN / Infinity (which Python's json accepts, and
numbers like 1e999 that become infinite), or a lone UTF-16 surrogate (`"\\ud800"`, which
decodes to a str that fails later, wherever it is encoded).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jaxinfer.engine.sampling_params import MAX_LOGPROBS, STRUCTURED_OUTPUT_KINDS
from serve.service import SAMPLING_FIELDS, InvalidRequestError

# SamplingParams fields a body sets under the same name (OpenAI's and vLLM's extensions); the
# others are spelled differently by OpenAI (max_tokens, logprobs) or not served over HTTP.
_DIRECT_FIELDS = tuple(name for name in SAMPLING_FIELDS
                       if name not in {"max_tokens", "logprobs", "prompt_logprobs"})


# OpenAI request bodies nest a handful of levels (messages -> content parts -> part); far
# deeper nesting is an attack on the parser or on the code that walks the body.
MAX_JSON_DEPTH = 64
# A JSON escape that may stand for half of a UTF-16 surrogate pair (\ud800-\udfff).
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


class _NonFinite:
    """What the decoder puts where the body has NaN, Infinity or an overflowing number."""

    def __init__(self, text: str) -> None:
        self.text = text


def _nested_deeper_than(value: Any, limit: int) -> bool:
    """Whether `value` has containers nested more than `limit` deep (no recursion)."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        children = node.values() if isinstance(node, dict) else node
        stack.extend((child, depth + 1) for child in children
                     if isinstance(child, dict | list))
    return False


def _find(value: Any, bad: Callable[[Any], bool]) -> tuple[str, str] | None:
    """The first key or scalar for which `bad` holds: (its top-level field, its path), e.g.
    ("messages", "messages[0].content"); ("", "the body") for a top-level key."""
    stack: list[tuple[str, str, Any]] = [("", "", value)]
    while stack:
        field, path, node = stack.pop()
        if isinstance(node, dict):
            for key, child in reversed(node.items()):
                if bad(key):
                    return field, f"a key in {path or 'the body'}"
                stack.append((field or key, f"{path}.{key}" if path else key, child))
        elif isinstance(node, list):
            stack.extend((field, f"{path}[{index}]", child)
                         for index, child in reversed(list(enumerate(node))))
        elif bad(node):
            return field, path
    return None


def _has_lone_surrogate(value: Any) -> bool:
    if not isinstance(value, str) or value.isascii():
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _refuse(found: tuple[str, str], problem: str) -> InvalidRequestError:
    field, path = found
    if len(path) > 200:  # a path of huge keys must not make a huge message
        path = path[:200] + "..."
    return InvalidRequestError(field or None, f"{path}: {problem}")


def decode_json_body(raw: bytes) -> dict[str, Any]:
    """A request body (UTF-8 JSON) as a dict.

    Nesting is bounded before the body is walked: a body with at most `MAX_JSON_DEPTH`
    brackets cannot nest deeper (the common case, one `bytes.count`); otherwise the parsed
    body's depth is measured without recursion. The C parser itself stops at Python's
    recursion limit (RecursionError, refused alike), so nothing recurses unbounded.

    Args:
        raw: The request's body bytes (already bounded by the server's size limit).

    Returns:
        The body's object.

    Raises:
        InvalidRequestError: Naming the problem, and the field where there is one.
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise InvalidRequestError(None, f"the body is not valid UTF-8 (byte {error.start}: "
                                        f"{error.reason}); send JSON in UTF-8") from None
    non_finite: list[str] = []

    def constant(literal: str) -> _NonFinite:  # NaN, Infinity, -Infinity
        non_finite.append(literal)
        return _NonFinite(literal)

    def number(literal: str) -> float | _NonFinite:
        value = float(literal)
        return value if math.isfinite(value) else constant(literal)

    try:
        body = json.loads(text, parse_constant=constant, parse_float=number)
    except json.JSONDecodeError as error:
        raise InvalidRequestError(None, f"the body is not valid JSON: {error}") from None
    except RecursionError:
        raise InvalidRequestError(None, f"the body is not valid JSON: it is nested deeper "
                                        f"than {MAX_JSON_DEPTH} levels") from None
    except ValueError as error:  # an integer beyond the int conversion limit
        reason = str(error).split(":")[0]
        raise InvalidRequestError(None, f"the body is not valid JSON: a number is too long "
                                        f"({reason})") from None
    if not isinstance(body, dict):
        raise InvalidRequestError(None, "the body must be a JSON object")
    if (raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH
            and _nested_deeper_than(body, MAX_JSON_DEPTH)):
        raise InvalidRequestError(None, f"the body is not valid JSON: it is nested deeper "
                                        f"than {MAX_JSON_DEPTH} levels")
    if non_finite:
        found = _find(body, lambda value: isinstance(value, _NonFinite))
        assert found is not None
        raise _refuse(found, f"{non_finite[0][:40]} is not a finite number (JSON has no "
                             "NaN or Infinity)")
    if _SURROGATE_ESCAPE.search(text):  # only then can a string hold a lone surrogate
        found = _find(body, _has_lone_surrogate)
        if found is not None:
            raise _refuse(found, "a string holds a lone UTF-16 surrogate (an unpaired "
                                 "\\ud800-\\udfff escape), which is not valid Unicode")
    return body


@dataclasses.dataclass
class ParsedRequest:
    """A checked request: prompts (text or ids), sampling fields, stream options.

    `structured_field` names the body field that carried the structured-output constraint
    (`response_format`, `structured_outputs` or a `guided_*` field), so that an error the
    engine reports on "structured_outputs" names what the client sent.
    """

    prompts: list[str | list[int]]
    fields: dict[str, Any]
    stream: bool
    include_usage: bool
    chat: bool
    structured_field: str | None = None


# vLLM's older spellings of `structured_outputs`, each one kind of constraint.
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


def _response_format(value: Any) -> dict[str, Any] | None:
    """OpenAI's `response_format` as `structured_outputs` fields (None for plain text).

    Raises:
        InvalidRequestError: On "response_format": not an object, an unknown type, or a
            json_schema without its schema.
    """
    field = "response_format"
    if not isinstance(value, dict):
        raise InvalidRequestError(field, "response_format must be an object with a 'type'")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise InvalidRequestError(field, "response_format.json_schema must be an object "
                                             "with a 'schema'")
        schema = spec.get("schema")
        if not isinstance(schema, dict):
            raise InvalidRequestError(field, "response_format.json_schema.schema must be a "
                                             "JSON schema object")
        # `strict` needs no mapping: the output always conforms to the schema.
        return {"json": schema}
    raise InvalidRequestError(field, f"response_format.type must be 'text', 'json_object' or "
                                     f"'json_schema', not {kind!r}")


def structured_outputs_of(body: Mapping[str, Any]) -> tuple[Any, str | None]:
    """The body's structured-output constraint, in whichever spelling it came.

    A `structured_outputs` object that sets no kind beside another spelling only adds its
    options (`disable_any_whitespace`) to that constraint, as in vLLM.

    Returns:
        (the value for `SamplingParams.structured_outputs`, as a dict of its fields or the
        client's `structured_outputs` value as sent (checked by `SamplingParams`), or None;
        the body field it came from, or None).

    Raises:
        InvalidRequestError: A malformed `response_format`, or more than one spelling in
            one body (named).
    """
    found: list[tuple[str, Any]] = []
    if body.get("response_format") is not None:
        constraint = _response_format(body["response_format"])
        if constraint is not None:
            found.append(("response_format", constraint))
    for name, kind in GUIDED_FIELDS.items():
        if body.get(name) is not None:
            found.append((name, {kind: body[name]}))
    options = body.get("structured_outputs")
    if options is not None and not (isinstance(options, dict) and found and not any(
            options.get(kind) not in (None, False) for kind in STRUCTURED_OUTPUT_KINDS)):
        found.append(("structured_outputs", options))
        options = None
    if len(found) > 1:
        raise InvalidRequestError(found[1][0], f"{found[1][0]}: only one structured-output "
                                               f"field may be given, and {found[0][0]} "
                                               "already is")
    if not found:
        return None, None
    name, constraint = found[0]
    if options:
        # As vLLM: a `structured_outputs` object without a kind of its own carries options
        # (e.g. disable_any_whitespace) for the constraint given in another field.
        constraint = {**options, **constraint}
    return constraint, name


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(token, int) and not isinstance(token, bool) for token in value)


def _refuse_unsupported(body: Mapping[str, Any], names: Sequence[str]) -> None:
    for name in names:
        if body.get(name) not in (None, False, [], ""):
            raise InvalidRequestError(name, f"{name} is not supported by this server")


def _common_fields(body: Mapping[str, Any]) -> tuple[dict[str, Any], str | None]:
    """The sampling fields both endpoints share, and the field structured output came in.

    Wire types and values are checked once, by `InferenceService.sampling_params`."""
    fields = {name: body.get(name) for name in _DIRECT_FIELDS}
    fields["structured_outputs"], structured_field = structured_outputs_of(body)
    return fields, structured_field


def _stream_options(body: Mapping[str, Any]) -> tuple[bool, bool]:
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise InvalidRequestError("stream", "stream must be a boolean")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise InvalidRequestError("stream_options", "stream_options must be an object")
    return stream, bool(options.get("include_usage", False))


def parse_completion(body: Mapping[str, Any]) -> ParsedRequest:
    """Checks a `/v1/completions` body.

    Raises:
        InvalidRequestError: A missing or malformed field (named).
    """
    _refuse_unsupported(body, ("echo", "suffix"))
    if body.get("best_of") not in (None, body.get("n", 1)):
        raise InvalidRequestError("best_of", "best_of other than n is not supported")
    prompt = body.get("prompt")
    if isinstance(prompt, str) or _is_token_ids(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(
            isinstance(item, str) or _is_token_ids(item) for item in prompt):
        prompts = list(prompt)
    elif prompt == [] or prompt == "":
        raise InvalidRequestError("prompt", "prompt must not be empty")
    else:
        raise InvalidRequestError("prompt", "prompt must be a string, a list of token ids, or "
                                            "a list of either")
    fields, structured_field = _common_fields(body)
    fields["max_tokens"] = body.get("max_tokens")
    fields["logprobs"] = body.get("logprobs")  # the top-n count
    stream, include_usage = _stream_options(body)
    return ParsedRequest(prompts, fields, stream, include_usage, chat=False,
                         structured_field=structured_field)


def parse_chat(body: Mapping[str, Any]) -> tuple[list[dict[str, Any]], ParsedRequest]:
    """Checks a `/v1/chat/completions` body; returns the messages and the request.

    Raises:
        InvalidRequestError: A missing or malformed field (named).
    """
    # tools and tool_choice are serve.tool_calling's; the legacy functions are not served.
    _refuse_unsupported(body, ("functions", "function_call", "audio"))
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages", "messages must be a non-empty list")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidRequestError("messages", f"messages[{index}] needs a string 'role'")
        content = message.get("content")
        if isinstance(content, list):  # content parts: only text parts are served
            if not all(isinstance(part, dict) and part.get("type") == "text" for part in content):
                raise InvalidRequestError("messages", f"messages[{index}]: only text content "
                                                      "parts are supported")
            message["content"] = "".join(str(part.get("text", "")) for part in content)
        elif content is not None and not isinstance(content, str):
            raise InvalidRequestError("messages", f"messages[{index}].content must be a "
                                                  "string or a list of text parts")
    fields, structured_field = _common_fields(body)
    fields["max_tokens"] = body.get("max_completion_tokens", body.get("max_tokens"))
    logprobs, top = body.get("logprobs", False), body.get("top_logprobs")
    if not isinstance(logprobs, bool | type(None)):
        raise InvalidRequestError("logprobs", "logprobs must be a boolean")
    if top is not None and (not isinstance(top, int) or isinstance(top, bool)
                            or not 0 <= top <= MAX_LOGPROBS):
        raise InvalidRequestError("top_logprobs", f"top_logprobs must be an integer in "
                                                  f"[0, {MAX_LOGPROBS}]")
    if top and not logprobs:
        raise InvalidRequestError("top_logprobs", "top_logprobs needs logprobs: true")
    fields["logprobs"] = (top or 0) if logprobs else None
    stream, include_usage = _stream_options(body)
    return messages, ParsedRequest([], fields, stream, include_usage, chat=True,
                                   structured_field=structured_field)


# ---------------------------------------------------------------------- responses


def _token_text(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False) if tokenizer else str(
        token_id)


def completion_logprobs(tokenizer: Any, token_ids: Sequence[int],
                        logprobs: Sequence[Mapping[int, float]], text_offset: int,
                        top: int) -> dict[str, Any]:
    """The legacy completions `logprobs` object for `token_ids` (one dict per token)."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    offset = text_offset
    for token_id, entry in zip(token_ids, logprobs, strict=False):
        text = _token_text(tokenizer, token_id)
        tokens.append(text)
        token_logprobs.append(entry.get(token_id))
        ranked = sorted(entry.items(), key=lambda item: -item[1])[:top]
        top_logprobs.append({_token_text(tokenizer, other): value for other, value in ranked})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}


def chat_logprobs(tokenizer: Any, token_ids: Sequence[int],
                  logprobs: Sequence[Mapping[int, float]], top: int) -> dict[str, Any]:
    """The chat `logprobs` object: `{"content": [{token, logprob, bytes, top_logprobs}]}`."""
    content = []
    for token_id, entry in zip(token_ids, logprobs, strict=False):
        text = _token_text(tokenizer, token_id)
        ranked = sorted(entry.items(), key=lambda item: -item[1])[:top]
        content.append({
            "token": text, "logprob": entry.get(token_id), "bytes": list(text.encode()),
            "top_logprobs": [{"token": _token_text(tokenizer, other), "logprob": value,
                              "bytes": list(_token_text(tokenizer, other).encode())}
                             for other, value in ranked]})
    return {"content": content}


def envelope(kind: str, request_id: str, model: str, choices: list[dict[str, Any]],
             usage: dict[str, int] | None = None) -> dict[str, Any]:
    """A response or chunk object: id, object, created, model, choices (and usage)."""
    body: dict[str, Any] = {"id": request_id, "object": kind, "created": int(time.time()),
                            "model": model, "choices": choices}
    if usage is not None:
        body["usage"] = usage
    return body


def usage_of(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """The `usage` object."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def error_body(message: str, status: int, param: str | None = None,
               kind: str = "invalid_request_error") -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}
