"""One process of a two-process jax.distributed run, for tests/jaxinfer/test_distributed.py and
test_multihost.py (4 CPU devices per process, 8 global).

    python tests/jaxinfer/multihost_worker.py SCENARIO --process-id I --port P

Scenarios:
    compute  sharded matmuls and a tensor-parallel model over the 8 global devices, with
             step messages of changing shapes from process 0; prints one JSON line of
             results per process and closes the channel cleanly.
    serve    a step loop that runs until killed: process 0 sends a step every 20 ms, every
             process runs a cross-process psum on it. Prints "serving" once steps flow.
    idle     joins without a step channel and sleeps until killed (jax's own detection).
    raise    like serve, but process 0 raises an uncaught exception after a few steps.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxinfer.config import ModelConfig
from jaxinfer.distributed import DistributedConfig, initialize
from jaxinfer.models import create_model
from jaxinfer.models.attention import PagedBatch
from jaxinfer.multihost import StepChannel
from jaxinfer.sharding import activate, make_mesh

# Every split dimension divides by 8 (as in test_sharding.py).
TINY = ModelConfig(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
                   num_layers=2, num_heads=16, num_kv_heads=8, head_dim=8,
                   max_position_embeddings=128)
SEED = 1  # its greedy continuation of PROMPT varies from token to token
PROMPT = (5, 17, 42, 7, 99, 3)
NEW_TOKENS = 6
LENGTH = 16  # the padded sequence every greedy step runs on


def greedy_step_fn(model: nnx.Module, mesh):
    """A jitted step: the logits [V] after the first `length` of `token_ids` [1, L],
    replicated, so that every process (the leader above all) can read them."""
    graphdef, state = nnx.split(model)

    @functools.partial(jax.jit, out_shardings=None if mesh is None else NamedSharding(mesh, P()))
    def step(state: nnx.State, token_ids: jax.Array, length: jax.Array) -> jax.Array:
        logits, _ = nnx.merge(graphdef, state)(token_ids)  # [1, L, V]; causal: padding after
        return logits[0, length - 1]  # [V]

    return lambda token_ids, length: step(state, token_ids, length)


def greedy_tokens(model: nnx.Module, mesh, channel: StepChannel | None
                  ) -> tuple[list[int], np.ndarray]:
    """Greedy decoding of PROMPT: the new tokens and each step's logits [NEW_TOKENS, V].

    With a channel, process 0 sends each step's inputs and every process uses what it got.
    """
    step = greedy_step_fn(model, mesh)
    tokens, rows = list(PROMPT), []
    with activate(mesh):
        while len(tokens) < len(PROMPT) + NEW_TOKENS:
            token_ids = np.zeros((1, LENGTH), np.int32)  # [1, L]
            token_ids[0, :len(tokens)] = tokens
            if channel is not None:
                _, (token_ids, length) = channel.broadcast_step(
                    "greedy", (token_ids, len(tokens)))
            else:
                length = len(tokens)
            rows.append(np.asarray(step(token_ids, np.int32(length))))
            tokens.append(int(rows[-1].argmax()))
    return tokens[len(PROMPT):], np.stack(rows)


def compute(process_id: int) -> dict:
    """Global devices, sharded matmuls, payload round trips and the tiny model's greedy tokens."""
    results: dict = {"devices": jax.device_count(), "local_devices": jax.local_device_count(),
                     "processes": jax.process_count(), "index": jax.process_index()}
    x = np.arange(8 * 32, dtype=np.float32).reshape(8, 32) / 100  # [8, 32]
    w = np.cos(np.arange(32 * 16, dtype=np.float32)).reshape(32, 16)  # [32, 16]
    for shape in ((2, 4), (1, 8)):
        mesh = make_mesh(shape)
        # The contraction dimension is split over 'model', which spans both processes on
        # the (1, 8) mesh, so the result needs a cross-process all-reduce.
        x_global = jax.make_array_from_callback(
            x.shape, NamedSharding(mesh, P("data", "model")), lambda index: x[index])
        w_global = jax.device_put(w, NamedSharding(mesh, P("model", None)))
        product = jax.jit(jnp.matmul, out_shardings=NamedSharding(mesh, P()))(x_global, w_global)
        results[f"matmul_{shape[0]}x{shape[1]}_error"] = float(
            np.abs(np.asarray(product) - x @ w).max())
        rows = jax.make_array_from_process_local_data(
            NamedSharding(mesh, P(("data", "model"))), np.full(4, process_id + 1, np.int32),
            (8,))
        results[f"local_data_sum_{shape[0]}x{shape[1]}"] = int(
            jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(rows))

    mesh = make_mesh((1, 8))
    weights = jax.device_put(w, NamedSharding(mesh, P("model", None)))  # [32, 16]
    project = jax.jit(lambda tokens, table: table[tokens % 32].sum(0),
                      out_shardings=NamedSharding(mesh, P()))
    with StepChannel.connect(timeout_s=30) as channel:
        received = []
        for size in (3, 50, 7, 1000):  # a new shape every step
            rng = np.random.default_rng(size)
            sent = ("step" if size % 2 else "prompt_step", {
                "token_ids": rng.integers(0, 256, size, dtype=np.int32),  # [T]
                "batch": PagedBatch(np.arange(size, dtype=np.int32), np.ones(2, np.int32),
                                    np.zeros((2, 4), np.int32), np.array([0, 1, size], np.int32),
                                    np.array([2], np.int32)),
                "temperature": rng.random(2, dtype=np.float32),  # [S]
                "mask": rng.random((2, 3)) < 0.5,  # [S, 3]
                "draft_probs": None, "note": "x" * size, "count": size})
            kind, payload = channel.broadcast_step(*sent)
            # Every process feeds its (host numpy) copy into the same jitted program.
            received.append({
                "kind": kind, "count": payload["count"], "note": len(payload["note"]),
                "batch_type": type(payload["batch"]).__name__,
                "checksum": float(sum(np.asarray(leaf, np.float64).sum() for leaf in
                                      jax.tree.leaves(payload) if isinstance(leaf, np.ndarray))),
                "projected": np.asarray(project(payload["token_ids"], weights)).tolist(),
                "expected": w[payload["token_ids"] % 32].sum(0).tolist()})
        results["received"] = received
        tokens, logits = greedy_tokens(create_model(TINY, seed=SEED, mesh=mesh), mesh, channel)
        results["greedy"], results["greedy_logits"] = tokens, logits.tolist()
    return results


def serve(process_id: int, fail_after: int | None = None) -> None:
    """Steps every 20 ms until killed (or, on process 0, until step `fail_after` raises)."""
    mesh = make_mesh((1, 8))
    ones = jax.device_put(np.ones(8, np.float32), NamedSharding(mesh, P("model")))
    total = jax.jit(lambda x, tokens: x.sum() + tokens.sum(),
                    out_shardings=NamedSharding(mesh, P()))
    with StepChannel.connect(timeout_s=30) as channel:
        for step in range(10**9):
            if fail_after is not None and process_id == 0 and step == fail_after:
                raise RuntimeError(f"scheduler bug at step {step}")
            _, tokens = channel.broadcast_step("step", np.arange(step % 7 + 1, dtype=np.int32))
            total(ones, tokens).block_until_ready()
            if step == 5:
                print("serving", flush=True)
            time.sleep(0.02)


def start(scenario: str, directory: pathlib.Path, heartbeat_timeout: int = 5
          ) -> list[subprocess.Popen]:
    """Starts both processes of `scenario` (for the tests); process i writes its stdout and
    stderr to `directory`/i.out and i.err."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    root = pathlib.Path(__file__).resolve().parents[2]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(root),
               XLA_FLAGS="--xla_force_host_platform_device_count=4")  # not conftest's 8
    processes = []
    for process_id in range(2):
        with (open(directory / f"{process_id}.out", "w") as out,
              open(directory / f"{process_id}.err", "w") as err):
            processes.append(subprocess.Popen(
                [sys.executable, __file__, scenario, "--process-id", str(process_id),
                 "--port", str(port), "--heartbeat-timeout", str(heartbeat_timeout)],
                stdout=out, stderr=err, env=env, cwd=root))
    return processes


def main() -> None:
    """Joins the run and plays one scenario."""
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=("compute", "serve", "idle", "raise"))
    parser.add_argument("--process-id", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--heartbeat-timeout", type=int, default=5)
    args = parser.parse_args()
    assert "device_count=4" in os.environ.get("XLA_FLAGS", ""), os.environ.get("XLA_FLAGS")
    initialize(DistributedConfig(
        coordinator_address=f"127.0.0.1:{args.port}", num_processes=2,
        process_id=args.process_id, initialization_timeout=60,
        heartbeat_timeout_seconds=args.heartbeat_timeout))
    if args.scenario == "compute":
        print(json.dumps(compute(args.process_id)), flush=True)
    elif args.scenario == "serve":
        serve(args.process_id)
    elif args.scenario == "raise":
        serve(args.process_id, fail_after=60)
    else:
        multihost_utils.sync_global_devices("joined")
        print("serving", flush=True)
        while True:
            time.sleep(1)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
