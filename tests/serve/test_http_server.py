"""The OpenAI-compatible HTTP front end, driven by the official `openai` package on loopback.

Greedy results are checked against `jaxinfer.llm.LLM` on the same model and engine options;
64 concurrent streams with a quarter cancelled leave the pool full; every invalid input is a
400 naming its field while another request keeps running; every malformed body, wrong
Content-Type, foreign Host or Origin is refused (400 / 415 / 403) and the server serves on;
overload is a 429; the API key is enforced.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import socket
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest

from jaxinfer.engine.sampling_params import SamplingParams
from jaxinfer.llm import LLM
from serve.server import BackgroundServer
from tests.serve.conftest import CHAT_TEMPLATE, ENGINE_OPTIONS, make_service, pool_is_full

PROMPTS = ["The list type is", "To open a file, use the", "A dictionary maps"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10)


@pytest.fixture(scope="module")
def llm():
    return LLM("builtin:demo", **ENGINE_OPTIONS)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="unused")


def _post(port: int, path: str, body: bytes, headers: dict | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", body,
                                     {"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def _metric(port: int, name: str, **labels: str) -> float:
    """One sample of /metrics (0 when the series does not exist yet)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics") as response:
        text = response.read().decode()
    for line in text.splitlines():
        series, _, value = line.rpartition(" ")
        if series.split("{")[0] == name and all(f'{key}="{wanted}"' in series
                                                for key, wanted in labels.items()):
            return float(value)
    return 0.0


def _wait_for(condition, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return False


def _wait_idle(service, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pool_is_full(service):
            return True
        time.sleep(0.05)
    return False


def test_completions_equal_llm_generate_streamed_or_not(client, llm):
    references = llm.generate(PROMPTS, GREEDY)
    expected = [output.outputs[0].text for output in references]
    batch = client.completions.create(model="demo", prompt=PROMPTS, max_tokens=10,
                                      temperature=0)
    assert batch.id.startswith("cmpl-") and batch.object == "text_completion"
    assert batch.model == "demo"
    assert [choice.index for choice in batch.choices] == [0, 1, 2]
    assert [choice.text for choice in batch.choices] == expected
    assert [choice.finish_reason for choice in batch.choices] == [
        output.outputs[0].finish_reason for output in references]
    assert batch.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in references)
    assert batch.usage.completion_tokens == 30
    assert batch.usage.total_tokens == batch.usage.prompt_tokens + 30
    stream = client.completions.create(model="demo", prompt=PROMPTS[0], max_tokens=10,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected[0]
    assert chunks[-1].usage.completion_tokens == 10
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_token_id_prompts_logprobs_and_extensions(client, llm):
    ids = llm.get_tokenizer().encode(PROMPTS[1])
    [reference] = llm.generate({"prompt_token_ids": ids}, SamplingParams(
        temperature=0.0, max_tokens=6, logprobs=2))
    result = client.completions.create(model="demo", prompt=ids, max_tokens=6, temperature=0,
                                       logprobs=2, extra_body={"top_k": 5, "min_p": 0.0})
    choice = result.choices[0]
    assert choice.text == reference.outputs[0].text
    sample = reference.outputs[0]
    expected = [entry[token] for entry, token in zip(sample.logprobs, sample.token_ids,
                                                      strict=True)]
    assert choice.logprobs.token_logprobs == pytest.approx(expected, abs=1e-4)
    assert all(len(top) <= 2 for top in choice.logprobs.top_logprobs)
    assert result.usage.prompt_tokens == len(ids)


def test_chat_streamed_and_not_equal_llm_chat(client, llm):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is a list?"}]
    [reference] = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=10, logprobs=2),
                           chat_template=CHAT_TEMPLATE)
    sample = reference.outputs[0]
    result = client.chat.completions.create(model="demo", messages=messages, max_tokens=10,
                                            temperature=0, logprobs=True, top_logprobs=2)
    choice = result.choices[0]
    assert choice.message.content == sample.text and choice.message.role == "assistant"
    assert choice.finish_reason == sample.finish_reason
    assert result.id.startswith("chatcmpl-") and result.object == "chat.completion"
    assert result.usage.prompt_tokens == len(reference.prompt_token_ids)
    assert result.usage.completion_tokens == len(sample.token_ids)
    assert result.usage.total_tokens == (result.usage.prompt_tokens
                                         + result.usage.completion_tokens)
    content = choice.logprobs.content
    assert [entry.logprob for entry in content] == pytest.approx(
        [entry[token] for entry, token in zip(sample.logprobs, sample.token_ids, strict=True)],
        abs=1e-4)
    assert all(len(entry.top_logprobs) == 2 and entry.bytes is not None for entry in content)
    chunks = list(client.chat.completions.create(
        model="demo", messages=messages, max_completion_tokens=10, temperature=0,
        stream=True, stream_options={"include_usage": True}))
    assert all(chunk.object == "chat.completion.chunk" for chunk in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
        sample.text)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(
        sample.token_ids)


def test_n_seed_and_stop(client):
    first = client.completions.create(model="demo", prompt=PROMPTS[0], max_tokens=8, n=2,
                                      seed=7, temperature=1.0)
    again = client.completions.create(model="demo", prompt=PROMPTS[0], max_tokens=8, n=2,
                                      seed=7, temperature=1.0)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    # A batch of two prompts with n=2, streamed: choice i * n + j is sample j of prompt i, and
    # the seeded samples equal the non-streamed ones.
    batch = dict(model="demo", prompt=PROMPTS[:2], max_tokens=6, n=2, seed=3, temperature=1.0)
    whole = client.completions.create(**batch)
    streamed: dict[int, str] = {}
    chunks = list(client.completions.create(**batch, stream=True))
    for chunk in chunks:
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert len({chunk.id for chunk in chunks}) == 1 and chunks[0].id.startswith("cmpl-")
    assert streamed == {choice.index: choice.text for choice in whole.choices}
    assert sorted(streamed) == [0, 1, 2, 3]
    alone = client.completions.create(**{**batch, "prompt": PROMPTS[0]})
    assert [c.text for c in alone.choices] == [c.text for c in whole.choices[:2]]
    full = client.completions.create(model="demo", prompt=PROMPTS[0], max_tokens=10,
                                     temperature=0).choices[0].text
    stop = full.strip()[:2]
    stopped = client.completions.create(model="demo", prompt=PROMPTS[0], max_tokens=10,
                                        temperature=0, stop=[stop]).choices[0]
    assert stopped.finish_reason == "stop" and stop not in stopped.text


def test_models_health_and_metrics(server, client):
    [model] = client.models.list().data
    assert model.id == "demo" and model.max_model_len == 256
    with urllib.request.urlopen(f"http://127.0.0.1:{server.http_port}/health") as response:
        assert response.status == 200
    with urllib.request.urlopen(f"http://127.0.0.1:{server.http_port}/metrics") as response:
        text = response.read().decode()
    for name in ("jaxinfer:num_requests_running", "jaxinfer:num_requests_waiting",
                 "jaxinfer:kv_cache_usage_perc", "jaxinfer:prefix_cache_hit_rate",
                 "jaxinfer:time_to_first_token_seconds_bucket",
                 "jaxinfer:time_per_output_token_seconds_bucket",
                 "jaxinfer:e2e_request_latency_seconds_bucket", "jaxinfer:prompt_tokens_total",
                 "jaxinfer:generation_tokens_total", "jaxinfer:num_preemptions"):
        assert name in text


def test_64_streams_with_a_quarter_cancelled(server, llm):
    rng = random.Random(0)
    prompts = [f"{PROMPTS[i % 3]} {i}" for i in range(64)]
    expected = {prompt: output.outputs[0].text for prompt, output in zip(
        prompts, llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8)),
        strict=True)}
    cancelled = set(rng.sample(range(64), 16))

    async def one(api: openai.AsyncOpenAI, index: int) -> str | None:
        # A cancelled request asks for far more tokens than the test waits for, so only an
        # abort (not its natural end) can give its pages back in time.
        long = index in cancelled
        stream = await api.completions.create(
            model="demo", prompt=prompts[index], max_tokens=200 if long else 8, temperature=0,
            stream=True, extra_body={"ignore_eos": long})
        text = ""
        async for chunk in stream:
            text += chunk.choices[0].text
            if index in cancelled and text:
                await stream.close()  # a client that goes away mid-stream
                return None
        return text

    async def main() -> list[str | None]:
        api = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1",
                                 api_key="unused", max_retries=0)
        try:
            return await asyncio.gather(*(one(api, index) for index in range(64)))
        finally:
            await api.close()

    results = asyncio.run(main())
    for index, text in enumerate(results):
        if index not in cancelled:
            assert text == expected[prompts[index]]
    service = server.server.service
    assert _wait_idle(service, timeout=20.0)
    with urllib.request.urlopen(f"http://127.0.0.1:{server.http_port}/metrics") as response:
        metrics = response.read().decode()
    assert 'jaxinfer:num_requests_running{model_name="demo"} 0.0' in metrics
    aborted = [line for line in metrics.splitlines()
               if line.startswith("jaxinfer:request_success_total") and '"abort"' in line]
    assert aborted and float(aborted[0].split()[-1]) >= len(cancelled)


# (path, body, the field the 400 must name); the message must name it too (see below).
INVALID = [
    ("completions", {"prompt": ""}, "prompt"),
    ("completions", {"prompt": []}, "prompt"),
    ("completions", {"prompt": "word " * 300}, "prompt"),  # longer than the 256-token context
    ("completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": "x", "max_tokens": 5000}, "max_tokens"),
    ("completions", {"prompt": "x", "temperature": -1}, "temperature"),
    ("completions", {"prompt": "x", "top_p": 0}, "top_p"),
    ("completions", {"prompt": "x", "top_p": 1.5}, "top_p"),
    ("completions", {"prompt": [1, 99999]}, "prompt"),  # token id beyond the vocabulary
    ("completions", {"prompt": [[1, 2], [-1]]}, "prompt"),
    ("completions", {"prompt": "x", "temperature": "hot"}, "temperature"),
    ("completions", {"prompt": "x", "max_tokens": "ten"}, "max_tokens"),
    ("completions", {"prompt": "x", "n": 1.5}, "n"),
    ("completions", {"prompt": "x", "stop": 5}, "stop"),
    ("completions", {"prompt": "x", "stream": "yes"}, "stream"),
    ("completions", {"prompt": "x", "logprobs": "all"}, "logprobs"),
    ("completions", {"prompt": "x", "logit_bias": {"99999": 1}}, "logit_bias"),
    ("completions", {"prompt": "x", "top_k": -5}, "top_k"),
    ("completions", {"prompt": 3}, "prompt"),
    ("completions", {"prompt": "x", "echo": True}, "echo"),  # not supported: refused
    ("completions", {"prompt": "x", "model": 7}, "model"),
    ("chat/completions", {"messages": []}, "messages"),
    ("chat/completions", {"messages": "hi"}, "messages"),
    ("chat/completions", {"messages": [{"content": "no role"}]}, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}],
                          "max_completion_tokens": 0}, "max_completion_tokens"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}],
                          "max_tokens": 9999}, "max_tokens"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}],
                          "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}],
                          "temperature": -1}, "temperature"),
]


def test_invalid_inputs_are_400_naming_the_field_while_a_request_runs(server, client, llm):
    # A long greedy request decodes while every bad request is refused; it must not notice.
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    [reference] = llm.generate(PROMPTS[2], long)
    service, result = server.server.service, {}
    running = threading.Thread(target=lambda: result.update(answer=client.completions.create(
        model="demo", prompt=PROMPTS[2], max_tokens=200, temperature=0,
        extra_body={"ignore_eos": True})))
    running.start()
    assert _wait_for(lambda: service.engine.num_unfinished_requests > 0)
    failures = []
    for path, body, param in INVALID:
        status, answer = _post(server.http_port, f"/v1/{path}",
                               json.dumps({"model": "demo", **body}).encode())
        error = answer.get("error", {})
        if (status != 400 or error.get("param") != param or param not in error["message"]
                or error.get("type") != "invalid_request_error"):
            failures.append((path, body, status, answer))
    for raw in (b"{not json", b"", b"[1, 2]"):
        status, answer = _post(server.http_port, "/v1/completions", raw)
        if status != 400 or "JSON" not in answer["error"]["message"]:
            failures.append((raw, status, answer))
    status, answer = _post(server.http_port, "/v1/completions",
                           json.dumps({"model": "other", "prompt": "x"}).encode())
    if status != 404 or answer["error"]["param"] != "model":
        failures.append(("wrong model", status, answer))
    status, answer = _post(server.http_port, "/v1/embeddings", b"{}")
    if status != 404 or "error" not in answer:
        failures.append(("unknown path", status, answer))
    still_running = service.engine.num_unfinished_requests > 0
    running.join()
    assert not failures
    assert still_running  # the bad requests really arrived while the long one decoded
    assert result["answer"].choices[0].text == reference.outputs[0].text
    assert result["answer"].usage.completion_tokens == 200


def test_a_closed_connection_aborts_a_non_streamed_request(server):
    service = server.server.service
    aborted = _metric(server.http_port, "jaxinfer:request_success_total",
                      finished_reason="abort")
    body = json.dumps({"model": "demo", "prompt": [1, 5], "max_tokens": 250,
                       "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", server.http_port)) as connection:
        connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                           b"Content-Type: application/json\r\n"
                           b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        assert _wait_for(lambda: service.engine.num_unfinished_requests > 0)
    # Closing the socket cancels the handler, which aborts the request long before its 250
    # tokens would end it, and frees its pages.
    assert _wait_idle(service, timeout=20.0)
    assert _metric(server.http_port, "jaxinfer:request_success_total",
                   finished_reason="abort") == aborted + 1


def test_overload_and_api_key():
    with BackgroundServer(make_service(max_queued_requests=1, api_key="k"),
                          grpc=False) as server:
        base = f"http://127.0.0.1:{server.http_port}/v1"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base, api_key="wrong", max_retries=0).models.list()
        status, answer = _post(server.http_port, "/v1/completions",
                               json.dumps({"model": "demo", "prompt": "x"}).encode())
        assert status == 401 and answer["error"]["type"] == "authentication_error"
        # A non-ASCII key (latin-1 on the wire) is a wrong key too, not a 500.
        status, answer = _post(server.http_port, "/v1/completions",
                               json.dumps({"model": "demo", "prompt": "x"}).encode(),
                               {"authorization": "Bearer k\xe9y"})
        assert status == 401 and answer["error"]["type"] == "authentication_error"
        status, _ = _post(server.http_port, "/v1/completions",
                          json.dumps({"model": "demo", "prompt": "x", "max_tokens": 2}).encode(),
                          {"authorization": "Bearer k"})
        assert status == 200
        api = openai.OpenAI(base_url=base, api_key="k", max_retries=0)
        assert api.models.list().data[0].id == "demo"
        with urllib.request.urlopen(f"http://127.0.0.1:{server.http_port}/health") as answer:
            assert answer.status == 200  # health stays open without the key

        async def burst() -> list[BaseException | object]:
            async_api = openai.AsyncOpenAI(base_url=base, api_key="k", max_retries=0)
            try:
                return await asyncio.gather(*(async_api.completions.create(
                    model="demo", prompt=f"{PROMPTS[0]} {i}", max_tokens=4) for i in range(12)),
                    return_exceptions=True)
            finally:
                await async_api.close()

        results = asyncio.run(burst())
        refused = [r for r in results if isinstance(r, openai.RateLimitError)]
        served = [r for r in results if not isinstance(r, BaseException)]
        assert refused and served
        assert len(refused) + len(served) == len(results)
        assert _wait_idle(server.server.service)


def _nested(depth: int) -> bytes:
    return b'{%(ok)s, "user": ' + b"[" * depth + b"]" * depth + b"}"


# Each endpoint's prompt field: well-formed (ok) and holding a lone surrogate (bad).
PROMPT_FIELDS = {
    "completions": {b"ok": b'"prompt": "x"', b"bad": b'"prompt": "x \\ud800"',
                    "field": "prompt"},
    "chat/completions": {b"ok": b'"messages": [{"role": "user", "content": "x"}]',
                         b"bad": b'"messages": [{"role": "user", "content": "x \\ud800"}]',
                         "field": "messages"},
}
# (case, raw body, headers, status, param, a fragment the error message must hold); in the
# body, %(ok)s is the endpoint's prompt field and %(bad)s the same with a lone surrogate, and
# a param of "prompt" means that field. Each case was a 500 or a 200 before these checks.
MALFORMED = [
    ("deeply nested", _nested(100_000), {}, 400, None, "nested deeper than 64"),
    ("nested past the limit", _nested(100), {}, 400, None, "nested deeper than 64"),
    ("a 5,000-digit integer", b'{%(ok)s, "seed": 1' + b"0" * 5000 + b"}", {}, 400, None,
     "4300 digits"),
    ("invalid UTF-8", b'{%(ok)s, "user": "\xc3\x28"}', {}, 400, None, "not valid UTF-8"),
    ("a lone surrogate in the prompt", b"{%(bad)s}", {}, 400, "prompt", "surrogate"),
    ("a lone surrogate in a stop string", b'{%(ok)s, "stop": ["a", "\\udc00"]}', {}, 400,
     "stop", "stop[1]"),
    ("a lone surrogate in a logit_bias key", b'{%(ok)s, "logit_bias": {"\\ud800": 1}}', {},
     400, "logit_bias", "surrogate"),
    ("a lone surrogate in an ignored field", b'{%(ok)s, "user": "\\udbff"}', {}, 400, "user",
     "surrogate"),
    # (NaN and infinities in sampling fields were refused already, by the engine's checks.)
    ("NaN", b'{%(ok)s, "user": NaN}', {}, 400, "user", "user: NaN is not a finite number"),
    ("Infinity", b'{%(ok)s, "stream_options": {"include_usage": Infinity}}', {}, 400,
     "stream_options", "stream_options.include_usage: Infinity"),
    ("a float overflowing to infinity", b'{%(ok)s, "user": -1e999}', {}, 400, "user",
     "-1e999 is not a finite number"),
    ("an unknown charset", b"{%(ok)s}", {"content-type": "application/json; charset=klingon"},
     415, None, "application/json"),
    ("another charset", b"{%(ok)s}", {"content-type": "application/json; charset=latin-1"},
     415, None, "application/json"),
    ("text/plain (a browser's simple cross-site POST)", b"{%(ok)s}",
     {"content-type": "text/plain"}, 415, None, "application/json"),
    ("a form", b"{%(ok)s}", {"content-type": "application/x-www-form-urlencoded"}, 415, None,
     "application/json"),
    ("a foreign Host (DNS rebinding)", b"{%(ok)s}", {"host": "evil.example"}, 403, None,
     "evil.example"),
    ("a foreign Host with a port", b"{%(ok)s}", {"host": "evil.example:8000"}, 403, None,
     "--allowed-hosts"),
    ("a web page's Origin", b"{%(ok)s}", {"origin": "https://evil.example"}, 403, None,
     "--allowed-origins"),
]


@pytest.mark.parametrize("path", sorted(PROMPT_FIELDS))
def test_malformed_requests_are_refused_and_the_server_serves_on(server, path):
    port, fields = server.http_port, PROMPT_FIELDS[path]
    ordinary = b'{"model": "demo", "max_tokens": 2, %(ok)s}' % fields
    failures = []
    for case, raw, headers, status, param, fragment in MALFORMED:
        param = fields["field"] if param == "prompt" else param
        got, answer = _post(port, f"/v1/{path}", raw % fields, headers)
        error = answer.get("error", {})
        if (got, error.get("param"), error.get("code")) != (status, param, status) or (
                fragment not in error.get("message", "")):
            failures.append((case, got, answer))
        # The next ordinary request is served as if nothing happened.
        got, answer = _post(port, f"/v1/{path}", ordinary)
        if got != 200 or answer["usage"]["completion_tokens"] != 2:
            failures.append((case, "then", got, answer))
    assert not failures
    assert _wait_idle(server.server.service)


def test_allowed_origins_get_cors_and_an_exposed_server_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="jaxinfer.serve"), BackgroundServer(
            make_service(allowed_origins=("https://app.example",)), "0.0.0.0",
            grpc=False) as server:
        port = server.http_port
        body = json.dumps({"model": "demo", "prompt": "x", "max_tokens": 2}).encode()
        # Bound beyond loopback: any Host is served, and no key draws a warning.
        assert "without an API key" in caplog.text
        status, _ = _post(port, "/v1/completions", body, {"host": "api.example:8000"})
        assert status == 200
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions", body,
            {"content-type": "application/json", "origin": "https://app.example"})
        with urllib.request.urlopen(request, timeout=120) as response:
            assert response.headers["access-control-allow-origin"] == "https://app.example"
        preflight = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions", method="OPTIONS",
            headers={"origin": "https://app.example",
                     "access-control-request-method": "POST",
                     "access-control-request-headers": "authorization, content-type"})
        with urllib.request.urlopen(preflight, timeout=120) as response:
            assert response.status == 204
            assert "POST" in response.headers["access-control-allow-methods"]
            assert "authorization" in response.headers["access-control-allow-headers"]
        status, answer = _post(port, "/v1/completions", body, {"origin": "https://other.example"})
        assert status == 403 and answer["error"]["type"] == "permission_error"
