"""The server process around the engine: a request the engine fails on alone gets an error
while the others run on, and a dead engine ends `Server.run()` with exit code 1 after health
turned NOT_SERVING and the requests in flight got their error."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxinfer.engine.output_processor import SampleState
from serve.generated.jaxinfer.v1 import inference_pb2 as pb
from serve.generated.jaxinfer.v1 import inference_pb2_grpc as pb_grpc
from serve.server import Server, ServerAddress
from tests.serve.conftest import make_service, pool_is_full

TIMEOUT = 60.0
POISON = "@@poison@@"  # a stop string that makes the engine fail on its request (see below)


def _eventually(condition) -> bool:
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return False


@pytest.fixture
def poisoned(monkeypatch):
    """Detokenizing fails for a request with the stop string POISON, after 3 tokens (so a
    streamed one has started: its error comes as an event, not a status)."""
    real = SampleState.add

    def add(self, *args, **kwargs):
        if POISON in self._stop_strings and len(self.token_ids) >= 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "poisoned")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(SampleState, "add", add)


async def _sse(session: aiohttp.ClientSession, port: int, body: dict) -> list[dict]:
    """The events of one streamed completion ([DONE] as the string "[DONE]")."""
    events = []
    async with session.post(f"http://127.0.0.1:{port}/v1/completions",
                            json={**body, "stream": True}) as response:
        assert response.status == 200
        async for line in response.content:
            if line.startswith(b"data: "):
                data = line[len(b"data: "):].strip()
                events.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return events


def test_a_request_the_engine_fails_on_gets_an_error_and_the_others_run_on(server, poisoned):
    service = server.server.service
    normal = {"prompt": [1, 5, 9], "max_tokens": 12, "ignore_eos": True, "temperature": 0.0}
    bad = {**normal, "stop": [POISON]}

    async def main():
        async with aiohttp.ClientSession() as session:
            return await asyncio.gather(
                _sse(session, server.http_port, normal), _sse(session, server.http_port, bad),
                session.post(f"http://127.0.0.1:{server.http_port}/v1/completions",
                             json=bad))

    def over_grpc(fields: dict) -> list[pb.GenerateResponse]:
        with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
            return list(pb_grpc.InferenceStub(channel).Generate(
                pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 5, 9]), **fields),
                timeout=TIMEOUT))

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        fields = {"max_tokens": 12, "ignore_eos": True, "temperature": 0.0}
        grpc_bad = pool.submit(over_grpc, {**fields, "stop": [POISON]})
        grpc_normal = pool.submit(over_grpc, fields)
        good, failed, plain = asyncio.run(main())
        with pytest.raises(grpc.RpcError) as error:
            grpc_bad.result()
        grpc_good = grpc_normal.result()
    assert error.value.code() == grpc.StatusCode.INTERNAL
    assert "engine failed on this request" in error.value.details()
    assert plain.status == 500  # the non-streamed one
    # The streamed one got its first tokens, then its error as an event, then [DONE].
    assert failed[0]["choices"][0]["finish_reason"] is None
    assert "engine failed on this request" in failed[-2]["error"]["message"]
    assert "poisoned" not in failed[-2]["error"]["message"]  # internals stay in the log
    assert failed[-1] == "[DONE]"
    text = "".join(event["choices"][0]["text"] for event in good[:-1] if event["choices"])
    assert good[-1] == "[DONE]" and good[-2]["choices"][0]["finish_reason"] == "length"
    assert sum(len(response.outputs[0].token_ids) for response in grpc_good) == 12
    assert grpc_good[-1].outputs[0].finish_reason == "length"
    expected = service.tokenizer.decode([t for response in grpc_good
                                         for t in response.outputs[0].token_ids])
    assert text == expected
    assert service.engine.is_running
    assert _eventually(lambda: pool_is_full(service))


def test_a_dead_engine_turns_health_not_serving_answers_in_flight_and_run_returns_1():
    service = make_service()
    server = Server(service, ServerAddress("127.0.0.1", 0, 0), grace_seconds=0.5)

    async def main():
        run = asyncio.create_task(server.run())
        while server.http_port is None and not run.done():
            await asyncio.sleep(0.01)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel, \
                aiohttp.ClientSession() as session:
            watch = health_pb2_grpc.HealthStub(channel).Watch(
                health_pb2.HealthCheckRequest(service=""))
            statuses = [(await watch.read()).status]
            body = {"prompt": [1, 5, 9], "max_tokens": 200, "ignore_eos": True, "stream": True}
            async with session.post(f"http://127.0.0.1:{server.http_port}/v1/completions",
                                    json=body) as response:
                lines = response.content.__aiter__()
                first = await lines.__anext__()  # the request runs

                def broken(*_):
                    raise RuntimeError("device lost")

                service.engine.engine.runner.execute = broken  # the next step fails
                rest = [line async for line in lines]
            statuses.append((await watch.read()).status)
        return await asyncio.wait_for(run, TIMEOUT), first, rest, statuses

    code, first, rest, statuses = asyncio.run(main())
    assert code == 1
    assert first.startswith(b"data: ")
    assert any(b"device lost" in line and b'"error"' in line for line in rest)
    serving = health_pb2.HealthCheckResponse
    assert statuses == [serving.SERVING, serving.NOT_SERVING]
    assert service.engine.errored and not service.engine.is_running
