"""jaxinfer.multihost: step payloads survive the wire; a dead or failing process ends the run.

The process tests start two local processes (tests/jaxinfer/multihost_worker.py, 4 CPU devices
each, 5 s heartbeat timeout), wait until steps flow, then SIGKILL one and time how long the
other takes to exit.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import signal
import subprocess
import time

import numpy as np
import pytest

from jaxinfer.models.attention import PagedBatch
from jaxinfer.multihost import (
    EXIT_PEER_LOST,
    EXIT_UNCAUGHT,
    ChannelError,
    StepChannel,
    decode,
    encode,
    register_payload_types,
)
from tests.jaxinfer import multihost_worker

JAX_ABORT = "JAX distributed service detected fatal errors"


@dataclasses.dataclass
class _Settings:
    temperature: float


def _round_trip(kind: str, payload):
    _, pickled, *buffers = encode(7, kind, payload)
    return decode(pickled, [bytearray(buffer) for buffer in buffers])


def test_payload_round_trip():
    payload = {
        "token_ids": np.arange(5, dtype=np.int32),  # [T]
        "page_indices": np.arange(12, dtype=np.int32).reshape(3, 4),  # [S, P]
        "strided": np.arange(12, dtype=np.float32).reshape(3, 4)[:, ::2],
        "want": np.array([True, False]), "empty": np.zeros((0, 3), np.uint32),
        "scalar": np.float32(0.5), "zero_d": np.array(3, np.int64),
        "batch": PagedBatch(*(np.full(i + 1, i, np.int32) for i in range(5))),
        "nested": [None, (1, 2.5, "x", b"y")], "draft_probs": None,
    }
    kind, got = _round_trip("step", payload)
    assert kind == "step"
    assert type(got["batch"]) is PagedBatch
    assert got["nested"] == payload["nested"] and got["draft_probs"] is None
    for name in ("token_ids", "page_indices", "strided", "want", "empty", "zero_d"):
        assert got[name].dtype == payload[name].dtype
        np.testing.assert_array_equal(got[name], payload[name])
    for mine, theirs in zip(got["batch"], payload["batch"]):
        np.testing.assert_array_equal(mine, theirs)
    assert got["scalar"] == np.float32(0.5)
    got["token_ids"][0] = 9  # received arrays are writable


def test_payload_refuses_what_is_not_data():
    class Evil:
        def __reduce__(self):
            return (os.system, ("echo owned",))

    with pytest.raises(pickle.UnpicklingError, match="may not contain"):
        _round_trip("step", Evil())
    with pytest.raises(pickle.UnpicklingError, match="register_payload_types"):
        _round_trip("step", _Settings(0.5))
    register_payload_types(_Settings)
    assert _round_trip("step", _Settings(0.5))[1] == _Settings(0.5)


def test_channel_needs_jax_distributed():
    with pytest.raises(ChannelError, match="not initialized"):
        StepChannel.connect(timeout_s=1)


def _start_and_wait_until_serving(scenario: str, directory, timeout_s: float = 60
                                  ) -> list[subprocess.Popen]:
    processes = multihost_worker.start(scenario, directory)
    deadline = time.monotonic() + timeout_s
    while not all("serving" in (directory / f"{i}.out").read_text() for i in range(2)):
        if time.monotonic() > deadline or any(p.poll() is not None for p in processes):
            for process in processes:
                process.kill()
            raise AssertionError("the processes did not start serving: " + " | ".join(
                (directory / f"{i}.err").read_text()[-2000:] for i in range(2)))
        time.sleep(0.1)
    return processes


def _kill_and_time_survivor(processes: list[subprocess.Popen], victim: int,
                            timeout_s: float) -> tuple[int, float]:
    """SIGKILLs process `victim`; returns the survivor's exit status and seconds to exit."""
    survivor = processes[1 - victim]
    processes[victim].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    try:
        code = survivor.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        survivor.kill()
        raise AssertionError(f"process {1 - victim} still ran {timeout_s} s after process "
                             f"{victim} was killed") from None
    finally:
        processes[victim].wait()
    return code, time.monotonic() - killed


def test_killed_follower_ends_the_leader(tmp_path):
    processes = _start_and_wait_until_serving("serve", tmp_path)
    code, seconds = _kill_and_time_survivor(processes, victim=1, timeout_s=30)
    error = (tmp_path / "0.err").read_text()
    # The leader sees the follower's socket close; no need to wait for heartbeats (5 s).
    assert code == EXIT_PEER_LOST, error[-3000:]
    assert "follower process 1 left the step channel" in error
    assert seconds < 4


def test_killed_leader_ends_the_follower(tmp_path):
    processes = _start_and_wait_until_serving("serve", tmp_path)
    code, seconds = _kill_and_time_survivor(processes, victim=0, timeout_s=30)
    error = (tmp_path / "1.err").read_text()
    # Whichever notices first: the step channel's end of file, or jax's coordination client
    # (the coordination service lived in the leader), which aborts the process.
    assert code in (EXIT_PEER_LOST, -signal.SIGABRT), error[-3000:]
    assert "lost the leader (process 0)" in error or JAX_ABORT in error
    assert seconds < 10


def test_uncaught_exception_on_the_leader_ends_both(tmp_path):
    processes = _start_and_wait_until_serving("raise", tmp_path)
    started = time.monotonic()
    codes = [process.wait(timeout=30) for process in processes]
    errors = [(tmp_path / f"{i}.err").read_text() for i in range(2)]
    # Without exit_on_uncaught_exception both would wait in jax.distributed.shutdown's
    # barrier for minutes.
    assert codes == [EXIT_UNCAUGHT, EXIT_PEER_LOST], errors
    assert "RuntimeError: scheduler bug at step 60" in errors[0]
    assert ("the leader aborted the run: the leader failed: RuntimeError: scheduler bug at "
            "step 60") in errors[1]
    assert time.monotonic() - started < 10


def test_coordination_service_ends_the_leader_when_a_follower_dies(tmp_path):
    """Without a step channel jax's heartbeats do it (after heartbeat_timeout_seconds = 5);
    this is what still catches a host that vanishes without closing its sockets."""
    processes = _start_and_wait_until_serving("idle", tmp_path)
    code, seconds = _kill_and_time_survivor(processes, victim=1, timeout_s=40)
    error = (tmp_path / "0.err").read_text()
    assert code == -signal.SIGABRT, error[-3000:]
    assert JAX_ABORT in error and "stopped sending heartbeats" in error
    assert 2 < seconds < 25
