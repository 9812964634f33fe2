"""The regression gate on compiled programs: `LLM(model)`'s default configuration compiles at
most a committed number of step programs, all of them at warm-up, and nothing afterwards,
structured-output requests included (their bitmask is an input of fixed shape).

Raising `PROGRAM_BUDGET` is a decision (warm-up time grows with it): say why in the commit.
"""

from __future__ import annotations

import json
import re

import pytest
import tokenizers
from jax._src import monitoring
from tokenizers import decoders, models, pre_tokenizers, trainers

from jaxinfer import LLM, SamplingParams
from jaxinfer.config import get_preset
from jaxinfer.engine.auto_config import Machine, auto_engine_options

# One program per token bucket, 1 and 8 to 1024 (CPU defaults): 9. The bucket of one token
# (2026-12-07) is batch-1 decode's: padded to 8 rows, a SmolLM2 Q4_1 decode step ran every
# weight kernel on 8 rows instead of 1.
PROGRAM_BUDGET = 9
# The tiny preset's 512 ids are more than the test tokenizer's ~300: constrained rows must
# also never pick the ids the tokenizer does not have.
TOKENIZER_VOCAB = 300

_compiles: list[str] = []


def _count(event: str, duration: float, **_: object) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _compiles.append(event)


monitoring.register_event_duration_secs_listener(_count)


@pytest.fixture(scope="module")
def tokenizer_directory(tmp_path_factory):
    """A byte-level BPE tokenizer smaller than the tiny preset's vocabulary."""
    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(["yes no 555-1234 the list type"] * 8, trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    directory = tmp_path_factory.mktemp("tokenizer")
    backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return directory


def test_the_default_configuration_stays_within_the_program_budget(tokenizer_directory):
    options = auto_engine_options(get_preset("tiny"), {}, Machine("cpu", 16 << 30))
    # The pool's size does not change the programs' count; a small one keeps the test light.
    llm = LLM("random:tiny", tokenizer=tokenizer_directory,
              **{**options, "num_pages": 64, "max_model_len": 128})
    assert llm.engine.compilations <= PROGRAM_BUDGET
    warmed = len(_compiles)
    prompts = [{"prompt_token_ids": list(range(3, 3 + length))} for length in (5, 40, 90)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    llm.generate(prompts * 4, SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=1,
                                             logprobs=2, max_tokens=6, ignore_eos=True))
    # Structured output beside plain requests, greedy and sampled.
    constrained = [SamplingParams(temperature=temperature, seed=2, max_tokens=12,
                                  structured_outputs=constraint)
                   for temperature in (0.0, 1.0)
                   for constraint in ({"regex": "[0-9]{3}-[0-9]{4}"},
                                      {"choice": ["yes", "no"]}, None)]
    outputs = llm.generate(prompts[:1] * len(constrained), constrained)
    assert len(_compiles) == warmed  # no XLA compile at all after warm-up
    assert llm.engine.compilations <= PROGRAM_BUDGET
    for params, output in zip(constrained, outputs, strict=True):
        sample = output.outputs[0]
        if params.structured_outputs is not None:
            # A random model follows its grammar, and never picks an id past the tokenizer.
            assert max(sample.token_ids) < llm.tokenizer.vocab_size <= TOKENIZER_VOCAB
            assert sample.finish_reason == "stop"
            assert (re.fullmatch("[0-9]{3}-[0-9]{4}", sample.text)
                    if params.structured_outputs.regex else sample.text in ("yes", "no"))
