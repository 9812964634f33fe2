"""Start `jaxinfer serve` as a child process, wait until it is healthy, stop it with SIGTERM.

What `make demo`, `benchmarks/serving_load.py` and the command-line tests share:

    with ServerProcess("builtin:demo", "--max-num-seqs", "8") as server:
        ...  # server.grpc_port, server.http_port are listening and warmed up
    server.exit_code  # 0 after a graceful stop
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request


def free_port() -> int:
    """A loopback TCP port nothing listens on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class ServerProcess:
    """`jaxinfer serve --model MODEL` on free loopback ports.

    Args:
        model: The `--model` argument.
        *options: More `jaxinfer serve` flags.
        ready_timeout_s: Longest wait for /health (warm-up compiles first).
        capture_output: Keep the server's stdout/stderr (in `output` after the stop) instead
            of letting it print.
        env: The server's environment (None: this process's).
    """

    def __init__(self, model: str, *options: str, ready_timeout_s: float = 900.0,
                 capture_output: bool = False, env: dict[str, str] | None = None) -> None:
        self.grpc_port, self.http_port = free_port(), free_port()
        self.command = [sys.executable, "-m", "jaxinfer.cli", "serve", "--model", model,
                        "--grpc-port", str(self.grpc_port), "--http-port", str(self.http_port),
                        *options]
        self.ready_timeout_s = ready_timeout_s
        self.capture_output = capture_output
        self.env = env
        self.process: subprocess.Popen | None = None
        self.exit_code: int | None = None
        self.output = ""

    def start(self) -> ServerProcess:
        """Starts the server and returns once /health answers 200.

        Raises:
            RuntimeError: The server exited before it was ready.
            TimeoutError: It was not ready within `ready_timeout_s`.
        """
        pipe = subprocess.PIPE if self.capture_output else None
        self.process = subprocess.Popen(self.command, stdout=pipe,
                                        stderr=subprocess.STDOUT if pipe else None, text=True,
                                        env=self.env)
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.stop()
                raise RuntimeError(f"the server exited with {self.process.returncode} before "
                                   f"it was ready\n{self.output}")
            if self.healthy():
                return self
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"the server was not healthy after {self.ready_timeout_s:.0f} s")

    def healthy(self) -> bool:
        """Whether GET /health answers 200 now."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/health",
                                        timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def stop(self, timeout_s: float = 120.0) -> int:
        """SIGTERM, then waits (SIGKILL after `timeout_s`); returns the exit code."""
        if self.process is None:
            return 0
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            output, _ = self.process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            output, _ = self.process.communicate()
        self.output = output or ""
        self.exit_code = self.process.returncode
        return self.exit_code

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
