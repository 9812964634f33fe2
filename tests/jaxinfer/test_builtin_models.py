"""The shipped demo models: loadable by us and by transformers, and they write English."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers

from jaxinfer.cli import main
from jaxinfer.model_loading import load_model, resolve_model_path
from jaxinfer.tokenizer import load_tokenizer
from tests.tiny_hf import relative_error

PROMPT = "The list type is"
COMMON_WORDS = {"the", "a", "is", "of", "to", "and", "in", "be", "that", "for", "are"}


@pytest.mark.parametrize("name", ["demo", "demo-draft"])
def test_builtin_matches_transformers(name):
    directory = resolve_model_path(f"builtin:{name}")
    ids = load_tokenizer(directory).encode(PROMPT + " used to store")
    ours = np.asarray(load_model(f"builtin:{name}")(np.asarray([ids], np.int32))[0])
    reference = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    with torch.no_grad():
        theirs = reference(torch.tensor([ids])).logits.numpy()
    assert relative_error(ours, theirs) < 1e-4


def test_demo_vocabulary_matches_its_tokenizer_and_the_drafter_shares_it():
    tokenizer = load_tokenizer(resolve_model_path("builtin:demo"))
    teacher, drafter = load_model("builtin:demo"), load_model("builtin:demo-draft")
    assert teacher.config.vocab_size == drafter.config.vocab_size == tokenizer.vocab_size
    files = [(resolve_model_path(name) / "tokenizer.model").read_bytes()
             for name in ("builtin:demo", "builtin:demo-draft")]
    assert files[0] == files[1]
    # The drafter is the small one (speculative decoding needs it cheap).
    assert drafter.config.num_layers < teacher.config.num_layers


def test_generate_prints_recognizable_text(capsys):
    words = set()
    texts = []
    for prompt in (PROMPT, "To open a file, use the"):
        assert main(["generate", "--model", "builtin:demo", "--prompt", prompt,
                     "--max-tokens", "40", "--json"]) == 0
        text = json.loads(capsys.readouterr().out)["text"]
        texts.append(text)
        words |= {word.strip(".,;:()`*'\"").lower() for word in text.split()}
    # A random model emits piece salad; the trained teacher writes documentation English.
    assert len(words & COMMON_WORDS) >= 2, texts


def test_unknown_builtin_is_named():
    with pytest.raises(FileNotFoundError, match="unknown builtin model 'large'"):
        load_model("builtin:large")
