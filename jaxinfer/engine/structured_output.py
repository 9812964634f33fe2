"""Structured output on the host: grammars compiled and matched by `llguidance`.

    compiler = GrammarCompiler(tokenizer, vocab_size=model_config.vocab_size)
    grammar = compiler.compile("req-1", StructuredOutputsParams(regex="[0-9]{3}"))
    matcher = grammar.matcher()           # one per sample, it follows that sample's tokens
    matcher.fill_bitmask(row)             # row: [ceil(V / 32)] int32, bit i = token i allowed
    matcher.accept(token_id)              # False: the token breaks the grammar
    matcher.is_terminated()               # the grammar is complete: the request stops
    compiler.prefetch_masks([matcher])    # next masks computed on a worker thread

We write no grammar engine: `llguidance` (the Rust engine behind vLLM's `guidance` backend
and llama.cpp's grammars) compiles JSON schemas, regexes, choices and Lark/GBNF grammars
against the tokenizer's vocabulary and computes each step's allowed tokens as a packed
bitmask in tens of microseconds. It was chosen over `xgrammar` because it has no torch
dependency (a small wheel, so it is a main dependency), its mask needs no warm-up per schema,
and it accepts every format the OpenAI and vLLM APIs send.

The device side (`jaxinfer.engine.device.sampler`) takes the rows as one fixed-shape
`[B, ceil(V / 32)]` int32 input, all ones for unconstrained rows, so constraints add no
compiled program. V is the model's vocabulary, which may be larger than the tokenizer's
(padded embeddings): ids past the tokenizer's vocabulary are never allowed in a constrained
row.

The masks are off the step's critical path. Once a step's tokens are accepted, the engine
hands every live matcher to `GrammarCompiler.prefetch_masks`: one worker thread computes their
next masks together (llguidance's parallel fill, which releases the GIL) while the engine
thread processes the step's outputs, schedules the next step and prepares its inputs.
`fill_bitmask` then only copies the finished row. A step whose masks are cheaper than the
hand-off (expected under `INLINE_MASK_SECONDS` from the measured time per row, e.g. a grammar
in a state that allows few tokens) computes them at once instead. A matcher never runs on two
threads at once: each of its calls first waits for its pending mask, and `is_terminated` and
`error` are recorded at `accept`, so the scheduler's checks never wait.

Matchers start as copies of a compiled grammar's first matcher (`LLMatcher.deep_copy`,
about a microsecond, where building one from the grammar takes ~0.6 ms).

No jax here. The tokenizer's llguidance view (`LLTokenizer`) is built once per compiler (per
engine), on the first constrained request, under a lock so any thread may compile.
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import os
import threading
import time
from typing import Any

import llguidance
import llguidance.numpy
import numpy as np

from jaxinfer.engine.errors import RequestError
from jaxinfer.engine.sampling_params import StructuredOutputsParams
from jaxinfer.tokenizer import HuggingFaceTokenizer, SentencePieceTokenizer, Tokenizer

FIELD = "structured_outputs"
# Compiled grammars kept per engine (each is its grammar text: kilobytes).
GRAMMAR_CACHE_SIZE = 256
# A step's masks expected to take less than this are computed at once on the engine thread:
# handing them to the worker (a thread wake-up and two GIL hand-offs) would cost more. A row
# takes from a few microseconds (few tokens allowed) to hundreds (a free string or a wide
# character class over a 50k vocabulary).
INLINE_MASK_SECONDS = 3e-4
MASK_TIME_SMOOTHING = 0.2

# llguidance's marker for a special token's bytes: such a token matches only where a grammar
# names it (e.g. `<|eot_id|>` in Lark), never as the text it spells.
_SPECIAL_MARKER = b"\xff"
# sentencepiece's word-boundary symbol, which stands for a space in the text.
_SPACE_PIECE = "\u2581"


def bitmask_words(vocab_size: int) -> int:
    """`ceil(V / 32)`: the int32 words of one row's packed bitmask."""
    return -(-vocab_size // 32)


def grammar_spec(params: StructuredOutputsParams) -> str:
    """The llguidance grammar (its JSON form) of a request's constraint.

    Raises:
        RequestError: On "structured_outputs", when llguidance refuses the input outright
            (e.g. a grammar GBNF cannot be converted).
    """
    try:
        if params.json is not None or params.json_object:
            schema: Any = {"type": "object"} if params.json_object else params.json
            overrides = {"whitespace_flexible": False} if params.disable_any_whitespace \
                else None
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=overrides)
        if params.regex is not None:
            return llguidance.grammar_from("regex", params.regex)
        if params.choice is not None:
            return llguidance.grammar_from("choice", json.dumps(list(params.choice)))
        return llguidance.grammar_from("grammar", params.grammar)
    except (ValueError, TypeError) as error:
        raise RequestError(FIELD, f"structured_outputs.{params.kinds[0]}: {error}") from None


def _sentencepiece_token_bytes(tokenizer: SentencePieceTokenizer) -> list[bytes]:
    """Each id's bytes in the text: pieces with their word-boundary symbol as a space, byte
    pieces (`<0x0A>`) as their byte, special tokens marked."""
    processor = tokenizer.sentencepiece_processor
    special = tokenizer.special_token_ids
    tokens = []
    for token_id in range(tokenizer.vocab_size):
        piece = tokenizer.id_to_token(token_id) or ""
        if token_id in special:
            tokens.append(_SPECIAL_MARKER + piece.encode())
        elif token_id < processor.get_piece_size() and processor.is_byte(token_id):
            tokens.append(bytes([int(piece[3:5], 16)]))
        else:
            tokens.append(piece.replace(_SPACE_PIECE, " ").encode())
    return tokens


class _SentencePieceVocabulary:
    """What `llguidance.TokenizerWrapper` reads off a tokenizer: the tokens' bytes, EOS and
    BOS, the special ids, and a call that tokenizes text (used by llguidance only for
    forced-token fast paths, which this engine does not take)."""

    def __init__(self, tokenizer: SentencePieceTokenizer, eos_token_id: int) -> None:
        self._tokenizer = tokenizer
        self.tokens = _sentencepiece_token_bytes(tokenizer)
        self.eos_token_id = eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = sorted(tokenizer.special_token_ids)

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text, add_special_tokens=False)


def build_llg_tokenizer(tokenizer: Tokenizer, eos_token_ids: tuple[int, ...] = ()
                        ) -> llguidance.LLTokenizer:
    """The tokenizer's vocabulary as llguidance sees it (built once per engine: ~10 ms for a
    4k vocabulary, about a second for 150k).

    Args:
        tokenizer: A `tokenizer.json` tokenizer (handed to llguidance whole, which decodes its
            byte-level or metaspace tokens itself) or a sentencepiece one (its pieces' bytes
            are given token by token).
        eos_token_ids: The ids that end generation (allowed once the grammar is complete);
            empty: the tokenizer's own.

    Raises:
        ValueError: A tokenizer of another kind, or one without any EOS id.
    """
    eos = list(eos_token_ids or tokenizer.eos_token_ids)
    if not eos:
        raise ValueError("structured output needs an end-of-sequence token id")
    if isinstance(tokenizer, HuggingFaceTokenizer):
        return llguidance.LLTokenizer(tokenizer.to_json(), eos_token=eos)
    if isinstance(tokenizer, SentencePieceTokenizer):
        vocabulary = _SentencePieceVocabulary(tokenizer, eos[0])
        return llguidance.LLTokenizer(llguidance.TokenizerWrapper(vocabulary), eos_token=eos)
    raise ValueError(f"structured output does not support {type(tokenizer).__name__}")


class GrammarMatcher:
    """One sample's position in its grammar: which tokens may come next, whether it is done.

    Args:
        matcher: A fresh llguidance matcher of the grammar.
        compiler: The compiler of its grammar (its valid ids, mask width and worker).
    """

    def __init__(self, matcher: llguidance.LLMatcher, compiler: GrammarCompiler) -> None:
        self._matcher = matcher
        self._compiler = compiler
        self._terminated = bool(matcher.is_stopped())
        self._error = ""
        # The next token's mask, computed ahead by `GrammarCompiler.prefetch_masks`: (the
        # worker's future, or None when it was computed at once, its `[M, ceil(V_tok / 32)]`
        # buffer, this matcher's row in it).
        self._pending: tuple[concurrent.futures.Future | None, np.ndarray, int] | None = None

    def _settle(self) -> tuple[np.ndarray, int] | None:
        """Waits for a pending mask (the worker is done with the matcher after this);
        returns its buffer and row, or None when none was pending."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        future, buffer, index = pending
        if future is not None:
            future.result()
        return buffer, index

    def fill_bitmask(self, row: np.ndarray) -> None:
        """Writes the next token's allowed set into `row` (`[ceil(V / 32)]` int32, bit
        `i % 32` of word `i // 32` for token i), in place: the prefetched mask, or one
        computed now."""
        settled = self._settle()
        if settled is None:
            buffer, index = np.zeros((1, self._compiler.llg_words), np.int32), 0
            llguidance.numpy.fill_next_token_bitmask(self._matcher, buffer, index)
        else:
            buffer, index = settled  # [M, ceil(V_tok / 32)]
        words = min(len(row), buffer.shape[1])
        row[:words] = buffer[index, :words]
        row[words:] = 0
        np.bitwise_and(row, self._compiler.valid_words, out=row)

    def accept(self, token_id: int) -> bool:
        """Advances past a sampled token; False if the grammar does not allow it (the
        matcher is then in an error state for good)."""
        self._settle()  # the mask was for this position; the token moves past it
        accepted = bool(self._matcher.consume_token(int(token_id)))
        self._terminated = bool(self._matcher.is_stopped())
        if not accepted:
            self._error = self._matcher.get_error()
        return accepted

    def is_terminated(self) -> bool:
        """Whether the grammar is complete and allows nothing but the end of the output
        (as of the last `accept`: never waits for a prefetch)."""
        return self._terminated

    @property
    def error(self) -> str:
        """Why the matcher failed, or "" while it has not."""
        return self._error


class CompiledGrammar:
    """A request's checked grammar; `matcher()` starts one sample on it."""

    def __init__(self, compiler: GrammarCompiler, spec: str) -> None:
        self._compiler = compiler
        self.spec = spec
        self._first: llguidance.LLMatcher | None = None  # copied by each matcher()
        self._lock = threading.Lock()

    def matcher(self) -> GrammarMatcher:
        """A matcher at the grammar's start (each sample of an n > 1 request gets its own)."""
        with self._lock:
            if self._first is None:
                self._first = llguidance.LLMatcher(self._compiler.llg_tokenizer, self.spec,
                                                   log_level=0)
            return GrammarMatcher(self._first.deep_copy(), self._compiler)


class GrammarCompiler:
    """Compiles requests' constraints against one engine's tokenizer and vocabulary.

    Args:
        tokenizer: The engine's tokenizer (None: every constrained request is refused).
        vocab_size: The model's vocabulary size V (the bitmask's width is `ceil(V / 32)`).
        eos_token_ids: The model's EOS ids (allowed once a grammar is complete).
    """

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int,
                 eos_token_ids: tuple[int, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self._lock = threading.Lock()
        self._llg_tokenizer: llguidance.LLTokenizer | None = None
        self._valid_words: np.ndarray | None = None
        # Prefetched masks: one worker thread, each task one parallel fill over a step's
        # matchers (llguidance's own threads, at most two: the device step wants the rest).
        self._worker: concurrent.futures.ThreadPoolExecutor | None = None
        self._executor: llguidance.LLExecutor | None = None
        # Recent seconds per mask row (an exponential average), which decides where a batch
        # is computed: starting high, the first batches go to the worker and are timed.
        self._row_seconds = 1e-3
        # Seconds spent computing masks (on either thread): what the constraint costs the
        # host's cores, whether or not it overlaps other work.
        self.mask_seconds = 0.0
        # Grammar text -> its compiled grammar, most recently used last: a server checks a
        # request's parameters before queuing it and the engine compiles them again, and
        # clients tend to send the same schema many times.
        self._compiled: collections.OrderedDict[str, CompiledGrammar] = (
            collections.OrderedDict())

    @property
    def llg_tokenizer(self) -> llguidance.LLTokenizer:
        """The tokenizer's llguidance view, built on first use.

        Raises:
            RequestError: On "structured_outputs": the engine has no tokenizer, or one
                llguidance cannot read.
        """
        with self._lock:
            if self._llg_tokenizer is None:
                if self.tokenizer is None:
                    raise RequestError(FIELD, "structured output needs a tokenizer; this "
                                              "engine has none")
                try:
                    self._llg_tokenizer = build_llg_tokenizer(self.tokenizer,
                                                              self.eos_token_ids)
                except ValueError as error:
                    raise RequestError(FIELD, f"structured output is unavailable: "
                                              f"{error}") from None
            return self._llg_tokenizer

    @property
    def llg_vocab_size(self) -> int:
        """The tokenizer's vocabulary size as llguidance counts it."""
        return self.llg_tokenizer.vocab_size

    @property
    def llg_words(self) -> int:
        """Words of llguidance's own mask rows: `ceil(tokenizer vocab / 32)`."""
        return bitmask_words(self.llg_vocab_size)

    def prefetch_masks(self, matchers: list[GrammarMatcher]) -> None:
        """Starts computing the next masks of `matchers` (live ones: not terminated, not
        failed) on the worker thread; their `fill_bitmask` takes the result."""
        live = [matcher for matcher in matchers
                if matcher._pending is None and not matcher._terminated and not matcher._error]
        if not live:
            return
        with self._lock:
            if self._worker is None:
                self._worker = concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix="jaxinfer-grammar")
                self._executor = llguidance.LLExecutor(
                    num_threads=max(1, min(2, (os.cpu_count() or 1) - 1)))
        buffer = np.zeros((len(live), self.llg_words), np.int32)  # [M, ceil(V_tok / 32)]
        targets = [(matcher._matcher, index) for index, matcher in enumerate(live)]
        future: concurrent.futures.Future | None = None
        if len(live) * self._row_seconds < INLINE_MASK_SECONDS:
            self._fill(targets, buffer)  # cheaper than handing it to the worker
        else:
            started = threading.Event()

            def fill() -> None:
                started.set()
                self._fill(targets, buffer)

            future = self._worker.submit(fill)
            # Wait until the worker holds the GIL and is entering llguidance, which releases
            # it: otherwise the worker would wait for this thread's GIL switch interval (5 ms,
            # longer than the host work it is meant to overlap) before it could start.
            started.wait()
        for index, matcher in enumerate(live):
            matcher._pending = (future, buffer, index)

    def _fill(self, targets: list[tuple[llguidance.LLMatcher, int]], buffer: np.ndarray
              ) -> None:
        """Fills `buffer`'s rows (`[M, ceil(V_tok / 32)]`) and updates the time per row."""
        started = time.perf_counter()
        llguidance.numpy.fill_next_token_bitmask_par(self._executor, targets, buffer)
        elapsed = time.perf_counter() - started
        self.mask_seconds += elapsed
        self._row_seconds += MASK_TIME_SMOOTHING * (elapsed / len(targets) - self._row_seconds)

    @property
    def valid_words(self) -> np.ndarray:
        """`[ceil(V / 32)]` int32: bits set for the ids below both vocabulary sizes."""
        if self._valid_words is None:
            allowed = np.zeros(bitmask_words(self.vocab_size) * 32, np.bool_)
            allowed[:min(self.vocab_size, self.llg_vocab_size)] = True
            self._valid_words = np.packbits(allowed, bitorder="little").view(np.int32)
        return self._valid_words

    def compile(self, request_id: str, params: StructuredOutputsParams) -> CompiledGrammar:
        """Checks a constraint against this tokenizer: the schema, regex or grammar must
        compile.

        Raises:
            RequestError: On "structured_outputs", with llguidance's reason.
        """
        spec = grammar_spec(params)
        tokenizer = self.llg_tokenizer
        with self._lock:
            compiled = self._compiled.get(spec)
            if compiled is not None:
                self._compiled.move_to_end(spec)
                return compiled
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(spec, tokenizer)
        if failed:
            raise RequestError(FIELD, f"request {request_id!r}: structured_outputs."
                                      f"{params.kinds[0]} does not compile: "
                                      f"{messages[0].strip()}")
        compiled = CompiledGrammar(self, spec)
        with self._lock:
            self._compiled[spec] = compiled
            while len(self._compiled) > GRAMMAR_CACHE_SIZE:
                self._compiled.popitem(last=False)
        return compiled
