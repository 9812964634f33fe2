"""jaxinfer.multihost: step payloads survive the wire; a dead or failing process ends the run.

The process tests start two local processes (tests/jaxinfer/multihost_worker.py, 4 CPU devices
each, 5 s heartbeat timeout), wait until steps flow, then SIGKILL one and time how long the
other takes to exit.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import ipaddress
import os
import pickle
import signal
import socket
import subprocess
import threading
import time
import types

import numpy as np
import pytest

from jaxinfer import multihost
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


# ------------------------------------------------------------ setup: binding and handshakes
#
# These run the leader's side of `StepChannel.connect` in this process, on a thread. The
# coordination service's key-value store is faked (the real one needs jax.distributed, which
# must be initialized before this process's backend starts) and jax is told this is process
# 0 of a larger run; followers are raw sockets speaking the handshake.


class _KeyValueStore:
    """The two calls of jax's coordination client that `connect` makes."""

    def __init__(self):
        self._values: dict[str, str] = {}
        self._changed = threading.Condition()

    def key_value_set(self, key: str, value: str) -> None:
        with self._changed:
            self._values[key] = value
            self._changed.notify_all()

    def blocking_key_value_get(self, key: str, timeout_ms: int) -> str:
        with self._changed:
            if not self._changed.wait_for(lambda: key in self._values, timeout_ms / 1000):
                raise TimeoutError(key)
            return self._values[key]

    def only_value(self) -> str:
        """Waits for the leader to publish its "port token" and returns it."""
        with self._changed:
            self._changed.wait_for(lambda: self._values, 30)
            (value,) = self._values.values()
            return value


class _Setup:
    """One leader's setup in progress: the future of its channel, its port and token, and
    the follower connections opened against it."""

    def __init__(self, future, port: int, token: bytes):
        self.future, self.port, self.token = future, port, token
        self.sockets: list[socket.socket] = []

    def connect(self, process: int = 1, *, host: str = "127.0.0.1", token: bytes | None = None,
                hello: bytes | None = None) -> socket.socket:
        """A follower connection that sends `hello` (default: the handshake of `process`
        with `token`, default the right one)."""
        sock = socket.create_connection((host, self.port), timeout=30)
        self.sockets.append(sock)
        sock.sendall(hello if hello is not None else multihost._HELLO.pack(
            self.token if token is None else token, process))
        return sock

    def channel(self) -> StepChannel:
        """The leader's channel, once `connect` returns (a minute at most: a guard against
        a setup that hangs, not a measurement)."""
        return self.future.result(timeout=60)


class _FatalError(Exception):
    """What `multihost.fatal` raises here instead of ending the test process."""


@contextlib.contextmanager
def _leader(monkeypatch, *, followers: int, host: str = "127.0.0.1", **options):
    """Runs `StepChannel.connect(**options)` as the leader of `followers` followers whose
    coordinator host is `host`, on a thread; yields its `_Setup`. Aborts the channel, then
    closes the connections."""
    store = _KeyValueStore()
    monkeypatch.setattr(multihost, "_kv_client", lambda: store)
    monkeypatch.setattr(multihost, "_coordinator_host", lambda: host)
    monkeypatch.setattr(multihost, "jax", types.SimpleNamespace(
        process_index=lambda: 0, process_count=lambda: followers + 1))

    def fatal(message, code=EXIT_PEER_LOST):
        raise _FatalError(message, code)

    monkeypatch.setattr(multihost, "fatal", fatal)
    pool = concurrent.futures.ThreadPoolExecutor(1)
    future = pool.submit(StepChannel.connect, **{"timeout_s": 30, **options})
    port, token = store.only_value().split()
    setup = _Setup(future, int(port), bytes.fromhex(token))
    try:
        yield setup
    finally:
        if not future.done():  # a failed test: closing the connections may end the setup
            for sock in setup.sockets:
                sock.close()
            concurrent.futures.wait([future], timeout=5)
        if future.done() and future.exception() is None:
            # Before the followers hang up: the channel's watch thread would take that for
            # a lost follower.
            future.result().abort("test over")
        for sock in setup.sockets:
            sock.close()
        pool.shutdown(wait=False)


def _hung_up(sock: socket.socket) -> bool:
    """Whether the leader closed `sock` (waits for it; any data counts as no)."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def _joined(channel: StepChannel, sock: socket.socket) -> bool:
    """Whether `sock` is the follower end the channel sends to (a frame arrives on it)."""
    channel.send("probe", None)
    return sock.recv(4) == b"JXST"


def test_silent_and_bad_connections_do_not_block_a_real_follower(monkeypatch):
    # Handshakes may take an hour: served one after another, the silent connection would
    # hold the leader for that long and the follower would not join.
    with _leader(monkeypatch, followers=1, timeout_s=3600, handshake_timeout_s=3600) as setup:
        silent = socket.create_connection(("127.0.0.1", setup.port))
        setup.sockets.append(silent)
        garbage = setup.connect(hello=b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        short = setup.connect(hello=setup.token[:5])  # then nothing more
        wrong_index = setup.connect(7)
        real = setup.connect(1)
        assert _joined(setup.channel(), real)
        # The leader hangs up on every other connection, the silent ones once it is done.
        assert all(_hung_up(sock) for sock in (silent, garbage, short, wrong_index))


def test_a_wrong_token_is_refused(monkeypatch, caplog):
    with _leader(monkeypatch, followers=1) as setup:
        impostor = setup.connect(1, token=bytes(16))  # claims process 1's index, first
        assert _hung_up(impostor)
        assert not setup.future.done()
        real = setup.connect(1)
        assert _joined(setup.channel(), real)
    assert "wrong token" in caplog.text


def test_a_connection_without_a_handshake_times_out(monkeypatch):
    with _leader(monkeypatch, followers=2, handshake_timeout_s=0.2) as setup:
        first = setup.connect(1)
        silent = socket.create_connection(("127.0.0.1", setup.port))
        setup.sockets.append(silent)
        assert _hung_up(silent)  # while the leader still waits for process 2
        assert not setup.future.done()
        second = setup.connect(2)
        assert _joined(setup.channel(), first) and _joined(setup.channel(), second)


def test_the_leader_listens_on_the_coordinator_host_only(monkeypatch):
    # 127.0.0.2 is this machine's too (all of 127/8 is loopback), but a different interface
    # address: a leader listening on every interface would accept on 127.0.0.1 as well.
    with _leader(monkeypatch, followers=1, host="127.0.0.2") as setup:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", setup.port))
        real = setup.connect(1, host="127.0.0.2")
        assert _joined(setup.channel(), real)


def test_the_leader_listens_everywhere_when_the_coordinator_host_is_not_its_own(
        monkeypatch, caplog):
    # 192.0.2.1 (TEST-NET-1) is no address of this machine: binding there fails.
    with _leader(monkeypatch, followers=1, host="192.0.2.1") as setup:
        real = setup.connect(1, host="127.0.0.1")
        assert _joined(setup.channel(), real)
    assert "listening on every interface" in caplog.text and "192.0.2.1" in caplog.text


def test_a_host_name_that_is_loopback_only_here_listens_everywhere(monkeypatch, caplog):
    # Debian maps the machine's own name to 127.0.1.1 in /etc/hosts, while other hosts
    # resolve it to its real address: listening on loopback would shut them out.
    resolve = socket.getaddrinfo
    monkeypatch.setattr(socket, "getaddrinfo", lambda host, *args, **kwargs: resolve(
        "127.0.1.1" if host == "leader-host" else host, *args, **kwargs))
    with multihost._listen("leader-host", 0, backlog=1) as server:
        assert server.getsockname()[0] in ("::", "0.0.0.0")
    assert "loopback address here" in caplog.text
    with multihost._listen("localhost", 0, backlog=1) as server:  # says loopback itself
        assert ipaddress.ip_address(server.getsockname()[0]).is_loopback


def test_not_every_follower_joining_is_an_error(monkeypatch):
    with _leader(monkeypatch, followers=2, timeout_s=0.5) as setup:
        first = setup.connect(1)
        with pytest.raises(ChannelError, match=r"only processes \[1\] of 1 \.\. 2 joined"):
            setup.channel()
        assert _hung_up(first)  # closed, not left dangling
