"""jaxinfer.tokenizer encodes, decodes, streams and renders chat templates like transformers.

Both backends are trained here on a small generated multilingual corpus, so the tests run
offline: a sentencepiece BPE model with byte fallback, and a byte-level BPE `tokenizer.json`.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import jinja2.exceptions
import pytest
import sentencepiece
import tokenizers
import transformers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers
from transformers.tokenization_utils_sentencepiece import SentencePieceBackend

from jaxinfer.chat_template import ChatTemplateError
from jaxinfer.detokenizer import IncrementalDetokenizer
from jaxinfer.tokenizer import (
    REPLACEMENT_CHARACTER,
    HuggingFaceTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    load_tokenizer,
)

WORDS = [
    "hello", "world", "the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "user",
    "assistant", "system", "stream", "token", "世界", "你好", "日本語", "テキスト", "한국어",
    "Привет", "мир", "café", "naïve", "données", "🙂", "👍🏽", "ok", "good", "morning",
]

# Leading/trailing spaces, tabs, newlines, emoji (with a skin-tone modifier), CJK, and
# characters absent from the corpus (🦙, 𝄞, Ω, !) that only byte fallback can encode.
TEXTS = [
    "  hello",
    " 世界",
    "🙂👍🏽 ok",
    "\tx",
    "hello world",
    "日本語のテキスト 🦙 and 𝄞 music",
    "naïve café\nnew line\n\nend",
    "  leading and trailing  ",
    "Привет, мир! Ω",
    "한국어 텍스트🙂🙂",
    "🦙🦙 𝄞",
]

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Unknown role: ' + message['role']) }}"
    "{% endif %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are helpful.<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] | trim }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOL_TEMPLATE = (
    "{{ bos_token }}[tools: {{ tools | tojson }}]"
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% generation %}{% if add_generation_prompt %}assistant:{% endif %}{% endgeneration %}"
)
CONVERSATION = [
    {"role": "user", "content": "hello 世界"},
    {"role": "assistant", "content": " 🙂 ok\n"},
    {"role": "user", "content": "naïve\tquestion 🦙?"},
]


@pytest.fixture(scope="module")
def corpus_path(tmp_path_factory) -> Path:
    generator = random.Random(0)
    lines = []
    for _ in range(3000):
        separator = generator.choice([" ", " ", "  ", "\t"])
        line = separator.join(generator.choice(WORDS) for _ in range(generator.randint(3, 12)))
        lines.append((" " if generator.random() < 0.2 else "") + line)
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def sentencepiece_model(corpus_path, tmp_path_factory) -> Path:
    prefix = tmp_path_factory.mktemp("sentencepiece_model") / "spm"
    # identity normalization and no whitespace cleanup, so that text round-trips exactly.
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus_path),
        model_prefix=str(prefix),
        vocab_size=400,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        remove_extra_whitespaces=False,
        normalization_rule_name="identity",
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        minloglevel=2,
    )
    return prefix.with_suffix(".model")


@pytest.fixture(scope="module")
def sentencepiece_directory(sentencepiece_model, tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("sentencepiece_directory")
    shutil.copy(sentencepiece_model, directory / "tokenizer.model")
    return directory


@pytest.fixture(scope="module")
def backend_tokenizer(corpus_path) -> tokenizers.Tokenizer:
    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        special_tokens=["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = corpus_path.read_text(encoding="utf-8").split("\n")
    tokenizer.train_from_iterator(lines, trainer)
    # BOS comes from tokenizer.json's own post-processor, as in Llama 3 checkpoints.
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    return tokenizer


@pytest.fixture(scope="module")
def tokenizer_json_directory(backend_tokenizer, tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("tokenizer_json_directory")
    backend_tokenizer.save(str(directory / "tokenizer.json"))
    special_tokens = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(special_tokens))
    return directory


@pytest.fixture(scope="module")
def transformers_directory(backend_tokenizer, tmp_path_factory) -> Path:
    """A directory written by transformers' own save_pretrained (chat_template.jinja)."""
    directory = tmp_path_factory.mktemp("transformers_directory")
    saved = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend_tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    saved.chat_template = CHAT_TEMPLATE
    saved.save_pretrained(directory)
    assert (directory / "chat_template.jinja").is_file()
    return directory


@pytest.fixture(scope="module", params=["sentencepiece", "tokenizer_json"])
def tokenizer(request, sentencepiece_directory, tokenizer_json_directory) -> Tokenizer:
    directories = {
        "sentencepiece": sentencepiece_directory,
        "tokenizer_json": tokenizer_json_directory,
    }
    return load_tokenizer(directories[request.param])


def _copy_directory(source: Path, destination: Path, **config_updates) -> Path:
    shutil.copytree(source, destination)
    config_path = destination / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    config.update(config_updates)
    config_path.write_text(json.dumps(config))
    return destination


def _auto_tokenizer(directory: Path):
    return transformers.AutoTokenizer.from_pretrained(directory, local_files_only=True)


def test_loader_picks_the_backend(sentencepiece_directory, tokenizer_json_directory, tmp_path):
    assert isinstance(load_tokenizer(sentencepiece_directory), SentencePieceTokenizer)
    assert isinstance(load_tokenizer(tokenizer_json_directory), HuggingFaceTokenizer)
    both = tmp_path / "both"
    shutil.copytree(tokenizer_json_directory, both)
    shutil.copy(sentencepiece_directory / "tokenizer.model", both / "tokenizer.model")
    assert isinstance(load_tokenizer(both), HuggingFaceTokenizer)


@pytest.mark.parametrize("directory_name", ["empty", "missing"])
def test_bad_directory_raises_a_clear_error(tmp_path, directory_name):
    directory = tmp_path / directory_name
    if directory_name == "empty":
        directory.mkdir()
    with pytest.raises(FileNotFoundError) as error:
        load_tokenizer(directory)
    message = str(error.value)
    assert str(directory) in message
    assert "tokenizer.json" in message and "tokenizer.model" in message


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tokenizer, text):
    token_ids = tokenizer.encode(text)
    assert token_ids[0] == tokenizer.bos_token_id == 1
    assert tokenizer.decode(token_ids) == text
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_sentencepiece_encoding_is_sentencepiece(sentencepiece_directory, sentencepiece_model):
    ours = load_tokenizer(sentencepiece_directory)
    processor = sentencepiece.SentencePieceProcessor(model_file=str(sentencepiece_model))
    for text in TEXTS:
        assert ours.encode(text) == [processor.bos_id(), *processor.encode(text)]
    assert ours.vocab_size == processor.get_piece_size()
    assert ours.eos_token_ids == (2,)
    expected_special_tokens = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    assert ours.special_tokens_map == expected_special_tokens


def test_special_tokens_in_text_and_decoding(tokenizer):
    token_ids = tokenizer.encode("hi</s>there<s>", add_special_tokens=False)
    assert token_ids.count(2) == 1 and token_ids[-1] == 1
    assert tokenizer.decode(token_ids, skip_special_tokens=False) == "hi</s>there<s>"
    assert "<s>" not in tokenizer.decode(token_ids) and "</s>" not in tokenizer.decode(token_ids)
    assert {1, 2} <= tokenizer.special_token_ids
    assert tokenizer.token_to_id("</s>") == 2 and tokenizer.id_to_token(2) == "</s>"
    assert tokenizer.token_to_id("no such token") is None
    assert tokenizer.id_to_token(10**6) is None
    assert tokenizer.decode([*tokenizer.encode("ok"), 10**6]) == "ok"


@pytest.mark.parametrize(
    "flags", [{"add_bos_token": False}, {"add_eos_token": True}, {"add_bos_token": True}]
)
def test_add_bos_and_eos_flags(tokenizer_json_directory, sentencepiece_directory, tmp_path, flags):
    texts = ["hello", "<s>hi</s>", ""]
    # transformers 5 ignores these flags in tokenizer_config.json when tokenizer.json exists
    # (its post-processor rules), but honours them as from_pretrained keyword arguments.
    json_directory = _copy_directory(tokenizer_json_directory, tmp_path / "json", **flags)
    ours, theirs = load_tokenizer(json_directory), _auto_tokenizer(json_directory)
    assert [ours.encode(text) for text in texts] == [theirs.encode(text) for text in texts]
    assert ours.encode("hello")[0] == 1
    ours = load_tokenizer(tokenizer_json_directory, **flags)
    theirs = transformers.AutoTokenizer.from_pretrained(
        tokenizer_json_directory, local_files_only=True, **flags
    )
    assert [ours.encode(text) for text in texts] == [theirs.encode(text) for text in texts]
    # sentencepiece: BOS unless add_bos_token is false, EOS only if add_eos_token is true; the
    # config flags count (transformers reads them too when there is no tokenizer.json).
    spm_directory = _copy_directory(sentencepiece_directory, tmp_path / "spm", **flags)
    for ours in [load_tokenizer(spm_directory), load_tokenizer(sentencepiece_directory, **flags)]:
        token_ids = ours.encode("hello")
        assert (token_ids[0] == 1) == flags.get("add_bos_token", True)
        assert (token_ids[-1] == 2) == flags.get("add_eos_token", False)


def _check_streaming(tokenizer, token_ids, skip_special_tokens=True, prompt_token_ids=()):
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)
    prompt_text = tokenizer.decode(prompt_token_ids, skip_special_tokens)
    deltas = []
    for length in range(1, len(token_ids) + 1):
        deltas.append(detokenizer.add_tokens([token_ids[length - 1]]))
        full = tokenizer.decode([*prompt_token_ids, *token_ids[:length]], skip_special_tokens)
        assert full.startswith(prompt_text)
        expected = full[len(prompt_text) :]
        assert detokenizer.text == "".join(deltas)
        if expected.endswith(REPLACEMENT_CHARACTER):
            assert expected.startswith(detokenizer.text)
        else:
            assert detokenizer.text == expected
    deltas.append(detokenizer.flush())
    full = tokenizer.decode([*prompt_token_ids, *token_ids], skip_special_tokens)
    assert detokenizer.text == "".join(deltas) == full[len(prompt_text) :]


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_detokenization_matches_full_decoding(tokenizer, text):
    token_ids = tokenizer.encode(text)
    _check_streaming(tokenizer, token_ids)
    _check_streaming(tokenizer, [*token_ids, 2, *token_ids], skip_special_tokens=False)
    _check_streaming(tokenizer, [*token_ids, 2, *token_ids], skip_special_tokens=True)


def test_incremental_detokenization_holds_back_split_characters(tokenizer):
    token_ids = tokenizer.encode("a 🦙", add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer)
    # The llama emoji is not in either vocabulary, so it arrives as several byte tokens.
    assert len(token_ids) >= 4
    emitted = [detokenizer.add_tokens([token_id]) for token_id in token_ids[:-1]]
    assert REPLACEMENT_CHARACTER not in "".join(emitted)
    assert detokenizer.text == "a "
    assert detokenizer.add_tokens(token_ids[-1:]) == "🦙"
    # Cut off mid-character, flush gives out what was held back, as a full decode would.
    cut = IncrementalDetokenizer(tokenizer)
    cut.add_tokens(token_ids[:-1])
    assert cut.text + cut.flush() == tokenizer.decode(token_ids[:-1])


def test_incremental_detokenization_with_a_prompt(tokenizer):
    for text in ["hello world good morning", "日本語 テキスト 🦙 ok", " 🙂👍🏽  fox"]:
        token_ids = tokenizer.encode(text)
        for split in range(1, len(token_ids)):
            if tokenizer.decode(token_ids[:split]).endswith(REPLACEMENT_CHARACTER):
                continue
            _check_streaming(tokenizer, token_ids[split:], prompt_token_ids=token_ids[:split])


def test_generation_config_eos_token_ids(
    tokenizer_json_directory, sentencepiece_directory, tmp_path
):
    for name, source in [("json", tokenizer_json_directory), ("spm", sentencepiece_directory)]:
        directory = _copy_directory(source, tmp_path / name, eos_token="</s>")
        assert load_tokenizer(directory).eos_token_ids == (2,)
        (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 4]}))
        assert load_tokenizer(directory).eos_token_ids == (2, 4)
        (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": 4}))
        assert load_tokenizer(directory).eos_token_ids == (4,)


def test_special_tokens_given_as_added_token_dicts(tokenizer_json_directory, tmp_path):
    def added_token(content):
        flags = dict.fromkeys(["lstrip", "normalized", "rstrip", "single_word"], False)
        return {"__type": "AddedToken", "content": content, "special": True, **flags}

    directory = _copy_directory(
        tokenizer_json_directory,
        tmp_path / "dicts",
        bos_token=added_token("<s>"),
        eos_token=added_token("<|im_end|>"),
        pad_token="<pad>",
    )
    ours = load_tokenizer(directory)
    theirs = _auto_tokenizer(directory)
    assert ours.bos_token_id == theirs.bos_token_id == 1
    assert ours.eos_token_ids == (theirs.eos_token_id,) == (4,)
    # <pad> is not in tokenizer.json: like transformers, it is added as a new special token.
    assert ours.pad_token_id == theirs.pad_token_id == len(theirs) - 1
    assert ours.vocab_size == len(theirs)
    assert ours.pad_token_id not in load_tokenizer(tokenizer_json_directory).special_token_ids
    assert ours.encode("a<pad>b") == theirs.encode("a<pad>b")


def test_matches_transformers_on_a_saved_directory(transformers_directory):
    ours = load_tokenizer(transformers_directory)
    theirs = _auto_tokenizer(transformers_directory)
    assert ours.bos_token_id == theirs.bos_token_id
    assert ours.eos_token_ids == (theirs.eos_token_id,)
    assert ours.vocab_size == len(theirs)
    assert set(theirs.all_special_ids) <= ours.special_token_ids
    for text in [*TEXTS, "<s>hi</s>", "<|im_start|>user\nhello<|im_end|>\n", "a </s> b<unk>"]:
        for add_special_tokens in [True, False]:
            expected = theirs.encode(text, add_special_tokens=add_special_tokens)
            assert ours.encode(text, add_special_tokens) == expected
        token_ids = theirs.encode(text)
        for skip in [True, False]:
            expected = theirs.decode(token_ids, skip_special_tokens=skip)
            assert ours.decode(token_ids, skip) == expected


@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_chat_template_matches_transformers(transformers_directory, add_generation_prompt):
    ours = load_tokenizer(transformers_directory)
    theirs = _auto_tokenizer(transformers_directory)
    for messages in [CONVERSATION, CONVERSATION[:1], [{"role": "system", "content": "Be brief."}]]:
        text = ours.apply_chat_template(messages, add_generation_prompt, tokenize=False)
        expected = theirs.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False
        )
        assert text == expected
        assert text.startswith("<s><|im_start|>system\n")
        assert text.endswith("<|im_start|>assistant\n") == add_generation_prompt
        token_ids = ours.apply_chat_template(messages, add_generation_prompt)
        expected_ids = theirs.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, return_dict=False
        )
        assert token_ids == expected_ids
        assert token_ids.count(ours.bos_token_id) == 1


def test_chat_template_raise_exception(transformers_directory):
    ours = load_tokenizer(transformers_directory)
    theirs = _auto_tokenizer(transformers_directory)
    messages = [{"role": "wizard", "content": "hi"}]
    with pytest.raises(ChatTemplateError, match="Unknown role: wizard"):
        ours.apply_chat_template(messages)
    with pytest.raises(jinja2.exceptions.TemplateError, match="Unknown role: wizard"):
        theirs.apply_chat_template(messages)


def test_chat_template_variables_and_globals(transformers_directory):
    ours = load_tokenizer(transformers_directory)
    theirs = _auto_tokenizer(transformers_directory)
    template = (
        "{% if think %}[think]{% endif %}{{ strftime_now('%Y') }}|{{ eos_token }}|"
        "{% for message in messages %}{{ message['role'] }}"
        "{% if message['name'] is defined %}({{ message['name'] }}){% endif %}"
        "{% if loop.index > 1 %}{% break %}{% endif %};{% endfor %}"
        "{{ messages | tojson(indent=1) }}"
    )
    # A None value is dropped from the message, so `is defined` is false for "name".
    messages = [{"role": "user", "content": "<é>", "name": None}, *CONVERSATION]
    for think in [False, True]:
        options = {"chat_template": template, "think": think, "tokenize": False}
        text = ours.apply_chat_template(messages, **options)
        assert text == theirs.apply_chat_template(messages, **options)
        assert '"<é>"' in text and "(" not in text.split("|")[2]


def test_chat_template_with_several_templates(backend_tokenizer, tmp_path):
    saved = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend_tokenizer, bos_token="<s>", eos_token="</s>"
    )
    saved.chat_template = {"default": CHAT_TEMPLATE, "tool_use": TOOL_TEMPLATE}
    saved.save_pretrained(tmp_path)
    assert (tmp_path / "additional_chat_templates" / "tool_use.jinja").is_file()
    ours, theirs = load_tokenizer(tmp_path), _auto_tokenizer(tmp_path)
    assert set(ours.chat_templates) == {"default", "tool_use"}
    tools = [{"type": "function", "function": {"name": "météo", "parameters": {}}}]
    for kwargs in [{}, {"tools": tools}, {"chat_template": "tool_use"}]:
        for add_generation_prompt in [False, True]:
            text = ours.apply_chat_template(
                CONVERSATION, add_generation_prompt, tokenize=False, **kwargs
            )
            expected = theirs.apply_chat_template(
                CONVERSATION, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs
            )
            assert text == expected
    assert '"météo"' in ours.apply_chat_template(CONVERSATION, tools=tools, tokenize=False)


def test_chat_template_in_tokenizer_config(tokenizer_json_directory, tmp_path):
    legacy_list = [{"name": "default", "template": CHAT_TEMPLATE}, {"name": "rag", "template": "x"}]
    for name, chat_template in [("string", CHAT_TEMPLATE), ("list", legacy_list)]:
        directory = _copy_directory(
            tokenizer_json_directory,
            tmp_path / name,
            chat_template=chat_template,
            bos_token="<s>",
            eos_token="</s>",
        )
        ours, theirs = load_tokenizer(directory), _auto_tokenizer(directory)
        assert ours.apply_chat_template(CONVERSATION) == theirs.apply_chat_template(
            CONVERSATION, return_dict=False
        )
    with pytest.raises(ChatTemplateError, match="no chat template"):
        load_tokenizer(tokenizer_json_directory).apply_chat_template(CONVERSATION)


def test_sentencepiece_directory_against_transformers(sentencepiece_model, tmp_path):
    directory = tmp_path / "llama"
    directory.mkdir()
    shutil.copy(sentencepiece_model, directory / "tokenizer.model")
    config = {
        "tokenizer_class": "LlamaTokenizer",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        # transformers 5 adds no BOS for a converted tokenizer.model unless told to; real
        # Llama checkpoints say so in their config, and then both agree.
        "add_bos_token": True,
        "chat_template": "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] "
        "{{ m['content'] }}{{ eos_token }}\n{% endfor %}",
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    ours = load_tokenizer(directory)
    assert isinstance(ours, SentencePieceTokenizer)
    theirs = _auto_tokenizer(directory)
    assert ours.bos_token_id == theirs.bos_token_id == 1
    assert ours.eos_token_ids == (theirs.eos_token_id,) == (2,)
    assert ours.vocab_size == len(theirs)
    # transformers 5 converts tokenizer.model to a `tokenizers` BPE with a Metaspace
    # pre-tokenizer. It agrees with sentencepiece on text that does not start with
    # whitespace, but it loses a leading space ("  hello" decodes to " hello") and adds no
    # "▁" dummy prefix to text that follows a special token. We follow sentencepiece there.
    for text in [text for text in TEXTS if not text[0].isspace()]:
        assert ours.encode(text) == theirs.encode(text)
        assert ours.decode(ours.encode(text)) == theirs.decode(theirs.encode(text), True) == text
    rendered = ours.apply_chat_template(CONVERSATION, tokenize=False)
    assert rendered == theirs.apply_chat_template(CONVERSATION, tokenize=False)
    # transformers' own sentencepiece backend (legacy=True) splits out special tokens and
    # encodes each chunk with its dummy prefix, as we do.
    legacy = SentencePieceBackend(
        vocab_file=str(sentencepiece_model), bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    expected = legacy.encode(rendered, add_special_tokens=False)
    assert ours.apply_chat_template(CONVERSATION) == expected
    assert expected.count(1) == 1 and expected.count(2) == len(CONVERSATION)
