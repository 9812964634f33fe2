"""The Hugging Face transformers peer: `generate` on the same weights, in the same process.

The jaxinfer model is exported with `checkpoints.save_hf_checkpoint` to a temporary directory
and loaded back with `transformers.AutoModelForCausalLM.from_pretrained` in float32 on the
CPU, so both sides run exactly the same function. HF runs the requests as static batches of
`batch_size` in submission order (what `vllm bench throughput --backend hf` does): each batch
is left-padded with an attention mask and decoded greedily under `torch.inference_mode()` with
`min_new_tokens = max_new_tokens = output_len`. EOS is switched off in the model's generation
config, so HF continues past it exactly as the engine does with `ignore_eos=True` (EOS is not
masked either, which would change the greedy tokens), and every request produces exactly its
output tokens. Timed spans include prefill and decode and nothing else (no export, no load).

torch and transformers are test extras (`pip install -e ".[test]"`); `require_transformers`
says so clearly when they are missing.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from jaxinfer.bench.workload import BenchRequest

PAD_TOKEN_ID = 0


class HFUnavailableError(RuntimeError):
    """torch or transformers is not installed, or cannot run this model."""


def require_transformers() -> tuple[Any, Any]:
    """Imports torch and transformers.

    Returns:
        The `torch` and `transformers` modules.

    Raises:
        HFUnavailableError: Either is missing; the message says how to install them.
    """
    try:
        import torch
        import transformers
    except ImportError as error:
        raise HFUnavailableError(
            f"--compare-hf needs torch and transformers ({error.name} is missing): "
            f"pip install -e \".[test]\"") from None
    return torch, transformers


def load_hf_peer(model: Any, num_threads: int | None = None) -> Any:
    """Exports a jaxinfer model to a temporary HF directory and loads it in transformers.

    Args:
        model: A `jaxinfer.models.Transformer` of a family transformers knows (Llama, Mistral,
            Qwen2, Mixtral).
        num_threads: If set, `torch.set_num_threads(num_threads)` (torch's intra-op pool).
            torch's OpenMP workers spin at barriers, so on a machine whose cores are busy
            with other work fewer threads can be much faster; the default keeps torch's own.

    Returns:
        The transformers model, float32, in eval mode, with EOS disabled in its generation
        config and padding on token 0.

    Raises:
        HFUnavailableError: torch or transformers is missing.
    """
    torch, transformers = require_transformers()
    from checkpoints import save_hf_checkpoint

    if num_threads is not None:
        if num_threads < 1:
            raise ValueError(f"num_threads = {num_threads}: must be >= 1")
        torch.set_num_threads(num_threads)

    transformers.utils.logging.disable_progress_bar()
    with tempfile.TemporaryDirectory(prefix="jaxinfer-bench-hf-") as directory:
        save_hf_checkpoint(model, directory, dtype="float32")
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(
            directory, dtype=torch.float32, attn_implementation="sdpa")
    hf_model = hf_model.float().eval()
    # Both settings live in the generation config, not in each generate() call: transformers
    # treats an explicit None as "unset" and would fall back to the checkpoint's EOS.
    hf_model.generation_config.eos_token_id = None
    hf_model.generation_config.pad_token_id = PAD_TOKEN_ID
    return hf_model


def generate_batch(hf_model: Any, prompts: Sequence[Sequence[int]],
                   output_len: int) -> list[list[int]]:
    """Greedy `generate` of one static, left-padded batch.

    Args:
        hf_model: From `load_hf_peer`.
        prompts: B prompts of any lengths.
        output_len: Tokens to generate for every prompt (min = max).

    Returns:
        B lists of exactly `output_len` generated token ids (prompt removed).
    """
    torch, _ = require_transformers()
    width = max(len(prompt) for prompt in prompts)
    input_ids = torch.full((len(prompts), width), PAD_TOKEN_ID, dtype=torch.long)  # [B, T]
    attention_mask = torch.zeros_like(input_ids)  # [B, T]
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt):] = torch.tensor(list(prompt), dtype=torch.long)
        attention_mask[row, width - len(prompt):] = 1
    with torch.inference_mode():
        output = hf_model.generate(
            input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
            max_new_tokens=output_len, min_new_tokens=output_len)  # [B, T + output_len]
    generated = output[:, width:].tolist()
    for row in generated:
        if len(row) != output_len:
            raise AssertionError(f"transformers generated {len(row)} tokens, not {output_len}")
    return generated


def time_generate(hf_model: Any, prompts: Sequence[Sequence[int]],
                  output_len: int) -> tuple[float, list[list[int]]]:
    """Seconds one `generate_batch` call takes (prefill + decode), and its tokens."""
    started = time.perf_counter()
    tokens = generate_batch(hf_model, prompts, output_len)
    return time.perf_counter() - started, tokens


@dataclasses.dataclass
class HFRun:
    """What the HF peer did on a workload.

    Attributes:
        elapsed_s: Wall seconds over all batches (prefill + decode, warm-up excluded).
        token_ids: request_id -> its generated token ids.
        batch_size: The static batch size.
        num_batches: How many `generate` calls ran.
    """

    elapsed_s: float
    token_ids: dict[str, list[int]]
    batch_size: int
    num_batches: int


def warm_up(hf_model: Any, requests: Sequence[BenchRequest], batch_size: int) -> float:
    """One short batch, so one-time costs (allocations, thread pools) are not timed.

    Returns:
        The seconds it took.
    """
    started = time.perf_counter()
    generate_batch(hf_model, [request.prompt_token_ids for request in requests[:batch_size]], 2)
    return time.perf_counter() - started


def run_hf(hf_model: Any, requests: Sequence[BenchRequest], batch_size: int = 16) -> HFRun:
    """Runs every request through HF `generate` in static batches, in submission order.

    A batch generates the longest output any of its requests asks for and each request keeps
    its own `output_len` tokens (only those count as output).

    Args:
        hf_model: From `load_hf_peer`.
        requests: The workload.
        batch_size: Requests per `generate` call.

    Returns:
        The timing and the tokens.

    Raises:
        ValueError: batch_size < 1.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size = {batch_size}: must be >= 1")
    token_ids: dict[str, list[int]] = {}
    elapsed = 0.0
    num_batches = 0
    for start in range(0, len(requests), batch_size):
        batch = requests[start:start + batch_size]
        seconds, generated = time_generate(
            hf_model, [request.prompt_token_ids for request in batch],
            max(request.output_len for request in batch))
        elapsed += seconds
        num_batches += 1
        for request, tokens in zip(batch, generated, strict=True):
            token_ids[request.request_id] = tokens[:request.output_len]
    return HFRun(elapsed, token_ids, batch_size, num_batches)


def library_versions() -> dict[str, Any]:
    """torch and transformers versions (or "not installed") and torch's thread count."""
    versions: dict[str, Any] = {}
    for name in ("torch", "transformers"):
        try:
            versions[name] = __import__(name).__version__
        except ImportError:
            versions[name] = "not installed"
    if versions["torch"] != "not installed":
        versions["torch_threads"] = __import__("torch").get_num_threads()
    return versions
