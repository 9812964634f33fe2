"""`jaxinfer generate` on checkpoints with and without tokenizer files; the engine flags of
`jaxinfer bench` and its `--config FILE`."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from jaxinfer.bench.latency import LATENCY_DEFAULTS
from jaxinfer.cli import build_parser, main, parse_args
from jaxinfer.engine.config import (
    BENCH_DEFAULTS,
    EngineConfig,
    SpeculativeConfig,
    engine_options_from_args,
)
from jaxinfer.engine.limits import RequestLimits
from jaxinfer.tokenizer import load_tokenizer
from tests.tiny_hf import hf_greedy, save_hf_model

VOCAB = 320


@pytest.fixture(scope="module")
def bare_checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("bare")
    return directory, save_hf_model("llama", directory)


@pytest.fixture(scope="module")
def checkpoint_with_tokenizer(tmp_path_factory):
    directory = tmp_path_factory.mktemp("with_tokenizer")
    hf_model = save_hf_model("llama", directory, vocab_size=VOCAB)
    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(["hello world, the quick brown fox"] * 50, trainer)
    backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}))
    return directory, hf_model


def _run_json(capsys, *argv: str) -> dict:
    assert main(["generate", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_token_ids_without_tokenizer_match_transformers(bare_checkpoint, capsys):
    directory, hf_model = bare_checkpoint
    out = _run_json(capsys, "--model", str(directory), "--prompt-token-ids", "1,5,77,9",
                    "--max-tokens", "12")
    assert out == {"token_ids": hf_greedy(hf_model, [1, 5, 77, 9], 12), "text": None}


def test_text_prompt_needs_a_tokenizer(bare_checkpoint, capsys):
    directory, _ = bare_checkpoint
    assert main(["generate", "--model", str(directory), "--prompt", "hi"]) == 2
    assert "has no tokenizer files" in capsys.readouterr().err


def test_text_prompt_and_decoded_output(checkpoint_with_tokenizer, capsys):
    directory, hf_model = checkpoint_with_tokenizer
    tokenizer = load_tokenizer(directory)
    out = _run_json(capsys, "--model", str(directory), "--prompt", "hello world",
                    "--max-tokens", "10", "--ignore-eos")
    prompt_ids = tokenizer.encode("hello world")
    assert len(out["token_ids"]) == 10
    assert out["text"] == tokenizer.decode(out["token_ids"])
    # Greedy through the CLI equals transformers' greedy unless transformers hit EOS first.
    reference = hf_greedy(hf_model, prompt_ids, 10)
    assert out["token_ids"][: len(reference)] == reference


def test_sampling_flags_are_seeded(bare_checkpoint, capsys):
    directory, _ = bare_checkpoint
    argv = ("--model", str(directory), "--prompt-token-ids", "1,2,3", "--max-tokens", "16",
            "--temperature", "1.0", "--top-k", "40", "--top-p", "0.9", "--ignore-eos")
    first = _run_json(capsys, *argv, "--seed", "1")
    assert first == _run_json(capsys, *argv, "--seed", "1")
    assert first != _run_json(capsys, *argv, "--seed", "2")


def test_bad_inputs_exit_2_with_a_message(bare_checkpoint, tmp_path, capsys):
    directory, _ = bare_checkpoint
    assert main(["generate", "--model", str(tmp_path / "nope"), "--prompt-token-ids", "1"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["generate", "--model", str(directory), "--prompt-token-ids", "1,999"]) == 2
    assert "outside the vocabulary" in capsys.readouterr().err
    assert main(["generate", "--model", str(directory), "--prompt-token-ids", "1",
                 "--top-p", "0"]) == 2
    assert "top_p" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "--model", str(directory), "--prompt-token-ids", "1,x"])


def test_prompt_from_stdin_in_a_subprocess(checkpoint_with_tokenizer):
    directory, _ = checkpoint_with_tokenizer
    command = [sys.executable, "-m", "jaxinfer.cli", "generate", "--model", str(directory),
               "--max-tokens", "5", "--json"]
    piped = subprocess.run(command, input="hello world", capture_output=True, text=True,
                           check=True, timeout=300)
    given = subprocess.run([*command, "--prompt", "hello world"], capture_output=True,
                           text=True, check=True, timeout=300)
    assert json.loads(piped.stdout) == json.loads(given.stdout)


# ---------------------------------------------------------------------- bench engine flags


def _bench_options(kind, *argv):
    return engine_options_from_args(build_parser().parse_args(["bench", kind, *argv]))


@pytest.mark.parametrize(("kind", "defaults"), [("throughput", BENCH_DEFAULTS),
                                                ("latency", LATENCY_DEFAULTS)])
def test_bench_engine_defaults(kind, defaults):
    library = EngineConfig().options()
    del library["max_model_len"], library["enable_prompt_logprobs"]  # the bench sets these
    for field in dataclasses.fields(RequestLimits):  # and its requests are within them
        del library[field.name]
    assert _bench_options(kind) == {**library, **defaults}


def test_bench_keeps_every_engine_flag_name():
    options = _bench_options(
        "throughput", "--page-size", "8", "--max-num-seqs", "4", "--max-num-batched-tokens",
        "32", "--min-token-bucket", "16", "--bucket-growth", "4", "--enable-prefix-caching",
        "--speculative", '{"method": "ngram", "num_tokens": 2, "max_ngram": 2}',
        "--tensor-parallel-size", "2", "--data-parallel-size", "3",
        "--expert-parallel-size", "1", "--kv-cache-dtype", "int8", "--num-pages", "99")
    assert options == dict(
        page_size=8, max_num_seqs=4, max_num_batched_tokens=32, min_token_bucket=16,
        bucket_growth=4, enable_prefix_caching=True,
        speculative=SpeculativeConfig(method="ngram", num_tokens=2, max_ngram=2),
        tensor_parallel_size=2, data_parallel_size=3, expert_parallel_size=1,
        kv_cache_dtype="int8", num_pages=99, cache_dtype=None, compilation_cache=None,
        kv_offload_bytes=0, preemption_mode="recompute")
    assert _bench_options("latency", "--no-enable-prefix-caching", "-tp", "2")[
        "tensor_parallel_size"] == 2


@pytest.mark.parametrize("flag", ["--max-model-len=64", "--enable-prompt-logprobs",
                                  "--no-prompt-logprobs"])
def test_bench_has_no_flags_for_what_it_sets_itself(flag, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "throughput", flag])
    assert "unrecognized arguments" in capsys.readouterr().err


def test_bench_reads_a_config_file_and_flags_win(tmp_path):
    path = tmp_path / "bench.toml"
    path.write_text("""
model = "random:tiny"
num_prompts = 8
input_len_range = [16, 32]
output-len = 16
compare = ["hf"]
no_roofline = true
max_num_seqs = 4
max_num_batched_tokens = 64
enable_prefix_caching = true
[speculative]
method = "ngram"
num_tokens = 2
""")
    args = parse_args(["bench", "throughput", "--config", str(path), "--num-prompts", "4"])
    assert (args.model, args.num_prompts, args.input_len_range, args.output_len) == (
        "random:tiny", 4, (16, 32), 16)
    assert (args.compare, args.no_roofline) == (("hf",), True)
    options = engine_options_from_args(args)
    assert (options["max_num_seqs"], options["max_num_batched_tokens"]) == (4, 64)
    assert options["enable_prefix_caching"] is True  # BENCH_DEFAULTS turns it off
    assert options["speculative"] == SpeculativeConfig(method="ngram", num_tokens=2)
    latency = tmp_path / "latency.yaml"
    latency.write_text("batch_size: [1, 4]\niterations: 2\ntensor-parallel-size: 2\n")
    args = parse_args(["bench", "latency", "--config", str(latency), "--iterations", "3"])
    assert (args.batch_size, args.iterations, args.tensor_parallel_size) == ((1, 4), 3, 2)


@pytest.mark.parametrize("key", ["max_model_len", "max_n", "host"])
def test_bench_config_refuses_what_it_has_no_flag_for(tmp_path, capsys, key):
    path = tmp_path / "bench.toml"
    path.write_text(f"{key} = 1\n")
    with pytest.raises(SystemExit):
        parse_args(["bench", "latency", "--config", str(path)])
    assert f"config file {path}: unknown option {key!r}" in capsys.readouterr().err
