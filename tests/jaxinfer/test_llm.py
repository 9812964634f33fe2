"""The offline API: `LLM.generate` / `stream` / `chat` on the built-in demo model, checked
against reference generation; bad input rejected without leaving anything running; a config
file's engine options."""

from __future__ import annotations

import itertools
import re

import jax
import pytest

from jaxinfer import LLM, CompletionOutput, RequestOutput, SamplingParams
from jaxinfer.engine.config import ConfigFileError, SpeculativeConfig
from jaxinfer.generate import generate

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return LLM(model="builtin:demo", max_model_len=128, max_num_seqs=4,
               max_num_batched_tokens=64, enable_prompt_logprobs=False)


def _idle(llm):
    engine = llm.engine
    return (not engine.has_unfinished_requests()
            and engine.num_free_pages == engine.config.num_pages - 1)


def test_generate_matches_reference_for_text_and_token_prompts(llm):
    tokenizer = llm.get_tokenizer()
    prompts = ["The list type", {"prompt_token_ids": [1, 450, 77]}, "A dictionary maps"]
    outputs = llm.generate(prompts, GREEDY)
    token_prompts = [tokenizer.encode(prompts[0]), [1, 450, 77], tokenizer.encode(prompts[2])]
    expected = generate(llm.engine.model, token_prompts,
                        max_new_tokens=12, eos_token_ids=())
    assert [output.prompt for output in outputs] == ["The list type", None, "A dictionary maps"]
    for output, prompt_ids, tokens in zip(outputs, token_prompts, expected, strict=True):
        assert isinstance(output, RequestOutput) and output.finished
        assert output.prompt_token_ids == prompt_ids
        [sample] = output.outputs
        assert isinstance(sample, CompletionOutput) and sample.index == 0
        assert sample.token_ids == tokens and sample.finish_reason == "length"
        assert sample.text == tokenizer.decode(tokens)
    assert _idle(llm)


def test_per_prompt_params_and_n(llm):
    outputs = llm.generate(["The list type", "The list type"], [
        SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
        SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True)])
    assert len(outputs[0].outputs[0].token_ids) == 3
    assert [len(sample.token_ids) for sample in outputs[1].outputs] == [6, 6]
    assert _idle(llm)


def test_stream_grows_and_ends_like_generate(llm):
    [final] = llm.generate("Tuples are", GREEDY)
    seen = list(llm.stream("Tuples are", GREEDY))
    texts = [output.outputs[0].text for output in seen]
    assert all(later.startswith(earlier) for earlier, later in itertools.pairwise(texts))
    assert seen[-1].finished and not any(output.finished for output in seen[:-1])
    assert seen[-1].outputs[0].token_ids == final.outputs[0].token_ids
    # Leaving a stream early aborts its request.
    for output in llm.stream("Tuples are", GREEDY):
        if len(output.outputs[0].token_ids) >= 2:
            break
    assert _idle(llm)


def test_chat_renders_the_template(llm):
    template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}assistant:{% endif %}")
    messages = [{"role": "user", "content": "What is a list?"}]
    [output] = llm.chat(messages, GREEDY, chat_template=template)
    assert output.prompt == "user: What is a list?\nassistant:"
    [plain] = llm.generate({"prompt_token_ids": output.prompt_token_ids}, GREEDY)
    assert output.outputs[0].token_ids == plain.outputs[0].token_ids
    both = llm.chat([messages, messages], GREEDY, chat_template=template)
    assert len(both) == 2
    with pytest.raises(ValueError, match="needs a 'role'"):
        llm.chat([{"content": "hi"}], GREEDY, chat_template=template)


def test_bad_input_rejects_the_call_and_leaves_nothing_running(llm):
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 4096\)"):
        llm.generate(["fine", {"prompt_token_ids": [1, 99999]}], GREEDY)
    with pytest.raises(ValueError, match="2 sampling params for 3 prompts"):
        llm.generate(["a", "b", "c"], [GREEDY, GREEDY])
    with pytest.raises(ValueError, match="give a string or a"):
        llm.generate([[1, 2, 3]], GREEDY)
    with pytest.raises(ValueError, match="max_tokens = 0"):
        SamplingParams(max_tokens=0)
    assert _idle(llm)
    with pytest.raises(ValueError, match=r"unknown engine options \['max_batch'\]"):
        LLM(model="builtin:demo", max_batch=4)


def test_a_serve_config_file_configures_the_engine(tmp_path):
    # `jaxinfer serve --config`'s file as is: the server's own keys are skipped.
    path = tmp_path / "serve.toml"
    path.write_text("""
model = "builtin:other"
host = "0.0.0.0"
http_port = 8080
dtype = "bfloat16"
max_num_seqs = 8
max_model_len = 128
kv_cache_dtype = "int8"
max_n = 3
[speculative]
method = "ngram"
num_tokens = 2
""")
    llm = LLM("builtin:demo", config=path, warm_up=False, max_num_seqs=2)
    config = llm.engine.config
    assert config.scheduler.max_num_seqs == 2  # the keyword wins over the file
    assert (config.max_model_len, config.cache.kv_cache_dtype, config.limits.max_n) == (
        128, "int8", 3)
    assert config.speculative == SpeculativeConfig(method="ngram", num_tokens=2)
    # The file's dtype: the demo is float32. On the CPU bfloat16 weights compute in float32.
    assert llm.engine.model.config.param_dtype == "bfloat16"
    assert llm.engine.model.config.dtype == (
        "float32" if jax.default_backend() == "cpu" else "bfloat16")
    assert llm.model_name == "builtin:demo"
    path.write_text("max_num_seq = 4\n")
    with pytest.raises(ConfigFileError, match=re.escape(f"{path}: unknown option 'max_num_seq'")):
        LLM("builtin:demo", config=path, warm_up=False)
