"""The host half of structured output: llguidance's view of our tokenizers (sentencepiece and
tokenizer.json), the packed bitmask a matcher writes for the device, a model vocabulary larger
than the tokenizer's, completion, and the parameters' own checks. No jax."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

import jaxinfer
from jaxinfer.engine.errors import RequestError
from jaxinfer.engine.sampling_params import SamplingParams, StructuredOutputsParams
from jaxinfer.engine.structured_output import GrammarCompiler, bitmask_words
from jaxinfer.tokenizer import load_tokenizer

DEMO = Path(jaxinfer.__file__).parent / "builtin_models" / "demo"
CORPUS = ["hello world, help the helpers", "42 is 6 times 7", '{"count": 3, "kind": "list"}',
          "yes or no", "the lists and the dicts"] * 4


@pytest.fixture(scope="module")
def sentencepiece_tokenizer():
    return load_tokenizer(DEMO)


@pytest.fixture(scope="module")
def tokenizer_json_tokenizer(tmp_path_factory):
    """A small byte-level BPE `tokenizer.json` (as Llama 3 and Qwen ship), trained here."""
    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    directory = tmp_path_factory.mktemp("tokenizer_json")
    backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}))
    return load_tokenizer(directory)


@pytest.fixture(params=["sentencepiece", "tokenizer_json"])
def tokenizer(request, sentencepiece_tokenizer, tokenizer_json_tokenizer):
    return {"sentencepiece": sentencepiece_tokenizer,
            "tokenizer_json": tokenizer_json_tokenizer}[request.param]


def _allowed_ids(row: np.ndarray) -> set[int]:
    return set(np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")).tolist())


def _token_texts(tokenizer) -> dict[int, str]:
    """Each non-special id's text as it reads after other text (decoded behind an anchor, so
    a sentencepiece word-start piece keeps its space)."""
    anchor = tokenizer.encode("a", add_special_tokens=False)
    prefix = tokenizer.decode(anchor)
    return {token: tokenizer.decode(anchor + [token])[len(prefix):]
            for token in range(tokenizer.vocab_size) if token not in tokenizer.special_token_ids}


def test_the_first_mask_of_a_choice_is_every_token_that_starts_one(tokenizer):
    # An oracle independent of the byte mapping: the decoded text of each token.
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)
    choices = ["hello", "help", " world"]
    matcher = compiler.compile("r", StructuredOutputsParams(choice=choices)).matcher()
    row = np.zeros(bitmask_words(tokenizer.vocab_size), np.int32)
    matcher.fill_bitmask(row)
    expected = {token for token, text in _token_texts(tokenizer).items()
                if text and any(choice.startswith(text) for choice in choices)}
    assert expected and _allowed_ids(row) == expected


def test_a_matcher_follows_its_tokens_to_completion(tokenizer):
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)
    matcher = compiler.compile("r", StructuredOutputsParams(regex="[0-9]{2}")).matcher()
    row = np.zeros(bitmask_words(tokenizer.vocab_size), np.int32)
    for token in tokenizer.encode("42", add_special_tokens=False):
        assert not matcher.is_terminated()
        matcher.fill_bitmask(row)
        assert token in _allowed_ids(row)
        assert matcher.accept(token)
    assert matcher.is_terminated()
    matcher.fill_bitmask(row)
    assert _allowed_ids(row) == set(tokenizer.eos_token_ids)  # only the end may follow
    letter = tokenizer.encode("x", add_special_tokens=False)[-1]
    fresh = compiler.compile("r", StructuredOutputsParams(regex="[0-9]{2}")).matcher()
    assert not fresh.accept(letter) and fresh.error


def test_prefetched_masks_equal_masks_computed_in_place(tokenizer):
    # Two matchers per sample take the same tokens: one fills its mask in place, the other
    # (with the other samples', in one batch) gets it from the worker thread. Each sample
    # walks its own path through the grammar: the lowest, highest or middle allowed id.
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)
    grammar = compiler.compile("r", StructuredOutputsParams(regex="[a-z0-9 ,]{1,40}"))
    pickers = [min, max, lambda ids: sorted(ids)[len(ids) // 2]]
    in_place = [grammar.matcher() for _ in pickers]
    prefetched = [grammar.matcher() for _ in pickers]
    row, other = (np.zeros(bitmask_words(tokenizer.vocab_size), np.int32) for _ in range(2))
    for _ in range(8):
        compiler.prefetch_masks(prefetched)
        for pick, first, second in zip(pickers, in_place, prefetched):
            first.fill_bitmask(row)
            second.fill_bitmask(other)
            np.testing.assert_array_equal(other, row)
            allowed = _allowed_ids(row) - set(tokenizer.eos_token_ids)
            token = pick(allowed)
            assert first.accept(token) and second.accept(token)
    finished = compiler.compile("r", StructuredOutputsParams(choice=["x"])).matcher()
    assert finished.accept(tokenizer.encode("x", add_special_tokens=False)[-1])
    assert finished.is_terminated()
    compiler.prefetch_masks([finished])  # terminated: nothing to compute, nothing pending
    assert finished._pending is None


def test_a_prefetched_mask_is_dropped_when_a_token_is_accepted_first(tokenizer):
    # A request not scheduled to sample may still advance (speculation, a forced token):
    # the accept waits for the worker, and the next mask is for the new position.
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)
    matcher = compiler.compile("r", StructuredOutputsParams(regex="[0-9]{2}")).matcher()
    compiler.prefetch_masks([matcher])
    digits = tokenizer.encode("42", add_special_tokens=False)
    for token in digits:
        assert matcher.accept(token)
    row = np.zeros(bitmask_words(tokenizer.vocab_size), np.int32)
    matcher.fill_bitmask(row)
    assert _allowed_ids(row) == set(tokenizer.eos_token_ids)


def test_ids_past_the_tokenizers_vocabulary_are_never_allowed(sentencepiece_tokenizer):
    # The model's vocabulary may be padded past the tokenizer's (here by 40 ids, one more
    # word): a constrained row never allows those ids, whatever the grammar.
    vocab = sentencepiece_tokenizer.vocab_size
    compiler = GrammarCompiler(sentencepiece_tokenizer, vocab + 40, (2,))
    matcher = compiler.compile("r", StructuredOutputsParams(regex="(?s:.*)")).matcher()
    row = np.full(bitmask_words(vocab + 40), -1, np.int32)
    matcher.fill_bitmask(row)
    allowed = _allowed_ids(row)
    assert len(allowed) > vocab // 2 and max(allowed) < vocab


def test_json_schema_and_json_object_compile_and_start_with_a_brace(sentencepiece_tokenizer):
    compiler = GrammarCompiler(sentencepiece_tokenizer, 4096, (2,))
    texts = _token_texts(sentencepiece_tokenizer)
    for params in (StructuredOutputsParams(json={"type": "object", "properties": {
            "n": {"type": "integer"}}}, disable_any_whitespace=True),
                   StructuredOutputsParams(json_object=True, disable_any_whitespace=True),
                   StructuredOutputsParams(json='{"enum": ["a", "b"]}')):
        row = np.zeros(bitmask_words(4096), np.int32)
        compiler.compile("r", params).matcher().fill_bitmask(row)
        starts = {texts[token][:1] for token in _allowed_ids(row)}
        assert starts == ({'"'} if params.json and "enum" in params.json else {"{"})


def test_a_compiled_grammar_is_cached_and_bad_ones_name_the_field(sentencepiece_tokenizer):
    compiler = GrammarCompiler(sentencepiece_tokenizer, 4096, (2,))
    params = StructuredOutputsParams(choice=["a", "b"])
    assert compiler.compile("r", params) is compiler.compile("s", params)
    for bad in ({"regex": "(unclosed"}, {"json": {"type": "integer", "minimum": "x"}},
                {"grammar": "start: nowhere"}):
        with pytest.raises(RequestError) as raised:
            compiler.compile("r", StructuredOutputsParams(**bad))
        assert raised.value.field == "structured_outputs"
        assert f"structured_outputs.{next(iter(bad))} does not compile" in raised.value.message


def test_gbnf_grammars_are_accepted(sentencepiece_tokenizer):
    compiler = GrammarCompiler(sentencepiece_tokenizer, 4096, (2,))
    gbnf = 'root ::= "yes" | "no"'
    matcher = compiler.compile("r", StructuredOutputsParams(grammar=gbnf)).matcher()
    for token in sentencepiece_tokenizer.encode("yes", add_special_tokens=False):
        assert matcher.accept(token)
    assert matcher.is_terminated()


def test_structured_outputs_params_shape_checks():
    assert SamplingParams(structured_outputs={"regex": "a+"}).structured_outputs == (
        StructuredOutputsParams(regex="a+"))
    assert StructuredOutputsParams(choice=["a", "b"]).choice == ("a", "b")  # a frozen copy
    assert StructuredOutputsParams(json_object=True).kinds == ["json_object"]
    with pytest.raises(RequestError, match="exactly one"):
        StructuredOutputsParams(json_object=False)
    with pytest.raises(RequestError, match="must be a JSON schema"):
        StructuredOutputsParams(json=3)
    with pytest.raises(RequestError, match="must be a bool"):
        StructuredOutputsParams(regex="a", disable_any_whitespace="yes")
    # A request without a tokenizer engine cannot be constrained.
    with pytest.raises(RequestError, match="needs a tokenizer") as raised:
        GrammarCompiler(None, 10).compile("r", StructuredOutputsParams(regex="a"))
    assert raised.value.field == "structured_outputs"
