"""The engine sizes `LLM(model)` picks when the user gives none: from the model and the machine.

The library's `EngineConfig()` defaults are small and fixed (16 sequences, a 256-token step),
which suits tests and embedding, but a user who writes `LLM(model)` wants the fast path. The
rule, per backend (the benchmarks in `benchmarks/results/engine.md` measured the CPU numbers):

- **Step size.** `max_num_batched_tokens` = 1024 on a CPU (a prefill step that long runs near
  the machine's matmul rate; longer steps only add latency) and 2048 on a GPU or TPU (vLLM's
  chunked-prefill default); `max_num_seqs` = 64 on a CPU and 256 on an accelerator (vLLM's).
- **KV pool.** A share of the memory the weights leave: 25% of the host's available memory
  on a CPU (the weights, activations and the user's own process live there too), 80% of the
  device's free memory on an accelerator (vLLM's `gpu_memory_utilization` is 0.9 of the
  whole device, weights included). The pool gets `max_num_seqs` full-length sequences or that
  much memory, whichever is smaller.
- **Context length.** The model's `max_position_embeddings`, lowered to what the pool can
  hold for one sequence when memory is that tight (vLLM refuses to start instead).

User options always win; `auto_engine_options` only fills the names the user did not give.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from jaxinfer.config import ModelConfig
from jaxinfer.memory_plan import kv_bytes_per_token

# Fraction of the free memory the KV pool may take, per backend.
CPU_POOL_SHARE = 0.25
ACCELERATOR_POOL_SHARE = 0.8


@dataclasses.dataclass(frozen=True)
class Machine:
    """What the rule looks at: the backend and the bytes free for the KV pool's share.

    Attributes:
        backend: jax's default backend ("cpu", "gpu", "tpu").
        free_bytes: Free memory where the pool lives (the host's available memory on a CPU,
            the device's limit minus what is in use on an accelerator).
    """

    backend: str
    free_bytes: int


def available_host_bytes() -> int:
    """The host's available memory (`MemAvailable` on Linux; else physical memory)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def this_machine() -> Machine:
    """The backend and free memory of the process's first device."""
    import jax

    backend = jax.default_backend()
    if backend == "cpu":
        return Machine(backend, available_host_bytes())
    stats = jax.devices()[0].memory_stats() or {}
    free = int(stats.get("bytes_limit", 0)) - int(stats.get("bytes_in_use", 0))
    return Machine(backend, free if free > 0 else available_host_bytes())


def auto_engine_options(model: ModelConfig, options: Mapping[str, Any] | None = None,
                        machine: Machine | None = None) -> dict[str, Any]:
    """`options` with the sizes the user left out chosen by the module's rule.

    Args:
        model: The model to serve.
        options: The user's flat engine options (`EngineConfig.from_options` names).
        machine: The backend and free memory (default: this process's, `this_machine()`).

    Returns:
        The options, completed with `max_num_seqs`, `max_num_batched_tokens`,
        `max_model_len` and `num_pages` where they were not given.
    """
    options = dict(options or {})
    machine = machine or this_machine()
    cpu = machine.backend == "cpu"
    options.setdefault("max_num_batched_tokens",
                       max(1024 if cpu else 2048, options.get("max_num_seqs", 0)))
    options.setdefault("max_num_seqs", min(64 if cpu else 256,
                                           options["max_num_batched_tokens"]))
    if "num_pages" in options:
        return options
    page_size = options.get("page_size", 16)
    tensor_parallel = options.get("tensor_parallel_size", 1)
    kv_format = options.get("kv_cache_dtype") or "bf16"
    token_bytes = kv_bytes_per_token(model, kv_format, tensor_parallel, page_size)
    if kv_format == "bf16" and (options.get("cache_dtype") or model.dtype) == "float32":
        token_bytes *= 2
    share = CPU_POOL_SHARE if cpu else ACCELERATOR_POOL_SHARE
    budget_pages = max(2, int(machine.free_bytes * share) // (token_bytes * page_size))
    max_model_len = options.get("max_model_len") or model.max_position_embeddings
    if "max_model_len" not in options and (budget_pages - 1) * page_size < max_model_len:
        max_model_len = (budget_pages - 1) * page_size
        options["max_model_len"] = max_model_len
    pages_per_sequence = -(-max_model_len // page_size)
    options["num_pages"] = max(pages_per_sequence + 1, min(
        budget_pages, options["max_num_seqs"] * pages_per_sequence + 1))
    return options
