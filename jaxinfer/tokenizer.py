"""Tokenizers: one interface over sentencepiece `tokenizer.model` and HF `tokenizer.json` files.

`load_tokenizer(directory)` reads a Hugging Face style tokenizer directory and returns a
`Tokenizer` that encodes and decodes like `transformers.AutoTokenizer` does for the same files:

* `tokenizer.json` (preferred) runs on the `tokenizers` library. Its own post-processor decides
  whether BOS/EOS are added: transformers 5 ignores `add_bos_token`/`add_eos_token` in
  `tokenizer_config.json` when a tokenizer.json exists, and so do we. Passing them to
  `load_tokenizer` (like `from_pretrained(..., add_bos_token=...)`) replaces the post-processor
  by one that adds exactly the requested tokens.
* `tokenizer.model` runs on `sentencepiece`. BOS is added unless `add_bos_token` is false;
  added/special tokens in the text are split out first and every text chunk between them is
  encoded by sentencepiece on its own (its dummy prefix included), which is what Meta's Llama
  reference code and transformers' `legacy=True` sentencepiece tokenizers do. transformers 5
  instead converts `tokenizer.model` to a `tokenizers` BPE that drops a leading space from the
  text and adds no dummy prefix after a special token; we keep sentencepiece's own behaviour,
  which round-trips exactly.

Special tokens, chat templates (`chat_template.jinja`, `additional_chat_templates/*.jinja`, or
`chat_template` in `tokenizer_config.json`) and EOS ids (`generation_config.json` first) are read
the way transformers reads them. `IncrementalDetokenizer` turns a stream of token ids into
text deltas for streaming responses (`jaxinfer.detokenizer`).
"""

from __future__ import annotations

import abc
import dataclasses
import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import sentencepiece
import tokenizers
from tokenizers import processors

from jaxinfer.chat_template import ChatTemplateError, render_chat_template

TOKENIZER_JSON_FILE = "tokenizer.json"
SENTENCEPIECE_MODEL_FILE = "tokenizer.model"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
GENERATION_CONFIG_FILE = "generation_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
ADDITIONAL_CHAT_TEMPLATES_DIRECTORY = "additional_chat_templates"

# The named special tokens transformers passes to chat templates (`special_tokens_map`).
NAMED_SPECIAL_TOKENS = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"
)
REPLACEMENT_CHARACTER = "\ufffd"
@dataclasses.dataclass(frozen=True)
class AddedToken:
    """An added or special token as serialized in `tokenizer_config.json` (`AddedToken`).

    The sentencepiece backend honours lstrip/rstrip when splitting text on added tokens; the
    `tokenizers` backend gets all the flags.
    """

    content: str
    special: bool = True
    lstrip: bool = False
    rstrip: bool = False
    single_word: bool = False
    normalized: bool = False


def _parse_added_token(value: Any, special: bool = True) -> AddedToken | None:
    """Reads a token given either as a plain string or as an `AddedToken` dict with "content"."""
    if value is None:
        return None
    if isinstance(value, str):
        return AddedToken(value, special=special)
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        flags = {flag: bool(value.get(flag, False))
                 for flag in ("lstrip", "rstrip", "single_word", "normalized")}
        return AddedToken(value["content"], bool(value.get("special", special)), **flags)
    raise ValueError(f"Cannot read a token from {value!r}: want a string or a dict with 'content'")


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as handle:
        return json.load(handle)


@dataclasses.dataclass
class TokenizerSettings:
    """What a tokenizer directory says besides the vocabulary itself.

    Attributes:
        config: The raw `tokenizer_config.json` contents (empty when the file is absent).
        named_special_tokens: bos_token, eos_token, ... as configured, by attribute name.
        extra_special_tokens: `additional_special_tokens` / `extra_special_tokens`.
        added_tokens_by_id: `added_tokens_decoder`, by token id.
        chat_templates: Chat templates by name; a single template is named "default".
        generation_eos_token_ids: `eos_token_id` from `generation_config.json`, if present.
    """

    config: dict[str, Any] = dataclasses.field(default_factory=dict)
    named_special_tokens: dict[str, AddedToken] = dataclasses.field(default_factory=dict)
    extra_special_tokens: list[AddedToken] = dataclasses.field(default_factory=list)
    added_tokens_by_id: dict[int, AddedToken] = dataclasses.field(default_factory=dict)
    chat_templates: dict[str, str] = dataclasses.field(default_factory=dict)
    generation_eos_token_ids: tuple[int, ...] | None = None

    @classmethod
    def from_directory(cls, directory: Path) -> TokenizerSettings:
        """Reads tokenizer_config.json, special_tokens_map.json, generation_config.json and
        the chat template files of `directory`; every one of them is optional."""
        config = _read_json(directory / TOKENIZER_CONFIG_FILE)
        # special_tokens_map.json is the legacy home of the special tokens; transformers only
        # falls back to it, so the tokenizer config wins where both name a token.
        legacy_map = _read_json(directory / SPECIAL_TOKENS_MAP_FILE)
        settings = cls(config=config)
        for name in NAMED_SPECIAL_TOKENS:
            value = config.get(name, legacy_map.get(name))
            token = _parse_added_token(value)
            if token is not None:
                settings.named_special_tokens[name] = token
        for key in ("additional_special_tokens", "extra_special_tokens"):
            value = config.get(key, legacy_map.get(key))
            # transformers 5 may store model specific special tokens as {name: token}.
            values = value.values() if isinstance(value, Mapping) else value or ()
            for item in values:
                token = _parse_added_token(item)
                if token is not None and token not in settings.extra_special_tokens:
                    settings.extra_special_tokens.append(token)
        for token_id, value in (config.get("added_tokens_decoder") or {}).items():
            token = _parse_added_token(value, special=False)
            if token is not None:
                settings.added_tokens_by_id[int(token_id)] = token
        settings.chat_templates = _read_chat_templates(directory, config)
        eos = _read_json(directory / GENERATION_CONFIG_FILE).get("eos_token_id")
        if eos is not None:
            eos_list = [eos] if isinstance(eos, int) else list(eos)
            settings.generation_eos_token_ids = tuple(dict.fromkeys(int(i) for i in eos_list))
        return settings


def _read_chat_templates(directory: Path, config: Mapping[str, Any]) -> dict[str, str]:
    """Finds the chat templates with transformers' precedence: the `.jinja` files that
    transformers 5 `save_pretrained` writes win over `chat_template` in tokenizer_config.json."""
    templates: dict[str, str] = {}
    template_file = directory / CHAT_TEMPLATE_FILE
    if template_file.is_file():
        templates["default"] = template_file.read_text(encoding="utf-8")
    additional_directory = directory / ADDITIONAL_CHAT_TEMPLATES_DIRECTORY
    if additional_directory.is_dir():
        for path in sorted(additional_directory.glob("*.jinja")):
            templates[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    if templates:
        return templates
    configured = config.get("chat_template")
    if isinstance(configured, str):
        return {"default": configured}
    if isinstance(configured, list):
        # The legacy multi-template format: [{"name": ..., "template": ...}, ...].
        return {entry["name"]: entry["template"] for entry in configured}
    return {}


class Tokenizer(abc.ABC):
    """Encodes text to token ids and back, and renders chat templates.

    Use `load_tokenizer` to get one. Subclasses implement the vocabulary specific methods.
    """

    def __init__(self, settings: TokenizerSettings, named_special_tokens: Mapping[str, str]):
        self._settings = settings
        self._named_special_tokens = dict(named_special_tokens)

    @abc.abstractmethod
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Encodes text; special tokens written in it (e.g. "<s>") become their ids.

        `add_special_tokens` adds BOS/EOS as the tokenizer's configuration says.
        """

    @abc.abstractmethod
    def decode(self, token_ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Decodes ids to text; ids outside the vocabulary are ignored, as `tokenizers` does."""

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (transformers' `len(tokenizer)`)."""

    @property
    @abc.abstractmethod
    def special_token_ids(self) -> frozenset[int]:
        """Ids that `decode(..., skip_special_tokens=True)` leaves out."""

    @abc.abstractmethod
    def token_to_id(self, token: str) -> int | None:
        """Returns the id of a vocabulary or added token, or None if there is none."""

    @abc.abstractmethod
    def id_to_token(self, token_id: int) -> str | None:
        """Returns the token string (e.g. "▁hello" or "Ġhello") of an id, or None."""

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """The named special tokens (bos_token, eos_token, ...) as strings."""
        return dict(self._named_special_tokens)

    def _named_token_id(self, name: str) -> int | None:
        token = self._named_special_tokens.get(name)
        return None if token is None else self.token_to_id(token)

    @property
    def bos_token(self) -> str | None:
        """The beginning-of-sequence token string, if any."""
        return self._named_special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        """The end-of-sequence token string from the tokenizer config, if any."""
        return self._named_special_tokens.get("eos_token")

    @property
    def bos_token_id(self) -> int | None:
        """The id of the beginning-of-sequence token, if any."""
        return self._named_token_id("bos_token")

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The ids that end generation.

        generation_config.json's `eos_token_id` (an int or a list) when present, because chat
        models often stop on several tokens (e.g. Llama 3's <|eot_id|> and <|end_of_text|>);
        otherwise the tokenizer's own EOS token.
        """
        if self._settings.generation_eos_token_ids is not None:
            return self._settings.generation_eos_token_ids
        eos_id = self._named_token_id("eos_token")
        return () if eos_id is None else (eos_id,)

    @property
    def pad_token_id(self) -> int | None:
        """The id of the padding token, if any."""
        return self._named_token_id("pad_token")

    @property
    def unk_token_id(self) -> int | None:
        """The id of the unknown token, if any."""
        return self._named_token_id("unk_token")

    @property
    def chat_templates(self) -> dict[str, str]:
        """All chat templates by name; a single template is named "default"."""
        return dict(self._settings.chat_templates)

    def get_chat_template(
        self, chat_template: str | None = None, tools: Sequence[Mapping[str, Any]] | None = None
    ) -> str:
        """Picks a chat template the way transformers does.

        Args:
            chat_template: A template name, a template's jinja source, or None for the default.
            tools: When given and a "tool_use" template exists, that one is the default.

        Returns:
            The jinja source of the template.

        Raises:
            ChatTemplateError: When the tokenizer has no (default) chat template.
        """
        templates = self._settings.chat_templates
        if chat_template is not None:
            return templates.get(chat_template, chat_template)
        if tools is not None and "tool_use" in templates:
            return templates["tool_use"]
        if "default" in templates:
            return templates["default"]
        if templates:
            raise ChatTemplateError(
                "This tokenizer has several chat templates and none named 'default'; pass one of "
                f"{sorted(templates)} as chat_template"
            )
        raise ChatTemplateError(
            "This tokenizer has no chat template: none in tokenizer_config.json and no "
            f"{CHAT_TEMPLATE_FILE}; pass the template's jinja source as chat_template"
        )

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str | list[int]:
        """Renders a conversation with the chat template, like transformers.

        Args:
            messages: The conversation, dicts with "role" and "content".
            add_generation_prompt: Whether to end with the header of a new assistant turn.
            tokenize: Return token ids (True) or the rendered text (False).
            tools: JSON schemas of tools, passed to the template.
            documents: Documents, passed to the template.
            chat_template: A template name or jinja source instead of the default template.
            **kwargs: Further template variables; they override the special tokens.

        Returns:
            The rendered text, or its token ids encoded without adding special tokens (the
            template writes BOS itself, as transformers assumes).
        """
        template = self.get_chat_template(chat_template, tools)
        variables = {**self._named_special_tokens, **kwargs}
        rendered = render_chat_template(
            template, messages, add_generation_prompt=add_generation_prompt, tools=tools,
            documents=documents, **variables,
        )
        if not tokenize:
            return rendered
        return self.encode(rendered, add_special_tokens=False)


class HuggingFaceTokenizer(Tokenizer):
    """A tokenizer backed by the `tokenizers` library: a Hugging Face `tokenizer.json` file, or
    a pipeline built in memory (a GGUF file's, see `jaxinfer.gguf_tokenizer`)."""

    def __init__(
        self,
        tokenizer_json_path: str | os.PathLike | tokenizers.Tokenizer,
        settings: TokenizerSettings,
        add_bos_token: bool | None = None,
        add_eos_token: bool | None = None,
    ):
        backend = (tokenizer_json_path if isinstance(tokenizer_json_path, tokenizers.Tokenizer)
                   else tokenizers.Tokenizer.from_file(str(tokenizer_json_path)))
        # transformers never truncates or pads in a plain `encode`; neither do we.
        backend.no_truncation()
        backend.no_padding()
        self._register_added_tokens(backend, settings)
        named = {name: token.content for name, token in settings.named_special_tokens.items()}
        super().__init__(settings, named)
        self._backend = backend
        if add_bos_token is not None or add_eos_token is not None:
            # As transformers 5 does for these keyword arguments: a flag left out means False.
            self._set_post_processor(bool(add_bos_token), bool(add_eos_token))
        self._special_token_ids = frozenset(
            token_id
            for token_id, token in backend.get_added_tokens_decoder().items()
            if token.special
        )

    @staticmethod
    def _register_added_tokens(backend: tokenizers.Tokenizer, settings: TokenizerSettings) -> None:
        # tokenizer_config.json may name tokens that tokenizer.json lacks (or holds as plain
        # added tokens); transformers adds them, and marks the named ones special, so that
        # they are matched in text and skipped when decoding.
        existing = {token.content: token for token in backend.get_added_tokens_decoder().values()}
        wanted = [token for _, token in sorted(settings.added_tokens_by_id.items())]
        wanted += [*settings.named_special_tokens.values(), *settings.extra_special_tokens]
        configured_special = {
            token.content
            for token in (*settings.named_special_tokens.values(), *settings.extra_special_tokens)
        }
        for token in wanted:
            special = token.special or token.content in configured_special
            present = existing.get(token.content)
            if present is not None and (present.special or not special):
                continue
            source = present if present is not None else token
            added = tokenizers.AddedToken(
                token.content, single_word=source.single_word, lstrip=source.lstrip,
                rstrip=source.rstrip, normalized=source.normalized, special=special,
            )
            if special:
                backend.add_special_tokens([added])
            else:
                backend.add_tokens([added])
            existing[token.content] = added

    def _set_post_processor(self, add_bos: bool, add_eos: bool) -> None:
        bos, eos = self.bos_token, self.eos_token
        bos_id, eos_id = self.bos_token_id, self._named_token_id("eos_token")
        add_bos = add_bos and bos is not None and bos_id is not None
        add_eos = add_eos and eos is not None and eos_id is not None
        single = f"{f'{bos}:0 ' if add_bos else ''}$A:0{f' {eos}:0' if add_eos else ''}"
        pair = f"{single}{f' {bos}:1' if add_bos else ''} $B:1{f' {eos}:1' if add_eos else ''}"
        special_tokens = []
        if add_bos:
            special_tokens.append((bos, bos_id))
        if add_eos:
            special_tokens.append((eos, eos_id))
        self._backend.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=special_tokens
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(
            [int(token_id) for token_id in token_ids], skip_special_tokens=skip_special_tokens
        )

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def special_token_ids(self) -> frozenset[int]:
        return self._special_token_ids

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def to_json(self) -> str:
        """The whole tokenizer, added tokens included, as `tokenizer.json` text (what
        grammar engines such as llguidance read a vocabulary from)."""
        return self._backend.to_str()

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(int(token_id))


class SentencePieceTokenizer(Tokenizer):
    """A tokenizer backed by a sentencepiece `tokenizer.model` file."""

    def __init__(
        self,
        model_path: str | os.PathLike,
        settings: TokenizerSettings,
        add_bos_token: bool | None = None,
        add_eos_token: bool | None = None,
    ):
        processor = sentencepiece.SentencePieceProcessor(model_file=str(model_path))
        self._processor = processor
        self._piece_count = processor.get_piece_size()
        named = {name: token.content for name, token in settings.named_special_tokens.items()}
        # Without a tokenizer config, the model's own control pieces are the special tokens.
        model_ids = {"bos_token": processor.bos_id(), "eos_token": processor.eos_id(),
                     "unk_token": processor.unk_id(), "pad_token": processor.pad_id()}
        for name, piece_id in model_ids.items():
            if name not in named and piece_id >= 0:
                named[name] = processor.id_to_piece(piece_id)
        super().__init__(settings, named)

        # Added tokens: configured ones by id, then named/extra special tokens by content,
        # taking the piece's id when the model has it and a new id past the vocabulary if not
        # (transformers' `add_tokens`).
        self._added_tokens: dict[int, AddedToken] = dict(settings.added_tokens_by_id)
        added_ids = {token.content: token_id for token_id, token in self._added_tokens.items()}
        special_contents = [*named.values()]
        special_contents += [token.content for token in settings.extra_special_tokens]
        for content in special_contents:
            if content in added_ids:
                token_id = added_ids[content]
                self._added_tokens[token_id] = dataclasses.replace(
                    self._added_tokens[token_id], special=True
                )
                continue
            token_id = self._piece_id(content)
            if token_id is None:
                token_id = max(self._piece_count, max(self._added_tokens, default=-1) + 1)
            self._added_tokens[token_id] = AddedToken(content, special=True)
            added_ids[content] = token_id
        self._added_ids_by_content = added_ids
        # Longest first, so that a token wins over the shorter tokens it contains.
        contents = sorted(added_ids, key=len, reverse=True)
        self._added_token_pattern = (
            re.compile("|".join(re.escape(content) for content in contents)) if contents else None
        )
        control_ids = {
            piece_id
            for piece_id in range(self._piece_count)
            if processor.is_control(piece_id) or processor.is_unknown(piece_id)
        }
        self._special_token_ids = frozenset(
            control_ids
            | {token_id for token_id, token in self._added_tokens.items() if token.special}
        )
        config = settings.config
        self._add_bos_token = bool(
            config.get("add_bos_token", True) if add_bos_token is None else add_bos_token
        )
        self._add_eos_token = bool(
            config.get("add_eos_token", False) if add_eos_token is None else add_eos_token
        )

    def _piece_id(self, piece: str) -> int | None:
        # piece_to_id answers the unknown id for a missing piece; check that it round-trips.
        piece_id = self._processor.piece_to_id(piece)
        return piece_id if self._processor.id_to_piece(piece_id) == piece else None

    def _split_added_tokens(self, text: str) -> list[str | int]:
        """Splits text into text chunks and added-token ids, honouring lstrip/rstrip."""
        if self._added_token_pattern is None:
            return [text]
        # Alternating [text, id, text, id, ..., text].
        segments: list[str | int] = []
        position = 0
        for match in self._added_token_pattern.finditer(text):
            segments.append(text[position : match.start()])
            segments.append(self._added_ids_by_content[match.group()])
            position = match.end()
        segments.append(text[position:])
        for index in range(1, len(segments), 2):
            token = self._added_tokens[segments[index]]
            if token.lstrip:
                segments[index - 1] = segments[index - 1].rstrip()
            if token.rstrip:
                segments[index + 1] = segments[index + 1].lstrip()
        return segments

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        token_ids: list[int] = []
        bos_id, eos_id = self.bos_token_id, self._named_token_id("eos_token")
        if add_special_tokens and self._add_bos_token and bos_id is not None:
            token_ids.append(bos_id)
        for segment in self._split_added_tokens(text):
            if isinstance(segment, int):
                token_ids.append(segment)
            elif segment:
                token_ids.extend(self._processor.encode(segment, out_type=int))
        if add_special_tokens and self._add_eos_token and eos_id is not None:
            token_ids.append(eos_id)
        return token_ids

    def decode(self, token_ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        # Skipped tokens are dropped before decoding (so the pieces around them join up, as
        # in sentencepiece's own decode); kept added tokens are written as their content and
        # split the pieces into runs that sentencepiece decodes one by one, which mirrors how
        # `encode` encodes the text between added tokens chunk by chunk.
        parts: list[str] = []
        run: list[int] = []
        for token_id in token_ids:
            token_id = int(token_id)
            if skip_special_tokens and token_id in self._special_token_ids:
                continue
            token = self._added_tokens.get(token_id)
            if token is None and 0 <= token_id < self._piece_count:
                if not self._processor.is_control(token_id):
                    run.append(token_id)
                    continue
                token = AddedToken(self._processor.id_to_piece(token_id))
            if token is None:
                continue  # Outside the vocabulary: ignored, like `tokenizers` does.
            if run:
                parts.append(self._processor.decode(run))
                run = []
            parts.append(token.content)
        if run:
            parts.append(self._processor.decode(run))
        return "".join(parts)

    @property
    def vocab_size(self) -> int:
        return max(self._piece_count, max(self._added_tokens, default=-1) + 1)

    @property
    def sentencepiece_processor(self) -> sentencepiece.SentencePieceProcessor:
        """The sentencepiece model itself (which pieces are bytes, controls, ...)."""
        return self._processor

    @property
    def special_token_ids(self) -> frozenset[int]:
        return self._special_token_ids

    def token_to_id(self, token: str) -> int | None:
        if token in self._added_ids_by_content:
            return self._added_ids_by_content[token]
        return self._piece_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        token_id = int(token_id)
        if token_id in self._added_tokens:
            return self._added_tokens[token_id].content
        if 0 <= token_id < self._piece_count:
            return self._processor.id_to_piece(token_id)
        return None


def _load_gguf_tokenizer(path: Path, add_bos_token: bool | None,
                         add_eos_token: bool | None) -> HuggingFaceTokenizer:
    """The tokenizer in a GGUF file's metadata (`jaxinfer.gguf_tokenizer`), flags overridable.

    Raises:
        FileNotFoundError: The file holds no tokenizer.
    """
    # Imported here: reading GGUF brings in the checkpoint code (and jax), which text-only
    # users of this module need not load.
    from checkpoints.gguf_io import open_gguf
    from jaxinfer.gguf_tokenizer import gguf_tokenizer_backend, gguf_tokenizer_settings

    metadata = open_gguf(path).metadata
    if "tokenizer.ggml.tokens" not in metadata:
        raise FileNotFoundError(f"{path}: this GGUF file holds no tokenizer "
                                "(no tokenizer.ggml.tokens)")
    found = gguf_tokenizer_settings(metadata)
    settings = TokenizerSettings(
        config={"add_bos_token": found.add_bos_token, "add_eos_token": found.add_eos_token},
        named_special_tokens={name: AddedToken(content)
                              for name, content in found.named_special_tokens.items()},
        chat_templates={} if found.chat_template is None else {"default": found.chat_template})
    return HuggingFaceTokenizer(
        gguf_tokenizer_backend(metadata), settings,
        found.add_bos_token if add_bos_token is None else add_bos_token,
        found.add_eos_token if add_eos_token is None else add_eos_token)


def load_tokenizer(
    directory: str | os.PathLike,
    *,
    add_bos_token: bool | None = None,
    add_eos_token: bool | None = None,
) -> Tokenizer:
    """Loads the tokenizer of a Hugging Face style model or tokenizer directory, or of a GGUF file.

    Args:
        directory: A directory holding tokenizer.json or tokenizer.model, and optionally
            tokenizer_config.json, special_tokens_map.json, generation_config.json and
            chat_template.jinja; or a `.gguf` file (its tokenizer metadata, see
            `jaxinfer.gguf_tokenizer`).
        add_bos_token: Overrides whether `encode` adds BOS. None: tokenizer.json's
            post-processor, or for sentencepiece tokenizer_config.json's flag (default True).
        add_eos_token: Overrides whether `encode` adds EOS, likewise (sentencepiece default
            False). With tokenizer.json, setting either flag sets the other to False unless
            given too, as in transformers.

    Returns:
        A `HuggingFaceTokenizer` when tokenizer.json exists (it is what transformers prefers
        too), otherwise a `SentencePieceTokenizer`.

    Raises:
        FileNotFoundError: When the directory holds neither file (or the GGUF file no
            tokenizer).
    """
    path = Path(directory)
    if path.is_file():
        return _load_gguf_tokenizer(path, add_bos_token, add_eos_token)
    tokenizer_json = path / TOKENIZER_JSON_FILE
    sentencepiece_model = path / SENTENCEPIECE_MODEL_FILE
    if tokenizer_json.is_file():
        settings = TokenizerSettings.from_directory(path)
        return HuggingFaceTokenizer(tokenizer_json, settings, add_bos_token, add_eos_token)
    if sentencepiece_model.is_file():
        settings = TokenizerSettings.from_directory(path)
        return SentencePieceTokenizer(sentencepiece_model, settings, add_bos_token, add_eos_token)
    state = "" if path.is_dir() else " (the directory does not exist)"
    raise FileNotFoundError(
        f"No tokenizer found in {str(path)!r}{state}: looked for {TOKENIZER_JSON_FILE} "
        f"(Hugging Face tokenizers) and {SENTENCEPIECE_MODEL_FILE} (sentencepiece)"
    )
