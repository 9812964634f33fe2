"""A real GGUF model, SmolLM2-135M-Instruct in Q4_1 (token_embd Q8_0): it loads with its
projections quantized, greedy generation through `LLM` equals transformers' greedy `generate`
on the same file, and the chat template from its metadata renders as transformers renders it.

The model is loaded once per module (about a minute on two cores); `smollm2_gguf` (conftest)
skips these tests when the file is not there.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from jaxinfer.engine.sampling_params import SamplingParams
from jaxinfer.llm import LLM
from jaxinfer.quant import QuantizedLinear
from jaxinfer.quant.gguf import gguf_weight_bytes
from jaxinfer.quant.linear import TIED_HEAD_EXACT_TOP
from jaxinfer.tokenizer import load_tokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one short sentence."},
     {"role": "user", "content": "Name a colour of the sky. Ünïcödé 🤖"}],
]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def loaded(smollm2_gguf):
    llm = LLM(smollm2_gguf, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=128)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32)
    reference_tokenizer = transformers.AutoTokenizer.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    return llm, reference, reference_tokenizer


def test_it_loads_with_quantized_projections(loaded):
    llm, _, _ = loaded
    model = llm.engine.model
    config = model.config
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads,
            config.vocab_size, config.tie_word_embeddings) == (30, 576, 9, 3, 49152, True)
    # The engine may hold the blocks stacked for its scan: one block of [L, ...] arrays.
    blocks = list(model.layers) or [model.stacked_layers]
    for block in blocks:
        for layer in (block.attention.q_proj, block.attention.k_proj, block.attention.v_proj,
                      block.attention.o_proj, block.mlp.gate_proj, block.mlp.up_proj,
                      block.mlp.down_proj):
            assert isinstance(layer, QuantizedLinear)
            assert (layer.format, layer.group_size, layer.zeros[...].dtype) == (
                "int4", 32, np.float32)
    # 30 blocks of 3.5M Q4_1 weights at 24 bytes per 32 (16 of nibbles, a float32 scale and
    # zero point), the float32 embedding table (dequantized from Q8_0: a gather) and the 61
    # norms, and the tied head served from the Q8_0 table (36 bytes per 32 weights: 32 int8
    # and a float32 scale): 224.9 MB, against 538.6 MB all float32.
    projections = 30 * (2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536)
    floats = 49152 * 576 + 61 * 576
    head = 49152 * 576 * 36 // 32
    assert gguf_weight_bytes(model) == projections * 24 // 32 + 4 * floats + head
    assert isinstance(model.lm_head, QuantizedLinear)
    assert (model.lm_head.format, model.lm_head.int8_activations,
            model.lm_head.exact_top) == ("int8_grouped", None, TIED_HEAD_EXACT_TOP)


def test_greedy_generation_equals_transformers(loaded, smollm2_gguf):
    llm, reference, _ = loaded
    tokenizer = load_tokenizer(smollm2_gguf)
    prompts = [tokenizer.apply_chat_template(messages, add_generation_prompt=True)
               for messages in CONVERSATIONS]
    outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in prompts],
                           SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS))
    for prompt, output in zip(prompts, outputs):
        with torch.no_grad():
            expected = reference.generate(torch.tensor([prompt]), do_sample=False,
                                          max_new_tokens=NEW_TOKENS)[0, len(prompt):]
        expected = [int(token) for token in expected]
        if 2 in expected:  # transformers pads after EOS; we stop on it
            expected = expected[:expected.index(2) + 1]
        assert list(output.outputs[0].token_ids) == expected
        assert len(expected) >= 4  # a real answer, not an immediate stop


def test_chat_template_and_ids_equal_transformers(loaded, smollm2_gguf):
    _, _, reference_tokenizer = loaded
    tokenizer = load_tokenizer(smollm2_gguf)
    for messages in CONVERSATIONS:
        for add_generation_prompt in (False, True):
            expected = reference_tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False)
            rendered = tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False)
            assert rendered == expected
            assert tokenizer.encode(rendered) == reference_tokenizer.encode(rendered)
    assert np.array_equal(tokenizer.encode("  Hello,\tworld! 日本 🤖"),
                          reference_tokenizer.encode("  Hello,\tworld! 日本 🤖"))
