"""InputProcessor: every request check names its field (SamplingParams' own checks included),
and a request with n > 1 fans out into seeded samples. No jax: this runs in well under a second.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

import jaxinfer
from jaxinfer.config import get_preset
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.errors import RequestError
from jaxinfer.engine.input_processor import InputProcessor, can_speculate, child_request_id
from jaxinfer.engine.sampling_params import RequestOutputKind, SamplingParams
from jaxinfer.tokenizer import load_tokenizer

# The demo tokenizer's directory, found without `jaxinfer.model_loading` (which imports jax).
DEMO = Path(jaxinfer.__file__).parent / "builtin_models" / "demo"
VOCAB = 4096  # the demo tokenizer's vocabulary, so its ids are valid prompts
MAX_MODEL_LEN = 64
MODEL = dataclasses.replace(get_preset("tiny"), vocab_size=VOCAB)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(DEMO)


def _processor(tokenizer=None, *, prompt_logprobs=True, speculative=False):
    config = EngineConfig.from_options(max_model_len=MAX_MODEL_LEN,
                                       enable_prompt_logprobs=prompt_logprobs)
    return InputProcessor(MODEL, config.resolved(MODEL.max_position_embeddings), tokenizer,
                          speculative=speculative)


@pytest.fixture(scope="module")
def processors(tokenizer):
    """The engines a row runs against: with a tokenizer, token ids only, and one built
    without the prompt-logprobs step."""
    return {"text": _processor(tokenizer), "ids": _processor(None),
            "no_prompt_logprobs": _processor(tokenizer, prompt_logprobs=False)}


def _process(processor, request_id, prompt, params):
    """Processes one request; a dict of params is built here, so SamplingParams' own
    construction errors are checked by the same row format."""
    if isinstance(params, dict):
        params = SamplingParams(**params)
    return processor.process(request_id, prompt, params)


# (case id, processor, request_id, prompt, params (a dict is SamplingParams kwargs),
#  the RequestError's field, a fragment of its message)
INVALID = [
    # request_id and the params object
    ("empty-request-id", "text", "", [1], None, "request_id", "non-empty string"),
    ("int-request-id", "text", 5, [1], None, "request_id", "non-empty string"),
    ("none-request-id", "text", None, [1], None, "request_id", "non-empty string"),
    ("dict-params", "text", "r", [1], object(), "sampling_params",
     "must be a SamplingParams, not object"),
    # prompt forms
    ("empty-ids", "text", "r", [], None, "prompt", "at least one token"),
    ("empty-ids-in-dict", "text", "r", {"prompt_token_ids": []}, None, "prompt",
     "at least one token"),
    ("bytes", "text", "r", b"abc", None, "prompt", "a string or a list of token ids"),
    ("floats", "text", "r", [1.0, 2.0], None, "prompt", "a string or a list of token ids"),
    ("bools", "text", "r", [True, 2], None, "prompt", "a string or a list of token ids"),
    ("nested", "text", "r", [[1, 2]], None, "prompt", "a string or a list of token ids"),
    ("words", "text", "r", ["a", "b"], None, "prompt", "a string or a list of token ids"),
    ("int", "text", "r", 5, None, "prompt", "a string or a list of token ids"),
    ("none", "text", "r", None, None, "prompt", "a string or a list of token ids"),
    ("dict-unknown-key", "text", "r", {"prompt": "x", "images": []}, None, "prompt",
     "got keys ['images', 'prompt']"),
    ("dict-no-keys", "text", "r", {}, None, "prompt", "got keys []"),
    ("dict-non-text-prompt", "text", "r", {"prompt_token_ids": [1], "prompt": 5}, None,
     "prompt", "'prompt' must be text"),
    ("dict-prompt-only-not-text", "text", "r", {"prompt": 5}, None, "prompt",
     "a string or a list of token ids"),
    ("text-without-tokenizer", "ids", "r", "hello", None, "prompt", "needs a tokenizer"),
    ("dict-text-without-tokenizer", "ids", "r", {"prompt": "hello"}, None, "prompt",
     "needs a tokenizer"),
    ("empty-text-without-tokenizer", "ids", "r", "", None, "prompt", "needs a tokenizer"),
    # the vocabulary, written once for prompt, stop_token_ids and logit_bias
    ("negative-prompt-id", "text", "r", [1, -1], None, "prompt",
     f"prompt token ids [-1] are outside the vocabulary [0, {VOCAB})"),
    ("prompt-id-at-vocab", "text", "r", [VOCAB, 1, VOCAB + 7], None, "prompt",
     f"[{VOCAB}, {VOCAB + 7}] are outside"),
    ("dict-prompt-ids-outside", "text", "r", {"prompt_token_ids": [-3]}, None, "prompt",
     "outside the vocabulary"),
    ("stop-token-id-at-vocab", "text", "r", [1], {"stop_token_ids": [2, VOCAB]},
     "stop_token_ids", f"stop_token_ids [{VOCAB}] are outside the vocabulary"),
    ("logit-bias-id-at-vocab", "text", "r", [1], {"logit_bias": {VOCAB + 1: 1.0}},
     "logit_bias", f"logit_bias token ids [{VOCAB + 1}] are outside"),
    # what the engine leaves room for and was built with
    ("prompt-fills-max-model-len", "text", "r", [1] * MAX_MODEL_LEN, None, "prompt",
     f"prompt of {MAX_MODEL_LEN} tokens leaves no room"),
    ("prompt-beyond-max-model-len", "text", "r", [1] * (MAX_MODEL_LEN + 5), None, "prompt",
     "leaves no room for output"),
    ("prompt-logprobs-not-compiled", "no_prompt_logprobs", "r", [1], {"prompt_logprobs": 1},
     "prompt_logprobs", "enable_prompt_logprobs=True"),
    ("stop-string-without-tokenizer", "ids", "r", [1], {"stop": ["x"]}, "stop",
     "stop strings need a tokenizer"),
    # SamplingParams fields, each a RequestError naming itself
    ("n-zero", "text", "r", [1], {"n": 0}, "n", "must be >= 1"),
    ("n-float", "text", "r", [1], {"n": 2.0}, "n", "must be an integer"),
    ("n-bool", "text", "r", [1], {"n": True}, "n", "must be an integer"),
    ("temperature-negative", "text", "r", [1], {"temperature": -0.5}, "temperature",
     "must be >= 0"),
    ("temperature-inf", "text", "r", [1], {"temperature": math.inf}, "temperature",
     "must be >= 0 (and finite)"),
    ("temperature-nan", "text", "r", [1], {"temperature": math.nan}, "temperature",
     "must be a number"),
    ("temperature-text", "text", "r", [1], {"temperature": "0.5"}, "temperature",
     "must be a number"),
    ("temperature-bool", "text", "r", [1], {"temperature": True}, "temperature",
     "must be a number"),
    ("top-p-zero", "text", "r", [1], {"top_p": 0.0}, "top_p", "must be in (0, 1]"),
    ("top-p-above-one", "text", "r", [1], {"top_p": 1.5}, "top_p", "must be in (0, 1]"),
    ("top-p-none", "text", "r", [1], {"top_p": None}, "top_p", "must be a number"),
    ("top-k-below-minus-one", "text", "r", [1], {"top_k": -2}, "top_k",
     "must be 0 or -1"),
    ("top-k-float", "text", "r", [1], {"top_k": 5.0}, "top_k", "must be an integer"),
    ("min-p-negative", "text", "r", [1], {"min_p": -0.01}, "min_p", "must be in [0, 1]"),
    ("min-p-above-one", "text", "r", [1], {"min_p": 1.01}, "min_p", "must be in [0, 1]"),
    ("seed-float", "text", "r", [1], {"seed": 1.5}, "seed", "must be an integer"),
    ("seed-text", "text", "r", [1], {"seed": "7"}, "seed", "must be an integer"),
    ("seed-bool", "text", "r", [1], {"seed": False}, "seed", "must be an integer"),
    ("presence-penalty-high", "text", "r", [1], {"presence_penalty": 2.01},
     "presence_penalty", "must be in [-2, 2]"),
    ("presence-penalty-nan", "text", "r", [1], {"presence_penalty": math.nan},
     "presence_penalty", "must be a number"),
    ("frequency-penalty-low", "text", "r", [1], {"frequency_penalty": -3},
     "frequency_penalty", "must be in [-2, 2]"),
    ("repetition-penalty-zero", "text", "r", [1], {"repetition_penalty": 0},
     "repetition_penalty", "must be > 0"),
    ("repetition-penalty-inf", "text", "r", [1], {"repetition_penalty": math.inf},
     "repetition_penalty", "must be > 0 (and finite)"),
    ("logit-bias-not-dict", "text", "r", [1], {"logit_bias": [(1, 2.0)]}, "logit_bias",
     "must be a dict"),
    ("logit-bias-negative-id", "text", "r", [1], {"logit_bias": {-1: 1.0}}, "logit_bias",
     "token ids must be >= 0"),
    ("logit-bias-text-id", "text", "r", [1], {"logit_bias": {"5": 1.0}}, "logit_bias",
     "must be an integer"),
    ("logit-bias-inf", "text", "r", [1], {"logit_bias": {5: math.inf}}, "logit_bias",
     "logit_bias[5] = inf: must be a finite number"),
    ("logit-bias-text-value", "text", "r", [1], {"logit_bias": {5: "high"}}, "logit_bias",
     "logit_bias[5] = 'high': must be a number"),
    ("max-tokens-zero", "text", "r", [1], {"max_tokens": 0}, "max_tokens", "must be >= 1"),
    ("max-tokens-float", "text", "r", [1], {"max_tokens": 8.0}, "max_tokens",
     "must be an integer"),
    ("min-tokens-negative", "text", "r", [1], {"min_tokens": -1}, "min_tokens",
     "must be in [0, max_tokens = 16]"),
    ("min-tokens-above-max", "text", "r", [1], {"min_tokens": 5, "max_tokens": 4},
     "min_tokens", "must be in [0, max_tokens = 4]"),
    ("min-tokens-float", "text", "r", [1], {"min_tokens": 1.0}, "min_tokens",
     "must be an integer"),
    ("stop-empty", "text", "r", [1], {"stop": ""}, "stop", "must be non-empty"),
    ("stop-item-not-text", "text", "r", [1], {"stop": ["a", 3]}, "stop",
     "stop[1] = 3: stop strings must be non-empty strings"),
    ("stop-item-empty", "text", "r", [1], {"stop": ["a", ""]}, "stop", "stop[1] = ''"),
    ("stop-not-iterable", "text", "r", [1], {"stop": 3}, "stop",
     "must be a string, a list of strings, or None"),
    ("stop-token-ids-text", "text", "r", [1], {"stop_token_ids": "12"}, "stop_token_ids",
     "must be a list of token ids or None"),
    ("stop-token-ids-int", "text", "r", [1], {"stop_token_ids": 12}, "stop_token_ids",
     "must be a list of token ids or None"),
    ("stop-token-ids-item-negative", "text", "r", [1], {"stop_token_ids": [1, -1]},
     "stop_token_ids", "stop_token_ids[1] = -1: token ids must be >= 0"),
    ("stop-token-ids-item-float", "text", "r", [1], {"stop_token_ids": [1.5]},
     "stop_token_ids", "stop_token_ids[0] = 1.5: must be an integer"),
    ("logprobs-above-max", "text", "r", [1], {"logprobs": 21}, "logprobs",
     "must be None or in [0, 20]"),
    ("logprobs-negative", "text", "r", [1], {"logprobs": -1}, "logprobs",
     "must be None or in [0, 20]"),
    ("logprobs-float", "text", "r", [1], {"logprobs": 2.0}, "logprobs",
     "must be an integer"),
    ("prompt-logprobs-above-max", "text", "r", [1], {"prompt_logprobs": 21},
     "prompt_logprobs", "must be None or in [0, 20]"),
    ("prompt-logprobs-bool", "text", "r", [1], {"prompt_logprobs": True},
     "prompt_logprobs", "must be an integer"),
    ("include-stop-str-int", "text", "r", [1], {"include_stop_str_in_output": 1},
     "include_stop_str_in_output", "must be a bool"),
    ("ignore-eos-text", "text", "r", [1], {"ignore_eos": "yes"}, "ignore_eos",
     "must be a bool"),
    ("skip-special-tokens-none", "text", "r", [1], {"skip_special_tokens": None},
     "skip_special_tokens", "must be a bool"),
    ("output-kind-unknown", "text", "r", [1], {"output_kind": "streaming"}, "output_kind",
     "must be one of ['cumulative', 'delta', 'final_only']"),
    # structured output: its shape (SamplingParams), then compiling it (the processor)
    ("structured-none-set", "text", "r", [1], {"structured_outputs": {}},
     "structured_outputs", "exactly one of"),
    ("structured-two-set", "text", "r", [1],
     {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
     "got ['regex', 'choice']"),
    ("structured-unknown-key", "text", "r", [1], {"structured_outputs": {"jsn": {}}},
     "structured_outputs", "unknown keys ['jsn']"),
    ("structured-not-an-object", "text", "r", [1], {"structured_outputs": "json"},
     "structured_outputs", "must be an object"),
    ("structured-choice-empty", "text", "r", [1], {"structured_outputs": {"choice": []}},
     "structured_outputs", "non-empty list"),
    ("structured-choice-text", "text", "r", [1], {"structured_outputs": {"choice": "yes"}},
     "structured_outputs", "list of strings"),
    ("structured-json-text-invalid", "text", "r", [1],
     {"structured_outputs": {"json": "{not json"}}, "structured_outputs", "not valid JSON"),
    ("structured-bad-schema", "text", "r", [1],
     {"structured_outputs": {"json": {"type": "nope"}}}, "structured_outputs",
     "structured_outputs.json does not compile"),
    ("structured-bad-regex", "text", "r", [1], {"structured_outputs": {"regex": "[0-9"}},
     "structured_outputs", "structured_outputs.regex does not compile"),
    ("structured-bad-grammar", "text", "r", [1],
     {"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs",
     "structured_outputs.grammar does not compile"),
    ("structured-without-tokenizer", "ids", "r", [1],
     {"structured_outputs": {"regex": "[0-9]"}}, "structured_outputs", "needs a tokenizer"),
]


@pytest.mark.parametrize(("processor", "request_id", "prompt", "params", "field", "fragment"),
                         [row[1:] for row in INVALID], ids=[row[0] for row in INVALID])
def test_invalid_request_names_its_field(processors, processor, request_id, prompt, params,
                                         field, fragment):
    with pytest.raises(RequestError) as raised:
        _process(processors[processor], request_id, prompt, params)
    assert raised.value.field == field
    assert fragment in raised.value.message and str(raised.value) == raised.value.message


def test_every_sampling_params_field_has_an_invalid_row():
    checked = {row[5] for row in INVALID if isinstance(row[4], dict)}
    assert {field.name for field in dataclasses.fields(SamplingParams)} <= checked


def test_request_error_is_a_value_error():
    # Callers that predate RequestError catch ValueError; both must keep working.
    with pytest.raises(ValueError, match="must be >= 1"):
        SamplingParams(n=0)


# ---------------------------------------------------------------------- accepted requests

def test_prompt_forms(processors, tokenizer):
    processor = processors["text"]
    text = "The list type"
    ids = tokenizer.encode(text)
    by_text = processor.process("a", text)
    assert (by_text.prompt, by_text.prompt_token_ids) == (text, ids)
    by_ids = processor.process("b", tuple(ids))
    assert (by_ids.prompt, by_ids.prompt_token_ids) == (None, ids)
    # A rendered chat: the ids are used as given, the text is kept for the output.
    both = processor.process("c", {"prompt_token_ids": [5, 6], "prompt": "chat"})
    assert (both.prompt, both.prompt_token_ids) == ("chat", [5, 6])
    text_only = processor.process("d", {"prompt": text})
    assert (text_only.prompt, text_only.prompt_token_ids) == (text, ids)
    # The tokenizer adds BOS, so empty text is still a one-token prompt.
    assert processor.process("e", "").prompt_token_ids == tokenizer.encode("")
    # The longest prompt that leaves room for one output token.
    assert len(processor.process("f", [1] * (MAX_MODEL_LEN - 1)).prompt_token_ids) == (
        MAX_MODEL_LEN - 1)
    ids_only = processors["ids"].process("g", [0, VOCAB - 1])
    assert ids_only.prompt_token_ids == [0, VOCAB - 1]


def test_single_sample_keeps_the_id_and_params(processors):
    params = SamplingParams(max_tokens=5, stop_token_ids=[7], seed=3)
    processed = processors["text"].process("a", [1, 2, 3], params, cache_salt="salt")
    [sample] = processed.samples
    assert processed.request_id == sample.request_id == "a"
    assert sample.sampling_params is params and processed.params is params
    assert sample.prompt_token_ids == (1, 2, 3) and sample.max_tokens == 5
    assert sample.eos_token_ids == (*MODEL.eos_token_ids, 7)
    assert sample.cache_salt == "salt" and not sample.skip_prefix_cache


@pytest.mark.parametrize(("seed", "seeds"), [(7, [7, 8, 9]), (None, [None, None, None])])
def test_n_fans_out_into_seeded_samples(processors, seed, seeds):
    params = SamplingParams(n=3, seed=seed, max_tokens=4, temperature=0.8)
    processed = processors["text"].process("ID", [1, 2], params)
    assert processed.params is params  # the user's n, for the output's n samples
    assert [sample.request_id for sample in processed.samples] == ["ID#0", "ID#1", "ID#2"]
    assert [sample.sampling_params.seed for sample in processed.samples] == seeds
    for sample in processed.samples:
        assert sample.sampling_params.n == 1
        assert dataclasses.replace(sample.sampling_params, n=3, seed=seed) == params
        assert sample.prompt_token_ids == (1, 2) and sample.max_tokens == 4


def test_stop_ids_eos_and_ignore_eos(processors):
    processor = processors["text"]
    [eos_too] = processor.process("a", [1], SamplingParams(stop_token_ids=[9, 2])).samples
    assert eos_too.eos_token_ids == (2, 9)  # EOS first, duplicates dropped
    [no_eos] = processor.process("b", [1], SamplingParams(
        stop_token_ids=[9], ignore_eos=True)).samples
    assert no_eos.eos_token_ids == (9,)


def test_prompt_logprobs_skip_the_prefix_cache(processors):
    # Cached blocks have no logits, so a prompt-logprobs request must compute its prompt.
    [sample] = processors["text"].process("a", [1, 2], SamplingParams(
        prompt_logprobs=1)).samples
    assert sample.skip_prefix_cache


def test_output_kind_value_is_normalized(processors):
    processed = processors["text"].process("a", [1], SamplingParams(output_kind="delta"))
    assert processed.params.output_kind is RequestOutputKind.DELTA


@pytest.mark.parametrize(("params", "expected"), [
    (SamplingParams(), True),
    (SamplingParams(temperature=0.0, top_k=5, min_tokens=2, stop_token_ids=[3]), True),
    (SamplingParams(logit_bias={1: 1.0}, seed=1), True),
    (SamplingParams(logprobs=0), False),
    (SamplingParams(prompt_logprobs=0), False),
    (SamplingParams(presence_penalty=0.1), False),
    (SamplingParams(frequency_penalty=-0.1), False),
    (SamplingParams(repetition_penalty=1.1), False),
    (SamplingParams(structured_outputs={"regex": "[0-9]+"}), False),  # per-token masks
])
def test_can_speculate(params, expected):
    assert can_speculate(params) is expected


@pytest.mark.parametrize(("engine", "request_opt_in", "params", "expected"), [
    (True, True, SamplingParams(), True),
    (True, False, SamplingParams(), False),  # the request opts out
    (True, True, SamplingParams(logprobs=1), False),  # needs per-token results
    (True, True, SamplingParams(structured_outputs={"choice": ["a"]}), False),  # constrained
    (False, True, SamplingParams(), False),  # the engine does not speculate
])
def test_which_requests_speculate(tokenizer, engine, request_opt_in, params, expected):
    processor = _processor(tokenizer, speculative=engine)
    processed = processor.process("a", [1], params, speculative=request_opt_in)
    assert processed.speculate is expected
    assert all(sample.speculate is expected for sample in processed.samples)


def test_structured_output_compiles_once_and_gives_each_sample_its_own_matcher(tokenizer):
    processor = _processor(tokenizer)
    params = SamplingParams(n=2, structured_outputs={"choice": ["yes", "no"]})
    first = processor.process("a", [1], params)
    second = processor.process("b", [1], params)
    assert first.grammar is second.grammar  # the compiled grammar is cached
    one, other = (sample.grammar for sample in first.samples)
    assert one is not other
    assert one.accept(tokenizer.encode("no", add_special_tokens=False)[0])
    assert not other.is_terminated()  # advancing one sample leaves the other at the start
    assert processor.process("c", [1], SamplingParams()).samples[0].grammar is None


@pytest.mark.parametrize(("index", "n", "expected"), [
    (0, 1, "ID"), (0, 2, "ID#0"), (1, 2, "ID#1"), (10, 11, "ID#10")])
def test_child_request_id(index, n, expected):
    assert child_request_id("ID", index, n) == expected
