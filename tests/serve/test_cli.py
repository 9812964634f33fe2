"""`jaxinfer serve` as a user runs it (a subprocess on loopback ports) and `jaxinfer bench serve`
against it: ready only after warm-up, both benchmark backends complete every request, and
SIGTERM with a request in flight exits 0 within the grace period. The access options (the
API key's sources, allowed hosts and origins) reach the service's config."""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import pytest

from jaxinfer.cli import build_parser
from jaxinfer.cli import main as jaxinfer_main
from serve.cli import service_config_from_args
from serve.launcher import ServerProcess


@pytest.fixture(scope="module")
def served():
    server = ServerProcess("builtin:demo", "--max-num-seqs", "4", "--max-num-batched-tokens",
                           "64", "--max-model-len", "128", "--no-prompt-logprobs",
                           "--grace-period", "3", ready_timeout_s=600, capture_output=True)
    with server:
        yield server


@pytest.mark.parametrize("backend", ["openai", "grpc"])
def test_bench_serve_completes_every_request(served, backend, tmp_path):
    port = served.http_port if backend == "openai" else served.grpc_port
    report = tmp_path / "serve.json"
    code = jaxinfer_main(["bench", "serve", "--backend", backend, "--port", str(port),
                          "--num-prompts", "6", "--random-input-len", "12",
                          "--random-output-len", "5", "--request-rate", "20", "inf",
                          "--max-concurrency", "4", "--output-json", str(report)])
    assert code == 0
    runs = json.loads(report.read_text())["runs"]
    assert [run["request_rate"] for run in runs] == [20.0, float("inf")]
    for run in runs:
        assert run["completed"] == 6 and run["failed"] == 0
        assert run["prompt_tokens"] == 6 * 12 and run["output_tokens"] == 6 * 5
        assert 0 < run["ttft_ms"]["p50"] <= run["e2el_ms"]["p50"]


def test_sigterm_stops_within_the_grace_period(served):
    http_port = served.http_port
    body = json.dumps({"model": "builtin:demo", "prompt": "The list type", "max_tokens": 100,
                       "temperature": 0, "ignore_eos": True, "stream": True}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{http_port}/v1/completions", body,
                                     {"content-type": "application/json"})
    received: list[bytes] = []

    def stream() -> None:
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                received.extend(response)
        except OSError:
            received.append(b"<connection closed>")

    client = threading.Thread(target=stream)
    client.start()
    time.sleep(1.0)  # the request is admitted and streaming
    assert served.stop(timeout_s=60) == 0  # SIGTERM
    client.join(timeout=30)
    assert received  # the in-flight request got an answer (finished, or ended by the stop)
    assert "stopping" in served.output


def _serve_args(*options: str):
    return build_parser().parse_args(["serve", "--model", "builtin:demo", *options])


def test_access_options_reach_the_service_config(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    config = service_config_from_args(_serve_args(
        "--api-key-file", str(key_file), "--allowed-hosts", "api.example, localhost",
        "--allowed-origins", "https://app.example"), environ={"JAXINFER_API_KEY": "env"})
    assert config.api_key == "from-file"
    assert config.allowed_hosts == ("api.example", "localhost")
    assert config.allowed_origins == ("https://app.example",)
    defaults = service_config_from_args(_serve_args(), environ={"VLLM_API_KEY": "vllm"})
    assert defaults.api_key == "vllm"
    assert defaults.allowed_hosts is None and defaults.allowed_origins == ()
    assert service_config_from_args(_serve_args(), environ={}).api_key is None


def test_conflicting_key_options_fail_before_the_model_loads(tmp_path, capsys):
    key_file = tmp_path / "key"
    key_file.write_text("k")
    # A model that does not exist: reaching the load would fail differently.
    code = jaxinfer_main(["serve", "--model", str(tmp_path / "no-model"), "--api-key", "k",
                          "--api-key-file", str(key_file)])
    assert code == 2
    assert "--api-key or --api-key-file, not both" in capsys.readouterr().err


def test_the_timeout_flags_reach_the_service_config():
    default = service_config_from_args(_serve_args(), environ={})
    assert (default.max_request_seconds, default.write_timeout_seconds) == (600.0, 30.0)
    given = service_config_from_args(_serve_args(
        "--max-request-seconds", "5", "--write-timeout-seconds", "0"), environ={})
    assert (given.max_request_seconds, given.write_timeout_seconds) == (5.0, None)
    with pytest.raises(ValueError, match="max_request_seconds"):
        service_config_from_args(_serve_args("--max-request-seconds", "-1"), environ={})
