"""The offline Python API, in vLLM's shape: `LLM(model=...).generate(prompts, params)`.

    from jaxinfer import LLM, SamplingParams

    llm = LLM(model="builtin:demo", max_num_seqs=32)
    outputs = llm.generate(["The list type", "A dictionary"],
                           SamplingParams(temperature=0.8, top_p=0.95, max_tokens=64))
    for output in outputs:
        print(output.prompt, "->", output.outputs[0].text)

    for output in llm.stream("The list type", SamplingParams(max_tokens=64)):
        print(output.outputs[0].text)  # cumulative text so far

Every prompt of a call is queued on one continuous-batching `Engine` at once, so a list of
prompts is served as a batch. Works as is in a notebook: nothing here needs a server or a
thread.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from checkpoints.gguf_io import shared_gguf_files
from jaxinfer.engine.auto_config import auto_engine_options
from jaxinfer.engine.core import Prompt
from jaxinfer.engine.factory import load_engine
from jaxinfer.engine.outputs import RequestOutput
from jaxinfer.engine.sampling_params import RequestOutputKind, SamplingParams
from jaxinfer.model_loading import dtype_overrides, load_model_config
from jaxinfer.tokenizer import Tokenizer

Conversation = Sequence[Mapping[str, Any]]


def _as_list(value: Any, single: type | tuple[type, ...]) -> list[Any]:
    """`[value]` for one item, `list(value)` for a list of them."""
    return [value] if isinstance(value, single) else list(value)



def render_chat_prompt(tokenizer: Tokenizer, conversation: Sequence[Mapping[str, Any]], *,
                       chat_template: str | None = None, add_generation_prompt: bool = True,
                       chat_template_kwargs: Mapping[str, Any] | None = None
                       ) -> dict[str, Any]:
    """One conversation as an engine prompt `{"prompt": text, "prompt_token_ids": ids}`.

    The template already writes the special tokens (BOS, role headers), so the text is
    encoded without adding them again. `LLM.chat` and the servers' chat endpoints share this.

    Raises:
        ChatTemplateError: No template, or the template rejected the conversation.
    """
    text = tokenizer.apply_chat_template(
        conversation, add_generation_prompt=add_generation_prompt, tokenize=False,
        chat_template=chat_template, **dict(chat_template_kwargs or {}))
    return {"prompt": text,
            "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}


def _with_config_file(path: str | os.PathLike[str], tokenizer: Any, dtype: str | None,
                      engine_options: dict[str, Any]) -> tuple[Any, str | None, dict[str, Any]]:
    """`LLM`'s tokenizer, dtype and engine options with a config file's beneath them."""
    from jaxinfer.cli import config_file_keys
    from jaxinfer.engine.config import check_config_keys, engine_option_names, read_config_file

    options = read_config_file(path)
    engine_names = set(engine_option_names())
    try:  # a server's file (`jaxinfer serve --config`) may hold `host`, `http_port`, ...
        server_names = config_file_keys("serve")
    except KeyError:  # the serve package is not installed: there are no server options
        server_names = frozenset()
    check_config_keys(path, options, {*engine_names, "tokenizer", "dtype", *server_names})
    return (options.get("tokenizer") if tokenizer is None else tokenizer,
            options.get("dtype") if dtype is None else dtype,
            {**{name: value for name, value in options.items() if name in engine_names},
             **engine_options})


class LLM:
    """A model and its engine, for offline generation from Python.

    Args:
        model: A Hugging Face checkpoint directory, `builtin:NAME` (e.g. `builtin:demo`), a
            jaxinfer checkpoint directory or `random:PRESET`.
        config: A TOML or YAML config file of engine options (`jaxinfer serve --config`'s
            file serves as is: `tokenizer` and `dtype` are read too, the server's own
            options such as `host` are skipped, and any other key is an error). The keyword
            arguments override it.
        tokenizer: Directory of the tokenizer files; None uses the model's directory.
        dtype: "float32" or "bfloat16" for parameters and compute; None keeps the
            checkpoint's.
        warm_up: Compile every step program now (in parallel, or read back from the
            persistent compilation cache), so that no `generate` call stops to compile.
        **engine_options: `EngineConfig` fields, e.g. `max_num_seqs=64`, `page_size=16`,
            `max_model_len=1024`, `enable_prefix_caching=False`, and the device layout
            `tensor_parallel_size=4`, `data_parallel_size=2`, `expert_parallel_size=4`
            (vLLM's names; see `jaxinfer.engine.parallel`). The step and pool sizes not
            given are chosen from the model and the machine
            (`jaxinfer.engine.auto_config`).

    Raises:
        ValueError: An unknown engine option (the valid ones are listed) or a bad value;
            `ConfigFileError` for an unreadable config file or a key it should not hold.
        FileNotFoundError: The model does not exist.
    """

    def __init__(self, model: str | os.PathLike[str], *,
                 config: str | os.PathLike[str] | None = None,
                 tokenizer: str | os.PathLike[str] | None = None, dtype: str | None = None,
                 warm_up: bool = True, **engine_options: Any) -> None:
        if config is not None:
            tokenizer, dtype, engine_options = _with_config_file(config, tokenizer, dtype,
                                                                 engine_options)
        self.model_name = str(model)
        overrides = dtype_overrides(dtype)
        # The config (read here and in load_engine), tokenizer and weights of a GGUF file
        # all come from one parse of its metadata.
        with shared_gguf_files():
            engine_options = auto_engine_options(load_model_config(model, **overrides),
                                                 engine_options)
            self.engine = load_engine(model, tokenizer=tokenizer, dtype=dtype,
                                      **engine_options)
        self.tokenizer = self.engine.tokenizer
        self._request_counter = itertools.count()
        if warm_up:
            self.engine.warm_up()

    def get_tokenizer(self) -> Tokenizer | None:
        """The tokenizer (None for a model without tokenizer files)."""
        return self.tokenizer

    # ------------------------------------------------------------------ generation

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Generates completions for one prompt or a list, batched on the engine.

        Args:
            prompts: A string, a `{"prompt_token_ids": [...]}` dict, or a list of these.
            sampling_params: One SamplingParams for every prompt, one per prompt, or None
                for the defaults.

        Returns:
            One finished RequestOutput per prompt, in the order given.

        Raises:
            ValueError: A bad prompt or parameter; no prompt of the call is left running.
        """
        order = self._submit(prompts, sampling_params)
        final = {}
        for output in self._drain(order):
            final[output.request_id] = output
        return [final[request_id] for request_id in order]

    def stream(self, prompts: Prompt | Sequence[Prompt],
               sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
               ) -> Iterator[RequestOutput]:
        """Like `generate`, but yields each request's cumulative output as it grows.

        Stopping the iteration early (break, close) aborts the unfinished requests.

        Yields:
            RequestOutputs; the last one of each request has `finished` set.
        """
        return (output.snapshot()
                for output in self._drain(self._submit(prompts, sampling_params)))

    def chat(self, messages: Conversation | Sequence[Conversation],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             chat_template_kwargs: Mapping[str, Any] | None = None) -> list[RequestOutput]:
        """Generates the next assistant turn of one conversation or a list of them.

        Args:
            messages: A conversation (a list of {"role", "content"} dicts) or a list of them.
            sampling_params: As for `generate`.
            chat_template: A template name or jinja source; None uses the tokenizer's.
            add_generation_prompt: End the rendered prompt with an assistant header.
            chat_template_kwargs: Further template variables.

        Returns:
            One RequestOutput per conversation; `prompt` is the rendered text.

        Raises:
            ValueError: No tokenizer, or a malformed conversation.
            ChatTemplateError: The tokenizer has no chat template and none was given.
        """
        if self.tokenizer is None:
            raise ValueError(f"{self.model_name} has no tokenizer, so it cannot render chats")
        if not isinstance(messages, Sequence) or not messages:
            raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts "
                             "or a list of such lists")
        conversations = [messages] if isinstance(messages[0], Mapping) else list(messages)
        prompts = []
        for conversation in conversations:
            for message in conversation:
                if not isinstance(message, Mapping) or "role" not in message:
                    raise ValueError(f"chat message {message!r} needs a 'role' (and usually "
                                     "'content')")
            prompts.append(render_chat_prompt(
                self.tokenizer, conversation, chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                chat_template_kwargs=chat_template_kwargs))
        return self.generate(prompts, sampling_params)

    # ------------------------------------------------------------------ helpers

    def _submit(self, prompts: Prompt | Sequence[Prompt],
                sampling_params: SamplingParams | Sequence[SamplingParams] | None
                ) -> list[str]:
        """Queues every prompt, or none: a bad one aborts those already queued."""
        # A list of ints is one token-id prompt only inside a dict; alone it is ambiguous.
        prompt_list = _as_list(prompts, (str, Mapping))
        if not prompt_list:
            raise ValueError("no prompts given")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(f"{len(params_list)} sampling params for "
                                 f"{len(prompt_list)} prompts: give one, or one per prompt")
        request_ids: list[str] = []
        try:
            for prompt, params in zip(prompt_list, params_list, strict=True):
                if not isinstance(prompt, str | Mapping):
                    raise ValueError(f"prompt {prompt!r:.60}: give a string or a "
                                     "{'prompt_token_ids': [...]} dict")
                request_id = str(next(self._request_counter))
                # The engine reports deltas; _drain keeps each request's cumulative output.
                params = dataclasses.replace(params or SamplingParams(),
                                             output_kind=RequestOutputKind.DELTA)
                self.engine.add_request(request_id, prompt, params)
                request_ids.append(request_id)
        except ValueError:
            for request_id in request_ids:
                self.engine.abort_request(request_id)
            raise
        return request_ids

    def _drain(self, request_ids: list[str]) -> Iterator[RequestOutput]:
        """Steps the engine until the requests finish; yields each request's cumulative
        output (one live object per request, grown from the engine's deltas) as it changes."""
        pending = set(request_ids)
        outputs: dict[str, RequestOutput] = {}
        try:
            while pending:
                for delta in self.engine.step():
                    output = outputs.get(delta.request_id)
                    if output is None:
                        output = outputs[delta.request_id] = dataclasses.replace(
                            delta, outputs=[])
                    output.add(delta)
                    yield output
                    if output.finished:
                        pending.discard(output.request_id)
        finally:
            for request_id in pending:  # the caller stopped early, or an error escaped
                self.engine.abort_request(request_id)
