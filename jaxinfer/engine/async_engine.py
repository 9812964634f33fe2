"""The engine for servers: one background thread owns it; asyncio code sends it commands.

    engine = AsyncEngine(load_engine("builtin:demo", max_num_seqs=32))
    engine.start()                     # compiles (warm-up), then serves
    async for output in engine.generate("The list type", SamplingParams(max_tokens=64)):
        print(output.outputs[0].text)  # cumulative; the last one has `finished`
    await engine.abort(request_id)     # or just stop iterating: that aborts too
    engine.shutdown()

Only the engine thread touches the `Engine` (or `DataParallelEngine`). Adding and aborting a
request are commands put on a thread-safe queue; the thread applies every queued command
between two steps, in the order they were issued (so an abort issued after an add of the same
id applies after it), and answers each through a `concurrent.futures.Future` that the caller
awaits with `asyncio.wrap_future`. No lock is held across a step, so a slow device step never
stalls the event loop: a command issued during a step simply completes after it. When no
request is unfinished the thread blocks on the queue, so a command wakes it at once.

After every step and every batch of commands the thread publishes an immutable `EngineStats`
snapshot; `stats()` returns the latest one without waiting, at most one step old.

Each `generate` call gets a one-item mailbox on its own event loop, fed with
`loop.call_soon_threadsafe` in step order, so any number of coroutines (one per HTTP or gRPC
request) wait without blocking the loop. A consumer that falls behind (a slow client) never
builds a backlog: a new output is merged into the unread one (DELTA outputs are concatenated
with `RequestOutput.add`, a cumulative one replaces it, an error replaces anything), so the
next read returns everything it missed in one item, and a stream holds O(unread output) memory
whatever the number of steps. A bad request raises `ValueError` from `generate`
before anything is yielded or queued and every other request carries on; an error inside the
engine loop itself is raised in every open stream and leaves the engine `errored` (a server's
health check); `stopped`, a future settled as the loop ends (with that error, or None after a
shutdown), lets a server notice at once and exit. A request the engine fails on alone (see
`jaxinfer.engine.core`) is no engine error: its stream ends with an output whose `error` is set.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import itertools
import queue
import threading
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from jaxinfer.engine.client import EngineClient, EngineStats
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.errors import RequestError
from jaxinfer.engine.input_processor import Prompt
from jaxinfer.engine.outputs import RequestOutput
from jaxinfer.engine.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from jaxinfer.config import ModelConfig
    from jaxinfer.tokenizer import Tokenizer


class EngineDeadError(RuntimeError):
    """The engine loop failed or was shut down; no request can be served."""


class _Stream:
    """Delivers one request's outputs from the engine thread to the coroutine awaiting them.

    Holds at most one unread item (see the module docstring): outputs that arrive while the
    consumer is behind are merged into it.

    Args:
        loop: The consumer's event loop.
        delta: The request asked for DELTA outputs (merged by concatenation; others replace).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, *, delta: bool = False) -> None:
        self.loop = loop
        self.delta = delta
        self.pending: RequestOutput | BaseException | None = None  # the unread item
        self.num_merged = 0  # items folded into an unread one instead of queued after it
        self._ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> bool:
        """Hands `item` over (from any thread); False if the coroutine's loop is gone."""
        try:
            self.loop.call_soon_threadsafe(self._deliver, item)
        except RuntimeError:  # the event loop was closed
            return False
        return True

    def _deliver(self, item: RequestOutput | BaseException) -> None:
        """On the consumer's loop: stores `item`, merged into the unread one if any."""
        pending = self.pending
        if pending is not None:
            self.num_merged += 1
        if pending is None or isinstance(item, BaseException):
            self.pending = item  # an error wins over the outputs it interrupts
        elif isinstance(pending, BaseException):
            pass  # nothing comes after an error
        elif self.delta:
            pending.add(item)  # a fresh object from the engine thread, now only ours
        else:
            self.pending = item  # cumulative (or final): the newest says it all
        self._ready.set()

    async def get(self) -> RequestOutput | BaseException:
        """The unread item (everything since the previous `get`), once there is one."""
        await self._ready.wait()
        item, self.pending = self.pending, None
        self._ready.clear()
        assert item is not None
        return item


class _Command:
    """A call for the engine thread to make between steps, and the future of its result."""

    def __init__(self, call: Callable[[], Any]) -> None:
        self.call = call
        self.future: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def apply(self) -> None:
        """Runs the call (unless the caller cancelled it first) and settles the future."""
        if not self.future.set_running_or_notify_cancel():
            return  # the caller gave up while it waited in the queue: it never happened
        try:
            result = self.call()
        except Exception as error:  # the caller's error (e.g. ValueError), not the engine's
            self.future.set_exception(error)
        else:
            self.future.set_result(result)


def _may_have_been_added(future: concurrent.futures.Future[Any]) -> bool:
    """Whether the add command behind `future` ran, or still may, with success."""
    if not future.done():
        return True
    return not future.cancelled() and future.exception() is None


class AsyncEngine:
    """Runs an `Engine` in a background thread and serves asyncio callers.

    Args:
        engine: The engine to drive (an `EngineClient`: an `Engine` or a
            `DataParallelEngine`); this object owns it from now on: once started, only the
            engine thread touches it.
        warm_up: Compile every step shape in `start()`, before serving.
        idle_wait_seconds: Longest block of the idle loop on the command queue before it
            checks again for shutdown (a command wakes it at once).
    """

    def __init__(self, engine: EngineClient, *, warm_up: bool = True,
                 idle_wait_seconds: float = 0.5) -> None:
        self.engine = engine
        self._warm_up = warm_up
        self._idle_wait_seconds = idle_wait_seconds
        self._commands: queue.SimpleQueue[_Command | None] = queue.SimpleQueue()
        # Makes "not closed, so queue it" atomic against the thread closing the queue; held
        # only for that check and put, never across a step.
        self._submit_lock = threading.Lock()
        self._closed = False
        self._streams: dict[str, _Stream] = {}  # read by other threads only for its length
        self._snapshot: EngineStats = engine.stats()
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.error: BaseException | None = None
        # Settled once the engine stops serving for good (shut down or failed): its result is
        # the error, or None. A server watches it to fail loudly.
        self.stopped: concurrent.futures.Future[BaseException | None] = (
            concurrent.futures.Future())
        self.warm_up_seconds: float | None = None

    @classmethod
    def from_pretrained(cls, model: str, *, warm_up: bool = True, **options: Any
                        ) -> AsyncEngine:
        """`AsyncEngine(load_engine(model, **options))`, not yet started."""
        from jaxinfer.engine.factory import load_engine

        return cls(load_engine(model, **options), warm_up=warm_up)

    # ------------------------------------------------------------------ facts

    # Fixed when the engine is built, so any thread may read them while the engine steps.

    @property
    def tokenizer(self) -> Tokenizer | None:
        """The engine's tokenizer (None for a token-ids-only model)."""
        return self.engine.tokenizer

    @property
    def model_config(self) -> ModelConfig:
        """The served model's config (vocab_size, eos_token_ids, ...)."""
        return self.engine.model_config

    @property
    def config(self) -> EngineConfig:
        """The engine's resolved config (max_num_seqs, num_pages, ...)."""
        return self.engine.config

    @property
    def max_model_len(self) -> int:
        """Longest sequence (prompt + output) the engine serves."""
        return self.engine.config.max_model_len

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Warms up (if asked) and starts the engine thread; idempotent."""
        if self._thread is not None:
            return
        if self._warm_up:
            self.warm_up_seconds = self.engine.warm_up()
            self._snapshot = self.engine.stats()
        self._thread = threading.Thread(target=self._loop, name="jaxinfer-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        """Stops the thread after its current step; open streams end with EngineDeadError.

        Commands still queued then are answered as on a stopped engine: adds raise
        EngineDeadError, aborts return False once the request is gone.
        """
        self._stopping = True
        self._commands.put(None)  # wakes an idle thread
        if self._thread is not None:
            self._thread.join()
        else:
            self._close(EngineDeadError("the engine was shut down"))

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
        """Requests being served now (added and neither finished nor aborted)."""
        return len(self._streams)

    def stats(self) -> EngineStats:
        """The engine's stats as of its last step or command; never waits.

        The engine thread publishes a fresh snapshot after every step and every batch of
        commands, so during a step this describes the state the step started from: it is at
        most one step old.
        """
        return self._snapshot

    # ------------------------------------------------------------------ requests

    async def generate(self, prompt: Prompt, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, *, cache_salt: str | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Serves one request; yields its output after every step that changes it (shaped by
        its `output_kind`), or, for a consumer that fell behind, after the steps it missed,
        merged.

        The request is added between two engine steps, so the first `__anext__` may wait for
        the step in progress. Leaving the `async for` early (a client disconnect, a
        cancelled task) aborts the request and frees its pages before the iterator closes.

        Args:
            prompt: Text, token ids or a `{"prompt_token_ids": [...]}` dict.
            sampling_params: None for the defaults.
            request_id: Unique among running requests; None picks one.
            cache_salt: Keeps the request's prefix-cache blocks apart from other salts.

        Raises:
            ValueError: An invalid request, raised before anything is yielded (nothing is
                queued; others carry on).
            EngineDeadError: The engine is not running.
        """
        if not self.is_running:
            raise EngineDeadError(self._dead_message())
        if request_id is None:
            request_id = f"request-{next(self._ids)}"
        delta = (sampling_params is not None
                 and sampling_params.output_kind is RequestOutputKind.DELTA)
        stream = _Stream(asyncio.get_running_loop(), delta=delta)
        added = self._submit(functools.partial(
            self._add_now, request_id, prompt, sampling_params, cache_salt, stream))
        if added is None:
            raise EngineDeadError(self._dead_message())
        finished = False
        try:
            await asyncio.wrap_future(added)  # raises the engine's ValueError
            while not finished:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished and _may_have_been_added(added):
                # Queued after the add, so it applies after it; `stream` keeps it from
                # aborting another request that holds the id (when this add was refused).
                aborted = self._submit(functools.partial(self._abort_now, request_id, stream))
                if aborted is not None:
                    await asyncio.shield(asyncio.wrap_future(aborted))

    async def abort(self, request_id: str) -> bool:
        """Aborts a request; its stream yields a last output with finish_reason "abort".

        The abort applies between steps, after every command issued before it (an add of the
        same id included). Cancelling the caller does not withdraw it.

        Returns:
            False if the request was not running.
        """
        aborted = self._submit(functools.partial(self._abort_now, request_id, None))
        if aborted is None:
            return False  # the engine is stopped: nothing is running
        return await asyncio.shield(asyncio.wrap_future(aborted))

    def _submit(self, call: Callable[[], Any]) -> concurrent.futures.Future[Any] | None:
        """Queues `call` for the engine thread; None if the engine no longer takes commands."""
        command = _Command(call)
        with self._submit_lock:
            if self._closed:
                return None
            self._commands.put(command)
        return command.future

    def _dead_message(self) -> str:
        if self.error is not None:
            return f"the engine is not running: {self.error!r}"
        if self._stopping:
            return "the engine is not running (it was shut down)"
        return "the engine is not running (start() it)"

    # ------------------------------------------------------------------ the thread

    def _add_now(self, request_id: str, prompt: Prompt, sampling_params: SamplingParams | None,
                 cache_salt: str | None, stream: _Stream) -> None:
        if self._closed:
            raise EngineDeadError(self._dead_message())
        if request_id in self._streams:
            raise RequestError("request_id", f"request id {request_id!r} is already in use")
        self.engine.add_request(request_id, prompt, sampling_params, cache_salt=cache_salt)
        self._streams[request_id] = stream

    def _abort_now(self, request_id: str, stream: _Stream | None = None) -> bool:
        """Aborts `request_id` (only if it is served to `stream`, when one is given)."""
        if stream is not None and self._streams.get(request_id) is not stream:
            return False
        stream = self._streams.pop(request_id, None)
        output = self.engine.abort_request(request_id)
        if stream is not None and output is not None:
            output.finished = True
            stream.put(output)
        return output is not None

    def _loop(self) -> None:
        try:
            while not self._stopping:
                if self._apply_commands(block=not self.engine.has_unfinished_requests()):
                    self._snapshot = self.engine.stats()
                if self._stopping or not self.engine.has_unfinished_requests():
                    continue
                outputs = self.engine.step()
                for output in outputs:
                    stream = (self._streams.pop(output.request_id, None) if output.finished
                              else self._streams.get(output.request_id))
                    if stream is not None and not stream.put(output):
                        self._abort_now(output.request_id)  # nobody is listening any more
                self._snapshot = self.engine.stats()
        except Exception as error:  # a device or engine bug: nothing can continue
            self.error = error
            self._close(EngineDeadError(f"the engine step failed: {error!r}"))
        else:
            self._close(EngineDeadError("the engine was shut down"))

    def _apply_commands(self, *, block: bool) -> bool:
        """Applies the queued commands, in order; True if there were any.

        Takes only those queued when it starts, so a flood of commands cannot starve the
        steps. With `block`, waits (up to `idle_wait_seconds`) for the first one.
        """
        commands = []
        if block:
            try:
                commands.append(self._commands.get(timeout=self._idle_wait_seconds))
            except queue.Empty:
                return False
        for _ in range(self._commands.qsize()):  # only this thread takes from the queue
            commands.append(self._commands.get_nowait())
        for command in commands:
            if command is not None:  # None only wakes the thread (shutdown)
                command.apply()
        return bool(commands)

    def _close(self, error: EngineDeadError) -> None:
        """Stops taking commands, answers those left, ends every open stream with `error`."""
        with self._submit_lock:
            self._closed = True
        if not self.stopped.done():
            # First, so that watchers (a server's health) hear of it before the streams do.
            self.stopped.set_result(self.error)
        self._apply_commands(block=False)  # adds now raise EngineDeadError; aborts still work
        streams, self._streams = self._streams, {}
        for request_id, stream in streams.items():
            # A broken engine may fail to free the pages; the streams must end all the same.
            with contextlib.suppress(Exception):
                self.engine.abort_request(request_id)
            stream.put(error)
        with contextlib.suppress(Exception):  # a broken engine keeps its last snapshot
            self._snapshot = self.engine.stats()
