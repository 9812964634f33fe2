"""Tool calling in `/v1/chat/completions`, the way vLLM's OpenAI server does it.

    chat = prepare_chat(body, messages, parsed, config)  # 400s name the field
    chat.messages, chat.template_kwargs                  # for the template ({"tools": [...]})
    parsed.fields["structured_outputs"]                  # a forced choice's schema, if any
    message, reason = chat_message(chat.output_format, text, finish_reason)  # the answer
    stream = chat.output_format.stream()                 # or streamed: one per choice

The request: `tools` are OpenAI function tools (`{"type": "function", "function": {"name",
"description", "parameters"}}`), `tool_choice` is "none", "auto" (the default when tools are
given), "required" or `{"type": "function", "function": {"name": ...}}`. They reach the chat
template as transformers' `apply_chat_template(messages, tools=...)` passes them (the tool
dicts as sent). As vLLM: with "none" the tools are still rendered unless the server runs with
`--exclude-tools-when-tool-choice-none`; "auto" needs `--enable-auto-tool-choice` and a
`--tool-call-parser` (else a 400 on `tool_choice`), and the parser (`serve.tool_parsers`)
finds calls in the model's free text; "required" and a named function need no parser: a JSON
schema forces the output through the structured-output machinery
(`StructuredOutputsParams(json=...)`) and the output is read as calls whatever the model's own
format:

    named      the function's `parameters` (an empty object's schema if it has none) is the
               whole output: the call's arguments
    required   [{"name": ..., "parameters": ...}, ...]: an array of at least one call, each
               item `anyOf` the tools (vLLM's schema, with `additionalProperties: false` on
               each item so small models do not wander; `$defs` of the tools hoisted to the
               root; `parallel_tool_calls: false` caps it at one call)

A forced schema cannot be combined with another structured-output constraint (400 on
`tool_choice`); a `structured_outputs` object that only sets options
(`disable_any_whitespace`) applies to the forced schema.

The history may hold assistant messages with `tool_calls` (their `arguments` are JSON text on
the wire and are handed to the template as dicts, as vLLM does, since tool-use templates expect
that) and `role: "tool"` messages with their `tool_call_id`.

The answer: `message.tool_calls` (ids `chatcmpl-tool-<hex>`, or the 9-character ids of the
mistral parser), content None when the output was only calls, and finish_reason "tool_calls"
where the output ended by itself ("stop"); an output cut short keeps "length". Streamed, a
call's first delta carries its index, id, type and name and the following ones its arguments.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

from jaxinfer.engine.errors import RequestError
from jaxinfer.engine.sampling_params import STRUCTURED_OUTPUT_KINDS
from serve.tool_parsers import (
    NamedCallFormat,
    RequiredCallsFormat,
    ToolParser,
    get_tool_parser,
    openai_tool_call_id,
)

if TYPE_CHECKING:
    from serve.openai_protocol import ParsedRequest
    from serve.service import ServiceConfig

Choice = Literal["none", "auto", "required", "named"]
_NAMED_USAGE = ('a named tool_choice is {"type": "function", "function": {"name": '
                '"my_function"}}')


def _check_tools(tools: Any) -> list[dict[str, Any]]:
    """The `tools` list, each a function tool with a unique name (400 on "tools")."""
    if not isinstance(tools, list):
        raise RequestError("tools", "tools must be a list of function tools")
    names: set[str] = set()
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise RequestError("tools", f'{where} must be {{"type": "function", "function": '
                                        '{...}} (only function tools are supported)')
        function = tool.get("function")
        if not isinstance(function, dict):
            raise RequestError("tools", f"{where}.function must be an object")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise RequestError("tools", f"{where}.function.name must be a non-empty string")
        if name in names:
            raise RequestError("tools", f"{where}.function.name: {name!r} is given twice")
        names.add(name)
        if not isinstance(function.get("description"), str | type(None)):
            raise RequestError("tools", f"{where}.function.description must be a string")
        if not isinstance(function.get("parameters"), dict | type(None)):
            raise RequestError("tools", f"{where}.function.parameters must be a JSON schema "
                                        "object")
    return tools


def _check_choice(choice: Any, names: Sequence[str]) -> tuple[Choice, str | None]:
    """`tool_choice` as (kind, the named function or None); 400 on "tool_choice"."""
    if choice in ("none", "auto", "required"):
        return choice, None
    if isinstance(choice, dict):
        function = choice.get("function")
        if choice.get("type") != "function" or not isinstance(function, dict):
            raise RequestError("tool_choice", f"tool_choice: {_NAMED_USAGE}")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise RequestError("tool_choice", f"tool_choice.function.name must be a non-empty "
                                              f"string; {_NAMED_USAGE}")
        if name not in names:
            raise RequestError("tool_choice", f"tool_choice names the function {name!r}, which "
                                              f"is not in tools ({', '.join(names)})")
        return "named", name
    raise RequestError("tool_choice", f'tool_choice must be "none", "auto", "required" or a '
                                      f"named function, not {choice!r}")


@dataclasses.dataclass(frozen=True)
class ToolRequest:
    """A chat request's tools and what it asks of them.

    Attributes:
        tools: The function tools, as sent.
        choice: "none", "auto", "required" or "named".
        function: The function a named choice forces.
        parallel: `parallel_tool_calls` (False: at most one call under "required").
    """

    tools: list[dict[str, Any]]
    choice: Choice
    function: str | None = None
    parallel: bool = True

    @property
    def forced(self) -> bool:
        """Whether a JSON schema forces the output to be calls ("required" or named)."""
        return self.choice in ("required", "named")

    def template_tools(self, config: ServiceConfig) -> list[dict[str, Any]] | None:
        """The chat template's `tools` (None: not rendered)."""
        if self.choice == "none" and config.exclude_tools_when_tool_choice_none:
            return None
        return self.tools

    def schema(self) -> dict[str, Any] | None:
        """The JSON schema a forced choice puts on the output (None otherwise).

        Raises:
            RequestError: On "tools", when two tools define one `$defs` name differently.
        """
        functions = {tool["function"]["name"]: tool["function"] for tool in self.tools}
        if self.choice == "named":
            return _parameters(functions[self.function])
        if self.choice != "required":
            return None
        definitions: dict[str, Any] = {}
        items = []
        for name, function in functions.items():
            parameters = copy.deepcopy(_parameters(function))
            # vLLM hoists each tool's $defs to the root, where "#/$defs/..." refers.
            for key, definition in parameters.pop("$defs", {}).items():
                if definitions.setdefault(key, definition) != definition:
                    raise RequestError("tools", f"the tools define $defs.{key} differently; "
                                                "tool_choice 'required' needs one definition")
            items.append({"type": "object",
                          "properties": {"name": {"type": "string", "enum": [name]},
                                         "parameters": parameters},
                          "required": ["name", "parameters"], "additionalProperties": False})
        schema: dict[str, Any] = {"type": "array", "minItems": 1,
                                  "items": {"type": "object", "anyOf": items}}
        if not self.parallel:
            schema["maxItems"] = 1
        if definitions:
            schema["$defs"] = definitions
        return schema

    def constrain(self, structured: Any, structured_field: str | None) -> Any:
        """The request's `structured_outputs` value with a forced choice's schema in it.

        Args:
            structured: The structured-output constraint the body gave (or None).
            structured_field: The body field it came in.

        Raises:
            RequestError: On "tool_choice", when the body constrains the output itself.
        """
        schema = self.schema()
        if schema is None:
            return structured
        if structured is None:
            return {"json": schema}
        if not isinstance(structured, dict) or any(
                structured.get(kind) not in (None, False) for kind in STRUCTURED_OUTPUT_KINDS):
            raise RequestError("tool_choice", f"tool_choice {self.choice!r} constrains the "
                                              f"output to tool calls, so {structured_field} "
                                              "cannot constrain it too")
        return {**structured, "json": schema}  # its options (disable_any_whitespace) apply

    def output_format(self, config: ServiceConfig) -> ToolParser | None:
        """What turns the output into calls: the forced format, the server's parser for
        "auto", or None (plain content)."""
        new_id: Callable[[], str] = openai_tool_call_id
        parser = get_tool_parser(config.tool_call_parser) if config.tool_call_parser else None
        if parser is not None:
            new_id = parser.new_id  # e.g. Mistral's templates need their own ids back
        if self.choice == "named":
            assert self.function is not None
            return NamedCallFormat(self.function, new_id)
        if self.choice == "required":
            return RequiredCallsFormat(new_id)
        return parser if self.choice == "auto" else None


def _parameters(function: Mapping[str, Any]) -> dict[str, Any]:
    # A function without parameters takes an empty object (vLLM's schema too).
    return function.get("parameters") or {"type": "object", "properties": {}}


def parse_tools(body: Mapping[str, Any], config: ServiceConfig) -> ToolRequest | None:
    """The body's `tools`, `tool_choice` and `parallel_tool_calls`, checked.

    Returns:
        The tool request, or None when the body gives no tools (or "required" with an empty
        list, which OpenAI and vLLM treat as "none").

    Raises:
        RequestError: Naming "tools", "tool_choice" or "parallel_tool_calls": a malformed
            tool, an unknown choice or function, a choice without tools, or "auto" on a
            server not started with --enable-auto-tool-choice and --tool-call-parser.
    """
    tools = body.get("tools")
    tools = [] if tools is None else _check_tools(tools)
    parallel = body.get("parallel_tool_calls")
    if not isinstance(parallel, bool | type(None)):
        raise RequestError("parallel_tool_calls", "parallel_tool_calls must be a boolean")
    given = body.get("tool_choice")
    if given is None:
        given = "auto" if tools else "none"
    if not tools:
        # As vLLM: "required" over an empty list is "none"; any other choice needs tools.
        if given == "none" or (given == "required" and body.get("tools") == []):
            return None
        raise RequestError("tool_choice", f"tool_choice {given!r} needs tools: give the "
                                          "functions in tools")
    choice, function = _check_choice(given, [tool["function"]["name"] for tool in tools])
    if choice == "auto" and not (config.enable_auto_tool_choice and config.tool_call_parser):
        raise RequestError("tool_choice", '"auto" tool choice requires the server to run with '
                                          "--enable-auto-tool-choice and --tool-call-parser "
                                          '(tool_choice "required", "none" or a named function '
                                          "work without)")
    return ToolRequest(tools, choice, function, parallel is not False)


def tool_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation with its tool messages checked and ready for the template.

    An assistant message's `tool_calls` carry their `arguments` as JSON text (OpenAI's wire
    form); templates expect dicts, so each is decoded (empty: {}), as vLLM does. A tool
    message's `tool_call_id` must be a string.

    Raises:
        RequestError: On "messages": a malformed tool call or arguments that are not JSON.
    """
    prepared = []
    for index, message in enumerate(messages):
        calls = message.get("tool_calls")
        if message.get("role") == "tool" and not isinstance(message.get("tool_call_id"),
                                                            str | type(None)):
            raise RequestError("messages", f"messages[{index}].tool_call_id must be a string")
        if calls is None:
            prepared.append(message)
            continue
        if message.get("role") != "assistant" or not isinstance(calls, list):
            raise RequestError("messages", f"messages[{index}].tool_calls must be a list, in "
                                           "an assistant message")
        decoded = []
        for number, call in enumerate(calls):
            where = f"messages[{index}].tool_calls[{number}]"
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise RequestError("messages", f"{where} must be {{\"id\", \"type\": "
                                               "\"function\", \"function\": {\"name\", "
                                               "\"arguments\"}}")
            arguments = function.get("arguments") or {}
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments)
                except ValueError as error:
                    raise RequestError("messages", f"{where}.function.arguments is not JSON: "
                                                   f"{error}") from None
            decoded.append({**call, "function": {**function, "arguments": arguments}})
        prepared.append({**message, "tool_calls": decoded})
    return prepared


def finish_reason(reason: str | None, called: bool) -> str | None:
    """The choice's finish reason: "tool_calls" for an output that ended by itself in calls;
    "length" and "abort" stay (the client must know the calls may be cut short)."""
    return "tool_calls" if called and reason == "stop" else reason


def chat_message(output_format: ToolParser | None, text: str, reason: str | None
                 ) -> tuple[dict[str, Any], str | None]:
    """The non-streamed assistant message of one choice, and its finish reason."""
    if output_format is None:
        return {"role": "assistant", "content": text}, reason
    content, calls = output_format.extract(text)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [call.to_openai() for call in calls]
    return message, finish_reason(reason, bool(calls))


@dataclasses.dataclass
class ChatTools:
    """What tool calling changes in one chat request.

    Attributes:
        messages: The conversation for the template (`tool_messages`).
        template_kwargs: The template's extra variables: `tools` when rendered.
        output_format: What turns the output into calls, or None (plain content).
    """

    messages: list[dict[str, Any]]
    template_kwargs: dict[str, Any]
    output_format: ToolParser | None

    def prompt_text(self) -> str:
        """The text the rendered chat holds at least (for the length check before the
        template runs): every message's content and tool calls, and the rendered tools."""
        parts = [str(message.get("content") or "") for message in self.messages]
        parts += [json.dumps(message["tool_calls"]) for message in self.messages
                  if message.get("tool_calls")]
        if self.template_kwargs.get("tools"):
            parts.append(json.dumps(self.template_kwargs["tools"]))
        return "".join(parts)


def prepare_chat(body: Mapping[str, Any], messages: Sequence[dict[str, Any]],
                 parsed: ParsedRequest, config: ServiceConfig) -> ChatTools:
    """Tool calling's part of a chat request: checks the body's tools and the history's tool
    messages, and puts a forced choice's schema into `parsed.fields` (and, for "auto" with a
    parser whose markers are special tokens, `skip_special_tokens=False`).

    Raises:
        RequestError: Naming the field (see `parse_tools`, `tool_messages`,
            `ToolRequest.constrain`).
    """
    tools = parse_tools(body, config)
    prepared = tool_messages(messages)
    if tools is None:
        return ChatTools(prepared, {}, None)
    if tools.forced:
        parsed.fields["structured_outputs"] = tools.constrain(
            parsed.fields["structured_outputs"], parsed.structured_field)
        parsed.structured_field = "tools"  # a schema that does not compile is the tools'
    output_format = tools.output_format(config)
    if tools.choice == "auto" and output_format is not None \
            and output_format.keeps_special_tokens:
        parsed.fields["skip_special_tokens"] = False  # the markers must reach the parser
    rendered = tools.template_tools(config)
    return ChatTools(prepared, {"tools": rendered} if rendered is not None else {},
                     output_format)
