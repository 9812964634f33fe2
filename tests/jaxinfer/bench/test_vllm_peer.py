"""The vLLM peer: a clear error without its environment; the same tokens with it."""

from __future__ import annotations

import pytest

from jaxinfer.bench import vllm_peer
from jaxinfer.cli import main


def test_a_missing_environment_says_how_to_make_it(monkeypatch, tmp_path):
    monkeypatch.setenv("JAXINFER_VLLM_PYTHON", str(tmp_path / "nope" / "python"))
    with pytest.raises(vllm_peer.VLLMUnavailableError, match="make vllm-env"):
        vllm_peer.vllm_python()


def test_the_cli_refuses_before_any_work(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("JAXINFER_VLLM_PYTHON", str(tmp_path / "nope" / "python"))
    assert main(["bench", "throughput", "--model", "random:tiny", "--num-prompts", "2",
                 "--compare", "hf,vllm"]) != 0
    assert "make vllm-env" in capsys.readouterr().err


def test_unknown_peers_are_refused(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "throughput", "--compare", "hf,sglang"])
    assert "unknown peers ['sglang']" in capsys.readouterr().err


@pytest.mark.slow
def test_vllm_generates_the_engines_tokens():
    try:
        vllm_peer.vllm_python()
    except vllm_peer.VLLMUnavailableError:
        pytest.skip("no vLLM environment (make vllm-env)")
    from jaxinfer.bench.throughput import load_bench_model, run_throughput
    from jaxinfer.bench.workload import make_requests

    model = load_bench_model("random:bench-30m", num_layers=2)
    requests = make_requests(4, vocab_size=model.config.vocab_size, input_len=(8, 24),
                             output_len=6, seed=1)
    result = run_throughput(model, requests, dict(max_num_seqs=4, max_num_batched_tokens=64),
                            compare_vllm=True, roofline=False)
    assert result["vllm_token_agreement"] == 1.0 and result["engine_over_vllm"] > 0
