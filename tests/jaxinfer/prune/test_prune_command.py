"""`jaxinfer prune` end to end on builtin:demo: the checkpoint it writes loads in `LLM` and
`jaxinfer eval ppl`, with the requested zeros; and Wanda and SparseGPT at 50% beat magnitude
on held-out perplexity."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.cli import main as jaxinfer_main
from jaxinfer.model_loading import load_model, resolve_model_path
from jaxinfer.perplexity import perplexity
from jaxinfer.prune import PruningConfig, prune_model
from jaxinfer.quant import is_quantized_checkpoint, linear_sites
from jaxinfer.quant.calibration import calibration_windows
from jaxinfer.tokenizer import load_tokenizer
from tests.jaxinfer.prune.texts import CALIBRATION, HELD_OUT


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    directory = tmp_path_factory.mktemp("texts")
    (directory / "calib.txt").write_text(CALIBRATION)
    (directory / "held_out.txt").write_text(HELD_OUT)
    return directory / "calib.txt", directory / "held_out.txt"


def _generate(directory) -> list[int]:
    llm = LLM(directory, max_num_seqs=2, max_num_batched_tokens=32, max_model_len=64)
    outputs = llm.generate(["The list type"], SamplingParams(temperature=0.0, max_tokens=8,
                                                             ignore_eos=True))
    return outputs[0].outputs[0].token_ids


def test_prune_command_writes_a_float_checkpoint_that_loads_everywhere(tmp_path, texts,
                                                                       capsys):
    calib, held_out = texts
    out = tmp_path / "demo-wanda-2-4"
    assert jaxinfer_main(["prune", "--model", "builtin:demo", "--method", "wanda",
                          "--pattern", "2:4", "--calib", str(calib), "--num-windows", "8",
                          "--window", "64", "--no-progress", "--out", str(out)]) == 0
    assert "wrote wanda 2:4" in capsys.readouterr().out
    assert (out / "config.json").is_file() and (out / "tokenizer.model").is_file()
    assert not is_quantized_checkpoint(out)
    pruned = load_model(out)
    for site in linear_sites(pruned):
        matrix = np.asarray(site.float_matrix())  # [I, O]
        zeros = np.sum(matrix.reshape(-1, 4, matrix.shape[1]) == 0, axis=1)  # [I / 4, O]
        assert np.all(zeros == 2) if site.path != "lm_head" else np.all(zeros < 4)
    assert len(_generate(out)) == 8
    assert jaxinfer_main(["eval", "ppl", "--model", str(out), "--data", str(held_out),
                          "--window", "64", "--json"]) == 0
    pruned_ppl = json.loads(capsys.readouterr().out)["ppl"]
    assert jaxinfer_main(["eval", "ppl", "--model", "builtin:demo", "--data", str(held_out),
                          "--window", "64", "--json"]) == 0
    dense_ppl = json.loads(capsys.readouterr().out)["ppl"]
    assert dense_ppl < pruned_ppl < 3 * dense_ppl  # 2:4 costs something, not everything


# 22 s alone, 80 s on busy shared cores; test_apply covers the joint checkpoint quickly.
@pytest.mark.slow
def test_prune_command_joint_sparsegpt_int4_writes_a_quantized_checkpoint(tmp_path, texts,
                                                                          capsys):
    calib, _ = texts
    out = tmp_path / "demo-sparsegpt-int4"
    assert jaxinfer_main(["prune", "--model", "builtin:demo", "--method", "sparsegpt",
                          "--sparsity", "0.5", "--bits", "4", "--group-size", "64",
                          "--calib", str(calib), "--num-windows", "4", "--window", "64",
                          "--no-progress", "--out", str(out)]) == 0
    assert is_quantized_checkpoint(out) and (out / "tokenizer.model").is_file()
    restored = load_model(out)
    down = linear_sites(restored)[6]
    assert down.path == "layers.0.mlp.down_proj" and down.is_quantized
    matrix = np.asarray(down.layer.dequantized())  # [I, O]
    assert np.all(np.sum(matrix == 0, axis=0) >= matrix.shape[0] // 2)
    assert len(_generate(out)) == 8


def test_prune_command_structured_writes_a_smaller_dense_model(tmp_path, texts, capsys):
    calib, _ = texts
    out = tmp_path / "demo-structured"
    assert jaxinfer_main(["prune", "--model", "builtin:demo", "--structured",
                          "heads=0.25,mlp=0.25,layers=1", "--calib", str(calib),
                          "--num-windows", "4", "--window", "64", "--out", str(out)]) == 0
    assert "wrote structured (heads=0.25,mlp=0.25,layers=1" in capsys.readouterr().out
    dense, pruned = load_model("builtin:demo").config, load_model(out).config
    assert pruned.num_layers == dense.num_layers - 1
    assert pruned.num_kv_heads == dense.num_kv_heads * 3 // 4
    assert pruned.intermediate_size == dense.intermediate_size * 3 // 4
    assert len(_generate(out)) == 8


@pytest.mark.slow  # 38 s on the shared 2-core machine
def test_prune_command_harp_searches_alphas_and_the_checkpoint_loads_everywhere(
        tmp_path, texts, capsys):
    calib, held_out = texts
    out = tmp_path / "demo-harp"
    assert jaxinfer_main(["prune", "--model", "builtin:demo", "--harp", "2", "--calib",
                          str(calib), "--num-windows", "4", "--window", "64", "--no-progress",
                          "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "wrote HARP (2 layers, alphas" in printed and "75.0% of" in printed  # 6 of 8 cached
    config = json.loads((out / "config.json").read_text())
    alphas = config["jaxinfer_harp"]["alphas"]
    assert config["jaxinfer_harp"]["layers"] == [6, 7] and len(alphas) == 2
    assert all(0.0 <= alpha <= 1.0 for alpha in alphas)
    assert load_model(out).config.harp_alphas == tuple(alphas)
    assert len(_generate(out)) == 8
    assert jaxinfer_main(["eval", "ppl", "--model", str(out), "--data", str(held_out),
                          "--window", "64", "--json"]) == 0
    harp_ppl = json.loads(capsys.readouterr().out)["ppl"]
    assert jaxinfer_main(["eval", "ppl", "--model", "builtin:demo", "--data", str(held_out),
                          "--window", "64", "--json"]) == 0
    dense_ppl = json.loads(capsys.readouterr().out)["ppl"]
    assert 1.0 < harp_ppl < 3 * dense_ppl
    fixed = tmp_path / "demo-harp-one"
    assert jaxinfer_main(["prune", "--model", "builtin:demo", "--harp", "1", "--harp-alpha",
                          "1", "--calib", str(calib), "--out", str(fixed)]) == 0
    assert load_model(fixed).config.harp_alphas == (1.0,)


@pytest.mark.parametrize("arguments, message", [
    (["--harp", "2", "--method", "wanda"], "--harp takes none of"),
    (["--harp", "2", "--harp-alpha", "2"], "'search' or a number in [0, 1]"),
    (["--harp", "8", "--harp-alpha", "1"], "need 1 <= n < num_layers = 8"),
    (["--method", "wanda", "--sparsity", "0.5", "--bits", "4"], "--method sparsegpt"),
    (["--method", "wanda", "--pattern", "2-4"], "N:M"),
    (["--method", "wanda", "--sparsity", "1.5"], "must be in [0, 1)"),
    (["--sparsity", "0.5"], "need --method"),
    (["--structured", "heads=0.25", "--method", "wanda"], "--structured takes none"),
    (["--structured", "heads=2"], "heads"),
])
def test_prune_command_refuses_bad_targets(tmp_path, texts, capsys, arguments, message):
    calib, _ = texts
    assert jaxinfer_main(["prune", "--model", "builtin:demo", *arguments, "--calib",
                          str(calib), "--out", str(tmp_path / "x")]) == 2
    assert message in capsys.readouterr().err


def test_wanda_and_sparsegpt_beat_magnitude_on_held_out_perplexity():
    tokenizer = load_tokenizer(resolve_model_path("builtin:demo"))
    model = load_model("builtin:demo")
    windows = calibration_windows(tokenizer.encode(CALIBRATION), 64, 1024)  # [B, 64]
    held_out = tokenizer.encode(HELD_OUT)
    dense = perplexity(model, held_out, window=128).ppl
    ppl = {method: perplexity(prune_model(model, PruningConfig.for_method(method, sparsity=0.5),
                                          windows, progress=False),
                              held_out, window=128).ppl
           for method in ("magnitude", "wanda", "sparsegpt")}
    assert dense < ppl["wanda"] < ppl["magnitude"], ppl
    assert dense < ppl["sparsegpt"] < ppl["magnitude"], ppl
