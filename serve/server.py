"""One server process: the engine, the gRPC and HTTP front ends, and their lifecycle.

`jaxinfer serve` (`serve.cli`) builds an `InferenceService`, then `Server.run()`: warm-up
(every step shape compiles before anything listens as healthy), both front ends bound on
loopback unless told otherwise, and on SIGTERM/SIGINT a graceful stop: refuse new calls, let
in-flight requests finish within the grace period, abort the rest, exit 0.

A server whose engine dies fails loudly rather than answering 503 forever: health turns
NOT_SERVING at once (gRPC health and HTTP /health), the requests in flight are answered with
the engine's error, the same graceful stop runs, and `run()` returns 1, so `jaxinfer serve`
exits 1 and a supervisor restarts it (a multi-host leader also aborts the step channel then,
so the followers exit too).

`BackgroundServer` runs the same `Server` on its own event loop in a thread, for tests and
notebooks:

    with BackgroundServer(service) as server:
        channel = grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}")
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import threading
import time
from typing import Any

from serve.access import exposure_warning
from serve.service import InferenceService

logger = logging.getLogger("jaxinfer.serve")


@dataclasses.dataclass
class ServerAddress:
    """Where the front ends listen; a port of 0 picks a free one, None disables that front."""

    host: str = "127.0.0.1"
    grpc_port: int | None = 50051
    http_port: int | None = 8000


class Server:
    """Both front ends over one `InferenceService`.

    Args:
        service: The engine and its request policy.
        address: Host and ports.
        grace_seconds: How long a stop waits for in-flight requests before aborting them.
    """

    def __init__(self, service: InferenceService, address: ServerAddress,
                 grace_seconds: float = 10.0) -> None:
        self.service = service
        self.address = address
        self.grace_seconds = grace_seconds
        self.grpc_port: int | None = None
        self.http_port: int | None = None
        self._grpc_server: Any = None
        self._http_runner: Any = None

    async def start(self) -> None:
        """Warms the engine up (in a worker thread), then binds the front ends."""
        if not self.service.engine.is_running:
            await asyncio.to_thread(self.service.engine.start)
        if self.address.grpc_port is not None:
            from serve.grpc_server import start_grpc_server

            self._grpc_server, self.grpc_port = await start_grpc_server(
                self.service, self.address.host, self.address.grpc_port)
        if self.address.http_port is not None:
            from serve.http_server import start_http_server

            self._http_runner, self.http_port = await start_http_server(
                self.service, self.address.host, self.address.http_port)
        logger.info("serving %s: gRPC %s:%s, HTTP %s:%s", self.service.model_name,
                    self.address.host, self.grpc_port, self.address.host, self.http_port)
        warning = exposure_warning(self.address.host, self.service.config.api_key)
        if warning is not None:
            logger.warning(warning)

    async def stop(self) -> None:
        """Stops accepting, drains in-flight requests for `grace_seconds`, aborts the rest."""
        deadline = time.monotonic() + self.grace_seconds
        if self._grpc_server is not None:
            # grpc.aio: refuses new RPCs now, cancels the remaining ones after the grace.
            grpc_stop = asyncio.ensure_future(self._grpc_server.stop(self.grace_seconds))
        else:
            grpc_stop = None
        if self._http_runner is not None:
            # Closes the listening sockets first; open responses run until they finish or
            # the runner's shutdown timeout cancels their handlers.
            await self._http_runner.shutdown()
        while self.service.engine.num_unfinished_requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if grpc_stop is not None:
            await grpc_stop
        if self._http_runner is not None:
            await self._http_runner.cleanup()
        await asyncio.to_thread(self.service.engine.shutdown)  # aborts what is left

    async def run(self) -> int:
        """Serves until SIGTERM or SIGINT, or until the engine stops serving; then stops
        gracefully.

        Returns:
            The exit code: 0 after a stop signal, 1 when the engine died (or stopped on its
            own) first.
        """
        await self.start()
        loop = asyncio.get_running_loop()
        stop_requested = asyncio.Event()
        if threading.current_thread() is threading.main_thread():  # signals reach it only
            for signum in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(signum, stop_requested.set)
        print(f"jaxinfer: serving {self.service.model_name} (gRPC {self.address.host}:"
              f"{self.grpc_port}, HTTP {self.address.host}:{self.http_port}); ready",
              flush=True)
        signalled = asyncio.ensure_future(stop_requested.wait())
        # Never cancelled: cancelling it would cancel the engine's own future.
        engine_stopped = asyncio.wrap_future(self.service.engine.stopped)
        await asyncio.wait({signalled, engine_stopped}, return_when=asyncio.FIRST_COMPLETED)
        if not engine_stopped.done():
            signalled.cancel()
            print("jaxinfer: stopping (finishing in-flight requests)", flush=True)
            await self.stop()
            return 0
        signalled.cancel()
        error = engine_stopped.result()
        logger.error("the engine stopped serving (%r): answering the requests in flight, "
                     "then exiting with status 1", error)
        print(f"jaxinfer: the engine stopped serving ({error!r}); exiting with status 1",
              flush=True)
        await self.stop()
        return 1


class BackgroundServer:
    """A `Server` on its own event loop in a daemon thread (tests, notebooks).

    Args:
        service: The engine and policy to serve.
        host: Interface to bind.
        grpc: Start the gRPC front end (on a free port).
        http: Start the HTTP front end (on a free port).
        grace_seconds: The stop's drain period.
    """

    def __init__(self, service: InferenceService, host: str = "127.0.0.1", *,
                 grpc: bool = True, http: bool = True, grace_seconds: float = 5.0) -> None:
        self.server = Server(service, ServerAddress(host, 0 if grpc else None,
                                                    0 if http else None), grace_seconds)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="jaxinfer-server")

    @property
    def grpc_port(self) -> int | None:
        """The bound gRPC port."""
        return self.server.grpc_port

    @property
    def http_port(self) -> int | None:
        """The bound HTTP port."""
        return self.server.http_port

    def start(self) -> BackgroundServer:
        """Starts the loop and the server; returns once both front ends listen."""
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start(), self._loop).result()
        return self

    def stop(self) -> None:
        """Stops the server gracefully and the loop."""
        if not self._thread.is_alive():
            return
        asyncio.run_coroutine_threadsafe(self.server.stop(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
