"""Host-side output processing: samples, parent requests, logprobs, stop strings, deltas.

The scheduler reports new token ids per scheduler request ("ID", or "ID#i" for sample i of a
request with n > 1); the runner reports logprobs. `OutputProcessor` turns them into what users
get (`jaxinfer.engine.outputs.RequestOutput`), one per user request that changed, shaped by the
request's `output_kind`:

- CUMULATIVE: the whole text, tokens and logprobs so far (a snapshot);
- DELTA: only what is new since the request's previous output: new text, new token ids, new
  logprobs, the finish reason once. Nothing grows per step, so a server streaming deltas does
  O(new tokens) work per step; concatenating a request's deltas gives its cumulative output;
- FINAL_ONLY: one cumulative output when the request finishes.

Stop *strings* live here, because they are text: a stop string may span several tokens and
several streamed chunks, so each new piece of text is searched together with the tail of the
text before it. When one is found the sample ends there (the engine aborts its scheduler
request), its text is cut before the stop string (or after it, with
`include_stop_str_in_output`), and `stop_reason` names it. While stop strings are pending,
streamed text holds back the last `len(longest stop) - 1` characters, so text once shown is
never taken back, which is what makes deltas well defined.

A failure in one request's host work here (detokenizing, stop strings, logprob dicts, building
its output) fails that request alone: its samples end with finish_reason "error", its output
carries the `error`, and the engine aborts its scheduler requests (freeing their pages), while
every other request of the step carries on as if nothing happened.

No jax here: runner results are read through their attributes only.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import numpy as np

from jaxinfer.detokenizer import IncrementalDetokenizer
from jaxinfer.engine.host.draft import SpecStats
from jaxinfer.engine.input_processor import ProcessedRequest, child_request_id
from jaxinfer.engine.outputs import CompletionOutput, RequestOutput, RequestTimes
from jaxinfer.engine.sampling_params import RequestOutputKind, SamplingParams
from jaxinfer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


def logprob_dict(token_id: int, logprob: float, top_ids: np.ndarray,
                 top_values: np.ndarray) -> dict[int, float]:
    """{chosen token: logprob, then the top alternatives}, as vLLM reports one position.

    `top_ids` and `top_values` are one position's `[M]` top logprobs, or their first entries
    (as many as the request asked for).
    """
    entry = {int(token_id): logprob}
    for top_id, value in zip(top_ids.tolist(), top_values.tolist(), strict=True):
        entry.setdefault(int(top_id), float(value))
    return entry


class SampleState:
    """The growing output of one sample (one of a request's n).

    Args:
        index: The sample's index within its request.
        prompt_token_ids: The prompt (context for the first decoded piece).
        tokenizer: For text; None leaves `text` empty (token ids only).
        stop_strings: Strings that end the sample.
        include_stop_str_in_output: Keep the stop string at the end of the text.
        skip_special_tokens: Leave special tokens out of the text.
        stop_token_ids: The ids that end the sample (EOS and stop_token_ids); when given, a
            "stop" whose last token is none of them (a structured-output grammar completed)
            reports no `stop_reason`, as vLLM reports an EOS stop. None: the last token is
            always the reason.
    """

    def __init__(self, index: int, prompt_token_ids: Sequence[int], tokenizer: Tokenizer | None,
                 stop_strings: Sequence[str] = (), include_stop_str_in_output: bool = False,
                 skip_special_tokens: bool = True,
                 stop_token_ids: Sequence[int] | None = None) -> None:
        self.index = index
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, float]] | None = None
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self._detokenizer = (None if tokenizer is None else IncrementalDetokenizer(
            tokenizer, prompt_token_ids, skip_special_tokens=skip_special_tokens))
        self._stop_strings = tuple(stop for stop in stop_strings if stop)
        self._include_stop = include_stop_str_in_output
        self._stop_token_ids = None if stop_token_ids is None else frozenset(stop_token_ids)
        self._hold_back = max((len(stop) for stop in self._stop_strings), default=1) - 1
        self._text = ""
        self._searched = 0  # characters already searched for stop strings
        # What the previous delta reported: text characters, tokens, and the finish.
        self._sent_text = 0
        self._sent_tokens = 0
        self._sent_finish = False

    @property
    def finished(self) -> bool:
        """Whether the sample is done."""
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        """The text so far; while unfinished, without the tail a stop string might claim."""
        return self._text[:self._shown()]

    def _shown(self) -> int:
        """How many characters of the text may be shown now."""
        if self.finished or not self._hold_back:
            return len(self._text)
        # The last len(longest stop) - 1 characters may be the start of a stop string that
        # the next tokens complete; showing them now could mean taking them back later.
        return max(0, len(self._text) - self._hold_back)

    def add(self, new_token_ids: Sequence[int], finish_reason: str | None = None,
            logprobs: Sequence[dict[int, float]] | None = None) -> bool:
        """Appends tokens the engine produced; returns True if a stop string ended the sample.

        Args:
            new_token_ids: The new tokens.
            finish_reason: The engine's reason if the request finished with these tokens.
            logprobs: One {token_id: logprob} dict per new token, if requested.
        """
        if self.finished:
            return False
        self.token_ids.extend(int(token) for token in new_token_ids)
        if logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(logprobs)
        if self._detokenizer is not None:
            self._detokenizer.add_tokens(new_token_ids)
            if finish_reason is not None:
                self._detokenizer.flush()
            self._text = self._detokenizer.text
        if self._stop_strings and self._find_stop_string():
            return True
        if finish_reason is not None:
            self.finish_reason = finish_reason
            if finish_reason == "stop" and self.token_ids and (
                    self._stop_token_ids is None or self.token_ids[-1] in self._stop_token_ids):
                self.stop_reason = self.token_ids[-1]
        return False

    def _find_stop_string(self) -> bool:
        best: tuple[int, str] | None = None
        for stop in self._stop_strings:
            # A match may start in text seen before, up to len(stop) - 1 characters back.
            found = self._text.find(stop, max(0, self._searched - len(stop) + 1))
            if found >= 0 and (best is None or found < best[0]):
                best = (found, stop)
        if best is None:
            self._searched = len(self._text)
            return False
        position, stop = best
        self._text = self._text[:position + (len(stop) if self._include_stop else 0)]
        self.finish_reason, self.stop_reason = "stop", stop
        return True

    def output(self) -> CompletionOutput:
        """The sample as a CompletionOutput (a snapshot)."""
        return CompletionOutput(self.index, self.text, list(self.token_ids), self.finish_reason,
                                self.stop_reason,
                                None if self.logprobs is None else list(self.logprobs))

    def delta(self) -> CompletionOutput | None:
        """What is new since the previous delta (None when nothing is)."""
        shown = self._shown()
        new_text = self._text[self._sent_text:shown]  # O(new text): no copy of the rest
        start = self._sent_tokens
        finishing = self.finished and not self._sent_finish
        if not (new_text or len(self.token_ids) > start or finishing):
            return None
        self._sent_text, self._sent_tokens = shown, len(self.token_ids)
        self._sent_finish = self.finished
        return CompletionOutput(self.index, new_text, self.token_ids[start:], self.finish_reason,
                                self.stop_reason,
                                None if self.logprobs is None else self.logprobs[start:])


class RequestState:
    """One user request: its prompt, parameters, samples, prompt logprobs and counters."""

    def __init__(self, processed: ProcessedRequest, tokenizer: Tokenizer | None) -> None:
        params = processed.params
        self.request_id = processed.request_id
        self.prompt = processed.prompt
        self.prompt_token_ids = processed.prompt_token_ids
        self.params: SamplingParams = params
        self.kind = params.output_kind
        # A constrained request may also stop because its grammar is complete.
        stop_token_ids = (processed.samples[0].eos_token_ids
                          if processed.grammar is not None else None)
        self.samples = [SampleState(index, self.prompt_token_ids, tokenizer, params.stop_strings,
                                    params.include_stop_str_in_output,
                                    params.skip_special_tokens, stop_token_ids)
                        for index in range(params.n)]
        # vLLM's format: None for the first prompt token, then a dict per prompt token.
        self.prompt_logprobs: list[dict[int, float] | None] | None = (
            None if params.prompt_logprobs is None else [None])
        self._prompt_logprobs_sent = False
        self.speculative: SpecStats | None = (
            SpecStats() if processed.speculate else None)
        self.times = RequestTimes(time.monotonic())

    @property
    def finished(self) -> bool:
        return all(sample.finished for sample in self.samples)

    def sample_ids(self) -> list[str]:
        """The scheduler ids of the request's samples, in order."""
        return [child_request_id(self.request_id, index, self.params.n)
                for index in range(self.params.n)]

    def add_prompt_logprobs(self, chunk: Any) -> None:
        """Records a chunk's prompt logprobs (`jaxinfer.engine.device.runner.PromptLogprobs`);
        positions already known, e.g. recomputed after a preemption, are skipped."""
        known = len(self.prompt_logprobs)
        top = self.params.prompt_logprobs
        for row in range(len(chunk.logprobs)):
            position = chunk.first_position + row
            if position < known:
                continue
            token = self.prompt_token_ids[position]
            self.prompt_logprobs.append(logprob_dict(
                token, float(chunk.logprobs[row]), chunk.top_token_ids[row][:top],
                chunk.top_logprobs[row][:top]))

    def _complete_prompt_logprobs(self) -> list[dict[int, float] | None] | None:
        if self.prompt_logprobs is not None and len(self.prompt_logprobs) == len(
                self.prompt_token_ids):
            return list(self.prompt_logprobs)
        return None

    def fail(self, error: str) -> RequestOutput:
        """Ends every unfinished sample with finish_reason "error"; returns the final output.

        The request's own state may be what broke, so when its usual output cannot be built
        the final output reports the samples' finish reasons with no new text or tokens.
        """
        for sample in self.samples:
            if not sample.finished:
                sample.finish_reason = "error"
        try:
            output = self.output(final=True)
        except Exception:  # any failure: the error output must still go out
            output = None
        if output is None:
            output = RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, [
                CompletionOutput(sample.index, "", [], sample.finish_reason)
                for sample in self.samples], True)
        output.finished = True
        output.error = error
        return output

    def output(self, final: bool = False) -> RequestOutput | None:
        """The request's output after a change, shaped by its `output_kind`; None when the
        kind has nothing to say now (FINAL_ONLY before the end, a DELTA with nothing new).

        Args:
            final: The request ended now (finished or aborted): always report it.
        """
        finished = final or self.finished
        if self.kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        speculative = None if self.speculative is None else self.speculative.copy()
        times = dataclasses.replace(self.times)
        if self.kind is not RequestOutputKind.DELTA:
            return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids,
                                 [sample.output() for sample in self.samples], finished,
                                 prompt_logprobs=self._complete_prompt_logprobs(),
                                 speculative=speculative, times=times)
        samples = [delta for delta in (sample.delta() for sample in self.samples)
                   if delta is not None]
        prompt_logprobs = None
        if not self._prompt_logprobs_sent:
            prompt_logprobs = self._complete_prompt_logprobs()
            self._prompt_logprobs_sent = prompt_logprobs is not None
        if not (samples or finished or prompt_logprobs is not None):
            return None
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, samples,
                             finished, prompt_logprobs=prompt_logprobs,
                             speculative=speculative, times=times)


class ProcessedStep(NamedTuple):
    """What `OutputProcessor.process` made of one step.

    Attributes:
        outputs: The outputs to hand out, one per changed user request (a failed request's
            final one included).
        stopped: Scheduler ids the scheduler must abort: samples a stop string ended, and
            every unfinished sample of a failed request.
        finished: Scheduler ids that finished in this step (stop strings and failures
            included), whose per-request state elsewhere can go.
        failed: Scheduler ids of every sample of each request that failed in this step.
    """

    outputs: list[RequestOutput]
    stopped: list[str]
    finished: list[str]
    failed: list[str]


def describe_failure(error: BaseException) -> str:
    """The message a request that failed on `error` reports (its `RequestOutput.error`): the
    kind of failure, not its text, which may quote server internals (the log has it all)."""
    return (f"the engine failed on this request ({type(error).__name__}); the others carry "
            "on, and the server log has the details")


class OutputProcessor:
    """Every unfinished user request's state, keyed by user id and by sample id."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self._requests: dict[str, RequestState] = {}
        self._samples: dict[str, tuple[RequestState, int]] = {}  # scheduler id -> sample

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def add_request(self, processed: ProcessedRequest) -> RequestState:
        """Starts tracking a checked request."""
        state = RequestState(processed, self.tokenizer)
        self._requests[processed.request_id] = state
        for index, sample_id in enumerate(state.sample_ids()):
            self._samples[sample_id] = (state, index)
        return state

    def parent_of(self, sample_id: str) -> str | None:
        """The user request id of an unfinished sample (None if it is not tracked)."""
        entry = self._samples.get(sample_id)
        return None if entry is None else entry[0].request_id

    def tracks(self, sample_id: str) -> bool:
        """Whether the sample is unfinished and its request has neither failed nor been
        aborted (a deferred sample of an n > 1 request is admitted only then)."""
        return sample_id in self._samples

    def scheduled(self, sample_ids: Iterable[str]) -> None:
        """Notes the time a step first ran each request (any of its samples)."""
        now = time.monotonic()
        for sample_id in sample_ids:
            entry = self._samples.get(sample_id)
            if entry is not None and entry[0].times.first_scheduled_time is None:
                entry[0].times.first_scheduled_time = now

    def process(self, updates: Iterable[Any], sampled: dict[str, Any],
                prompt_logprobs: dict[str, Any]) -> ProcessedStep:
        """Applies one step's results.

        A request whose own processing raises fails alone (see the module docstring): the
        exception is logged, never raised.

        Args:
            updates: The scheduler's per-request updates
                (`jaxinfer.engine.host.scheduler.RequestOutput`: new token ids, finish reason,
                draft counts).
            sampled: The runner's sampled tokens by scheduler id (logprobs read from them).
            prompt_logprobs: The runner's prompt-logprob chunks by scheduler id.
        """
        now = time.monotonic()
        failures: dict[str, tuple[RequestState, BaseException]] = {}
        for sample_id, chunk in prompt_logprobs.items():
            state = self._samples[sample_id][0]
            try:
                state.add_prompt_logprobs(chunk)
            except Exception as error:  # this request's failure alone
                failures.setdefault(state.request_id, (state, error))
        touched: dict[str, RequestState] = {}
        stopped, finished = [], []
        for update in updates:
            state, index = self._samples[update.request_id]
            if state.request_id in failures:
                continue
            try:
                if state.speculative is not None:
                    state.speculative.add(update.num_draft_tokens, update.num_accepted_tokens)
                logprobs = None
                if state.params.logprobs is not None and update.new_token_ids:
                    token = sampled[update.request_id]
                    top = state.params.logprobs
                    logprobs = [logprob_dict(token.token_id, token.logprob,
                                             token.top_token_ids[:top],
                                             token.top_logprobs[:top])]
                sample = state.samples[index]
                stop_string = sample.add(update.new_token_ids, update.finish_reason, logprobs)
                if update.new_token_ids:
                    times = state.times
                    if times.first_token_time is None:
                        times.first_token_time = now
                    times.last_token_time = now
            except Exception as error:  # this request's failure alone
                failures[state.request_id] = (state, error)
                continue
            if stop_string:
                stopped.append(update.request_id)
            if sample.finished:
                del self._samples[update.request_id]
                finished.append(update.request_id)
            touched[state.request_id] = state
        outputs = []
        for request_id, state in touched.items():
            if request_id in failures:
                continue
            try:
                output = state.output()
            except Exception as error:  # this request's failure alone
                failures[request_id] = (state, error)
                continue
            if state.finished:
                del self._requests[request_id]
            if output is not None:
                outputs.append(output)
        failed = []
        for request_id, (state, error) in failures.items():
            logger.error("request %r failed; the others carry on", request_id,
                         exc_info=error)
            unfinished = [sample_id for sample_id in state.sample_ids()
                          if sample_id in self._samples]
            output, sample_ids = self.abort(request_id, error=describe_failure(error))
            if output is None:  # it finished and was already handed out: nothing to end
                continue
            outputs.append(output)
            stopped.extend(unfinished)
            finished.extend(unfinished)
            failed.extend(sample_ids)
        return ProcessedStep(outputs, stopped, finished, failed)

    def abort(self, request_id: str, *, error: str | None = None
              ) -> tuple[RequestOutput | None, list[str]]:
        """Ends every sample of a request now.

        Args:
            request_id: The user request.
            error: Why the engine gives up on the request (it failed alone); None for an
                abort.

        Returns:
            (the request's final output, unfinished samples ending with finish_reason
            "abort", or "error" and the output's `error` set when `error` is given; or None
            if the request was not unfinished), and the scheduler ids of its samples.
        """
        state = self._requests.pop(request_id, None)
        if state is None:
            return None, []
        sample_ids = state.sample_ids()
        for sample_id in sample_ids:
            self._samples.pop(sample_id, None)
        if error is not None:
            return state.fail(error), sample_ids
        for sample in state.samples:
            if not sample.finished:
                sample.finish_reason = "abort"
        return state.output(final=True), sample_ids
