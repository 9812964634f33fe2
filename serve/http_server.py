"""The OpenAI-compatible HTTP front end (aiohttp) over the shared `InferenceService`.

    POST /v1/completions        POST /v1/chat/completions   (JSON, or SSE with stream: true)
    GET  /v1/models             GET  /health                GET  /metrics (Prometheus)

Several prompts in one completions request (or n > 1) become several engine requests served
concurrently; their outputs are merged into one response whose choice index is
`prompt_index * n + sample_index`, as OpenAI numbers them. The server runs with aiohttp's
`handler_cancellation`, so a client that disconnects cancels its handler, which closes the
engine streams (`contextlib.aclosing`) and so aborts the requests and frees their pages. A
client that stays connected but stops reading is dropped the same way once a streamed write
has waited `write_timeout_seconds` (`InferenceService.write`). Until then nothing piles up on
the server: each prompt's engine stream holds one unread output, merged (see
`jaxinfer.engine.async_engine`), and hands the next only once the handler took the previous.

Not served: `echo` and `suffix` (completions) and the legacy `functions` (chat) are refused
with a 400 naming the field rather than silently ignored; `user` is accepted and ignored.
Structured output (`response_format`, `structured_outputs`, `guided_*`) is served in both
endpoints; a schema, regex or grammar that does not compile is a 400 naming the field it came
in. Tool calling (`tools`, `tool_choice`, tool messages in the history) is served in chat as
vLLM serves it (`serve.tool_calling`): calls come back as `message.tool_calls` (streamed as
tool-call deltas) with finish_reason "tool_calls".

Before any handler runs (`serve.access`): a `Host` outside the allowed hosts (by default only
loopback names on a loopback-bound server: DNS rebinding) and an `Origin` outside
`--allowed-origins` (any web page) get 403; then the API key (401). A POST body must be
`application/json` (charset utf-8, if any), else 415: this also refuses the "simple" cross-site
POSTs (`text/plain`) a browser sends without asking. Every malformed body is a 400
(`openai_protocol.decode_json_body`), and an unexpected failure a 500 that reveals nothing of
the server's internals (the traceback goes to the log).

Shutdown (`Server.stop`): the runner's `shutdown()` closes the listening socket and makes
requests that still arrive on open keep-alive connections answer 503, while the responses in
flight run on; `cleanup()` then gives them `_SHUTDOWN_TIMEOUT` seconds before cancelling
their handlers (which aborts their engine requests).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

import jinja2
from aiohttp import web

from jaxinfer.engine.async_engine import EngineDeadError
from jaxinfer.engine.errors import RequestError
from jaxinfer.engine.outputs import RequestOutput
from jaxinfer.engine.sampling_params import SamplingParams
from jaxinfer.llm import render_chat_prompt
from serve import openai_protocol as protocol
from serve import tool_calling
from serve.access import HttpAccess
from serve.metrics import CONTENT_TYPE
from serve.service import (
    OFF_LOOP_CHARS,
    InferenceService,
    InvalidRequestError,
    OverloadedError,
    RequestFailedError,
    SlowClientError,
    UnauthenticatedError,
)
from serve.tool_parsers import ToolCallStream, ToolParser

logger = logging.getLogger("jaxinfer.serve.http")

# Server.stop has already waited its grace period for in-flight requests when cleanup() runs,
# so the responses still open then get only a short while before their handlers are cancelled.
_SHUTDOWN_TIMEOUT = 3.0
# The media types a POST body may have, and its charsets (none given means UTF-8, as JSON is).
_JSON_TYPE = "application/json"
_JSON_CHARSETS = frozenset({None, "utf-8", "utf8"})
# What a CORS preflight of an allowed origin is told it may send.
_CORS_HEADERS = {"access-control-allow-methods": "GET, POST",
                 "access-control-allow-headers": "authorization, content-type",
                 "access-control-max-age": "600"}


@dataclasses.dataclass
class _State:
    """What the handlers share: the service, the Host / Origin policy, and the runner once it
    exists (for shutdown)."""

    service: InferenceService
    access: HttpAccess
    runner: web.AppRunner | None = None
    draining: bool = False


_STATE = web.AppKey("state", _State)
_OPEN_PATHS = frozenset({"/health", "/metrics"})


class _RefusedError(Exception):
    """A request refused before its handler parses it (403, 415): answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, kind: str) -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


def _error(status: int, message: str, param: str | None = None,
           kind: str = "invalid_request_error") -> web.Response:
    return web.json_response(protocol.error_body(message, status, param, kind), status=status)


def _check_access(request: web.Request, access: HttpAccess) -> None:
    """403 for a Host outside the allowed hosts and for a browser origin not allowed."""
    host = request.headers.get("host")
    if not access.host_allowed(host):
        # A loopback-bound server answers only to loopback names by default: DNS rebinding.
        raise _RefusedError(403, f"the Host {host!r} is not one this server answers to (see "
                                 "--allowed-hosts)", "permission_error")
    origin = request.headers.get("origin")
    if origin is not None and not access.origin_allowed(origin):
        raise _RefusedError(403, f"requests from web pages at {origin!r} are not allowed "
                                 "(see --allowed-origins)", "permission_error")


def _is_preflight(request: web.Request) -> bool:
    """A browser's CORS preflight: OPTIONS with Origin and Access-Control-Request-Method."""
    return (request.method == "OPTIONS" and "origin" in request.headers
            and "access-control-request-method" in request.headers)


async def _add_cors_headers(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: lets an allowed origin's page read the response (streams too)."""
    origin = request.headers.get("origin")
    if origin is not None and request.app[_STATE].access.origin_allowed(origin):
        response.headers["access-control-allow-origin"] = origin
        response.headers.add("vary", "Origin")


@web.middleware
async def _errors_and_auth(request: web.Request, handler: Any) -> web.StreamResponse:
    """The Host / Origin and API key checks, and the mapping of errors to HTTP statuses."""
    state = request.app[_STATE]
    try:
        _check_access(request, state.access)
        if _is_preflight(request):  # carries no key: answered before the key check
            return web.Response(status=204, headers=_CORS_HEADERS)
        if request.path not in _OPEN_PATHS:
            if state.draining:
                return _error(503, "the server is shutting down", kind="service_unavailable")
            state.service.check_api_key(request.headers.get("authorization"))
        return await handler(request)
    except _RefusedError as error:
        return _error(error.status, error.message, kind=error.kind)
    except UnauthenticatedError as error:
        return _error(401, str(error), kind="authentication_error")
    except RequestError as error:  # the engine's checks and the service's
        return _error(400, error.message, error.field)
    except OverloadedError as error:
        return _error(429, str(error), kind="rate_limit_error")
    except EngineDeadError as error:
        return _error(503, str(error), kind="service_unavailable")
    except RequestFailedError as error:  # the engine failed on this request alone
        return _error(500, str(error), kind="server_error")
    except web.HTTPException as error:
        if error.status < 400:
            raise
        # aiohttp's own refusals (unknown path, wrong method, body too large) in OpenAI's
        # shape too, so clients that parse {"error": ...} report them properly.
        return _error(error.status, error.reason, kind="invalid_request_error")
    except ConnectionError:
        raise  # the client went away: nobody to answer
    except Exception:  # a bug: answer in OpenAI's shape rather than a bare 500 page
        # The details (which may quote the request or the server's state) go to the log only.
        logger.exception("request %s %s failed", request.method, request.path)
        return _error(500, "internal server error (logged on the server)",
                      kind="server_error")


async def _json_body(request: web.Request) -> dict[str, Any]:
    """The POST body as a JSON object: 415 unless it is `application/json` in UTF-8, 400
    (naming the problem) unless it is a well-formed object."""
    charset = request.charset.lower() if request.charset else None
    if request.content_type != _JSON_TYPE or charset not in _JSON_CHARSETS:
        given = request.headers.get("content-type", "none")
        raise _RefusedError(415, f"the body must be sent as 'content-type: application/json' "
                                 f"(charset utf-8, if any), not {given!r}",
                            "invalid_request_error")
    return protocol.decode_json_body(await request.read())


def _check_model(service: InferenceService, body: dict[str, Any]) -> web.Response | None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidRequestError("model", "model must be a string")
    if model is not None and model != service.model_name:
        return _error(404, f"the model {model!r} does not exist; this server serves "
                           f"{service.model_name!r}", "model", "not_found_error")
    return None


async def _merged(service: InferenceService, prompts: Sequence[Any],
                  params: Sequence[SamplingParams], request_id: str
                  ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Runs one engine request per prompt concurrently; yields (prompt index, output).

    The engine requests are named `{request_id}-{prompt index}`. Each prompt's pump hands one
    output over and waits until it is taken before reading the next, so at most one output
    per prompt waits here; the outputs of the steps in between merge in the engine stream.
    Closing this iterator (the handler was cancelled, or one prompt failed) cancels every
    pump, and each pump's `aclosing` aborts its engine request.
    """
    queue: asyncio.Queue[tuple[int, RequestOutput, asyncio.Event] | BaseException | None] = (
        asyncio.Queue())

    async def pump(index: int, prompt: Any, sampling: SamplingParams) -> None:
        try:
            async with contextlib.aclosing(service.generate(
                    prompt, sampling, f"{request_id}-{index}")) as stream:
                async for output in stream:
                    taken = asyncio.Event()
                    queue.put_nowait((index, output, taken))
                    await taken.wait()
            queue.put_nowait(None)
        except Exception as error:  # handed to the handler, which maps it to a status
            queue.put_nowait(error)

    tasks = [asyncio.create_task(pump(index, prompt, sampling))
             for index, (prompt, sampling) in enumerate(zip(prompts, params, strict=True))]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                index, output, taken = item
                taken.set()  # the pump may fetch the next (merged) output meanwhile
                yield index, output
    finally:
        for task in tasks:  # a disconnect or an error: abort every sibling request too
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class _Endpoint:
    """One completions-style request in flight: builds choices from the engine's deltas."""

    def __init__(self, service: InferenceService, parsed: protocol.ParsedRequest,
                 prompts: list[Any], params: list[SamplingParams],
                 tool_format: ToolParser | None = None) -> None:
        self.service, self.parsed, self.prompts, self.params = service, parsed, prompts, params
        self.tool_format = tool_format  # chat with tools: what turns the output into calls
        self.tool_streams: dict[int, ToolCallStream] = {}  # streamed: per choice index
        self.n = params[0].n
        self.kind = "chat.completion" if parsed.chat else "text_completion"
        self.prefix = "chatcmpl" if parsed.chat else "cmpl"
        self.prompt_tokens: dict[int, int] = {}  # prompt index -> its token count
        self.completion_tokens = 0  # every sample's generated tokens so far
        self.sent_text: dict[int, int] = {}  # choice index -> characters streamed
        self.outputs: dict[int, RequestOutput] = {}  # non-streamed: the deltas, accumulated
        self.response: web.StreamResponse | None = None  # streamed: once it is started

    def choice_index(self, prompt_index: int, sample_index: int) -> int:
        """OpenAI's (and vLLM's) numbering of choices across prompts and samples."""
        return prompt_index * self.n + sample_index

    def count(self, prompt_index: int, output: RequestOutput) -> None:
        """Counts one delta's tokens for the usage."""
        self.prompt_tokens[prompt_index] = len(output.prompt_token_ids)
        self.completion_tokens += sum(len(sample.token_ids) for sample in output.outputs)

    def usage(self) -> dict[str, int]:
        """Token counts so far: each prompt once, every sample's generated tokens."""
        return protocol.usage_of(sum(self.prompt_tokens.values()), self.completion_tokens)

    def logprobs(self, token_ids: list[int], entries: list | None, offset: int) -> Any:
        """The `logprobs` object of a choice (or a delta), None when not requested."""
        top = self.parsed.fields["logprobs"]
        if top is None or entries is None:
            return None
        tokenizer = self.service.tokenizer
        if self.parsed.chat:
            return protocol.chat_logprobs(tokenizer, token_ids, entries, top)
        return protocol.completion_logprobs(tokenizer, token_ids, entries, offset, top)

    def full_choices(self) -> list[dict[str, Any]]:
        """Every choice of the finished request, for the non-streamed response."""
        choices = []
        for prompt_index, output in sorted(self.outputs.items()):
            for sample in output.outputs:
                index = self.choice_index(prompt_index, sample.index)
                logprobs = self.logprobs(list(sample.token_ids), sample.logprobs, 0)
                if self.parsed.chat:
                    message, reason = tool_calling.chat_message(
                        self.tool_format, sample.text, sample.finish_reason)
                    choices.append({"index": index, "logprobs": logprobs,
                                    "finish_reason": reason, "message": message})
                else:
                    choices.append({"index": index, "text": sample.text, "logprobs": logprobs,
                                    "finish_reason": sample.finish_reason})
        return sorted(choices, key=lambda choice: choice["index"])

    def delta_choices(self, prompt_index: int, output: RequestOutput) -> list[dict[str, Any]]:
        """The choices of one streamed chunk: the engine's delta of each sample that has one."""
        choices = []
        for sample in output.outputs:
            index = self.choice_index(prompt_index, sample.index)
            first = index not in self.sent_text
            offset = self.sent_text.get(index, 0)
            self.sent_text[index] = offset + len(sample.text)
            logprobs = self.logprobs(list(sample.token_ids), sample.logprobs, offset)
            if self.parsed.chat:
                delta, reason = self.chat_delta(index, sample.text, sample.finish_reason)
                if not delta and reason is None and logprobs is None and not first:
                    continue  # the tool parser holds the text back (a marker may be starting)
                if first:
                    delta = {"role": "assistant", "content": "", **delta}
                choices.append({"index": index, "delta": delta, "logprobs": logprobs,
                                "finish_reason": reason})
            else:
                choices.append({"index": index, "text": sample.text, "logprobs": logprobs,
                                "finish_reason": sample.finish_reason})
        return choices

    def chat_delta(self, index: int, text: str, reason: str | None
                   ) -> tuple[dict[str, Any], str | None]:
        """One streamed chat choice's delta and finish reason: the text as content, or as
        the tool parser splits it into content and tool-call deltas."""
        if self.tool_format is None:
            return {"content": text}, reason
        stream = self.tool_streams.get(index)
        if stream is None:
            stream = self.tool_streams[index] = self.tool_format.stream()
        delta = stream.finish(text) if reason is not None else stream.feed(text)
        return delta, tool_calling.finish_reason(reason, stream.called)

    async def respond(self, request: web.Request) -> web.StreamResponse:
        """Runs the request and answers with one JSON response or an SSE stream."""
        request_id = self.service.new_request_id(self.prefix)
        stream = _merged(self.service, self.prompts, self.params, request_id)
        if not self.parsed.stream:
            async with contextlib.aclosing(stream):
                async for prompt_index, output in stream:
                    self.count(prompt_index, output)
                    self.outputs.setdefault(prompt_index, RequestOutput(
                        output.request_id, output.prompt, output.prompt_token_ids, [])
                    ).add(output)
            return web.json_response(protocol.envelope(
                self.kind, request_id, self.service.model_name, self.full_choices(),
                self.usage()))
        try:
            return await self._stream(request, stream, request_id)
        except SlowClientError as error:
            # Its socket buffer is full, so nothing more can reach it, not even an error:
            # drop the connection (the stream is closed already, which aborted the requests).
            # aiohttp then finds the transport gone when it ends the response, as it does
            # for a client that disconnected.
            logger.warning("stream %s: %s", request_id, error)
            if request.transport is not None:
                request.transport.abort()
            assert self.response is not None  # only a streamed write times out
            return self.response

    async def _stream(self, request: web.Request, stream: AsyncIterator[tuple[int, Any]],
                      request_id: str) -> web.StreamResponse:
        """`respond` for `stream: true`: the SSE stream, every write bounded in time."""
        chunk_kind = "chat.completion.chunk" if self.parsed.chat else "text_completion"
        response: web.StreamResponse | None = None
        failed = False
        send = functools.partial(_send, self.service)
        async with contextlib.aclosing(stream):
            try:
                async for prompt_index, output in stream:
                    if response is None:  # headers once the engine accepted the request
                        response = self.response = web.StreamResponse(headers={
                            "content-type": "text/event-stream", "cache-control": "no-cache"})
                        await self.service.write(response.prepare(request))
                    self.count(prompt_index, output)
                    choices = self.delta_choices(prompt_index, output)
                    if choices:
                        await send(response, protocol.envelope(
                            chunk_kind, request_id, self.service.model_name, choices))
            except Exception as error:
                if response is None or isinstance(error, ConnectionError):
                    raise  # nothing sent yet: the middleware answers with a status
                # The status line is gone (e.g. one prompt of a batch was refused, the engine
                # failed on it, or the engine died): an error event tells the client, which
                # raises it (openai's client raises APIError on a chunk holding "error").
                logger.warning("stream %s failed: %r", request_id, error)
                failed = True
                await send(response, protocol.error_body(str(error), 500, None,
                                                         "server_error"))
        assert response is not None  # every engine request yields at least its final output
        if self.parsed.include_usage and not failed:
            await send(response, protocol.envelope(chunk_kind, request_id,
                                                   self.service.model_name, [], self.usage()))
        await self.service.write(response.write(b"data: [DONE]\n\n"))
        await self.service.write(response.write_eof())
        return response


async def _send(service: InferenceService, response: web.StreamResponse,
                body: dict[str, Any]) -> None:
    """Writes one SSE event, within the service's write timeout."""
    await service.write(response.write(f"data: {json.dumps(body)}\n\n".encode()))


def _params_for(service: InferenceService, parsed: protocol.ParsedRequest,
                token_ids: list[list[int]]) -> list[SamplingParams]:
    # Completions default to OpenAI's 16 tokens; chat to the rest of the context, as vLLM.
    default = None if parsed.chat else 16
    try:
        return [service.sampling_params(parsed.fields, len(ids), default) for ids in token_ids]
    except RequestError as error:
        wire = parsed.structured_field
        if error.field == "structured_outputs" and wire not in (None, "structured_outputs"):
            # Name the field the client actually sent (response_format, guided_json, ...).
            raise InvalidRequestError(wire, f"{wire}: {error.message}") from None
        raise


async def completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/completions."""
    service = request.app[_STATE].service
    body = await _json_body(request)
    wrong_model = _check_model(service, body)
    if wrong_model is not None:
        return wrong_model
    parsed = protocol.parse_completion(body)
    service.check_prompt_count(len(parsed.prompts))
    token_ids = [await service.encode_prompt_async(prompt) for prompt in parsed.prompts]
    params = _params_for(service, parsed, token_ids)
    prompts = [{"prompt": prompt, "prompt_token_ids": ids} if isinstance(prompt, str)
               else ids for prompt, ids in zip(parsed.prompts, token_ids, strict=True)]
    return await _Endpoint(service, parsed, prompts, params).respond(request)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/chat/completions."""
    service = request.app[_STATE].service
    body = await _json_body(request)
    wrong_model = _check_model(service, body)
    if wrong_model is not None:
        return wrong_model
    messages, parsed = protocol.parse_chat(body)
    chat = tool_calling.prepare_chat(body, messages, parsed, service.config)
    if service.tokenizer is None:
        raise InvalidRequestError("messages", "this model has no tokenizer to render chats")
    # The rendered chat holds every message's text (and the tools): one too long to fit is
    # refused before the template and the tokenizer run.
    service.check_prompt_chars(chat.prompt_text(), "messages")
    render = functools.partial(render_chat_prompt, service.tokenizer, chat.messages,
                               chat_template=service.config.chat_template,
                               chat_template_kwargs=chat.template_kwargs)
    try:
        # A long chat is rendered and tokenized in a worker thread (see encode_prompt_async).
        prompt = (await asyncio.to_thread(render) if request.content_length is not None
                  and request.content_length > OFF_LOOP_CHARS else render())
    except (jinja2.TemplateError, TypeError) as error:  # ChatTemplateError is a TemplateError
        raise InvalidRequestError("messages", f"cannot render the chat: {error} (a server "
                                              "can be given one with --chat-template)") from None
    token_ids = service.encode_prompt(prompt["prompt_token_ids"], "messages")
    try:
        params = _params_for(service, parsed, [token_ids])
    except RequestError as error:
        if error.field == "max_tokens" and body.get("max_completion_tokens") is not None:
            # Name the field the client actually sent (the newer spelling of max_tokens).
            raise InvalidRequestError("max_completion_tokens",
                                      f"max_completion_tokens: {error.message}") from None
        raise
    return await _Endpoint(service, parsed, [prompt], params,
                           chat.output_format).respond(request)


async def models(request: web.Request) -> web.Response:
    """GET /v1/models."""
    service = request.app[_STATE].service
    return web.json_response({"object": "list", "data": [{
        "id": service.model_name, "object": "model", "created": 0, "owned_by": "jaxinfer",
        "max_model_len": service.max_model_len, "vocab_size": service.vocab_size}]})


async def health(request: web.Request) -> web.Response:
    """GET /health: 200 once warmed up and serving, 503 otherwise."""
    ready = request.app[_STATE].service.ready
    return web.json_response({"status": "ok" if ready else "unavailable"},
                             status=200 if ready else 503)


async def metrics(request: web.Request) -> web.Response:
    """GET /metrics (Prometheus text format)."""
    body = request.app[_STATE].service.metrics.render()
    return web.Response(body=body, headers={"content-type": CONTENT_TYPE})


async def _stop_listening(app: web.Application) -> None:
    """on_shutdown: close the listening sockets, answer 503 to new requests on old sockets."""
    state = app[_STATE]
    state.draining = True
    if state.runner is not None:
        for site in list(state.runner.sites):
            await site.stop()  # the in-flight responses carry on; cleanup() waits for them


def build_app(service: InferenceService, access: HttpAccess) -> web.Application:
    """The aiohttp application with every route.

    Args:
        service: The engine and its request policy.
        access: The Host and Origin allow-lists.

    Returns:
        The application; `start_http_server` runs it.
    """
    app = web.Application(middlewares=[_errors_and_auth], client_max_size=16 * 1024 * 1024)
    app[_STATE] = _State(service, access)
    app.on_shutdown.append(_stop_listening)
    app.on_response_prepare.append(_add_cors_headers)
    app.add_routes([web.post("/v1/completions", completions),
                    web.post("/v1/chat/completions", chat_completions),
                    web.get("/v1/models", models), web.get("/health", health),
                    web.get("/metrics", metrics)])
    return app


async def start_http_server(service: InferenceService, host: str, port: int
                            ) -> tuple[web.AppRunner, int]:
    """Binds the HTTP front end; returns the runner (for shutdown) and the bound port.

    Args:
        service: The engine and its request policy (the engine already started).
        host: Interface to bind; when it is loopback, only loopback Host names are served
            unless `service.config.allowed_hosts` says otherwise.
        port: TCP port; 0 picks a free one.

    `handler_cancellation=True` makes a client disconnect cancel the handler (aiohttp's
    default lets it run to completion), which is what aborts the engine request.
    """
    app = build_app(service, HttpAccess.build(host, service.config.allowed_hosts,
                                              service.config.allowed_origins))
    runner = web.AppRunner(app, handler_cancellation=True,
                           shutdown_timeout=_SHUTDOWN_TIMEOUT, access_log=None)
    app[_STATE].runner = runner
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner, runner.addresses[0][1]  # port 0 picked a free one
