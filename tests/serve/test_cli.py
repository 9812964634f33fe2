"""`jaxinfer serve` as a user runs it (a subprocess on loopback ports) and `jaxinfer bench serve`
against it: ready only after warm-up, both benchmark backends complete every request, and
SIGTERM with a request in flight exits 0 within the grace period. The access options (the
API key's sources, allowed hosts and origins) reach the service's config. Every `EngineConfig`
field is a `serve` flag and a `--config FILE` key, by the name `LLM(...)` takes, with the
dataclass's default and help; the file sets `serve`'s own options too, below the flags."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
import typing
import urllib.request

import pytest

from jaxinfer.cli import build_parser, command_parser, config_file_keys, parse_args
from jaxinfer.cli import main as jaxinfer_main
from jaxinfer.engine.config import (
    SERVING_DEFAULTS,
    EngineConfig,
    SpeculativeConfig,
    engine_option_names,
    engine_options_from_args,
)
from serve.cli import service_config_from_args
from serve.launcher import ServerProcess
from tests.jaxinfer.engine.test_config import CHANGED, toml_text


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    # Most options from a config file, as a deployment would; the flag beats the file's 16.
    config = tmp_path_factory.mktemp("serve") / "serve.toml"
    config.write_text("max_num_seqs = 16\nmax_num_batched_tokens = 64\nmax_model_len = 128\n"
                      "enable_prompt_logprobs = false\ngrace_period = 3\n")
    server = ServerProcess("builtin:demo", "--config", str(config), "--max-num-seqs", "4",
                           ready_timeout_s=600, capture_output=True)
    with server:
        yield server


def test_the_server_runs_with_its_config_file(served):
    with urllib.request.urlopen(f"http://127.0.0.1:{served.http_port}/v1/models",
                                timeout=30) as response:
        [model] = json.load(response)["data"]
    assert model["max_model_len"] == 128  # the file's (the demo model's own is 1024)


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


def test_the_tool_flags_reach_the_service_config():
    default = service_config_from_args(_serve_args(), environ={})
    assert (default.tool_call_parser, default.enable_auto_tool_choice,
            default.exclude_tools_when_tool_choice_none) == (None, False, False)
    given = service_config_from_args(_serve_args(
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
        "--exclude-tools-when-tool-choice-none"), environ={})
    assert (given.tool_call_parser, given.enable_auto_tool_choice,
            given.exclude_tools_when_tool_choice_none) == ("hermes", True, True)
    with pytest.raises(ValueError, match="--tool-call-parser"):
        service_config_from_args(_serve_args("--enable-auto-tool-choice"), environ={})
    with pytest.raises(SystemExit):  # not one of the parsers: argparse refuses it
        _serve_args("--tool-call-parser", "qwen")


# ---------------------------------------------------------------------- every option, --config


def _engine_fields():
    """(flat name, field) of every option of every `EngineConfig` part, found from the
    EngineConfig class itself (not the module's own list), so that a new part or a new field
    is here without anyone adding it; `speculative` is one option (its fields are the JSON's)."""
    hints = typing.get_type_hints(EngineConfig)
    for part in dataclasses.fields(EngineConfig):
        if part.name == "speculative":
            yield part.name, part
            continue
        yield from ((field.name, field) for field in dataclasses.fields(hints[part.name]))


def test_every_engine_config_field_is_a_serve_flag_and_a_config_key():
    names = [name for name, _ in _engine_fields()]
    assert {"max_n", "kv_cache_dtype", "speculative", "tensor_parallel_size"} <= set(names)
    assert sorted(names) == sorted(engine_option_names())  # what LLM(...) and from_options take
    serve = command_parser("serve")
    flags = serve._option_string_actions
    keys = config_file_keys("serve")
    for name, field in _engine_fields():
        action = flags["--" + name.replace("_", "-")]
        assert action.dest == name and name in keys
        if name == "speculative":
            assert action.default is None and "--speculative-config" in action.option_strings
            continue
        assert action.default == SERVING_DEFAULTS.get(name, field.default), name
        assert field.metadata["help"] in action.help, name


def test_a_config_file_sets_every_engine_option(tmp_path):
    # CHANGED moves every option off its default (test_config checks it covers them all).
    assert set(CHANGED) == {name for name, _ in _engine_fields()}
    assert set(CHANGED["speculative"]) == {
        field.name for field in dataclasses.fields(SpeculativeConfig)}
    path = tmp_path / "serve.toml"
    path.write_text('model = "builtin:demo"\n' + toml_text(CHANGED, tables=("speculative",)))
    args = parse_args(["serve", "--config", str(path)])
    assert EngineConfig.from_options(**engine_options_from_args(args)).options() == CHANGED


def test_a_config_file_sets_the_server_options_and_flags_win(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    path = tmp_path / "serve.yaml"
    path.write_text(f"""
model: builtin:demo
host: 0.0.0.0
http-port: 8080
grpc_port: 50052
api_key_file: {key_file}
allowed_origins: [https://a.example, https://b.example]
max_queued_requests: 32
max_request_seconds: 60
max_num_seqs: 64
enable_prefix_caching: false
speculative: {{method: ngram, num_tokens: 4}}
""")
    args = parse_args(["serve", "--max-num-seqs", "8", "--config", str(path), "--http-port",
                       "9000", "--enable-prefix-caching"])
    assert (args.model, args.host, args.http_port, args.grpc_port) == (
        "builtin:demo", "0.0.0.0", 9000, 50052)
    assert (args.max_num_seqs, args.enable_prefix_caching) == (8, True)  # flags, either side
    assert args.speculative == SpeculativeConfig(method="ngram", num_tokens=4)
    assert args.max_num_batched_tokens == SERVING_DEFAULTS["max_num_batched_tokens"]
    config = service_config_from_args(args, environ={})
    assert config.api_key == "from-file"
    assert config.allowed_origins == ("https://a.example", "https://b.example")
    assert (config.max_queued_requests, config.max_request_seconds) == (32, 60.0)


def test_the_model_may_come_from_the_file_and_is_still_required(tmp_path, capsys):
    path = tmp_path / "serve.toml"
    path.write_text("max_num_seqs = 4\n")
    with pytest.raises(SystemExit):
        parse_args(["serve", "--config", str(path)])
    assert "the following arguments are required: --model" in capsys.readouterr().err
    path.write_text("model = 'builtin:demo'\n")
    assert parse_args(["serve", "--config", str(path)]).model == "builtin:demo"
    assert parse_args(["serve", "--config", str(path), "--model", "x"]).model == "x"


@pytest.mark.parametrize(("text", "fragment"), [
    ("max_num_seq = 4", "unknown option 'max_num_seq' (did you mean 'max_num_seqs'?)"),
    ("handler = 'x'", "unknown option 'handler'"),  # a default the parser sets, no option
    ("config = 'other.toml'", "unknown option 'config'"),
    ("max_num_seqs = 'many'", "max_num_seqs = 'many': expected an integer"),
    ("max_num_seqs = 4.5", "max_num_seqs = 4.5: expected an integer"),
    ("max_num_seqs = true", "max_num_seqs = True: expected a value, not true/false"),
    ("grace_period = 'soon'", "grace_period = 'soon': expected a number"),
    ("enable_prefix_caching = 'no'", "enable_prefix_caching = 'no': expected true or false"),
    ("kv_cache_dtype = 'fp8'", "kv_cache_dtype = 'fp8': choose from 'int8'"),
    ("speculative = {method = 'medusa', num_tokens = 2}", "must be one of"),
])
def test_a_bad_key_or_value_fails_naming_it_and_the_file(tmp_path, capsys, text, fragment):
    path = tmp_path / "serve.toml"
    path.write_text(f"model = 'builtin:demo'\n{text}\n")
    with pytest.raises(SystemExit) as exited:  # an argparse error, like a bad flag's
        jaxinfer_main(["serve", "--config", str(path)])
    assert exited.value.code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"jaxinfer serve: error: config file {path}: " in err and fragment in err


def test_one_config_file_at_a_time(tmp_path, capsys):
    first, second = tmp_path / "a.toml", tmp_path / "b.toml"
    first.write_text("model = 'a'\n")
    second.write_text("model = 'b'\n")
    with pytest.raises(SystemExit):
        parse_args(["serve", "--config", str(first), "--config", str(second)])
    assert f"give one --config, not {first} and {second}" in capsys.readouterr().err
