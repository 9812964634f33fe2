"""What one request can hold on the server: bounded memory per stream and bounded time.

- a reader that pauses gets the outputs it missed merged, never a per-step backlog (the HTTP
  front end's fan-in of several prompts holds at most one output per prompt);
- a client that stops reading a stream is dropped once a write has waited
  `write_timeout_seconds` (HTTP and gRPC), its request is aborted and its pages come back,
  while other requests run on;
- a request that runs past `max_request_seconds` ends with finish_reason "abort".

Real sockets throughout. A client that stops reading only blocks the server's writes once
every buffer between them is full, so the tests keep those small: the server side's send
buffer of the HTTP connection is shrunk (Linux would otherwise grow it to megabytes), and the
gRPC client turns off the flow-control window growth (BDP probing) it would otherwise do.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import socket
import time
import urllib.request

import grpc
import pytest

from serve.generated.jaxinfer.v1 import inference_pb2 as pb
from serve.generated.jaxinfer.v1 import inference_pb2_grpc as pb_grpc
from serve.http_server import _merged
from serve.server import BackgroundServer
from serve.service import ServiceConfig
from tests.serve.conftest import make_service, pool_is_full

TIMEOUT = 60.0  # the longest any wait here may take before the test fails (a hang)
# Enough output (about 1 MB of SSE with logprobs) to fill every buffer of a loopback socket
# that is not read: 4 prompts x 4 samples, 200 tokens each.
HEAVY = {"prompt": ["Hello there", "Once upon a", "The list type", "A B C"], "n": 4,
         "max_tokens": 200, "logprobs": 5, "ignore_eos": True, "temperature": 0.0}


def _wait_for(condition) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


def _finished_requests(service) -> float:
    """Engine requests the service has ended, whatever the reason (its request metric)."""
    return sum(sample.value for metric in service.metrics.registry.collect()
               if metric.name == "jaxinfer:request_success"
               for sample in metric.samples if sample.name.endswith("_total"))


def _post(port: int, body: dict) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                     json.dumps(body).encode(),
                                     {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=TIMEOUT) as response:
        return json.loads(response.read())


def test_the_http_fan_in_holds_one_output_per_prompt_for_a_paused_reader():
    service = make_service()
    service.engine.start()
    prompts = [[1, 5, 9, 200], [1, 42, 43]]
    params = [service.sampling_params({"max_tokens": 40, "ignore_eos": True,
                                       "temperature": 0.0}, len(prompt)) for prompt in prompts]

    async def read(request_id: str, pause: bool) -> tuple[dict[int, tuple], int]:
        """Each prompt's (token ids, text), and the items read after the pause."""
        tokens: dict[int, list[int]] = {0: [], 1: []}
        texts = {0: "", 1: ""}
        after_pause = 0
        stream = _merged(service, prompts, params, request_id)
        async for index, output in stream:
            if pause and not after_pause:
                # Stop reading until the engine has run both requests to their end.
                while not pool_is_full(service):
                    await asyncio.sleep(0.01)
                # ... and has handed their last outputs over: the engine thread marks a
                # request finished inside its step and delivers the outputs after it, so
                # wait for a command, which it applies only after that delivery (and whose
                # answer reaches this loop after the outputs do).
                await service.engine.abort("no-such-request")
            after_pause += pause
            tokens[index] += output.outputs[0].token_ids
            texts[index] += output.outputs[0].text
        return {index: (tokens[index], texts[index]) for index in tokens}, after_pause

    try:
        prompt_read, _ = asyncio.run(read("prompt", pause=False))
        paused, read_after_pause = asyncio.run(read("paused", pause=True))
    finally:
        service.engine.shutdown()
    # The 2 x 40 steps' outputs came as at most 2 items per prompt (one waiting in the fan-in,
    # the rest merged in the engine stream), plus the one read before the pause.
    assert read_after_pause <= 1 + 2 * len(prompts)
    assert paused == prompt_read  # the same tokens and text
    assert all(len(tokens) == 40 and text for tokens, text in paused.values())


@pytest.fixture(scope="module")
def impatient():
    """A server that drops a client after 1 s of a write that cannot complete."""
    with BackgroundServer(make_service(write_timeout_seconds=1.0)) as running:
        yield running


def test_an_http_stream_that_is_never_read_is_dropped_and_its_pages_freed(impatient):
    service = impatient.server.service
    web_server = impatient.server._http_runner.server
    slow = socket.create_connection(("127.0.0.1", impatient.http_port))
    _wait_for(lambda: len(web_server.connections) == 1)
    handler = web_server.connections[0]
    # Keep the server's kernel buffer for this connection small (see the module docstring).
    handler.transport.get_extra_info("socket").setsockopt(
        socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    body = json.dumps({**HEAVY, "stream": True}).encode()
    slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                 % (len(body), body))
    _wait_for(lambda: service.engine.num_unfinished_requests > 0)
    # Meanwhile an ordinary request is served in full.
    normal = {"prompt": [1, 5, 9], "max_tokens": 8, "ignore_eos": True, "temperature": 0.0}
    during = _post(impatient.http_port, normal)
    _wait_for(lambda: handler.transport is None)  # the server dropped the slow connection
    _wait_for(lambda: pool_is_full(service))
    slow.settimeout(TIMEOUT)
    received = b""
    try:
        while chunk := slow.recv(1 << 16):
            received += chunk
    except ConnectionResetError:
        pass
    slow.close()
    assert received.startswith(b"HTTP/1.1 200") and b"[DONE]" not in received
    after = _post(impatient.http_port, normal)
    assert during["choices"][0]["text"] == after["choices"][0]["text"]
    assert during["usage"]["completion_tokens"] == 8


def test_a_grpc_stream_that_is_never_read_is_dropped_and_its_pages_freed(impatient):
    service = impatient.server.service
    finished = _finished_requests(service)
    options = [("grpc.http2.bdp_probe", 0)]  # see the module docstring
    with grpc.insecure_channel(f"127.0.0.1:{impatient.grpc_port}", options=options) as channel:
        stub = pb_grpc.InferenceStub(channel)
        call = stub.Generate(pb.GenerateRequest(text="Hello there", n=16, max_tokens=220,
                                                logprobs=20, ignore_eos=True,
                                                temperature=0.0), timeout=TIMEOUT)
        # The handler has given its request up (a write timed out) or finished it.
        _wait_for(lambda: _finished_requests(service) > finished)
        with pytest.raises(grpc.RpcError) as error:
            for _ in call:
                pass
        assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "stopped reading" in error.value.details()
        _wait_for(lambda: pool_is_full(service))
        normal = list(stub.Generate(pb.GenerateRequest(text="Hi", max_tokens=4,
                                                       ignore_eos=True), timeout=TIMEOUT))
        assert normal[-1].finished and normal[-1].usage.completion_tokens == 4


def test_a_request_past_max_request_seconds_is_aborted():
    # 0.5 s against 240 steps of 16 sequences, seconds of work even on a fast machine.
    with BackgroundServer(make_service(max_request_seconds=0.5)) as running:
        service = running.server.service

        def over_grpc() -> pb.GenerateResponse:
            with grpc.insecure_channel(f"127.0.0.1:{running.grpc_port}") as channel:
                return list(pb_grpc.InferenceStub(channel).Generate(pb.GenerateRequest(
                    text="Hello there", n=8, max_tokens=240, ignore_eos=True),
                    timeout=TIMEOUT))[-1]

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            grpc_last = pool.submit(over_grpc)
            http = _post(running.http_port, {"prompt": "Once upon a", "n": 8,
                                             "max_tokens": 240, "ignore_eos": True})
            grpc_last = grpc_last.result()
        assert {choice["finish_reason"] for choice in http["choices"]} == {"abort"}
        assert http["usage"]["completion_tokens"] < 8 * 240
        assert grpc_last.finished
        assert {output.finish_reason for output in grpc_last.outputs} == {"abort"}
        _wait_for(lambda: pool_is_full(service))


def test_timeouts_must_be_positive():
    for name in ("max_request_seconds", "write_timeout_seconds"):
        with pytest.raises(ValueError, match=name):
            ServiceConfig(model_name="demo", **{name: 0})
        assert getattr(ServiceConfig(model_name="demo", **{name: None}), name) is None

