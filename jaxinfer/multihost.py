"""Multi-host serving: the leader -> followers step channel and failure handling.

Design (one process per host, joined by `jaxinfer.distributed.initialize`):

* Process 0, the leader, runs the front ends and the scheduler. Before each step it packs
  the step's inputs on the host (small numpy arrays whose shapes change with the batch
  buckets) and sends them, with a kind ("step", "prompt_step", ...), down a `StepChannel`;
  then it calls the jitted step like a single-process engine would.
* Every other process, a follower, loops over the channel: it receives each message and calls
  the same jitted step on the same inputs, so all processes enter the same programs with the
  same arguments in the same order, which SPMD over a global mesh requires. A "stop" message
  ends the loop cleanly when the leader shuts down.
* The channel is a TCP connection from each follower to the leader (length-prefixed frames,
  numpy buffers sent out of band), found through the coordination service's key-value store,
  which also hands out a random token that followers must present. During setup the leader
  listens only on the coordinator host's interface, handshakes with all connections at once
  (each within `HANDSHAKE_TIMEOUT_S`, so a silent or garbage connection holds up no one) and
  compares tokens in constant time. Payloads decode with a restricted unpickler: numpy
  arrays and scalars, builtin containers, NamedTuples of modules already imported, and types
  given to `register_payload_types` -- nothing else is imported or called.

Failure behaviour (measured with jax 0.10.2 on CPU, two local processes):

* jax's coordination service already ends the survivors when a process dies: it aborts
  them (SIGABRT: shell status 134, Popen returncode -6) with "Terminating process because
  the JAX distributed service detected fatal errors ...". A dead follower is noticed by the
  service (in process 0) after `heartbeat_timeout_seconds` ("The following tasks are
  unhealthy (stopped sending heartbeats)"); a dead leader within ~0.1 s, since the
  service dies with it and the followers' connections to it close ("Socket closed"; a host
  that vanishes without closing them should instead show as failed heartbeats). This holds
  whatever the survivor is doing: sleeping, blocked in a key-value get, or in a gloo
  collective, which by itself waits for the dead peer without erroring.
* The channel notices a process death sooner, by end-of-file on its sockets: the leader
  watches every follower's socket from a thread and a follower sees it in `receive`; either
  then logs what happened and ends the process with `EXIT_PEER_LOST` (well under a second
  after a process dies, on a host that stays up).
* An uncaught Python exception is the case jax does not cover: the process runs its atexit
  handlers, where `jax.distributed.shutdown` waits at a barrier for every other process,
  and stays connected meanwhile, so the failing process and the survivors hang (measured:
  until the survivor's own 60 s wait ran out). `exit_on_uncaught_exception`, which
  `jaxinfer.distributed.initialize` installs, makes such a process end at once (exit 1),
  which the others then see as a death. A leader leaving a `with channel:` block
  by an exception also sends "abort" so the followers exit with its message, and so does a
  leader whose engine step fails inside a server's engine thread, where no exception leaves
  the block (`jaxinfer.engine.multihost_steps.LeaderEngine`).
* A leader that merely stops sending steps is not a failure: followers wait indefinitely
  (an idle server).
* `client.get_live_nodes` is not a liveness poll: it is a barrier that blocks until every
  process listed calls it, so nothing here uses it.

Integration notes (checked by tests/jaxinfer/test_distributed.py): host numpy inputs go
straight into a jitted program on the global mesh (every process passes the same values, which
is what the channel guarantees); `jax.device_put(numpy, NamedSharding(global_mesh, ...))` and
`jax.make_array_from_process_local_data` build global arrays; an output the leader reads must
be replicated (`out_shardings=NamedSharding(mesh, P())`), since fetching an array with shards
on another process raises.

Cost (`benchmarks/step_channel.py`: two local processes on a 2-core machine, an 11 KB payload
of 13 arrays per step, each step also a psum over the 8 devices of ~1 ms): the TCP channel
delivers a message in 0.22-0.25 ms (median; p90 0.31-0.38 ms) and adds 0.3-0.7 ms per step;
the coordination service's key-value store (set, blocking get, delete) 1.6 ms and 2 ms; and
`multihost_utils.broadcast_one_to_all` (a psum, for which followers must know the shapes
beforehand) 10 ms and 14 ms, plus 70-100 ms of compilation for every new set of shapes.
"""

from __future__ import annotations

import hmac
import io
import ipaddress
import itertools
import logging
import os
import pickle
import secrets
import selectors
import socket
import struct
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from types import TracebackType
from typing import Any, NoReturn

import jax
from jax._src import distributed as _jax_distributed

logger = logging.getLogger(__name__)

EXIT_PEER_LOST = 69  # os.EX_UNAVAILABLE: another process of the run is gone
EXIT_UNCAUGHT = 1

STOP = "stop"
ABORT = "abort"

_MAGIC = b"JXST"
_HEADER = struct.Struct("<4sQQI")  # magic, sequence number, pickle bytes, out-of-band buffers
_LENGTH = struct.Struct("<Q")
_HELLO = struct.Struct("<16sI")  # token, follower's process index
HANDSHAKE_TIMEOUT_S = 10.0  # a real follower sends its hello right after connecting
_MAX_PENDING = 64  # unfinished handshakes held at once; the oldest goes beyond that
_JOIN_LIMIT = 1 << 20  # a frame up to this size goes out as one sendall

# Globals the payload unpickler may resolve: what numpy arrays, scalars and dtypes pickle as.
_NUMPY_GLOBALS = frozenset(
    (module, name)
    for prefix in ("numpy._core", "numpy.core")
    for module, name in ((f"{prefix}.multiarray", "_reconstruct"),
                         (f"{prefix}.multiarray", "scalar"),
                         (f"{prefix}.numeric", "_frombuffer"))
) | {("numpy", "dtype"), ("numpy", "ndarray")}
_payload_types: dict[tuple[str, str], type] = {}
_generations = itertools.count()


class ChannelError(RuntimeError):
    """The step channel could not be set up, or was used from the wrong process."""


def fatal(message: str, code: int = EXIT_PEER_LOST) -> NoReturn:
    """Logs `message` and ends this process at once with exit status `code`.

    `os._exit` skips the atexit handlers on purpose: `jax.distributed.shutdown` there waits
    at a barrier for every process, and a dead one never arrives.
    """
    text = f"jaxinfer process {_process_index()}: {message}; exiting with status {code}"
    if logger.hasHandlers() and logger.isEnabledFor(logging.CRITICAL):
        logger.critical(text)
        for handler in (*logger.handlers, *logging.getLogger().handlers):
            handler.flush()
    else:
        print(text, file=sys.stderr, flush=True)
    os._exit(code)


def exit_on_uncaught_exception() -> None:
    """Makes an uncaught exception, in any thread, end this process at once (status 1).

    Without this a failing process waits in `jax.distributed.shutdown`'s barrier for the
    others, which wait for it, so the whole run hangs. Call it right after joining.
    """
    def on_main(kind: type[BaseException], value: BaseException,
                trace: TracebackType | None) -> None:
        traceback.print_exception(kind, value, trace)
        fatal(f"uncaught {kind.__name__}: {value}", EXIT_UNCAUGHT)

    def on_thread(args: threading.ExceptHookArgs) -> None:
        if args.exc_type is SystemExit:
            return
        on_main(args.exc_type, args.exc_value or args.exc_type(), args.exc_traceback)

    sys.excepthook = on_main
    threading.excepthook = on_thread


def register_payload_types(*types: type) -> None:
    """Lets step payloads carry instances of `types` (beyond numpy arrays, builtin
    containers and NamedTuples). Call it on every process, before the first message."""
    for kind in types:
        _payload_types[(kind.__module__, kind.__qualname__)] = kind


class _PayloadUnpickler(pickle.Unpickler):
    """Resolves only numpy's array globals, registered types and already-imported
    NamedTuples; imports nothing."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _NUMPY_GLOBALS:
            return super().find_class(module, name)
        if (module, name) in _payload_types:
            return _payload_types[(module, name)]
        found = getattr(sys.modules.get(module), name, None) if "." not in name else None
        if isinstance(found, type) and issubclass(found, tuple) and hasattr(found, "_fields"):
            return found
        raise pickle.UnpicklingError(
            f"step payloads may not contain {module}.{name}; register it with "
            "jaxinfer.multihost.register_payload_types on every process")


def encode(sequence: int, kind: str, payload: Any) -> list[bytes | memoryview]:
    """One frame: header, buffer lengths, the pickled (kind, payload), the array buffers."""
    buffers: list[pickle.PickleBuffer] = []
    pickled = pickle.dumps((kind, payload), protocol=5, buffer_callback=buffers.append)
    raw = [buffer.raw() for buffer in buffers]
    header = _HEADER.pack(_MAGIC, sequence, len(pickled), len(raw))
    lengths = b"".join(_LENGTH.pack(view.nbytes) for view in raw)
    return [header + lengths, pickled, *raw]


def decode(pickled: bytes | bytearray, buffers: list[bytearray]) -> tuple[str, Any]:
    """Inverse of `encode` past the header: (kind, payload); arrays use `buffers`' memory."""
    kind, payload = _PayloadUnpickler(io.BytesIO(pickled), buffers=buffers).load()
    return kind, payload


def _process_index() -> int | None:
    """This process's rank, without initializing a backend (None before joining)."""
    state = _jax_distributed.global_state
    return state.process_id if state.client is not None else None


def _kv_client() -> Any:
    """jax's coordination service client (no public handle; multihost_utils uses this one)."""
    client = _jax_distributed.global_state.client
    if client is None:
        raise ChannelError("jax.distributed is not initialized (jaxinfer.distributed.initialize)")
    return client


def _coordinator_host() -> str:
    """The host part of process 0's coordinator address, which every process can reach."""
    host = _jax_distributed.global_state.coordinator_address.rsplit(":", 1)[0]
    return host.strip("[]")


def _names_loopback(host: str) -> bool:
    """Whether `host` itself says loopback ("localhost", 127.0.0.1, ::1)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name
        return False


def _listen(host: str, port: int, backlog: int) -> socket.socket:
    """A listening TCP socket on `host`'s address, port `port`.

    `host` is the coordinator's host, the one address every follower is known to reach,
    so the leader listens there and not on every interface. It listens on every interface
    instead, with a warning, where that address is none of this machine's (a load
    balancer's or NAT's: binding fails), and where a host name that does not say loopback
    resolves to loopback here (Debian's `127.0.1.1 HOSTNAME` line in /etc/hosts), which
    followers on other hosts could not reach.
    """
    problem = ""
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                       proto=socket.IPPROTO_TCP)
    except OSError as error:
        addresses, problem = [], f"it does not resolve ({error})"
    if addresses and not _names_loopback(host) and all(
            ipaddress.ip_address(address[4][0].split("%")[0]).is_loopback
            for address in addresses):
        addresses = []
        problem = "it resolves to a loopback address here, which other hosts cannot reach"
    for family, _, _, _, address in addresses:
        try:
            return socket.create_server(address, family=family, backlog=backlog)
        except OSError as error:
            problem = f"cannot listen on {address[0]} ({error})"
    logger.warning("step channel: listening on every interface, not only on the coordinator "
                   "host %r: %s", host, problem)
    family = socket.AF_INET6 if socket.has_dualstack_ipv6() else socket.AF_INET
    return socket.create_server(("", port), family=family, backlog=backlog,
                                dualstack_ipv6=family == socket.AF_INET6)


def _accept_followers(server: socket.socket, token: bytes, followers: int, deadline: float,
                      handshake_timeout_s: float) -> dict[int, socket.socket]:
    """Accepts connections on `server` until processes 1 .. `followers` have each presented
    `token`; returns their sockets (blocking, TCP_NODELAY) by process index.

    Every connection's handshake runs at once with the others (one selector), and each
    must finish within `handshake_timeout_s`: one that sends nothing, too little, a wrong
    token or a process index that is out of range or taken is closed and the others carry
    on. At most `_MAX_PENDING` handshakes are held; a flood of connections drops the oldest.

    Raises:
        ChannelError: Not every follower joined by `deadline` (time.monotonic()).
    """
    joined: dict[int, socket.socket] = {}
    pending: dict[socket.socket, tuple[bytearray, float]] = {}  # hello so far, expiry
    selector = selectors.DefaultSelector()

    def drop(sock: socket.socket, reason: str) -> None:
        peer = _peer(sock)
        del pending[sock]
        selector.unregister(sock)
        sock.close()
        logger.warning("step channel: refused a connection from %s: %s", peer, reason)

    server.setblocking(False)
    selector.register(server, selectors.EVENT_READ)
    try:
        while len(joined) < followers:
            now = time.monotonic()
            if now >= deadline:
                raise ChannelError(
                    f"step channel: only processes {sorted(joined)} of 1 .. {followers} "
                    "joined within the timeout")
            for sock, (_, expires) in list(pending.items()):
                if expires <= now:
                    drop(sock, f"no handshake within {handshake_timeout_s} s")
            wake = min([deadline, *(expires for _, expires in pending.values())])
            for selected, _ in selector.select(max(wake - now, 0.0)):
                if selected.fileobj is server:
                    try:
                        sock, _ = server.accept()
                    except (BlockingIOError, InterruptedError):
                        continue
                    except OSError as error:  # e.g. out of file descriptors: wait, retry
                        logger.warning("step channel: accept failed: %s", error)
                        time.sleep(0.1)
                        continue
                    sock.setblocking(False)
                    selector.register(sock, selectors.EVENT_READ)
                    pending[sock] = (bytearray(), now + handshake_timeout_s)
                    if len(pending) > _MAX_PENDING:
                        drop(next(iter(pending)), "too many unfinished handshakes")
                    continue
                sock = selected.fileobj
                if sock not in pending:  # dropped since select() returned
                    continue
                hello, _ = pending[sock]
                try:
                    data = sock.recv(_HELLO.size - len(hello))
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError as error:
                    drop(sock, str(error))
                    continue
                if not data:
                    drop(sock, "closed before its handshake")
                    continue
                hello += data
                if len(hello) < _HELLO.size:
                    continue
                given, process = _HELLO.unpack(hello)
                if not hmac.compare_digest(given, token):
                    drop(sock, "wrong token")
                elif not 0 < process <= followers or process in joined:
                    drop(sock, f"process index {process} is out of range or taken")
                else:
                    pending.pop(sock)
                    selector.unregister(sock)
                    sock.setblocking(True)
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    joined[process] = sock
    except BaseException:
        for sock in joined.values():
            sock.close()
        raise
    finally:
        for sock in pending:
            sock.close()
        selector.close()
    return joined


def _peer(sock: socket.socket) -> str:
    """`sock`'s remote address for a log line."""
    try:
        return str(sock.getpeername()[:2])
    except OSError:
        return "?"


def _receive_exactly(sock: socket.socket, size: int) -> bytearray:
    """Reads `size` bytes; raises ConnectionError at end of file."""
    data = bytearray(size)
    view = memoryview(data)
    done = 0
    while done < size:
        count = sock.recv_into(view[done:])
        if count == 0:
            raise ConnectionError("connection closed")
        done += count
    return data


class StepChannel:
    """Carries each step's host inputs from the leader (process 0) to every follower.

    Open it on every process with `StepChannel.connect()`; then the leader calls `send`
    (or `broadcast_step`) once per step and followers iterate over the channel (or call
    `receive` / `broadcast_step`) until the leader's `close` sends "stop".

    Messages are (kind, payload): kind a short string ("stop" and "abort" are reserved),
    payload a pytree of numpy arrays, Python scalars, strings, None, lists, tuples, dicts
    and NamedTuples (see `register_payload_types` for other types). Shapes may change from
    message to message; nothing compiles.
    """

    def __init__(self, *, leader: bool, sockets: dict[int, socket.socket]) -> None:
        """Use `connect`. `sockets`: the leader's per-follower sockets, or {0: leader}."""
        self.is_leader = leader
        self._sockets = sockets
        self._sequence = 0
        self._closing = False
        self._closed = False
        self._gone: set[int] = set()
        self._gone_changed = threading.Condition()
        self._selector: selectors.BaseSelector | None = None
        if leader and sockets:
            self._selector = selectors.DefaultSelector()
            for process, sock in sockets.items():
                self._selector.register(sock, selectors.EVENT_READ, process)
            threading.Thread(target=self._watch_followers, name="jaxinfer-step-channel-watch",
                             daemon=True).start()

    # ------------------------------------------------------------------ setup

    @classmethod
    def connect(cls, *, timeout_s: float = 120.0, port: int = 0, name: str = "steps",
                handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S) -> StepChannel:
        """Opens the channel; every process of the run must call it (in the same order as
        any other `connect`).

        The leader listens on `port` (0: any free port) of the coordinator host's interface
        (see `_listen`) and publishes the port and a fresh token in the coordination
        service's key-value store; followers connect to the coordinator's host on that port
        and present the token. The leader handshakes with every connection at once, each
        within `handshake_timeout_s`, so a connection that sends nothing or garbage is
        dropped without holding up the others, and keeps listening until every follower
        has joined or `timeout_s` has passed.

        Args:
            timeout_s: How long to wait for the leader's address and for every follower.
            port: The leader's listening port (pick a fixed one where firewalls need it).
            name: Tells apart channels of one run.
            handshake_timeout_s: How long one connection may take to present its token.

        Raises:
            ChannelError: jax.distributed is not initialized, or not every follower
                joined within `timeout_s`.
        """
        client = _kv_client()
        key = f"jaxinfer/step_channel/{name}/{next(_generations)}"
        followers = jax.process_count() - 1
        deadline = time.monotonic() + timeout_s
        if jax.process_index() == 0:
            token = secrets.token_bytes(16)
            with _listen(_coordinator_host(), port, backlog=max(followers, 1)) as server:
                client.key_value_set(key, f"{server.getsockname()[1]} {token.hex()}")
                sockets = _accept_followers(server, token, followers, deadline,
                                            handshake_timeout_s)
            return cls(leader=True, sockets=sockets)
        remaining_ms = int(max(deadline - time.monotonic(), 0.001) * 1000)
        port_text, token_hex = client.blocking_key_value_get(key, remaining_ms).split()
        sock = socket.create_connection((_coordinator_host(), int(port_text)),
                                        timeout=max(deadline - time.monotonic(), 0.001))
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(_HELLO.pack(bytes.fromhex(token_hex), jax.process_index()))
        return cls(leader=False, sockets={0: sock})

    # ------------------------------------------------------------------ leader

    def send(self, kind: str, payload: Any = None) -> None:
        """Sends one message to every follower (leader only).

        Raises:
            ChannelError: Called on a follower, after `close`, or with a reserved kind.
        """
        if kind in (STOP, ABORT):
            raise ChannelError(f"kind {kind!r} is reserved; use close() or abort()")
        self._send(kind, payload)

    def _send(self, kind: str, payload: Any) -> None:
        if not self.is_leader:
            raise ChannelError("only the leader (process 0) sends on the step channel")
        if self._closed:
            raise ChannelError("the step channel is closed")
        self._sequence += 1
        frame = encode(self._sequence, kind, payload)
        if sum(memoryview(part).nbytes for part in frame) <= _JOIN_LIMIT:
            frame = [b"".join(frame)]
        for process, sock in self._sockets.items():
            try:
                for part in frame:
                    sock.sendall(part)
            except OSError as error:
                if kind == ABORT:
                    continue
                fatal(f"lost follower process {process} while sending a {kind!r} "
                      f"message ({error})")

    def _watch_followers(self) -> None:
        """Ends the leader when a follower's socket reaches end of file before `close`."""
        assert self._selector is not None
        while len(self._gone) < len(self._sockets):
            try:
                events = self._selector.select()
            except (OSError, ValueError) as error:  # the sockets closed under us
                if self._closing:
                    return
                fatal(f"step channel watch failed: {error}")
            for key, _ in events:
                process = key.data
                try:
                    data = key.fileobj.recv(1)  # followers never send after the handshake
                except OSError as error:
                    data, reason = b"", str(error)
                else:
                    reason = "end of file" if not data else "unexpected data"
                if not self._closing:
                    fatal(f"follower process {process} left the step channel ({reason}): "
                          "it died or failed; the run cannot go on without it")
                self._selector.unregister(key.fileobj)
                with self._gone_changed:
                    self._gone.add(process)
                    self._gone_changed.notify_all()

    def close(self, timeout_s: float = 60.0) -> None:
        """Ends the run's step loop, on every process: the leader sends "stop" and waits
        (up to `timeout_s`) for every follower to hang up; a follower that has not yet had
        "stop" waits for it (any other message there is an error), then hangs up.

        Raises:
            ChannelError: A follower got a step message instead of "stop".
        """
        if self._closed:
            return
        if not self.is_leader:
            kind, _ = self.receive()
            if kind != STOP:
                self._hang_up()
                raise ChannelError(f"close() on a follower got a {kind!r} message, not "
                                   "'stop': the leader and this process are out of step")
            return
        self._closing = True
        self._send(STOP, None)
        with self._gone_changed:
            if not self._gone_changed.wait_for(
                    lambda: len(self._gone) == len(self._sockets), timeout_s):
                logger.warning("step channel: followers %s did not hang up within %s s",
                               sorted(set(self._sockets) - self._gone), timeout_s)
        self._hang_up()

    def _hang_up(self) -> None:
        self._closing = True
        self._closed = True
        for sock in self._sockets.values():
            sock.close()

    def abort(self, reason: str) -> None:
        """Tells every follower to exit with `reason` (leader only), then closes."""
        if self._closed:
            return
        self._closing = True
        self._send(ABORT, reason)
        self._hang_up()

    def __enter__(self) -> StepChannel:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 trace: TracebackType | None) -> None:
        if kind is None:
            self.close()
        elif self.is_leader:
            self.abort(f"the leader failed: {kind.__name__}: {value}")
        else:  # the leader sees the end of file and ends the run
            self._hang_up()

    # ------------------------------------------------------------------ follower

    def receive(self) -> tuple[str, Any]:
        """Waits for the leader's next message (followers only); returns (kind, payload).

        Returns ("stop", None) once, when the leader closes the channel. Ends the process
        (`fatal`) when the leader is gone or sends "abort".

        Raises:
            ChannelError: Called on the leader or after "stop".
        """
        if self.is_leader:
            raise ChannelError("the leader does not receive on the step channel")
        if self._closed:
            raise ChannelError("the step channel is closed")
        sock = self._sockets[0]
        try:
            magic, sequence, size, count = _HEADER.unpack(_receive_exactly(sock, _HEADER.size))
            if magic != _MAGIC or sequence != self._sequence + 1:
                fatal(f"step channel out of step: frame {sequence} (magic {magic!r}) after "
                      f"frame {self._sequence}")
            lengths = [length for (length,) in _LENGTH.iter_unpack(
                _receive_exactly(sock, _LENGTH.size * count))]
            pickled = _receive_exactly(sock, size)
            buffers = [_receive_exactly(sock, length) for length in lengths]
        except (OSError, ConnectionError) as error:
            fatal(f"lost the leader (process 0) on the step channel ({error}): it died or "
                  "failed; see its log")
        self._sequence = sequence
        kind, payload = decode(pickled, buffers)
        if kind == ABORT:
            fatal(f"the leader aborted the run: {payload}")
        if kind == STOP:
            self._hang_up()
        return kind, payload

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        """Yields the leader's messages until "stop" (followers only)."""
        while True:
            kind, payload = self.receive()
            if kind == STOP:
                return
            yield kind, payload

    # ------------------------------------------------------------------ both

    def broadcast_step(self, kind: str = "step", payload: Any = None) -> tuple[str, Any]:
        """SPMD form: the leader sends (kind, payload) and returns it; a follower ignores
        its arguments and returns the leader's message (("stop", None) at the end)."""
        if self.is_leader:
            self.send(kind, payload)
            return kind, payload
        return self.receive()
