"""Incremental detokenization for streaming responses."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from jaxinfer.tokenizer import REPLACEMENT_CHARACTER, Tokenizer


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas, for streaming generation.

    Decoding token by token is wrong twice over: a multi-byte UTF-8 character can be split
    across byte-fallback or byte-level tokens, and sentencepiece drops the leading space of
    the first piece it decodes. So, like vLLM's prefix_offset/read_offset method, each step
    decodes a window of already emitted tokens plus the new ones and emits the part of the text
    past what the window's earlier tokens produced; text ending in U+FFFD (an unfinished
    character) is held back until the character completes or `flush` is called.

    Args:
        tokenizer: The tokenizer.
        prompt_token_ids: The prompt; its last tokens give the first generated tokens context
            (e.g. the space before a sentencepiece word). Its text is not part of `text`.
        skip_special_tokens: Leave special tokens (EOS, ...) out of the text.
    """

    # Prompt tokens kept as context (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET).
    _PROMPT_CONTEXT_TOKENS = 5

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # Skipped tokens never enter the window, which keeps window decoding equal to decoding
        # everything: both `decode`s drop them before joining the pieces around them.
        self._skipped_ids = tokenizer.special_token_ids if skip_special_tokens else frozenset()
        context = [int(i) for i in prompt_token_ids if int(i) not in self._skipped_ids]
        self._token_ids = context[-self._PROMPT_CONTEXT_TOKENS :]
        self._prefix_offset = 0  # Start of the decoding window in _token_ids.
        self._read_offset = len(self._token_ids)  # Tokens before it are fully emitted.
        # Characters of the window's text already emitted (or belonging to the prompt).
        self._window_emitted = len(self._decode_window().rstrip(REPLACEMENT_CHARACTER))
        self._text_parts: list[str] = []

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._text_parts)

    def _decode_window(self, end: int | None = None) -> str:
        return self._tokenizer.decode(
            self._token_ids[self._prefix_offset : end],
            skip_special_tokens=self._skip_special_tokens,
        )

    def add_tokens(self, new_token_ids: Iterable[int]) -> str:
        """Adds generated tokens and returns the text they complete (possibly "")."""
        new_ids = [int(i) for i in new_token_ids if int(i) not in self._skipped_ids]
        if not new_ids:
            return ""
        self._token_ids.extend(new_ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """Returns the text held back at the end of the stream (e.g. an unfinished character)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        window_text = self._decode_window()
        # An unfinished character decodes to U+FFFD; the text before it is already final.
        stable_text = window_text if final else window_text.rstrip(REPLACEMENT_CHARACTER)
        if len(stable_text) <= self._window_emitted:
            return ""
        new_text = stable_text[self._window_emitted :]
        self._text_parts.append(new_text)
        if len(stable_text) < len(window_text):
            self._window_emitted = len(stable_text)
            return new_text
        # Everything decoded so far is out: move the window on, keeping the last read tokens
        # as the context the next tokens are decoded with.
        self._prefix_offset, self._read_offset = self._read_offset, len(self._token_ids)
        self._window_emitted = len(self._decode_window(self._read_offset))
        del self._token_ids[: self._prefix_offset]
        self._read_offset -= self._prefix_offset
        self._prefix_offset = 0
        return new_text
