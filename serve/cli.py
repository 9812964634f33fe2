"""`jaxinfer serve` and `jaxinfer bench serve`, added to the `jaxinfer` command.

    jaxinfer serve --model builtin:demo [--host 127.0.0.1] [--grpc-port 50051]
                   [--http-port 8000] [--api-key-file PATH] [--allowed-hosts H,...]
                   [--allowed-origins O,...] [--no-vllm-metrics]
                   [--enable-auto-tool-choice --tool-call-parser hermes|llama3_json|mistral]
                   [--exclude-tools-when-tool-choice-none] [engine options] [--config FILE]
    jaxinfer bench serve --backend openai|grpc --port 8000 [--request-rate 4]
                         [--num-prompts 64] [--max-concurrency 16]

jaxinfer never imports this package: the `jaxinfer.cli` entry point in pyproject.toml points
`jaxinfer.cli` at `register`. Only argparse is imported at registration, so `jaxinfer --help`
stays instant; the engine, grpc and aiohttp load when a command runs. `--config FILE` holds any
of `serve`'s options by dest name (`jaxinfer.cli.add_config_argument`); flags override it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from jaxinfer import distributed

if TYPE_CHECKING:
    from jaxinfer.multihost import StepChannel
    from serve.service import ServiceConfig


def _add_engine_options(parser: argparse.ArgumentParser) -> None:
    """Every EngineConfig option (vLLM's flag names) with the serving defaults, and --dtype."""
    from jaxinfer.engine.config import SERVING_DEFAULTS, add_engine_arguments

    add_engine_arguments(parser, SERVING_DEFAULTS)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                        help="parameter and compute dtype (default: the checkpoint's)")


def _tool_parser_names() -> list[str]:
    # The parsers module imports only the standard library, so --help stays instant.
    from serve.tool_parsers import TOOL_PARSERS

    return sorted(TOOL_PARSERS)


def register(subparsers: argparse._SubParsersAction,
             bench_subparsers: argparse._SubParsersAction) -> None:
    """Adds `serve` and `bench serve` to the jaxinfer command line."""
    from jaxinfer.cli import add_config_argument

    serve = subparsers.add_parser(
        "serve", help="serve a model over gRPC and an OpenAI-compatible HTTP API",
        description="Serve a model: gRPC (jaxinfer.v1.Inference, JetStream's Orchestrator, "
                    "health, reflection) and OpenAI-compatible HTTP (/v1/completions, "
                    "/v1/chat/completions, /v1/models, /health, /metrics).")
    serve.add_argument("--model", required=True,
                       help="HF directory, jaxinfer checkpoint, builtin:NAME or random:PRESET")
    serve.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the "
                                                         "model's)")
    serve.add_argument("--served-model-name", default=None,
                       help="the name clients use (default: --model)")
    serve.add_argument("--host", default="127.0.0.1",
                       help="interface to bind (default loopback; 0.0.0.0 exposes it)")
    serve.add_argument("--grpc-port", type=int, default=50051, help="gRPC port (0: free)")
    serve.add_argument("--http-port", type=int, default=8000, help="HTTP port (0: free)")
    serve.add_argument("--api-key", default=None,
                       help="require 'authorization: Bearer KEY' on every call (visible to "
                            "other users in ps: prefer --api-key-file or JAXINFER_API_KEY)")
    serve.add_argument("--api-key-file", default=None, metavar="PATH",
                       help="read the API key from this file; without either option the key "
                            "comes from JAXINFER_API_KEY (or VLLM_API_KEY), if set")
    serve.add_argument("--allowed-hosts", default=None, metavar="H1,H2",
                       help="HTTP Host names to answer (others get 403); default: localhost, "
                            "127.0.0.1 and [::1] when --host is loopback, any otherwise; "
                            "'*' any, '*.example.com' its subdomains")
    serve.add_argument("--allowed-origins", default=None, metavar="O1,O2",
                       help="browser origins (https://app.example) allowed to call the HTTP "
                            "API, with CORS; default none (requests carrying Origin get 403); "
                            "'*' any")
    serve.add_argument("--max-queued-requests", type=int, default=256,
                       help="waiting sequences (n per request) before new requests get 429 / "
                            "RESOURCE_EXHAUSTED")
    serve.add_argument("--chat-template", default=None,
                       help="jinja chat template (a file, or the source itself) for "
                            "/v1/chat/completions; default: the tokenizer's")
    serve.add_argument("--grace-period", type=float, default=10.0,
                       help="seconds a stop waits for in-flight requests")
    serve.add_argument("--max-request-seconds", type=float, default=600.0,
                       help="abort a request still running after this many seconds "
                            "(finish_reason 'abort'); 0: no limit")
    serve.add_argument("--write-timeout-seconds", type=float, default=30.0,
                       help="drop a streaming call (and abort its request) when one write "
                            "waits this long for a client that stopped reading; 0: no limit")
    serve.add_argument("--vllm-metrics", action=argparse.BooleanOptionalAction, default=True,
                       help="/metrics also exports vLLM's metric names (vllm:*, with vLLM's "
                            "labels) beside jaxinfer:*, so Grafana dashboards built for vLLM "
                            "work unchanged; --no-vllm-metrics exports jaxinfer:* only")
    serve.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='serve tool_choice "auto" in /v1/chat/completions: the model '
                            "calls tools when it decides to, found in its output by "
                            "--tool-call-parser (required with it)")
    serve.add_argument("--tool-call-parser", default=None, choices=_tool_parser_names(),
                       help="the model's tool-call format (vLLM's names): hermes (Hermes, "
                            "Qwen2.5, Qwen3), llama3_json (Llama 3.1-3.3), mistral")
    serve.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                       help='leave tools out of the prompt when tool_choice is "none" (by '
                            "default the template renders them, as vLLM does)")
    _add_engine_options(serve)
    distributed.add_arguments(serve)
    add_config_argument(serve)
    serve.set_defaults(handler=_run_serve)

    from serve.bench_serve import add_arguments

    bench = bench_subparsers.add_parser(
        "serve", help="load-test a running server (vLLM's serving benchmark)",
        description="Send requests to a running server at a Poisson/gamma rate (or all at "
                    "once), streaming, and report throughput, TTFT, TPOT, ITL and latency.")
    add_arguments(bench)
    bench.set_defaults(handler=_run_bench_serve)


def _run_serve(args: argparse.Namespace) -> int:
    from jaxinfer.cli import CommandError

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    # jax logs its backend probes at INFO ("Unable to initialize backend 'tpu'" on every
    # machine without libtpu): noise to a user; a backend that is wanted and fails still
    # raises, and JAX_PLATFORMS names the wanted one.
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
    try:
        # Before anything touches a device: a multi-host run joins jax.distributed first.
        distributed.initialize(distributed.config_from_args(args))
    except ValueError as error:
        raise CommandError(str(error)) from None
    import jax

    if jax.process_count() == 1:
        return _serve(args, channel=None)
    from jaxinfer.multihost import StepChannel

    with StepChannel.connect() as channel:
        code = _serve(args, channel=channel)
        if code != 0 and channel.is_leader:  # "stop" would let the followers exit 0
            channel.abort(f"the leader's server ended with status {code}")
        return code


def _serve(args: argparse.Namespace, channel: StepChannel | None) -> int:
    """Loads the engine; process 0 serves it, other processes follow its steps."""
    from jaxinfer.cli import CommandError
    from jaxinfer.engine.async_engine import AsyncEngine
    from jaxinfer.engine.config import engine_options_from_args
    from jaxinfer.engine.factory import load_engine
    from jaxinfer.engine.multihost_steps import LeaderEngine, follow
    from serve.server import Server, ServerAddress
    from serve.service import InferenceService

    options = engine_options_from_args(args)
    try:
        config = service_config_from_args(args)  # before the long load: a bad key file fails now
        # Process 0's runners send each step down the channel before running it.
        leader_end = channel if channel is not None and channel.is_leader else None
        engine = load_engine(args.model, tokenizer=args.tokenizer, dtype=args.dtype,
                             step_channel=leader_end, **options)
        if leader_end is not None:  # a failing step must end the followers too
            engine = LeaderEngine(engine, leader_end)
        if channel is not None and not channel.is_leader:
            import jax

            # A supervisor stopping the slice signals every process; process 0 then drains
            # its requests and closes the channel, which ends this one. Leaving now would cut
            # the steps still in flight short.
            for stop_signal in (signal.SIGTERM, signal.SIGINT):
                signal.signal(stop_signal, lambda number, frame: print(
                    f"jaxinfer: process {jax.process_index()} got signal {number}; it stops "
                    "when process 0 does", flush=True))
            print(f"jaxinfer: process {jax.process_index()} of {jax.process_count()} runs "
                  f"process 0's steps on its devices", flush=True)
            steps = follow(engine, channel)
            print(f"jaxinfer: process {jax.process_index()}: the leader stopped after "
                  f"{steps} steps", flush=True)
            return 0
        service = InferenceService(AsyncEngine(engine, warm_up=True), config)
    except (ValueError, FileNotFoundError) as error:
        raise CommandError(str(error)) from None
    print(f"jaxinfer: loaded {args.model}; compiling every step shape (warm-up)", flush=True)
    server = Server(service, ServerAddress(args.host, args.grpc_port, args.http_port),
                    grace_seconds=args.grace_period)
    try:
        return asyncio.run(server.run())
    except OSError as error:  # a port in use
        raise CommandError(f"cannot listen: {error}") from None


def service_config_from_args(args: argparse.Namespace,
                             environ: Mapping[str, str] | None = None) -> ServiceConfig:
    """The `ServiceConfig` of `jaxinfer serve`'s options (and the API key's environment).

    A timeout of 0 is no limit.

    Raises:
        ValueError: Conflicting or unreadable API key options, or a negative timeout.
        FileNotFoundError: A --chat-template path that is gone (is_file raced).
    """
    from serve.access import resolve_api_key, split_list
    from serve.service import ServiceConfig

    return ServiceConfig(
        model_name=args.served_model_name or args.model,
        max_queued_requests=args.max_queued_requests,
        api_key=resolve_api_key(args.api_key, args.api_key_file, environ),
        chat_template=_read_template(args.chat_template),
        allowed_hosts=split_list(args.allowed_hosts),
        allowed_origins=split_list(args.allowed_origins) or (),
        max_request_seconds=args.max_request_seconds or None,
        write_timeout_seconds=args.write_timeout_seconds or None,
        vllm_metrics=args.vllm_metrics,
        tool_call_parser=args.tool_call_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none)


def _read_template(value: str | None) -> str | None:
    """`--chat-template`: a file's contents, or the value itself when it is no file."""
    if value is None:
        return None
    path = Path(value)
    return path.read_text(encoding="utf-8") if path.is_file() else value


def _run_bench_serve(args: argparse.Namespace) -> int:
    from jaxinfer.cli import CommandError
    from serve.bench_serve import run_from_args

    try:
        return run_from_args(args)
    except (ValueError, OSError, ConnectionError) as error:
        raise CommandError(str(error)) from None


if __name__ == "__main__":
    from jaxinfer.cli import main

    sys.exit(main(["serve", *sys.argv[1:]]))
