"""Quantized checkpoints: save, load (`load_model`, `LLM`), greedy engine output equal to the
reference path of the same quantized model; `jaxinfer quantize` and `jaxinfer eval ppl`."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from flax import nnx

from jaxinfer.cli import main as jaxinfer_main
from jaxinfer.config import get_preset
from jaxinfer.engine.sampling_params import SamplingParams
from jaxinfer.generate import generate
from jaxinfer.llm import LLM
from jaxinfer.model_loading import load_model
from jaxinfer.models import create_model
from jaxinfer.perplexity import perplexity
from jaxinfer.quant import (
    QuantizationConfig,
    QuantizationRule,
    QuantizedLinear,
    WeightScheme,
    linear_sites,
    quantize_model,
)
from jaxinfer.quant.checkpoint import (
    is_quantized_checkpoint,
    read_quantization_config,
    save_quantized_model,
)
from jaxinfer.sharding import make_mesh

# Mixed formats in one model: the rules, not one global format, decide.
MIXED = QuantizationConfig(method="rtn", rules=(
    QuantizationRule(r"lm_head$", None),
    QuantizationRule(r"\.down_proj$", WeightScheme(format="int8")),
    QuantizationRule(r"\.o_proj$", WeightScheme(format="int4", bits=3, group_size=32)),
    QuantizationRule(r".", WeightScheme(format="int4", bits=4, group_size=32,
                                        symmetric=False)),
))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model = create_model(get_preset("tiny"), seed=0)
    quantized = quantize_model(model, MIXED)
    directory = save_quantized_model(quantized, MIXED, tmp_path_factory.mktemp("q") / "tiny")
    return quantized, directory


def test_save_and_load_round_trip_every_array(saved):
    quantized, directory = saved
    assert is_quantized_checkpoint(directory)
    assert read_quantization_config(directory) == MIXED
    loaded = load_model(directory)
    for before, after in zip(linear_sites(quantized), linear_sites(loaded), strict=True):
        assert before.path == after.path and before.is_quantized == after.is_quantized
        if before.is_quantized:
            assert (after.layer.format, after.layer.bits, after.layer.group_size) == (
                before.layer.format, before.layer.bits, before.layer.group_size)
    for left, right in zip(jax.tree.leaves(jax.tree.map(np.asarray, nnx.state(quantized))),
                           jax.tree.leaves(jax.tree.map(np.asarray, nnx.state(loaded))),
                           strict=True):
        assert left.dtype == right.dtype
        np.testing.assert_array_equal(left, right)
    assert isinstance(loaded.layers[1].mlp.down_proj, QuantizedLinear)
    assert loaded.layers[1].mlp.down_proj.format == "int8"
    with pytest.raises(ValueError, match="quantized checkpoint"):
        load_model(directory, dtype="bfloat16")


def test_llm_greedy_output_equals_the_reference_path(saved):
    quantized, directory = saved
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 512, size=length).tolist() for length in (3, 11, 30)]
    expected = generate(quantized, prompts, max_new_tokens=5, eos_token_ids=())
    llm = LLM(directory, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64,
              bucket_growth=4)
    outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in prompts],
                           SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    assert [output.outputs[0].token_ids for output in outputs] == expected


def test_a_quantized_checkpoint_splits_over_a_tensor_parallel_mesh(saved):
    """Each quantized layer is split like the float weight it replaced (q/k/v/gate/up on
    their outputs, o/down on their inputs, with their group scales and zero points), so a
    chip holds 1/TP of it, and the TP=2 engine's greedy output equals the one-device
    reference path of the same model."""
    quantized, directory = saved
    mesh = make_mesh({"model": 2}, devices=jax.devices()[:2])
    loaded = load_model(directory, mesh=mesh)
    block = loaded.layers[0]
    q_proj, o_proj, down_proj = block.attention.q_proj, block.attention.o_proj, block.mlp.down_proj
    assert q_proj.values[...].addressable_shards[0].data.shape == (32, 32)  # [I // 2, O / 2]
    assert q_proj.zeros[...].addressable_shards[0].data.shape == (2, 32)  # [C, O / 2]
    assert o_proj.values[...].addressable_shards[0].data.shape == (16, 64)  # [I / 2 // 2, O]
    assert o_proj.scales[...].addressable_shards[0].data.shape == (1, 64)  # [C / 2, O]
    assert down_proj.values[...].addressable_shards[0].data.shape == (64, 64)  # [I / 2, O]
    assert down_proj.scales[...].addressable_shards[0].data.shape == (64,)  # [O], whole
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 512, size=length).tolist() for length in (3, 11, 30)]
    expected = generate(quantized, prompts, max_new_tokens=5, eos_token_ids=())
    llm = LLM(directory, tensor_parallel_size=2, max_num_seqs=4, max_num_batched_tokens=32,
              max_model_len=64, bucket_growth=4)
    outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in prompts],
                           SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    assert [output.outputs[0].token_ids for output in outputs] == expected


def test_quantize_and_eval_ppl_commands(tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text("The list type is a mutable sequence. A dictionary maps keys to values. "
                    "Strings are immutable sequences of Unicode code points. " * 8)
    out = tmp_path / "demo-int4"
    assert jaxinfer_main(["quantize", "--model", "builtin:demo", "--method", "rtn", "--bits",
                          "4", "--group-size", "32", "--out", str(out)]) == 0
    assert is_quantized_checkpoint(out) and (out / "tokenizer.model").is_file()
    capsys.readouterr()
    assert jaxinfer_main(["eval", "ppl", "--model", str(out), "--data", str(text),
                          "--window", "64", "--json"]) == 0
    line = capsys.readouterr().out.strip()
    assert "\n" not in line
    result = json.loads(line)
    assert set(result) == {"ppl", "tokens"}
    quantized = load_model(out)
    tokens = LLM(out, max_num_seqs=1, max_num_batched_tokens=16, max_model_len=32
                 ).get_tokenizer().encode(text.read_text())
    direct = perplexity(quantized, tokens, window=64)
    assert result["tokens"] == direct.tokens == len(tokens) - 1
    assert result["ppl"] == pytest.approx(direct.ppl, rel=1e-6)
    full = perplexity(load_model("builtin:demo"), tokens, window=64)
    assert full.ppl < result["ppl"] < 1.2 * full.ppl  # int4 costs a little, not a lot
    assert jaxinfer_main(["quantize", "--model", "builtin:demo", "--method", "gptq",
                          "--out", str(tmp_path / "x")]) == 2  # no --calib


def test_a_tied_head_is_quantized_from_the_table_saved_and_restored(tmp_path):
    config = get_preset("tiny").replace(tie_word_embeddings=True)
    model = create_model(config, seed=3)
    quantization = QuantizationConfig.for_method("rtn", bits=4, group_size=32, head="int8")
    quantized = quantize_model(model, quantization)
    head = quantized.lm_head
    assert isinstance(head, QuantizedLinear) and head.format == "int8_grouped"
    assert head.group_size == 32 and model.lm_head is None  # the float model is left tied
    # The head is the table's Q8_0-style copy: logits within int8 rounding of the float
    # table's, from the same hidden states; the lookup still reads the float table.
    hidden = jax.random.normal(jax.random.key(0), (2, 5, config.hidden_size))  # [B, T, D]
    want = np.asarray(hidden @ model.embed.weight[...].T)  # [B, T, V]
    got = np.asarray(quantized.logits(hidden))  # [B, T, V]
    assert 0 < np.max(np.abs(got - want)) < 0.02 * np.max(np.abs(want))
    np.testing.assert_array_equal(np.asarray(quantized.embed.weight[...]),
                                  np.asarray(model.embed.weight[...]))
    loaded = load_model(save_quantized_model(quantized, quantization, tmp_path / "tied"))
    assert isinstance(loaded.lm_head, QuantizedLinear)
    np.testing.assert_array_equal(np.asarray(loaded.lm_head.values[...]),
                                  np.asarray(head.values[...]))
    np.testing.assert_array_equal(np.asarray(loaded.logits(hidden)), got)


def test_the_default_config_keeps_a_tied_head_on_the_float_table():
    model = create_model(get_preset("tiny").replace(tie_word_embeddings=True), seed=3)
    quantized = quantize_model(model, QuantizationConfig.for_method("rtn", bits=8))
    assert quantized.lm_head is None


@pytest.mark.parametrize("head,quantized_head", [("auto", True), ("float", False)])
def test_quantize_command_gives_a_tied_head_int8_by_default(tmp_path, head, quantized_head):
    from tests.tiny_hf import save_hf_model
    save_hf_model("qwen2", tmp_path / "hf")  # tied
    out = tmp_path / f"q-{head}"
    assert jaxinfer_main(["quantize", "--model", str(tmp_path / "hf"), "--method", "rtn",
                          "--bits", "4", "--group-size", "32", "--head", head,
                          "--out", str(out)]) == 0
    loaded = load_model(out)
    assert isinstance(loaded.lm_head, QuantizedLinear) == quantized_head
