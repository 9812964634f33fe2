"""A soak test of a running server: many concurrent streams for minutes, some cancelled, some
clients that never read, hostile requests interleaved; nothing may be lost or wrong, and the
server's memory must stay flat.

    report = asyncio.run(run_soak(http_port, grpc_port, references, SoakConfig(duration_s=60),
                                  rss=lambda: process_rss_bytes()))
    assert report.ok, report.problems()

Load, all at once until the duration is over:
- `streams` workers, each sending one greedy request after another over HTTP (SSE) or gRPC
  (alternating), a `cancel_fraction` of them dropped after the first chunk; every request that
  runs to its end is compared with its offline output: text over HTTP, token ids over gRPC;
- `slow_readers` clients that send a streamed request with a long output and never read a
  byte, holding the connection open for `slow_reader_hold_s`;
- one worker sending hostile requests (each must be refused with a 4xx, and only that).

The caller gives the offline references (`LLM.generate` on the same model and options) and a
function measuring the server's RSS, sampled every `rss_interval_s`. `tests/serve/test_soak.py`
runs a short soak in `make test` and the full one under `make test-slow`;
`benchmarks/soak.py` writes the full run's numbers to `benchmarks/results/reliability.md`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import random
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import grpc

from serve.client import build_request
from serve.generated.jaxinfer.v1 import inference_pb2_grpc as pb_grpc

# (prompt, max_tokens) -> (text, token ids) of the greedy offline output.
References = Mapping[tuple[str, int], tuple[str, Sequence[int]]]

# Hostile HTTP bodies, each refused with the status given (see tests/serve/test_hostile_inputs).
HOSTILE: tuple[tuple[dict[str, Any], int], ...] = (
    ({"prompt": "x", "top_k": 2 ** 31, "max_tokens": 2}, 200),
    ({"prompt": "x", "n": 10 ** 9}, 400),
    ({"prompt": "x", "stop": ["s"] * 100}, 400),
    ({"prompt": "x", "logit_bias": {str(i): 1 for i in range(1000)}}, 400),
    ({"prompt": "x", "temperature": 1e39}, 400),
    ({"prompt": "a" * 3_000_000}, 400),
    ({"prompt": ["a"] * 1000}, 400),
    ({"prompt": [10 ** 9]}, 400),
    ({"prompt": "x", "seed": 2 ** 80}, 400),
)


@dataclasses.dataclass(frozen=True)
class SoakConfig:
    """The load.

    Attributes:
        duration_s: How long new requests are started.
        streams: Concurrent request workers.
        cancel_fraction: Share of requests dropped after their first chunk.
        slow_readers: Clients that never read their stream.
        slow_reader_hold_s: How long each keeps its connection open before the next one.
        slow_reader_max_tokens: The output each asks for (long, so it would pile up).
        hostile_interval_s: Pause between two hostile requests.
        rss_interval_s: RSS sampling period.
        request_timeout_s: Longest a normal request may take before it counts as lost.
        seed: Picks prompts, protocols and which requests are cancelled.
    """

    duration_s: float = 180.0
    streams: int = 64
    cancel_fraction: float = 0.25
    slow_readers: int = 4
    slow_reader_hold_s: float = 20.0
    slow_reader_max_tokens: int = 200
    hostile_interval_s: float = 0.25
    rss_interval_s: float = 0.5
    request_timeout_s: float = 120.0
    seed: int = 0


@dataclasses.dataclass
class SoakReport:
    """What happened.

    Attributes:
        completed: Requests that ran to their end (each compared with its reference).
        cancelled: Requests the client dropped after their first chunk.
        slow_readers: Never-read streams opened.
        hostile: Hostile requests sent.
        wrong: Completed requests whose output differed from the reference.
        lost: Requests that failed or hung (with what happened).
        hostile_unexpected: Hostile requests answered with another status than expected.
        rss_bytes: (seconds since the start, RSS) samples.
        seconds: Wall time of the whole soak.
    """

    completed: int = 0
    cancelled: int = 0
    slow_readers: int = 0
    hostile: int = 0
    wrong: list[str] = dataclasses.field(default_factory=list)
    lost: list[str] = dataclasses.field(default_factory=list)
    hostile_unexpected: list[str] = dataclasses.field(default_factory=list)
    rss_bytes: list[tuple[float, int]] = dataclasses.field(default_factory=list)
    seconds: float = 0.0

    def rss_window(self, start: float, end: float) -> int:
        """The peak RSS sampled in [start, end) x the soak's length."""
        last = self.rss_bytes[-1][0] if self.rss_bytes else 0.0
        window = [rss for at, rss in self.rss_bytes if start * last <= at < end * last]
        return max(window, default=0)

    @property
    def rss_growth_bytes(self) -> int:
        """Peak RSS of the last quarter of the run less that of its second quarter (the first
        quarter is the warm-up: buffers, lazily compiled programs, allocator pools)."""
        return self.rss_window(0.75, 1.01) - self.rss_window(0.25, 0.5)

    def problems(self, max_rss_growth_bytes: int) -> list[str]:
        """Everything that went wrong (empty: the soak passed)."""
        found = [f"wrong output: {item}" for item in self.wrong]
        found += [f"lost: {item}" for item in self.lost]
        found += [f"hostile: {item}" for item in self.hostile_unexpected]
        if self.rss_growth_bytes > max_rss_growth_bytes:
            found.append(f"RSS grew by {self.rss_growth_bytes / 2**20:.0f} MiB (limit "
                         f"{max_rss_growth_bytes / 2**20:.0f} MiB)")
        if not self.completed:
            found.append("no request completed")
        return found


# The prompts and output lengths the soak's requests are drawn from (the demo model's domain).
PROMPTS = ("The list type is", "To open a file, use the", "A dictionary maps", "Python is")
MAX_TOKENS = (8, 24)


def greedy_references(llm: Any, prompts: Sequence[str] = PROMPTS,
                      max_tokens: Sequence[int] = MAX_TOKENS) -> dict[tuple[str, int],
                                                                   tuple[str, list[int]]]:
    """The offline greedy outputs (`LLM.generate`) of every (prompt, max_tokens) pair."""
    from jaxinfer.engine.sampling_params import SamplingParams

    found = {}
    for length in max_tokens:
        outputs = llm.generate(list(prompts), SamplingParams(temperature=0.0, max_tokens=length))
        for prompt, output in zip(prompts, outputs, strict=True):
            found[(prompt, length)] = (output.outputs[0].text, list(output.outputs[0].token_ids))
    return found


def process_rss_bytes(pid: int | str = "self") -> int:
    """The resident set size of a process (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc status")


async def run_soak(http_port: int, grpc_port: int, references: References,
                   config: SoakConfig, rss: Callable[[], int], host: str = "127.0.0.1"
                   ) -> SoakReport:
    """Runs the soak against a server; returns what happened (nothing raised for failures).

    Args:
        http_port: The server's HTTP port.
        grpc_port: Its gRPC port.
        references: The greedy offline outputs the requests are drawn from.
        config: The load.
        rss: Measures the server's resident set size.
        host: The server's address.
    """
    report = SoakReport()
    started = time.monotonic()
    deadline = started + config.duration_s
    rng = random.Random(config.seed)
    keys = sorted(references)
    base = f"http://{host}:{http_port}"
    async with (aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(
                    total=config.request_timeout_s)) as session,
                grpc.aio.insecure_channel(f"{host}:{grpc_port}") as channel):
        stub = pb_grpc.InferenceStub(channel)

        async def worker(index: int) -> None:
            count = 0
            while time.monotonic() < deadline:
                prompt, max_tokens = rng.choice(keys)
                cancel = rng.random() < config.cancel_fraction
                over_grpc = (index + count) % 2 == 1
                count += 1
                label = f"{'grpc' if over_grpc else 'http'} {prompt!r} {max_tokens}"
                try:
                    if over_grpc:
                        got = await _grpc_request(stub, prompt, max_tokens, cancel,
                                                  config.request_timeout_s)
                    else:
                        got = await _http_request(session, base, prompt, max_tokens, cancel)
                except Exception as error:  # anything but the outcome asked for is a loss
                    report.lost.append(f"{label}: {error!r}"[:300])
                    continue
                if cancel:
                    report.cancelled += 1
                    continue
                report.completed += 1
                text, ids = references[(prompt, max_tokens)]
                if got != (list(ids) if over_grpc else text):
                    report.wrong.append(f"{label}: got {got!r}"[:300])

        async def slow_reader() -> None:
            while time.monotonic() < deadline:
                body = json.dumps({"prompt": keys[0][0], "max_tokens":
                                   config.slow_reader_max_tokens, "ignore_eos": True,
                                   "temperature": 0, "stream": True}).encode()
                _, writer = await asyncio.open_connection(host, http_port)
                writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: " + host.encode()
                             + b"\r\nContent-Type: application/json\r\nContent-Length: "
                             + str(len(body)).encode() + b"\r\n\r\n" + body)
                await writer.drain()
                report.slow_readers += 1
                await asyncio.sleep(min(config.slow_reader_hold_s,
                                        max(deadline - time.monotonic(), 0.0)))
                writer.close()
                with contextlib.suppress(Exception):
                    await writer.wait_closed()

        async def hostile() -> None:
            while time.monotonic() < deadline:
                body, status = rng.choice(HOSTILE)
                report.hostile += 1
                try:
                    async with session.post(f"{base}/v1/completions",
                                            json={"model": None, **body}) as response:
                        await response.read()
                        if response.status != status:
                            report.hostile_unexpected.append(
                                f"{list(body)}: {response.status}, expected {status}")
                except Exception as error:
                    report.hostile_unexpected.append(f"{list(body)}: {error!r}"[:300])
                await asyncio.sleep(config.hostile_interval_s)

        async def sample_rss() -> None:
            while time.monotonic() < deadline:
                report.rss_bytes.append((time.monotonic() - started, rss()))
                await asyncio.sleep(config.rss_interval_s)

        await asyncio.gather(*(worker(index) for index in range(config.streams)),
                             *(slow_reader() for _ in range(config.slow_readers)),
                             hostile(), sample_rss())
    report.seconds = time.monotonic() - started
    return report


async def _http_request(session: aiohttp.ClientSession, base: str, prompt: str,
                        max_tokens: int, cancel: bool) -> str:
    """One streamed greedy completion; its text (or "" once cancelled after a chunk)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    text = []
    async with session.post(f"{base}/v1/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"status {response.status}: {(await response.text())[:200]}")
        async for line in response.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"error event: {chunk['error']}")
            text.append(chunk["choices"][0]["text"])
            if cancel:
                return ""  # leaving the block closes the connection: the server aborts
    return "".join(text)


async def _grpc_request(stub: pb_grpc.InferenceStub, prompt: str, max_tokens: int,
                        cancel: bool, timeout: float) -> list[int]:
    """One streamed greedy Generate; its token ids (or [] once cancelled after a chunk)."""
    call = stub.Generate(build_request(prompt, temperature=0, max_tokens=max_tokens),
                         timeout=timeout)
    ids: list[int] = []
    async for chunk in call:
        for output in chunk.outputs:
            ids.extend(output.token_ids)
        if cancel:
            call.cancel()
            return []
    return ids
