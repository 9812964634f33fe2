"""`jaxinfer serve` across two processes joined by jax.distributed (4 CPU devices each, as two
hosts of a slice would be): process 0 serves and schedules, process 1 runs the same steps on
its devices; a client gets the single-process greedy tokens, and killing the other process
ends the server with a non-zero status within a bounded time."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from jaxinfer import LLM, SamplingParams
from serve.client import InferenceClient
from serve.launcher import ServerProcess, free_port

ENGINE = ("--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--max-model-len", "128",
          "--no-prompt-logprobs", "--min-token-bucket", "64", "--bucket-growth", "4")
PROMPTS = ([5, 17, 99, 3, 250, 7], list(range(10, 60)))
MAX_TOKENS = 8


def _two_host_environment() -> dict[str, str]:
    environment = dict(os.environ, JAX_PLATFORMS="cpu")
    # Each process is one "host" with 4 devices (the test session itself simulates 8).
    environment["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    return environment


def test_two_processes_serve_like_one_and_a_lost_process_ends_the_server():
    coordinator = f"127.0.0.1:{free_port()}"
    # TP=2 x DP=2: each replica takes one device of each process, so both take part in
    # every step; the tiny model's 2 KV heads split over the two processes.
    multihost = ("--tensor-parallel-size", "2", "--data-parallel-size", "2",
                 "--coordinator-address", coordinator, "--num-processes", "2",
                 "--heartbeat-timeout", "10", *ENGINE)
    environment = _two_host_environment()
    follower = subprocess.Popen(
        [sys.executable, "-m", "jaxinfer.cli", "serve", "--model", "random:tiny",
         "--grpc-port", "0", "--http-port", "0", *multihost, "--process-id", "1"],
        env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    leader = ServerProcess("random:tiny", *multihost, "--process-id", "0", env=environment,
                           capture_output=True, ready_timeout_s=600)
    try:
        leader.start()
        client = InferenceClient(f"127.0.0.1:{leader.grpc_port}")
        served = [client.complete(prompt, max_tokens=MAX_TOKENS, temperature=0.0,
                                  ignore_eos=True).token_ids[0] for prompt in PROMPTS]
        # A stop signal to a follower alone does not end it (process 0 decides when the
        # slice stops), so the server keeps answering.
        follower.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        assert follower.poll() is None
        again = client.complete(PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0.0,
                                ignore_eos=True).token_ids[0]
        client.close()

        follower.kill()
        killed = time.monotonic()
        code = leader.process.wait(timeout=90)
        waited = time.monotonic() - killed
    finally:
        leader.stop(timeout_s=30)
        if follower.poll() is None:
            follower.kill()
        follower_output = follower.communicate()[0]
    assert code != 0, leader.output
    assert waited < 60
    assert "process 1" in leader.output, leader.output  # the message names the lost process
    assert "runs process 0's steps" in follower_output, follower_output
    assert "stops when process 0 does" in follower_output, follower_output

    # The same requests on one device, in this process.
    single = LLM("random:tiny", max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128,
                 enable_prompt_logprobs=False, bucket_growth=4)
    expected = single.generate([{"prompt_token_ids": list(prompt)} for prompt in PROMPTS],
                               SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                              ignore_eos=True))
    assert served == [output.outputs[0].token_ids for output in expected]
    assert again == served[0]


def test_serve_rejects_layouts_and_partial_multihost_settings_at_start(capsys):
    from jaxinfer.cli import main as jaxinfer_main

    ports = ["--grpc-port", "0", "--http-port", "0"]
    assert jaxinfer_main(["serve", "--model", "random:tiny", "--tensor-parallel-size", "4",
                          *ports]) == 2
    assert "tensor_parallel_size = 4 does not divide" in capsys.readouterr().err
    assert jaxinfer_main(["serve", "--model", "random:tiny", "--tensor-parallel-size", "2",
                          "--data-parallel-size", "8", *ports]) == 2
    assert "16 devices, but only 8" in capsys.readouterr().err
    assert jaxinfer_main(["serve", "--model", "random:tiny", "--coordinator-address",
                          "127.0.0.1:1234", *ports]) == 2
    assert "all-or-nothing" in capsys.readouterr().err
