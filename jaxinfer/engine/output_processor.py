"""Host-side output processing: detokenization, stop strings, finish reasons, per sample.

The engine stops requests on stop token ids and lengths itself; stop *strings* live here,
because they are text: a stop string may span several tokens and several streamed chunks,
so each new piece of text is searched together with the tail of the text before it. When a
stop string is found the sample ends there (the caller aborts its engine request), its text
is cut before the stop string (or after it, with `include_stop_str_in_output`), and
`stop_reason` names it. While stop strings are pending, streamed text holds back the last
`len(longest stop) - 1` characters, so text once shown is never taken back.
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxinfer.detokenizer import IncrementalDetokenizer
from jaxinfer.engine.outputs import CompletionOutput
from jaxinfer.tokenizer import Tokenizer


class SampleState:
    """The growing output of one sample (one of a request's n).

    Args:
        index: The sample's index within its request.
        prompt_token_ids: The prompt (context for the first decoded piece).
        tokenizer: For text; None leaves `text` empty (token ids only).
        stop_strings: Strings that end the sample.
        include_stop_str_in_output: Keep the stop string at the end of the text.
        skip_special_tokens: Leave special tokens out of the text.
    """

    def __init__(self, index: int, prompt_token_ids: Sequence[int], tokenizer: Tokenizer | None,
                 stop_strings: Sequence[str] = (), include_stop_str_in_output: bool = False,
                 skip_special_tokens: bool = True) -> None:
        self.index = index
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, float]] | None = None
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self._detokenizer = (None if tokenizer is None else IncrementalDetokenizer(
            tokenizer, prompt_token_ids, skip_special_tokens=skip_special_tokens))
        self._stop_strings = tuple(stop for stop in stop_strings if stop)
        self._include_stop = include_stop_str_in_output
        self._hold_back = max((len(stop) for stop in self._stop_strings), default=1) - 1
        self._text = ""
        self._searched = 0  # characters already searched for stop strings

    @property
    def finished(self) -> bool:
        """Whether the sample is done."""
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        """The text so far; while unfinished, without the tail a stop string might claim."""
        if self.finished or not self._hold_back:
            return self._text
        # The last len(longest stop) - 1 characters may be the start of a stop string that
        # the next tokens complete; showing them now could mean taking them back later.
        return self._text[:max(0, len(self._text) - self._hold_back)]

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
            self.logprobs = (self.logprobs or []) + list(logprobs)
        if self._detokenizer is not None:
            self._detokenizer.add_tokens(new_token_ids)
            if finish_reason is not None:
                self._detokenizer.flush()
            self._text = self._detokenizer.text
        if self._stop_strings and self._find_stop_string():
            return True
        if finish_reason is not None:
            self.finish_reason = finish_reason
            if finish_reason == "stop" and self.token_ids:
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
