"""Tokenizers from GGUF metadata: the same ids and chat template as transformers'
`AutoTokenizer.from_pretrained(directory, gguf_file=...)` on the same file.

The files are written here: a byte-level BPE trained with `tokenizers` (stored as llama.cpp
stores a "gpt2" vocabulary, under several `tokenizer.ggml.pre` names) and a sentencepiece BPE
trained with `sentencepiece` (stored as a "llama" vocabulary with scores and token types).
"""

from __future__ import annotations

import json

import gguf
import pytest
import sentencepiece
import tokenizers
import transformers
from tokenizers import models, pre_tokenizers, trainers

from jaxinfer.tokenizer import load_tokenizer
from tests.gguf_files import write_tiny_llama

CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's 2024, isn't it?",
    "Héllo wörld — naïve café, 日本語のテキスト, emoji 🤖🎉 and tabs\tand\nnew lines.",
    "def main():\n    return [x ** 2 for x in range(10)]  # squares 0123456789",
    "I'll say WE'RE here; you've seen 3.14159 and 1,000,000 things.",
] * 20
TEXTS = [
    "Hello world",
    "  leading spaces, trailing spaces   ",
    "tabs\tand\n\nnew lines\r\n",
    "Héllo wörld — 日本語 🤖 unseen: ψ ж ﬁ",
    "<|im_start|>user\nhi there<|im_end|>\n",
    "<s>a</s> <unk> numbers 1234567 and 3.14",
    "don't I'll WE'RE you've",
    "",
]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is 2+2? ünïcode 🤖"},
            {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _write(path, tokens, types, *, model: str, pre: str | None = None, merges=None,
           scores=None, bos: int, eos: int, unk: int | None = None,
           add_bos: bool | None = None) -> None:
    """A tiny llama GGUF file (weights irrelevant here) with this tokenizer metadata."""

    def tokenizer(writer: gguf.GGUFWriter) -> None:
        writer.add_tokenizer_model(model)
        if pre is not None:
            writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        if merges is not None:
            writer.add_token_merges(merges)
        if scores is not None:
            writer.add_token_scores(scores)
        if unk is not None:
            writer.add_unk_token_id(unk)
        if add_bos is not None:
            writer.add_add_bos_token(add_bos)
        writer.add_chat_template(CHAT_TEMPLATE)

    # The file's bos/eos ids are 1 and 2, which both vocabularies give their BOS and EOS.
    assert (bos, eos) == (1, 2)
    write_tiny_llama(path, gguf.GGMLQuantizationType.F32, metadata=tokenizer)


def _byte_level_file(path, pre: str | None, add_bos: bool | None):
    bpe = tokenizers.Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    model = json.loads(bpe.model.__getstate__())
    tokens = [token for token, _ in sorted(model["vocab"].items(), key=lambda item: item[1])]
    merges = [" ".join(merge) if isinstance(merge, list) else merge
              for merge in model["merges"]]
    types = [gguf.TokenType.CONTROL if token in SPECIALS else gguf.TokenType.NORMAL
             for token in tokens]
    _write(path, tokens, types, model="gpt2", pre=pre, merges=merges, bos=1, eos=2,
           add_bos=add_bos)


def _sentencepiece_file(path, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(CORPUS), encoding="utf-8")
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(tmp_path / "spm"), vocab_size=400,
        model_type="bpe", byte_fallback=True, character_coverage=1.0,
        user_defined_symbols=["<|im_start|>", "<|im_end|>"], minloglevel=2)
    processor = sentencepiece.SentencePieceProcessor(model_file=str(tmp_path / "spm.model"))
    tokens, scores, types = [], [], []
    for index in range(processor.get_piece_size()):
        tokens.append(processor.id_to_piece(index))
        scores.append(processor.get_score(index))
        types.append(gguf.TokenType.UNKNOWN if processor.is_unknown(index) else
                     gguf.TokenType.CONTROL if processor.is_control(index) else
                     gguf.TokenType.BYTE if processor.is_byte(index) else
                     gguf.TokenType.USER_DEFINED if tokens[-1].startswith("<|") else
                     gguf.TokenType.NORMAL)
    _write(path, tokens, types, model="llama", scores=scores, bos=processor.bos_id(),
           eos=processor.eos_id(), unk=processor.unk_id())


VARIANTS = {
    "gpt2-default": lambda path, tmp: _byte_level_file(path, "smollm", False),
    "gpt2-llama-bpe-bos": lambda path, tmp: _byte_level_file(path, "llama-bpe", True),
    "gpt2-qwen2": lambda path, tmp: _byte_level_file(path, "qwen2", None),
    "llama-sentencepiece": _sentencepiece_file,
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def tokenizer_pair(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    path = directory / "model.gguf"
    VARIANTS[request.param](path, directory)
    reference = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=path.name)
    return load_tokenizer(path), reference


def test_ids_equal_transformers(tokenizer_pair):
    ours, reference = tokenizer_pair
    for text in TEXTS:
        assert ours.encode(text) == reference.encode(text), text
        assert ours.encode(text, add_special_tokens=False) == reference.encode(
            text, add_special_tokens=False), text


def test_special_ids_and_round_trip(tokenizer_pair):
    ours, reference = tokenizer_pair
    assert ours.bos_token_id == reference.bos_token_id
    assert ours.eos_token_ids == (reference.eos_token_id,)
    assert ours.vocab_size == len(reference)
    text = "Héllo wörld — 日本語 🤖 and 1234"
    assert ours.decode(ours.encode(text)) == reference.decode(reference.encode(text),
                                                             skip_special_tokens=True)


def test_chat_template_equals_transformers(tokenizer_pair):
    ours, reference = tokenizer_pair
    for add_generation_prompt in (False, True):
        expected = reference.apply_chat_template(
            MESSAGES, add_generation_prompt=add_generation_prompt, tokenize=False)
        assert ours.apply_chat_template(
            MESSAGES, add_generation_prompt=add_generation_prompt, tokenize=False) == expected


def test_a_gguf_file_without_a_tokenizer_is_reported(tmp_path):
    path = write_tiny_llama(tmp_path / "bare.gguf", gguf.GGMLQuantizationType.F32)
    with pytest.raises(FileNotFoundError, match="holds no tokenizer"):
        load_tokenizer(path)
