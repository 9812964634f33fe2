"""The soak test (`serve.soak`): 64 concurrent streams over HTTP and gRPC, a quarter cancelled,
clients that never read, hostile requests interleaved. Nothing is lost or wrong, every page is
free afterwards and the server's memory stays flat.

The short run is part of `make test`; the full one (3 minutes) runs under `make test-slow`, and
`benchmarks/soak.py` records its numbers in `benchmarks/results/reliability.md`.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from jaxinfer.llm import LLM
from serve.server import BackgroundServer
from serve.soak import SoakConfig, greedy_references, process_rss_bytes, run_soak
from tests.serve.conftest import ENGINE_OPTIONS, make_service, pool_is_full

MAX_RSS_GROWTH = 128 * 2 ** 20


@pytest.fixture(scope="module")
def references():
    return greedy_references(LLM("builtin:demo", **ENGINE_OPTIONS))


def _soak(references, config: SoakConfig) -> None:
    service = make_service(max_queued_requests=10_000)
    with BackgroundServer(service) as server:
        report = asyncio.run(run_soak(server.http_port, server.grpc_port, references, config,
                                      rss=process_rss_bytes))
        deadline = time.monotonic() + 60
        while not pool_is_full(service):
            assert time.monotonic() < deadline, "pages still held after the soak"
            time.sleep(0.1)
        assert service.engine.is_running
    assert report.problems(MAX_RSS_GROWTH) == []
    assert report.completed > config.streams and report.cancelled > 0
    assert report.slow_readers >= config.slow_readers and report.hostile > 0


def test_short_soak(references):
    _soak(references, SoakConfig(duration_s=40.0, slow_readers=2, slow_reader_hold_s=10.0))


@pytest.mark.slow
def test_full_soak(references):
    _soak(references, SoakConfig(duration_s=180.0))
