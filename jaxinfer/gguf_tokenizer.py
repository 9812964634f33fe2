"""The tokenizer a GGUF file describes, as a `HuggingFaceTokenizer` over a `tokenizers` backend.

A GGUF file has no `tokenizer.json`: llama.cpp stores the vocabulary (`tokenizer.ggml.tokens`,
with a `token_type` per token), BPE merges or sentencepiece scores, the special token ids,
`add_bos_token` / `add_eos_token` and the chat template as metadata. This module rebuilds the
`tokenizers` pipeline from them the way transformers' GGUF tokenizer conversion does, so ids
match `AutoTokenizer.from_pretrained(directory, gguf_file=...)`:

* `tokenizer.ggml.model == "gpt2"`: byte-level BPE (tokens respelled in the byte alphabet
  where the file wrote them as text), GPT-2's pre-tokenizer, or the split expression named
  by `tokenizer.ggml.pre` (llama3-style, qwen2-style, tekken, gpt-4o-style); BOS only when
  the file says `add_bos_token`.
* `tokenizer.ggml.model == "llama"`: sentencepiece-style BPE with byte fallback and a
  leading "▁" on the first word; merges from the file, else derived from the scores as
  transformers does; BOS unless the file says otherwise.

Tokens of type CONTROL become special added tokens, USER_DEFINED ones plain added tokens;
bos/eos/unk/pad come from their ids. `jaxinfer.tokenizer.load_tokenizer` hands the backend
and these settings to the same `HuggingFaceTokenizer` a `tokenizer.json` directory gets (this
module works on the metadata mapping alone and imports nothing of jaxinfer).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import tokenizers
from tokenizers import Regex, decoders, pre_tokenizers
from tokenizers.models import BPE

CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types (gguf.TokenType)
_SPECIAL_IDS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
                "unk_token": "unknown_token_id", "pad_token": "padding_token_id"}

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# `tokenizer.ggml.pre` -> the split its merges were learned with; other names (gpt-2,
# smollm, default, ...) keep GPT-2's byte-level pre-tokenizer, as in transformers.
PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                     "midm-2.0", "lfm2", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "minimax-m2"), _GPT4O_SPLIT),
}


def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table (`bytes_to_unicode`)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    characters = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            characters.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, characters)))


def merges_from_scores(vocab: Mapping[str, int],
                       scores: Mapping[str, float]) -> list[tuple[str, str]]:
    """BPE merges a sentencepiece vocabulary implies: every split of a token into two
    tokens, best score first (transformers' `generate_merges`, so ties break alike)."""
    merges = []
    for token, score in scores.items():
        pairs = [(token[:cut], token[cut:], score) for cut in range(1, len(token))
                 if token[:cut] in vocab and token[cut:] in vocab]
        merges.extend(sorted(pairs, key=lambda pair: (vocab[pair[0]], vocab[pair[1]])))
    merges.sort(key=lambda merge: (merge[2], len(merge[0]), len(merge[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _byte_level_backend(metadata: Mapping[str, Any]) -> tuple[tokenizers.Tokenizer, set[str]]:
    spelling = byte_alphabet()
    alphabet = set(spelling.values())
    vocab = {token if set(token) <= alphabet else
             "".join(spelling[byte] for byte in token.encode("utf-8")): index
             for index, token in enumerate(metadata["tokenizer.ggml.tokens"])}
    merges = [tuple(merge.split(" ")) for merge in metadata.get("tokenizer.ggml.merges", [])]
    backend = tokenizers.Tokenizer(BPE(vocab=vocab, merges=merges, dropout=None,
                                       continuing_subword_prefix="", end_of_word_suffix="",
                                       fuse_unk=False))
    split = PRE_TOKENIZER_SPLITS.get(metadata.get("tokenizer.ggml.pre"))
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    return backend, alphabet


def _sentencepiece_backend(metadata: Mapping[str, Any]) -> tokenizers.Tokenizer:
    tokens = metadata["tokenizer.ggml.tokens"]
    vocab = {token: index for index, token in enumerate(tokens)}
    if "tokenizer.ggml.merges" in metadata:
        merges = [tuple(merge.split(" ")) for merge in metadata["tokenizer.ggml.merges"]]
    else:
        merges = merges_from_scores(vocab, dict(zip(tokens, metadata["tokenizer.ggml.scores"])))
    backend = tokenizers.Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=True,
                                       byte_fallback=True, dropout=None))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first",
                                                     split=False)
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return backend


def gguf_tokenizer_backend(metadata: Mapping[str, Any]) -> tokenizers.Tokenizer:
    """The `tokenizers` pipeline of a GGUF file's tokenizer metadata, added tokens included.

    Raises:
        ValueError: A tokenizer model other than "gpt2" and "llama".
    """
    model = metadata.get("tokenizer.ggml.model")
    alphabet = None
    if model == "gpt2":
        backend, alphabet = _byte_level_backend(metadata)
    elif model == "llama":
        backend = _sentencepiece_backend(metadata)
    else:
        raise ValueError(f"GGUF tokenizer model {model!r} is not supported (gpt2, llama)")
    tokens: Sequence[str] = metadata["tokenizer.ggml.tokens"]
    types: Sequence[int] = metadata.get("tokenizer.ggml.token_type") or ()
    # A CONTROL token outside the byte alphabet of a byte-level vocabulary is a llama.cpp
    # mislabel (transformers skips it too: adding it would grow the vocabulary).
    control = [tokenizers.AddedToken(token, normalized=False, special=True)
               for token, kind in zip(tokens, types)
               if kind == CONTROL and (alphabet is None or set(token) <= alphabet)]
    if control:
        backend.add_special_tokens(control)
    vocab = backend.get_vocab()
    user_defined = [tokenizers.AddedToken(token, normalized=False, special=False)
                    for token, kind in zip(tokens, types)
                    if kind == USER_DEFINED and token in vocab]
    if user_defined:
        backend.add_tokens(user_defined)
    return backend


@dataclasses.dataclass(frozen=True)
class GGUFTokenizerSettings:
    """What the metadata says besides the vocabulary.

    Attributes:
        named_special_tokens: bos_token, eos_token, unk_token, pad_token -> token text.
        add_bos_token: Whether encoding adds BOS (default: yes for sentencepiece files).
        add_eos_token: Whether encoding adds EOS.
        chat_template: `tokenizer.chat_template`, if any.
    """

    named_special_tokens: dict[str, str]
    add_bos_token: bool
    add_eos_token: bool
    chat_template: str | None


def gguf_tokenizer_settings(metadata: Mapping[str, Any]) -> GGUFTokenizerSettings:
    """The named special tokens, `add_bos_token` / `add_eos_token` and chat template."""
    tokens = metadata["tokenizer.ggml.tokens"]
    named = {}
    for name, key in _SPECIAL_IDS.items():
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        if token_id is not None and 0 <= int(token_id) < len(tokens):
            named[name] = tokens[int(token_id)]
    # llama.cpp adds BOS to a sentencepiece vocabulary whose file does not say otherwise.
    default_bos = metadata.get("tokenizer.ggml.model") == "llama"
    template = metadata.get("tokenizer.chat_template")
    return GGUFTokenizerSettings(
        named_special_tokens=named,
        add_bos_token=bool(metadata.get("tokenizer.ggml.add_bos_token", default_bos)),
        add_eos_token=bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
        chat_template=template if isinstance(template, str) else None)
