"""What users get back (vLLM's shapes): `RequestOutput` holding `CompletionOutput`s, with the
request's speculative-decoding counters (`jaxinfer.engine.host.draft.SpecStats`) and the times
it reached each stage in the engine (`RequestTimes`)."""

from __future__ import annotations

import dataclasses

from jaxinfer.engine.host.draft import SpecStats


@dataclasses.dataclass
class CompletionOutput:
    """One generated sample of a request.

    Attributes:
        index: Which of the request's n samples this is.
        text: The generated text (stop string excluded unless asked for).
        token_ids: The generated token ids.
        finish_reason: "stop" (a stop token or string), "length" (max_tokens or the model's
            length), "abort", "error" (the engine failed on this request alone, see
            `RequestOutput.error`), or None while generating.
        stop_reason: The stop string or stop token id that ended it, if any.
        logprobs: Per generated token, {token_id: logprob} of the chosen token and the top
            alternatives, when requested; else None.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[dict[int, float]] | None = None

    @property
    def finished(self) -> bool:
        """Whether this sample is done."""
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestTimes:
    """When a request reached each stage in the engine, in `time.monotonic()` seconds (vLLM's
    request-phase metrics are differences of these).

    Attributes:
        arrival_time: The engine took the request.
        first_scheduled_time: A step first ran one of its samples; None before.
        first_token_time: Its first generated token; None before.
        last_token_time: Its latest generated token; None before the first.
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None

    @property
    def queue_seconds(self) -> float | None:
        """Waiting before its first step."""
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def prefill_seconds(self) -> float | None:
        """First step to first token (the prompt's prefill, chunks included)."""
        if self.first_scheduled_time is None or self.first_token_time is None:
            return None
        return self.first_token_time - self.first_scheduled_time

    @property
    def inference_seconds(self) -> float | None:
        """First step to last token (prefill and decode)."""
        if self.first_scheduled_time is None or self.last_token_time is None:
            return None
        return self.last_token_time - self.first_scheduled_time


@dataclasses.dataclass
class RequestOutput:
    """A request's prompt and its samples so far.

    Attributes:
        request_id: The request.
        prompt: The prompt text, if it was given as text.
        prompt_token_ids: The prompt's token ids.
        outputs: One CompletionOutput per sample (n of them).
        finished: Whether every sample is done.
        prompt_logprobs: When requested, None for the first prompt token and then one
            {token_id: logprob} dict per prompt token (the token itself and the top
            alternatives), once the whole prompt is computed; else None.
        speculative: The request's speculative-decoding counters (all samples together),
            when the engine speculates; else None.
        error: Why the engine gave up on this request alone (its unfinished samples end with
            finish_reason "error"); None otherwise. A server answers it with an error.
        times: When the request reached each stage in the engine (a copy, as of this
            output); None where the engine did not record them.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[dict[int, float] | None] | None = None
    speculative: SpecStats | None = None
    error: str | None = None
    times: RequestTimes | None = None

    def add(self, delta: RequestOutput) -> None:
        """Appends a DELTA output of the same request (`SamplingParams.output_kind`), so a
        consumer can keep the cumulative output without the engine copying it every step."""
        samples = {sample.index: sample for sample in self.outputs}
        for new in delta.outputs:
            sample = samples.get(new.index)
            if sample is None:
                sample = samples[new.index] = CompletionOutput(new.index, "", [])
                self.outputs.append(sample)
                self.outputs.sort(key=lambda output: output.index)
            sample.text += new.text
            sample.token_ids.extend(new.token_ids)
            if new.logprobs is not None:
                sample.logprobs = (sample.logprobs or []) + list(new.logprobs)
            sample.finish_reason = new.finish_reason
            sample.stop_reason = new.stop_reason
        self.finished = delta.finished
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.speculative is not None:
            self.speculative = delta.speculative
        if delta.error is not None:
            self.error = delta.error
        if delta.times is not None:
            self.times = delta.times

    def snapshot(self) -> RequestOutput:
        """An independent copy (later `add`s do not change it)."""
        return RequestOutput(
            self.request_id, self.prompt, list(self.prompt_token_ids),
            [dataclasses.replace(sample, token_ids=list(sample.token_ids),
                                 logprobs=None if sample.logprobs is None
                                 else list(sample.logprobs)) for sample in self.outputs],
            self.finished, prompt_logprobs=self.prompt_logprobs,
            speculative=None if self.speculative is None
            else self.speculative.copy(), error=self.error,
            times=None if self.times is None else dataclasses.replace(self.times))
