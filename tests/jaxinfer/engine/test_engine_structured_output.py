"""Structured output end to end on the built-in demo model (a small LM trained on Python's
documentation, which writes no JSON, digits or yes/no answers by itself): choice, regex and
JSON schema requests produce exactly what they ask for, constrained and unconstrained,
greedy and sampled requests share batches without changing each other's tokens, and a
speculating engine serves constrained requests without drafts."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from jaxinfer.engine.core import Engine, EngineConfig
from jaxinfer.engine.sampling_params import SamplingParams
from jaxinfer.model_loading import load_model, resolve_model_path
from jaxinfer.tokenizer import load_tokenizer

PROMPTS = ["The list type", "Is a tuple mutable?", "A dictionary maps"]
OPTIONS = dict(page_size=16, max_num_batched_tokens=64, max_num_seqs=8, max_model_len=256,
               min_token_bucket=16, bucket_growth=4)
SCHEMA = {"type": "object",
          "properties": {"count": {"type": "integer"},
                         "kind": {"enum": ["list", "dict", "tuple"]}},
          "required": ["count", "kind"], "additionalProperties": False}
PHONE = "[0-9]{3}-[0-9]{4}"


@pytest.fixture(scope="module")
def demo():
    return load_model("builtin:demo"), load_tokenizer(resolve_model_path("builtin:demo"))


def _engine(demo, **overrides):
    model, tokenizer = demo
    return Engine(model, EngineConfig.from_options(**{**OPTIONS, **overrides}), tokenizer)


def _run(engine, requests):
    """Adds `{request_id: (prompt, params)}` and steps until idle; returns final outputs."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    final = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            final[output.request_id] = output
    return final


def _greedy(max_tokens=48, **structured):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens,
                          structured_outputs=structured or None)


def test_choice_regex_and_json_schema_outputs_match(demo):
    engine = _engine(demo)
    requests = {}
    for index, prompt in enumerate(PROMPTS):
        requests[f"choice{index}"] = prompt, _greedy(choice=["yes", "no"])
        requests[f"phone{index}"] = prompt, _greedy(regex=PHONE)
        requests[f"json{index}"] = prompt, _greedy(json=SCHEMA, disable_any_whitespace=True)
    final = _run(engine, requests)
    for request_id, output in final.items():
        sample = output.outputs[0]
        # Every one ends because its grammar is complete, long before max_tokens (no stop
        # token or string did it, so there is no stop_reason, as for EOS in vLLM).
        assert (sample.finish_reason, sample.stop_reason) == ("stop", None), (
            request_id, sample.text)
        if request_id.startswith("choice"):
            assert sample.text in ("yes", "no")
        elif request_id.startswith("phone"):
            assert re.fullmatch(PHONE, sample.text)
        else:
            jsonschema.validate(json.loads(sample.text), SCHEMA)
    # Unconstrained, the model writes none of these.
    plain = _run(engine, {"plain": (PROMPTS[1], _greedy())})["plain"].outputs[0].text
    assert plain.strip() not in ("yes", "no") and not re.fullmatch(PHONE, plain)


def test_json_object_and_a_lark_grammar(demo):
    grammar = 'start: "x = " NUMBER\nNUMBER: /[1-9][0-9]?/'
    final = _run(_engine(demo), {
        "object": (PROMPTS[0], _greedy(json_object=True, disable_any_whitespace=True)),
        "lark": (PROMPTS[2], _greedy(grammar=grammar))})
    assert isinstance(json.loads(final["object"].outputs[0].text), dict)
    assert re.fullmatch(r"x = [1-9][0-9]?", final["lark"].outputs[0].text)


def test_unconstrained_requests_get_their_own_tokens_beside_constrained_ones(demo):
    alone = {prompt: _run(_engine(demo), {"a": (prompt, _greedy(24))})["a"]
             for prompt in PROMPTS}
    engine = _engine(demo)
    requests = {f"plain{index}": (prompt, _greedy(24)) for index, prompt in enumerate(PROMPTS)}
    requests.update({f"json{index}": (prompt, _greedy(json=SCHEMA))
                     for index, prompt in enumerate(PROMPTS)})
    requests["sampled"] = PROMPTS[0], SamplingParams(
        temperature=1.0, seed=3, max_tokens=24, structured_outputs={"regex": PHONE})
    final = _run(engine, requests)
    for index, prompt in enumerate(PROMPTS):
        assert final[f"plain{index}"].outputs[0].token_ids == alone[prompt].outputs[0].token_ids
    assert re.fullmatch(PHONE, final["sampled"].outputs[0].text)


def test_n_samples_each_follow_their_own_grammar(demo):
    params = SamplingParams(n=4, temperature=1.5, seed=0, max_tokens=16,
                            structured_outputs={"choice": ["alpha", "beta", "gamma"]})
    [output] = _run(_engine(demo), {"n": (PROMPTS[0], params)}).values()
    assert len(output.outputs) == 4
    assert all(sample.text in ("alpha", "beta", "gamma") for sample in output.outputs)


def test_a_speculating_engine_serves_constrained_requests_without_drafts(demo):
    engine = _engine(demo, speculative={"method": "ngram", "num_tokens": 3,
                                        "adaptive": False})
    final = _run(engine, {"phone": (PROMPTS[0], _greedy(regex=PHONE)),
                          "plain": (PROMPTS[1], _greedy(24))})
    assert re.fullmatch(PHONE, final["phone"].outputs[0].text)
    assert final["phone"].speculative is None  # it never speculated
    assert final["plain"].speculative is not None
