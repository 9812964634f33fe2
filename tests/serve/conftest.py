"""A real server on loopback ports over the built-in demo model, shared by the serve tests.

The engine is small (16 sequences, 256-token context, no warm-up: lazy compiles keep the suite
fast); `max_queued_requests` is large so only the overload test, which builds its own service,
sees 429 / RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import pytest

from jaxinfer.engine.async_engine import AsyncEngine
from jaxinfer.engine.factory import load_engine
from serve.server import BackgroundServer
from serve.service import InferenceService, ServiceConfig

# The demo tokenizer has no chat template; the chat endpoint is tested with this one.
CHAT_TEMPLATE = ("{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
                 "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
ENGINE_OPTIONS = dict(page_size=16, max_num_batched_tokens=128, max_num_seqs=16,
                      max_model_len=256, min_token_bucket=16, bucket_growth=4)


def make_service(**config) -> InferenceService:
    """A service over a fresh demo-model engine (not yet started)."""
    engine = AsyncEngine(load_engine("builtin:demo", **ENGINE_OPTIONS),
                         warm_up=False)
    config.setdefault("chat_template", CHAT_TEMPLATE)
    return InferenceService(engine, ServiceConfig(model_name="demo", **config))


@pytest.fixture(scope="session")
def server():
    """Both front ends over one engine, for the whole test session."""
    with BackgroundServer(make_service(max_queued_requests=10_000)) as running:
        yield running


def pool_is_full(service: InferenceService) -> bool:
    """No request running and every page back in the pool."""
    inner = service.engine.engine
    return (not inner.has_unfinished_requests()
            and inner.num_free_pages == inner.config.num_pages - 1)
