"""The gRPC front end, driven over real loopback channels with real stubs.

Greedy results are checked against `jaxinfer.llm.LLM` on the same model and engine options;
every invalid input gets INVALID_ARGUMENT naming its field while another request runs on;
cancellation and deadlines free the request's pages; the API key and the waiting-queue bound
are checked on a second, small server.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from jaxinfer.engine.sampling_params import SamplingParams
from jaxinfer.llm import LLM
from serve.client import InferenceClient, build_request
from serve.generated.jaxinfer.v1 import inference_pb2 as pb
from serve.generated.jaxinfer.v1 import inference_pb2_grpc as pb_grpc
from serve.generated.jetstream_proto import jetstream_pb2 as js
from serve.generated.jetstream_proto import jetstream_pb2_grpc as js_grpc
from serve.server import BackgroundServer
from tests.serve.conftest import ENGINE_OPTIONS, make_service, pool_is_full

TIMEOUT = 60.0  # per call: generous for a loaded machine, but a hang still fails
PROMPTS = ["The list type", "A dictionary maps"]


@pytest.fixture(scope="module")
def target(server):
    return f"127.0.0.1:{server.grpc_port}"


@pytest.fixture(scope="module")
def channel(target):
    with grpc.insecure_channel(target) as opened:
        yield opened


@pytest.fixture(scope="module")
def stub(channel):
    return pb_grpc.InferenceStub(channel)


@pytest.fixture(scope="module")
def client(target):
    with InferenceClient(target) as opened:
        yield opened


@pytest.fixture(scope="module")
def llm():
    return LLM("builtin:demo", **ENGINE_OPTIONS)


def reference(llm, prompt, **params):
    """`LLM.generate`'s samples for one prompt (text or token ids)."""
    given = prompt if isinstance(prompt, str) else {"prompt_token_ids": list(prompt)}
    return llm.generate(given, SamplingParams(**params))[0].outputs


def wait_until(condition, seconds=20.0):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def abort_count(service):
    value = service.metrics.registry.get_sample_value(
        "jaxinfer:request_success_total",
        {"model_name": service.model_name, "finished_reason": "abort"})
    return value or 0.0


# ---------------------------------------------------------------------- Generate


def test_greedy_generate_matches_llm(stub, llm, client):
    token_prompt = client.tokenize("Lists and tuples")
    for prompt in [*PROMPTS, token_prompt]:
        expected = reference(llm, prompt, temperature=0.0, max_tokens=12)[0]
        chunks = list(stub.Generate(build_request(prompt, temperature=0.0, max_tokens=12),
                                    timeout=TIMEOUT))
        assert len(chunks) > 1  # streamed, not one message at the end
        text = "".join(delta.text for chunk in chunks for delta in chunk.outputs)
        token_ids = [token for chunk in chunks for delta in chunk.outputs
                     for token in delta.token_ids]
        assert (text, token_ids) == (expected.text, expected.token_ids)
        last = chunks[-1]
        assert last.finished and not any(chunk.finished for chunk in chunks[:-1])
        assert [delta.finish_reason for delta in last.outputs] == [expected.finish_reason]
        prompt_len = len(prompt) if not isinstance(prompt, str) else len(
            client.tokenize(prompt))
        assert (last.usage.prompt_tokens, last.usage.completion_tokens,
                last.usage.total_tokens) == (prompt_len, len(token_ids),
                                             prompt_len + len(token_ids))


def test_client_complete_and_request_id(client, llm):
    result = client.complete(PROMPTS[0], request_id="mine-1", temperature=0, max_tokens=8)
    expected = reference(llm, PROMPTS[0], temperature=0.0, max_tokens=8)[0]
    assert (result.request_id, result.text, result.token_ids[0]) == (
        "mine-1", expected.text, expected.token_ids)
    assert result.finish_reasons == ["length"] and result.completion_tokens == 8
    assert client.complete(PROMPTS[0], max_tokens=2).request_id.startswith("grpc-")


def test_logprobs_samples_and_stop(client, stub):
    chunks = list(stub.Generate(build_request(PROMPTS[0], temperature=0, max_tokens=6,
                                              logprobs=2, prompt_logprobs=1),
                                timeout=TIMEOUT))
    deltas = [delta for chunk in chunks for delta in chunk.outputs]
    for delta in deltas:
        assert len(delta.logprobs) == len(delta.token_ids)
        for token, position in zip(delta.token_ids, delta.logprobs):
            assert position.token_id == token and position.logprob <= 0
            assert len(position.top_logprobs) == 2
            # Greedy: the chosen token is the most likely one.
            assert position.top_logprobs[0].token_id == token
            assert position.top_logprobs[0].logprob >= position.top_logprobs[1].logprob
    prompt_ids = client.tokenize(PROMPTS[0])
    prompt_logprobs = [position for chunk in chunks for position in chunk.prompt_logprobs]
    assert [position.token_id for position in prompt_logprobs] == prompt_ids[1:]

    sampled = client.complete(PROMPTS[1], n=2, temperature=1.0, seed=7, max_tokens=5)
    assert len(sampled.texts) == 2 and sampled.completion_tokens == 10
    assert sampled.finish_reasons == ["length", "length"]

    greedy = client.complete(PROMPTS[0], temperature=0, max_tokens=12).text
    stop = greedy[3:6]
    stopped = list(stub.Generate(build_request(PROMPTS[0], temperature=0, max_tokens=12,
                                               stop=[stop]), timeout=TIMEOUT))
    last = stopped[-1].outputs[-1]
    assert (last.finish_reason, last.stop_str) == ("stop", stop)
    assert "".join(d.text for c in stopped for d in c.outputs) == greedy[:greedy.find(stop)]


# ---------------------------------------------------------------------- the other RPCs


def test_tokenize_detokenize_model_info(client, server):
    ids = client.tokenize("Hello world")
    assert ids[0] == 1 and client.tokenize("Hello world", add_special_tokens=False) == ids[1:]
    assert client.detokenize(ids) == "Hello world"
    info = client.model_info()
    service = server.server.service
    assert (info.name, info.max_model_len, info.vocab_size) == (
        "demo", service.max_model_len, service.vocab_size)
    assert list(info.eos_token_ids) == [2] and info.bos_token_id == 1 and info.has_tokenizer
    with pytest.raises(grpc.RpcError) as error:
        client.detokenize([1, 10**6])
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "token_ids" in error.value.details()


def test_health_and_reflection(channel, client):
    health = health_pb2_grpc.HealthStub(channel)
    for name in ("", "jaxinfer.v1.Inference", "jetstream_proto.Orchestrator"):
        response = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=TIMEOUT)
        assert response.status == health_pb2.HealthCheckResponse.SERVING
    assert client.health()
    watch = health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=TIMEOUT)
    assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
    watch.cancel()
    assert js_grpc.OrchestratorStub(channel).HealthCheck(js.HealthCheckRequest(),
                                                         timeout=TIMEOUT).is_live

    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    responses = reflection.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=TIMEOUT)
    names = {service.name for response in responses
             for service in response.list_services_response.service}
    assert names >= {"jaxinfer.v1.Inference", "jetstream_proto.Orchestrator",
                     "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}


# ---------------------------------------------------------------------- JetStream


def decode(channel, **fields):
    responses = list(js_grpc.OrchestratorStub(channel).Decode(js.DecodeRequest(**fields),
                                                              timeout=TIMEOUT))
    assert responses[0].WhichOneof("content") == "initial_content"
    assert all(r.WhichOneof("content") == "stream_content" for r in responses[1:])
    return responses[1:]


def test_jetstream_decode_matches_generate(channel, client):
    generated = client.complete(PROMPTS[1], temperature=0, max_tokens=10)
    responses = decode(channel, text_content=js.DecodeRequest.TextContent(text=PROMPTS[1]),
                       max_tokens=10)
    assert all(len(r.stream_content.samples) == 1 for r in responses)
    samples = [r.stream_content.samples[0] for r in responses]
    assert "".join(sample.text for sample in samples) == generated.text
    assert [t for sample in samples for t in sample.token_ids] == generated.token_ids[0]

    ids = client.tokenize(PROMPTS[1])
    responses = decode(channel, token_content=js.DecodeRequest.TokenContent(token_ids=ids),
                       max_tokens=10, num_samples=2)
    for index in range(2):
        assert "".join(r.stream_content.samples[index].text
                       for r in responses) == generated.text

    # has_bos: the text already carries its BOS, so none is added (the same prompt ids).
    responses = decode(channel, text_content=js.DecodeRequest.TextContent(
        text="<s>" + PROMPTS[1]), max_tokens=10, has_bos=True)
    assert "".join(r.stream_content.samples[0].text for r in responses) == generated.text

    with pytest.raises(grpc.RpcError) as error:
        decode(channel, text_content=js.DecodeRequest.TextContent(text="x"), max_tokens=4,
               lora_adapter_id="adapter")
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "lora_adapter_id" in error.value.details()


# ---------------------------------------------------------------------- bad input


def test_invalid_inputs_name_the_field_and_disturb_nothing(stub, llm):
    background = {}

    def run_background():
        background["chunks"] = list(stub.Generate(
            build_request(PROMPTS[0], temperature=0, max_tokens=64),
            timeout=TIMEOUT))

    thread = threading.Thread(target=run_background)
    thread.start()
    too_long = [5] * 300  # the context is 256 tokens
    cases = [
        (pb.GenerateRequest(text=""), "text"),
        (pb.GenerateRequest(), "prompt"),
        (build_request([]), "token_ids"),
        (build_request(too_long), "token_ids"),
        (build_request("Hi", max_tokens=0), "max_tokens"),
        (build_request("Hi", max_tokens=1000), "max_tokens"),
        (build_request("Hi", temperature=-1.0), "temperature"),
        (build_request("Hi", top_p=0.0), "top_p"),
        (build_request("Hi", top_p=1.5), "top_p"),
        (build_request([5, 999_999]), "token_ids"),
        (build_request("Hi", stop_token_ids=[10**6]), "stop_token_ids"),
        (build_request("Hi", logprobs=99), "logprobs"),
        (build_request("Hi", request_id="a#1"), "request_id"),
    ]
    for request, field in cases:
        with pytest.raises(grpc.RpcError) as error:
            list(stub.Generate(request, timeout=TIMEOUT))
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, error.value)
        assert error.value.details().startswith(field), (field, error.value.details())
    thread.join(TIMEOUT)
    tokens = [t for chunk in background["chunks"] for d in chunk.outputs for t in d.token_ids]
    assert tokens == reference(llm, PROMPTS[0], temperature=0.0, max_tokens=64)[0].token_ids


# ---------------------------------------------------------------------- cancellation


def test_cancel_mid_stream_frees_pages(stub, server):
    service = server.server.service
    aborted = abort_count(service)
    call = stub.Generate(build_request(PROMPTS[0], request_id="long", temperature=0,
                                       max_tokens=200, ignore_eos=True), timeout=TIMEOUT)
    next(call)
    next(call)
    # While it runs, its id is taken.
    with pytest.raises(grpc.RpcError) as error:
        list(stub.Generate(build_request("Hi", request_id="long", max_tokens=2),
                           timeout=TIMEOUT))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.details().startswith("request_id")
    call.cancel()
    wait_until(lambda: pool_is_full(service))
    wait_until(lambda: abort_count(service) > aborted)


def test_client_ids_never_collide_with_server_ids(stub, llm, server):
    long = dict(temperature=0.0, max_tokens=200, ignore_eos=True)
    ours = stub.Generate(build_request(PROMPTS[0], **long), timeout=TIMEOUT)
    first = next(ours)
    server_id = first.request_id  # grpc-N, made by the server
    assert server_id.startswith("grpc-")
    # While the server's grpc-N runs, a client names its own request grpc-N: no collision,
    # and each stream carries only its own tokens, under the id its client knows.
    theirs = list(stub.Generate(build_request(PROMPTS[1], request_id=server_id,
                                              temperature=0, max_tokens=8), timeout=TIMEOUT))
    rest = list(ours)
    assert not first.finished and len(rest) > 1  # it was running all along
    assert {chunk.request_id for chunk in theirs} == {server_id}
    assert [t for c in theirs for d in c.outputs for t in d.token_ids] == reference(
        llm, PROMPTS[1], temperature=0.0, max_tokens=8)[0].token_ids
    assert [t for c in [first, *rest] for d in c.outputs for t in d.token_ids] == reference(
        llm, PROMPTS[0], **long)[0].token_ids
    wait_until(lambda: pool_is_full(server.server.service))


def test_deadline_aborts_the_request(stub, server):
    service = server.server.service
    aborted = abort_count(service)
    with pytest.raises(grpc.RpcError) as error:
        list(stub.Generate(build_request(PROMPTS[1], temperature=0, max_tokens=230,
                                         ignore_eos=True), timeout=0.5))
    assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(lambda: pool_is_full(service))
    wait_until(lambda: abort_count(service) > aborted)


# ---------------------------------------------------------------------- key and overload


@pytest.fixture(scope="module")
def guarded():
    """A second server: API key "k" and a waiting queue of one request."""
    with BackgroundServer(make_service(api_key="k", max_queued_requests=1),
                          http=False) as running:
        yield running


def test_api_key(guarded):
    target = f"127.0.0.1:{guarded.grpc_port}"
    for api_key in (None, "wrong"):
        with InferenceClient(target, api_key=api_key) as anonymous:
            for call in (lambda c: c.complete("Hi", max_tokens=2), lambda c: c.model_info(),
                         lambda c: c.tokenize("Hi")):
                with pytest.raises(grpc.RpcError) as error:
                    call(anonymous)
                assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert anonymous.health()  # health checks stay open
    with grpc.insecure_channel(target) as channel, pytest.raises(grpc.RpcError) as error:
        decode(channel, text_content=js.DecodeRequest.TextContent(text="Hi"), max_tokens=2)
    assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with InferenceClient(target, api_key="k") as keyed:
        assert keyed.complete("Hi", temperature=0, max_tokens=4).completion_tokens == 4


def test_overload_is_resource_exhausted(guarded):
    target = f"127.0.0.1:{guarded.grpc_port}"
    codes = []
    with InferenceClient(target, api_key="k") as keyed:
        for _ in range(3):  # a burst normally suffices; retried in case one slips through
            start = threading.Barrier(8)

            def one(index, start=start):
                start.wait()
                try:
                    result = keyed.complete(f"Request {index}", temperature=0, max_tokens=8)
                except grpc.RpcError as error:
                    return error.code()
                assert result.completion_tokens == 8
                return grpc.StatusCode.OK

            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                codes = list(pool.map(one, range(8)))
            if grpc.StatusCode.RESOURCE_EXHAUSTED in codes:
                break
    assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes and grpc.StatusCode.OK in codes
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}
    wait_until(lambda: pool_is_full(guarded.server.service))


def test_dead_engine_is_unavailable_and_not_serving():
    with BackgroundServer(make_service(), http=False) as running:
        running.server.service.engine.shutdown()
        target = f"127.0.0.1:{running.grpc_port}"
        with InferenceClient(target) as dead, grpc.insecure_channel(target) as channel:
            assert not dead.health()
            status = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="jaxinfer.v1.Inference"),
                timeout=TIMEOUT).status
            assert status == health_pb2.HealthCheckResponse.NOT_SERVING
            assert not js_grpc.OrchestratorStub(channel).HealthCheck(
                js.HealthCheckRequest(), timeout=TIMEOUT).is_live
            with pytest.raises(grpc.RpcError) as error:
                dead.complete("Hi", max_tokens=2)
            assert error.value.code() == grpc.StatusCode.UNAVAILABLE
