"""Chat templates rendered with jinja2 the way transformers renders them.

Same sandboxed environment (`trim_blocks`, `lstrip_blocks`, loop controls), the same helpers
(`raise_exception`, `strftime_now`, a `tojson` that does not escape HTML) and the same message
normalization, so that a template gives byte-identical text here and in
`transformers`' `apply_chat_template`.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.exceptions
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Names a message's reasoning may come under; transformers copies it to the first two.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(jinja2.exceptions.TemplateError):
    """A chat template rejected its input through `raise_exception`, or no template exists."""


class _GenerationTagExtension(jinja2.ext.Extension):
    """Accepts `{% generation %}...{% endgeneration %}` blocks and renders their body as is.

    transformers uses the tag to find assistant tokens for training masks; templates that
    contain it must still parse and render the same here.
    """

    tags = frozenset({"generation"})

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(
            lineno
        )

    def _render_body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters (<, >, &, '), which would change the prompt.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(format_string: str) -> str:
    return datetime.now().strftime(format_string)


@functools.lru_cache(maxsize=64)
def _compile_chat_template(template: str) -> jinja2.Template:
    # Chat templates come from model repositories and are untrusted code: render them in the
    # immutable sandbox, with the same whitespace options as transformers so output matches.
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_GenerationTagExtension, jinja2.ext.loopcontrols],
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment.from_string(template)


def _normalize_messages(messages: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    normalized = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise TypeError(f"Chat messages must be dicts, got {message!r}")
        # Many templates render a None value as the text "None" but handle a missing key, so
        # (as transformers does) keys whose value is None are dropped.
        message = {key: value for key, value in message.items() if value is not None}
        reasoning = next(
            (message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None
        )
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        normalized.append(message)
    return normalized


def render_chat_template(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = False,
    tools: Sequence[Mapping[str, Any]] | None = None,
    documents: Sequence[Mapping[str, Any]] | None = None,
    **variables: Any,
) -> str:
    """Renders a jinja chat template the way transformers' `apply_chat_template` does.

    Args:
        template: The jinja source of the chat template.
        messages: The conversation, dicts with at least "role" and "content".
        add_generation_prompt: Whether to end with the header of a new assistant turn.
        tools: JSON schemas of the tools the model may call, or None.
        documents: Documents for retrieval-augmented templates, or None.
        **variables: Further template variables (bos_token, eos_token, custom flags...).

    Returns:
        The rendered prompt text.

    Raises:
        ChatTemplateError: When the template calls `raise_exception`.
    """
    # tools and documents are always passed, also as None: `tools is not none` is true for an
    # undefined variable in jinja, so leaving them out would change what templates render.
    return _compile_chat_template(template).render(
        messages=_normalize_messages(messages), tools=tools, documents=documents,
        add_generation_prompt=add_generation_prompt, **variables,
    )
