"""The engine for servers: its loop runs in one background thread; asyncio code talks to it.

    engine = AsyncEngine(load_engine("builtin:demo", max_num_seqs=32))
    engine.start()                     # compiles (warm-up), then serves
    async for output in engine.generate("The list type", SamplingParams(max_tokens=64)):
        print(output.outputs[0].text)  # cumulative; the last one has `finished`
    await engine.abort(request_id)     # or just stop iterating: that aborts too
    engine.shutdown()

One thread owns the `Engine` and calls `step()` while any request is unfinished, and sleeps
otherwise; requests are added and aborted under the same lock, between steps. Each
`generate` call gets an `asyncio.Queue` on its own event loop, fed with
`loop.call_soon_threadsafe`, so any number of coroutines (one per HTTP or gRPC request) wait
without blocking the loop. A bad request raises `ValueError` from `generate` before anything
is queued and every other request carries on; an error inside the engine step itself is
raised in every open stream and leaves the engine `errored` (a server's health check).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import AsyncIterator
from typing import Any

from jaxinfer.engine.core import Engine, EngineStats, Prompt
from jaxinfer.engine.outputs import RequestOutput
from jaxinfer.engine.sampling_params import SamplingParams


class EngineDeadError(RuntimeError):
    """The engine loop failed or was shut down; no request can be served."""


class _Stream:
    """Delivers one request's outputs from the engine thread to the coroutine awaiting them."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> bool:
        """Hands `item` over; False if the coroutine's loop is gone."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop was closed
            return False
        return True


class AsyncEngine:
    """Runs an `Engine` in a background thread and serves asyncio callers.

    Args:
        engine: The engine to drive; this object owns it from now on.
        warm_up: Compile every step shape in `start()`, before serving.
        idle_wait_seconds: Longest sleep of the idle loop between checks.
    """

    def __init__(self, engine: Engine, *, warm_up: bool = True,
                 idle_wait_seconds: float = 0.5) -> None:
        self.engine = engine
        self._warm_up = warm_up
        self._idle_wait_seconds = idle_wait_seconds
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.error: BaseException | None = None
        self.warm_up_seconds: float | None = None

    @classmethod
    def from_pretrained(cls, model: str, *, warm_up: bool = True, **options: Any
                        ) -> AsyncEngine:
        """`AsyncEngine(load_engine(model, **options))`, not yet started."""
        from jaxinfer.engine.factory import load_engine

        return cls(load_engine(model, **options), warm_up=warm_up)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Warms up (if asked) and starts the engine thread; idempotent."""
        if self._thread is not None:
            return
        if self._warm_up:
            self.warm_up_seconds = self.engine.warm_up()
        self._thread = threading.Thread(target=self._loop, name="jaxinfer-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        """Stops the thread; open streams end with EngineDeadError."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
        self._fail_all(EngineDeadError("the engine was shut down"))

    @property
    def is_running(self) -> bool:
        """Whether the engine thread is alive and has not failed."""
        return (self._thread is not None and self._thread.is_alive() and self.error is None
                and not self._stopping)

    @property
    def errored(self) -> bool:
        """Whether the engine loop died with an error (see `error`)."""
        return self.error is not None

    @property
    def num_unfinished_requests(self) -> int:
        """Requests being served now."""
        return len(self._streams)

    def stats(self) -> EngineStats:
        """The engine's `stats()`, taken between steps."""
        with self._lock:
            return self.engine.stats()

    # ------------------------------------------------------------------ requests

    async def generate(self, prompt: Prompt, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, *, cache_salt: str | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Serves one request; yields its cumulative output after every step that changes it.

        Leaving the `async for` early (a client disconnect, a cancelled task) aborts the
        request and frees its pages.

        Args:
            prompt: Text, token ids or a `{"prompt_token_ids": [...]}` dict.
            sampling_params: None for the defaults.
            request_id: Unique among running requests; None picks one.
            cache_salt: Keeps the request's prefix-cache blocks apart from other salts.

        Raises:
            ValueError: An invalid request (nothing is queued; others carry on).
            EngineDeadError: The engine is not running.
        """
        if not self.is_running:
            raise EngineDeadError(f"the engine is not running: {self.error!r}"
                                  if self.error else "the engine is not running (start() it)")
        if request_id is None:
            request_id = f"request-{next(self._ids)}"
        stream = _Stream(asyncio.get_running_loop())
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self.engine.add_request(request_id, prompt, sampling_params, cache_salt=cache_salt)
            self._streams[request_id] = stream
        self._wake.set()
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self._abort_now(request_id)

    async def abort(self, request_id: str) -> bool:
        """Aborts a request; its stream yields a last output with finish_reason "abort".

        Returns:
            False if the request was not running.
        """
        return self._abort_now(request_id)

    def _abort_now(self, request_id: str) -> bool:
        with self._lock:
            stream = self._streams.pop(request_id, None)
            output = self.engine.abort_request(request_id)
        if stream is not None and output is not None:
            output.finished = True
            stream.put(output)
        return output is not None

    # ------------------------------------------------------------------ the thread

    def _loop(self) -> None:
        while not self._stopping:
            with self._lock:
                busy = self.engine.has_unfinished_requests()
            if not busy:
                self._wake.wait(self._idle_wait_seconds)
                self._wake.clear()
                continue
            try:
                with self._lock:
                    outputs = self.engine.step()
                    streams = [(self._streams.get(output.request_id), output)
                               for output in outputs]
                    for output in outputs:
                        if output.finished:
                            self._streams.pop(output.request_id, None)
            except Exception as error:  # a device or engine bug: nothing can continue
                self.error = error
                self._fail_all(EngineDeadError(f"the engine step failed: {error!r}"))
                return
            for stream, output in streams:
                if stream is not None and not stream.put(output):
                    self._abort_now(output.request_id)  # nobody is listening any more

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            streams, self._streams = self._streams, {}
            for request_id in streams:
                self.engine.abort_request(request_id)
        for stream in streams.values():
            stream.put(error)
