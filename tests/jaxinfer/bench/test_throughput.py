"""`jaxinfer bench throughput` on the tiny preset: the numbers follow from the timings, the
engine compiles nothing after warm-up, and its greedy tokens equal HF transformers' on the same
(exported) weights, left-padded static batches of mixed prompt lengths included."""

from __future__ import annotations

import json
import sys
import time

import pytest

from jaxinfer.bench.throughput import (
    bench_engine_config,
    load_bench_model,
    run_throughput,
    throughput_table,
)
from jaxinfer.bench.workload import make_requests
from jaxinfer.cli import main
from jaxinfer.engine.config import BENCH_DEFAULTS, EngineConfig
from jaxinfer.generate import generate

# Few buckets (tokens 16, 32 x sequences 1, 2, 4), so warm-up compiles 6 small programs.
OPTIONS = dict(max_num_seqs=4, max_num_batched_tokens=32, min_token_bucket=16)
# One token bucket (16): prompts of up to 20 tokens take chunked prefills.
SMALL_ENGINE = ["--max-num-seqs", "2", "--max-num-batched-tokens", "16",
                "--min-token-bucket", "16"]


@pytest.fixture(scope="module")
def model():
    return load_bench_model("random:tiny")


@pytest.fixture(scope="module")
def requests(model):
    # 5 requests over HF batches of 2 (2 + 2 + 1), prompts of 3 to 20 tokens: left padding.
    return make_requests(5, vocab_size=model.config.vocab_size, input_len=(3, 20),
                         output_len=(5, 8), seed=3)


@pytest.fixture(scope="module")
def result(model, requests):
    started = time.perf_counter()
    result = run_throughput(model, requests, OPTIONS, compare_hf=True, hf_batch_size=2)
    result["wall_s"] = time.perf_counter() - started
    return result


def test_engine_numbers_follow_from_the_run(result, requests):
    engine = result["engine"]
    prompt = sum(request.prompt_len for request in requests)
    output = sum(request.output_len for request in requests)
    assert (result["num_requests"], result["prompt_tokens"], result["output_tokens"]) == (
        5, prompt, output)
    assert 0 < engine["elapsed_s"] < result["wall_s"]
    assert engine["requests_per_s"] == pytest.approx(5 / engine["elapsed_s"])
    assert engine["output_tokens_per_s"] == pytest.approx(output / engine["elapsed_s"])
    assert engine["total_tokens_per_s"] == pytest.approx((prompt + output) / engine["elapsed_s"])
    assert engine["compilations_during_run"] == 0
    assert engine["programs"] == 3  # one per token bucket (1, 16, 32)
    assert 0 < engine["warm_up_s"] < result["wall_s"]
    # At most 4 running: the 8-token outputs need at least 8 decode steps after prefill.
    assert max(request.output_len for request in requests) <= engine["num_steps"] < 60


def test_hf_numbers_and_ratio(result, requests):
    hf, engine = result["hf"], result["engine"]
    assert (hf["batch_size"], hf["num_batches"]) == (2, 3)
    assert hf["output_tokens_per_s"] == pytest.approx(result["output_tokens"] / hf["elapsed_s"])
    assert engine["elapsed_s"] + hf["elapsed_s"] < result["wall_s"]
    assert result["engine_over_hf"] == pytest.approx(
        engine["output_tokens_per_s"] / hf["output_tokens_per_s"])


def test_greedy_tokens_agree_with_hf_and_reference(result, requests, model):
    ours, theirs = result["token_ids"]["engine"], result["token_ids"]["hf"]
    for request in requests:
        assert len(ours[request.request_id]) == request.output_len
        assert ours[request.request_id] == theirs[request.request_id], request.request_id
    assert result["hf_token_agreement"] == 1.0
    reference = generate(model, [list(request.prompt_token_ids) for request in requests],
                         max_new_tokens=8, eos_token_ids=())
    for request, expected in zip(requests, reference):
        assert ours[request.request_id] == expected[:request.output_len]


def test_cli_writes_json_and_markdown(tmp_path, capsys):
    json_path, markdown = tmp_path / "out.json", tmp_path / "report.md"
    markdown.write_text("# Earlier results\n")
    argv = ["bench", "throughput", "--model", "random:tiny", "--num-prompts", "4",
            "--input-len-range", "4,12", "--output-len", "3", *SMALL_ENGINE,
            "--output-json", str(json_path), "--markdown", str(markdown)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    numbers = json.loads(json_path.read_text())
    assert "token_ids" not in numbers
    assert numbers["output_tokens"] == 12 and numbers["num_requests"] == 4
    assert numbers["engine"]["compilations_during_run"] == 0
    assert numbers["engine"]["output_tokens_per_s"] == pytest.approx(
        12 / numbers["engine"]["elapsed_s"])
    assert numbers["machine"]["cpu_count"] >= 1 and numbers["machine"]["jax_backend"] == "cpu"
    assert numbers["model"].startswith("random:tiny (")
    assert f"{numbers['engine']['output_tokens_per_s']:.1f}" in printed
    text = markdown.read_text()
    assert text.startswith("# Earlier results\n## jaxinfer bench throughput (")  # appended
    assert "jaxinfer bench throughput --model random:tiny" in text
    assert "| jaxinfer engine |" in text and "HF transformers" not in text
    [engine_line] = [line for line in text.splitlines() if line.startswith("- engine: ")]
    for setting in ("page_size=16", "max_num_batched_tokens=16", "max_num_seqs=2",
                    "enable_prompt_logprobs=False"):
        assert setting in engine_line.removeprefix("- engine: ").split(", ")


def test_compare_hf_without_transformers_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` fails
    assert main(["bench", "throughput", "--model", "random:tiny", "--compare-hf"]) == 2
    error = capsys.readouterr().err
    assert "jaxinfer bench throughput: error: --compare-hf needs torch and transformers" in error
    assert 'pip install -e ".[test]"' in error


def test_size_flags_need_a_random_model(capsys):
    assert main(["bench", "throughput", "--model", "builtin:demo", "--num-layers", "2"]) == 2
    assert "only apply to random:PRESET" in capsys.readouterr().err


def test_cli_speculative_reports_acceptance(tmp_path, capsys):
    json_path = tmp_path / "out.json"
    argv = ["bench", "throughput", "--model", "random:tiny", "--num-prompts", "2",
            "--input-len-range", "12", "--output-len", "8", *SMALL_ENGINE,
            "--speculative", '{"method": "ngram", "num_tokens": 2, "max_ngram": 2}',
            "--output-json", str(json_path)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    numbers = json.loads(json_path.read_text())
    spec = numbers["speculative"]
    assert numbers["engine"]["compilations_during_run"] == 0
    assert 0 <= spec["num_accepted_tokens"] <= spec["num_draft_tokens"]
    assert numbers["engine_settings"]["speculative"]["method"] == "ngram"
    assert f"{spec['num_draft_tokens']} drafted" in printed


@pytest.mark.parametrize(("value", "fragment"), [
    ("[1]", "must be a JSON object"),
    ("{not json", "not JSON"),
    ('{"method": "medusa", "num_tokens": 2}', "must be one of"),
])
def test_cli_rejects_bad_speculative_options(capsys, value, fragment):
    # argparse rejects them while parsing, before any model is loaded.
    with pytest.raises(SystemExit) as exited:
        main(["bench", "throughput", "--model", "random:tiny", *SMALL_ENGINE,
              "--speculative", value])
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert "argument --speculative" in error and fragment in error


def test_bench_engine_config_sizes_the_workload_and_keeps_prompt_logprobs_off():
    config = bench_engine_config({"page_size": 8, "max_num_seqs": 4,
                                  "max_num_batched_tokens": 32}, 21)
    assert config.max_model_len == 24  # 21 tokens, rounded up to whole pages of 8
    assert not config.compile.enable_prompt_logprobs
    assert config.scheduler.max_num_seqs == 4
    assert config.cache.enable_prefix_caching == BENCH_DEFAULTS["enable_prefix_caching"]
    assert bench_engine_config(None, 16) == EngineConfig.from_options(
        **BENCH_DEFAULTS, max_model_len=16, enable_prompt_logprobs=False)
    with pytest.raises(ValueError, match=r"\['max_model_len'\] are set by the benchmark"):
        bench_engine_config({"max_model_len": 64}, 16)


def test_the_run_reports_its_steps_against_the_roofline(result):
    roofline = result["roofline"]
    assert roofline["peaks"]["matmul_flops"] > 0 and roofline["peaks"]["read_bytes"] > 0
    # max_num_seqs = 4: decode at batch 16 and 64 does not fit and is skipped.
    assert [step["name"] for step in roofline["steps"]] == ["prefill", "decode@1"]
    for step in roofline["steps"]:
        assert step["floor_s"] > 0 and step["host_seconds"] + step["device_seconds"] > 0
        assert step["seconds"] == pytest.approx(step["host_seconds"] + step["device_seconds"])
    assert 0 < result["engine"]["host_fraction"] < 1
    assert "measured / floor" in throughput_table(result)

