"""Per-step cost of sending a step's host inputs from the leader to the followers.

    python benchmarks/step_channel.py [--steps 300]

Starts two local processes (4 CPU devices each) joined by jax.distributed and times, per
step, leader -> follower delivery of a ~10 KB payload (12 int32/float32/bool arrays, the size
of a packed decode step of 256 tokens and 16 sequences) followed by a tiny jitted psum over
all 8 devices, which keeps the processes in lockstep as a real step would. Printed per
method: milliseconds per step, and over the psum-only loop. Methods:

* tcp: `jaxinfer.multihost.StepChannel`.
* kv: the coordination service's key-value store (leader sets a step-numbered key, the
  follower blocks on it and deletes it).
* broadcast: `jax.experimental.multihost_utils.broadcast_one_to_all` on arrays whose shapes
  the follower already knows (a psum over the devices); its first call's compilation is
  printed apart.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time

import numpy as np


def payload(step: int) -> dict[str, np.ndarray]:
    """A decode step's packed inputs, ~10 KB: [T] = 384 tokens, [Q] = 32 sequences, and a
    send time stamp (monotonic ns mod 2^31; the clock is the same for all local processes)."""
    tokens, seqs, pages = 384, 32, 32
    rng = np.random.default_rng(step)
    ints = {name: rng.integers(0, 1000, tokens, dtype=np.int32)
            for name in ("token_ids", "positions", "slots", "next_token_ids")}
    ints.update({name: rng.integers(0, 1000, seqs, dtype=np.int32)
                 for name in ("kv_lens", "last", "output_index")})
    ints["cu_q_lens"] = np.arange(seqs + 1, dtype=np.int32)
    ints["page_indices"] = rng.integers(0, 1000, (seqs, pages), dtype=np.int32)
    ints["temperature"] = rng.random(seqs, dtype=np.float32)
    ints["top_p"] = rng.random(seqs, dtype=np.float32)
    ints["want_logprobs"] = rng.random(seqs) < 0.5
    ints["sent"] = np.zeros(1, np.int32)
    return ints


def stamp(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """`arrays` with the send time stamped in."""
    arrays["sent"] = np.asarray([time.monotonic_ns() % 2**31], np.int32)
    return arrays


def delay_ms(arrays: dict[str, np.ndarray]) -> float:
    """Milliseconds since `arrays` was stamped."""
    return ((time.monotonic_ns() - int(arrays["sent"][0])) % 2**31) / 1e6


def worker(process_id: int, port: int, steps: int) -> None:
    """One process of the benchmark; process 0 prints the table."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxinfer.distributed import DistributedConfig, initialize
    from jaxinfer.multihost import StepChannel, _kv_client
    from jaxinfer.sharding import make_mesh

    initialize(DistributedConfig(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                                 process_id=process_id, heartbeat_timeout_seconds=10))
    leader = process_id == 0
    mesh = make_mesh((1, 8))
    ones = jax.make_array_from_callback((8,), NamedSharding(mesh, P("model")),
                                        lambda index: np.ones(8, np.float32)[index])
    total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))
    total(ones).block_until_ready()
    channel = StepChannel.connect()
    client = _kv_client()
    example = payload(0)
    size = sum(array.nbytes for array in example.values())

    delays: list[float] = []

    def check(step: int, got: dict[str, np.ndarray]) -> None:
        delays.append(delay_ms(got))
        if step % 50 == 0:
            want = payload(step)
            assert all(np.array_equal(got[name], want[name]) for name in want
                       if name != "sent"), step

    def none(step: int) -> None:
        del step

    def tcp(step: int) -> None:
        _, got = channel.broadcast_step("step", stamp(payload(step)) if leader else None)
        if not leader:
            check(step, got)

    def kv(step: int) -> None:
        key = f"bench/{step}"
        if leader:
            client.key_value_set_bytes(
                key, b"".join(a.tobytes() for a in stamp(payload(step)).values()))
        else:
            data = client.blocking_key_value_get_bytes(key, 60_000)
            client.key_value_delete(key)
            offset, got = 0, {}
            for name, array in example.items():
                got[name] = np.frombuffer(data, array.dtype, array.size, offset).reshape(
                    array.shape)
                offset += array.nbytes
            check(step, got)

    def broadcast(step: int) -> None:
        got = multihost_utils.broadcast_one_to_all(stamp(payload(step)) if leader else example)
        if not leader:
            check(step, got)

    started = time.perf_counter()
    broadcast(0)
    first_broadcast = time.perf_counter() - started
    rows = {}
    for name, method in (("none", none), ("tcp", tcp), ("kv", kv), ("broadcast", broadcast)):
        for step in range(1, 11):  # warm up
            method(step)
            total(ones).block_until_ready()
        multihost_utils.sync_global_devices(name)
        delays.clear()
        started = time.perf_counter()
        for step in range(steps):
            method(step)
            total(ones).block_until_ready()
        elapsed = (time.perf_counter() - started) / steps * 1000
        latency = np.percentile(delays, [50, 90]) if delays else np.zeros(2)
        rows[name] = np.array(multihost_utils.process_allgather(
            np.asarray([elapsed, *latency], np.float32))[1 - process_id])
        rows[name][0] = elapsed
    channel.close()
    if leader:
        print(f"payload {size} bytes in {len(example)} arrays, {steps} steps, 2 processes")
        print("| method | ms / step | ms over psum only | delivery ms, median | p90 |")
        print("|---|---:|---:|---:|---:|")
        for name, (ms, median, p90) in rows.items():
            if name != "none":
                print(f"| {name} | {ms:.3f} | {ms - rows['none'][0]:.3f} | {median:.3f} | "
                      f"{p90:.3f} |")
        print(f"psum-only step: {rows['none'][0]:.3f} ms")
        print(f"broadcast_one_to_all's first call (compiles): {first_broadcast * 1000:.0f} ms")


def main() -> None:
    """Starts both processes (or, with --process-id, runs one)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--process-id", type=int, default=None)
    parser.add_argument("--port", type=int, default=None)
    args = parser.parse_args()
    if args.process_id is not None:
        worker(args.process_id, args.port, args.steps)
        return
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=4")
    command = [sys.executable, __file__, "--steps", str(args.steps), "--port", str(port)]
    processes = [subprocess.Popen([*command, "--process-id", str(i)], env=env)
                 for i in range(2)]
    codes = [process.wait() for process in processes]
    if any(codes):
        raise SystemExit(f"exit statuses {codes}")


if __name__ == "__main__":
    main()
