"""Hostile input, table-driven over HTTP, gRPC and JetStream: every case is refused with a clear
status naming the field (or served within bounds), and after each one an ordinary request still
gets the right answer and the KV pool is full again.

Each case is something one client could send to take the server down, stall it or make it
allocate without bound (issue 21's "seen on main" list, and more). The ordinary request is
greedy, so "the right answer" is the one the same server gave before any hostile case.

Malformed HTTP bodies and headers (nesting, 4,300-digit integers, charsets, lone surrogates,
NaN, Content-Type, Host and Origin) have their own table, `MALFORMED` in
`tests/serve/test_http_server.py`, run against both endpoints the same way; the API key's
cases are in `test_overload_and_api_key` there, slow and never-reading clients in
`tests/serve/test_soak.py`.
"""

from __future__ import annotations

import dataclasses
import json
import time
import urllib.error
import urllib.request
from typing import Any

import grpc
import pytest

from serve.client import build_request
from serve.generated.jaxinfer.v1 import inference_pb2_grpc as pb_grpc
from serve.generated.jetstream_proto import jetstream_pb2 as js
from serve.generated.jetstream_proto import jetstream_pb2_grpc as js_grpc
from tests.serve.conftest import pool_is_full

TIMEOUT = 60.0
ORDINARY = {"model": "demo", "prompt": "The list type is", "max_tokens": 8, "temperature": 0}


@dataclasses.dataclass(frozen=True)
class Http:
    """One raw HTTP request and what the server must answer.

    Attributes:
        body: The JSON value (dumped) or raw bytes.
        status: The expected status.
        fragment: Text the error's message must hold (or, for a 200, None).
        param: The error's `param` (the field), when the error names one.
        path: The endpoint.
        headers: Extra headers (content-type defaults to application/json).
    """

    body: Any
    status: int
    fragment: str | None = None
    param: str | None = None
    path: str = "/v1/completions"
    headers: tuple[tuple[str, str], ...] = ()


def _completion(**fields: Any) -> dict[str, Any]:
    return {**ORDINARY, **fields}


def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": "demo", "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 4, **fields}


HTTP_CASES = {
    # 1. top_k past int32 killed the engine thread; it now keeps every token.
    "top_k-2^31": Http(_completion(top_k=2 ** 31), 200),
    "top_k-2^70": Http(_completion(top_k=2 ** 70), 200),
    # 2. n has a bound (and a request of n samples is admitted as n sequences).
    "n-huge": Http(_completion(n=10 ** 9), 400, "n = 1000000000", "n"),
    "n-past-max-num-seqs": Http(_completion(n=17), 400, "max_num_seqs = 16", "n"),
    # 4. stop strings, logit bias: bounded in count and size.
    "stop-count": Http(_completion(stop=[f"s{i}" for i in range(17)]), 400, "at most 16",
                       "stop"),
    "stop-length": Http(_completion(stop=["x" * 257]), 400, "257 characters", "stop"),
    "logit-bias-count": Http(_completion(logit_bias={str(i): 1 for i in range(301)}), 400,
                             "at most 300", "logit_bias"),
    "logit-bias-value": Http(_completion(logit_bias={"5": 101}), 400, "[-100, 100]",
                             "logit_bias"),
    "stop-token-ids-count": Http(_completion(stop_token_ids=[3] * 257), 400, "at most 256",
                                 "stop_token_ids"),
    # 5. prompts per request and text length, checked before tokenizing.
    "too-many-prompts": Http(_completion(prompt=["a"] * 65), 400, "65 prompts", "prompt"),
    "prompt-too-long-in-characters": Http(_completion(prompt="a" * 2_000_000), 400,
                                          "characters cannot fit", "prompt"),
    "chat-too-long-in-characters": Http(
        _chat(messages=[{"role": "user", "content": "a" * 2_000_000}]), 400,
        "characters cannot fit", "messages", path="/v1/chat/completions"),
    "token-ids-far-too-many": Http(_completion(prompt=[5] * 100_000), 400, "no room",
                                   "prompt"),
    # 9. finite in float64, infinite in float32.
    "temperature-float32-inf": Http(_completion(temperature=1e39), 400, "temperature",
                                    "temperature"),
    "temperature-above-limit": Http(_completion(temperature=101), 400, "<= 100",
                                    "temperature"),
    "repetition-penalty-underflow": Http(_completion(repetition_penalty=1e-40), 400,
                                         "[0.01, 100]", "repetition_penalty"),
    "logit-bias-float32-inf": Http(_completion(logit_bias={"5": 3.5e38}), 400, "logit_bias",
                                   "logit_bias"),
    "presence-penalty-huge": Http(_completion(presence_penalty=1e300), 400, "[-2, 2]",
                                  "presence_penalty"),
    "seed-past-64-bit": Http(_completion(seed=2 ** 64), 400, "64-bit", "seed"),
    # 11. errors on list and dict entries name the field.
    "logit-bias-bad-key": Http(_completion(logit_bias={"abc": 1}), 400, "logit_bias",
                               "logit_bias"),
    "stop-entry-not-text": Http(_completion(stop=["ok", 5]), 400, "stop", "stop"),
    "stop-token-id-negative": Http(_completion(stop_token_ids=[-1]), 400, "stop_token_ids",
                                   "stop_token_ids"),
}


def _http(port: int, case: Http) -> tuple[int, dict[str, Any]]:
    body = case.body if isinstance(case.body, bytes) else json.dumps(case.body).encode()
    headers = {"content-type": "application/json", **dict(case.headers)}
    request = urllib.request.Request(f"http://127.0.0.1:{port}{case.path}", body, headers)
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.fixture(scope="module")
def ordinary(server):
    """The ordinary request's answer before any hostile case."""
    status, answer = _http(server.http_port, Http(ORDINARY, 200))
    assert status == 200
    return answer["choices"][0]["text"]


def _still_serving(server, expected: str) -> None:
    """An ordinary request gets the right answer, and then every page is free."""
    status, answer = _http(server.http_port, Http(ORDINARY, 200))
    assert status == 200 and answer["choices"][0]["text"] == expected
    service = server.server.service
    deadline = time.monotonic() + 30
    while not pool_is_full(service):
        assert time.monotonic() < deadline, "the KV pool did not fill up again"
        time.sleep(0.05)


@pytest.mark.parametrize("name", list(HTTP_CASES))
def test_http(server, ordinary, name):
    case = HTTP_CASES[name]
    status, answer = _http(server.http_port, case)
    assert status == case.status, answer
    if case.status != 200:
        error = answer["error"]
        assert case.fragment in error["message"], error
        if case.param is not None:
            assert error["param"] == case.param, error
    _still_serving(server, ordinary)


# ---------------------------------------------------------------------- gRPC and JetStream

GRPC_CASES = {
    "n-huge": (dict(n=2 ** 31 - 1), "n"),
    "stop-count": (dict(stop=[f"s{i}" for i in range(17)]), "stop"),
    "stop-length": (dict(stop=["x" * 257]), "stop"),
    "logit-bias-count": (dict(logit_bias={i: 1.0 for i in range(301)}), "logit_bias"),
    "logit-bias-float32-inf": (dict(logit_bias={5: 3.5e38}), "logit_bias"),
    "temperature-float32-inf": (dict(temperature=1e39), "temperature"),
    "repetition-penalty-underflow": (dict(repetition_penalty=1e-40), "repetition_penalty"),
    "stop-token-ids-count": (dict(stop_token_ids=[3] * 257), "stop_token_ids"),
}


@pytest.mark.parametrize("name", list(GRPC_CASES))
def test_grpc(server, ordinary, name):
    fields, field = GRPC_CASES[name]
    stub = pb_grpc.InferenceStub(grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}"))
    with pytest.raises(grpc.RpcError) as raised:
        list(stub.Generate(build_request("Hi", max_tokens=4, **fields), timeout=TIMEOUT))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert raised.value.details().startswith(field), raised.value.details()
    _still_serving(server, ordinary)


def test_grpc_top_k_at_the_int32_limit_is_served(server, ordinary):
    stub = pb_grpc.InferenceStub(grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}"))
    chunks = list(stub.Generate(build_request("Hi", max_tokens=4, top_k=2 ** 31 - 1),
                                timeout=TIMEOUT))
    assert chunks[-1].finished
    _still_serving(server, ordinary)


@pytest.mark.parametrize(("fields", "field"), [
    (dict(num_samples=2 ** 31 - 1), "n"),
    (dict(num_samples=17), "n"),
    (dict(text_content=js.DecodeRequest.TextContent(text="a" * 2_000_000)),
     "text_content.text"),
], ids=["num-samples-huge", "num-samples-past-max-num-seqs", "text-too-long"])
def test_jetstream(server, ordinary, fields, field):
    stub = js_grpc.OrchestratorStub(grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}"))
    fields.setdefault("text_content", js.DecodeRequest.TextContent(text="Hi"))
    with pytest.raises(grpc.RpcError) as raised:
        list(stub.Decode(js.DecodeRequest(max_tokens=4, **fields), timeout=TIMEOUT))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert raised.value.details().startswith(field), raised.value.details()
    _still_serving(server, ordinary)
