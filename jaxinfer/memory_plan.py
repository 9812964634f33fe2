"""Memory arithmetic for serving a model on a slice: weights and KV cache per chip.

What a deployment plan needs before anything is compiled: how many bytes of weights each chip
holds under tensor parallelism, how many bytes one token of context costs in the KV cache per
chip, and so how many tokens of context (summed over all running sequences) fit in what is
left of a chip's memory. Pure arithmetic over `ModelConfig`; no jax, no devices.

Conventions (the engine's):
- tensor parallelism shards attention heads, MLP columns and the vocabulary over `tp` chips,
  so every weight matrix is split `tp` ways; norms and biases are small and counted whole;
- the KV cache shards on KV heads; with more chips than KV heads each chip holds one head
  (the heads are replicated, as `jaxinfer.sharding` does);
- weight formats: "bf16", "int8" (one f32 scale per output channel), "int4" (two values per
  byte, one f32 scale and one int8 zero point per group of `group_size` input rows) for the
  dense block linears; the embedding, LM head and MoE expert stacks stay bf16 (what
  `jaxinfer.quant.quantize_model` does: it quantizes the dense projections only);
- KV formats: "bf16", "int8" (one f32 scale per token and KV head, for K and for V).
"""

from __future__ import annotations

import dataclasses
import math

from jaxinfer.config import ModelConfig
from jaxinfer.kv_formats import bytes_per_head_token

WEIGHT_FORMATS = ("bf16", "int8", "int4")
KV_FORMATS = ("bf16", "int8", "fp8_e4m3", "fp8_e5m2", "int4", "int2")
GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Accelerator:
    """One slice: chips of equal memory.

    Attributes:
        name: e.g. "v5e-8".
        chips: Chips in the slice.
        memory_per_chip: HBM bytes per chip.
    """

    name: str
    chips: int
    memory_per_chip: int


# Published HBM per chip: TPU v5e 16 GiB, v5p 95 GiB, H100 80 GiB, H200 141 GiB.
ACCELERATORS: dict[str, Accelerator] = {
    "v5e-8": Accelerator("v5e-8", 8, 16 * GIB),
    "v5p-8": Accelerator("v5p-8", 4, 95 * GIB),
    "v5p-16": Accelerator("v5p-16", 8, 95 * GIB),
    "h100x8": Accelerator("h100x8", 8, 80 * GIB),
    "h200": Accelerator("h200", 1, 141 * GIB),
}


def linear_shapes(config: ModelConfig, *, quantizable_only: bool = False
                  ) -> list[tuple[int, int]]:
    """`(K, N)` of every block linear weight (input features by output features).

    Args:
        config: The model.
        quantizable_only: Only the weights a weight format applies to: without the MoE
            expert stacks, which stay bf16.
    """
    d, h, f = config.hidden_size, config.head_dim, config.intermediate_size
    value_output = [(d, config.num_kv_heads * h), (config.num_heads * h, d)]  # v, o
    attention = [(d, config.num_heads * h), (d, config.num_kv_heads * h)] + value_output
    # HARP blocks (the top config.num_harp_layers) have no q/k projections.
    attention_shapes = (attention * config.num_cache_layers
                        + value_output * config.num_harp_layers)
    if config.num_experts and quantizable_only:
        return attention_shapes
    experts = max(config.num_experts, 1)
    mlp = [(d, f), (d, f), (f, d)] * experts
    return attention_shapes + mlp * config.num_layers


def parameter_count(config: ModelConfig) -> int:
    """Parameters of the model (embedding, blocks, norms, biases, router, LM head)."""
    d, h = config.hidden_size, config.head_dim
    linear = sum(k * n for k, n in linear_shapes(config))
    per_layer_small = 2 * d  # the two RMSNorm gains
    if config.num_experts:
        per_layer_small += d * config.num_experts  # the router
    biases = 0
    if config.attention_bias:  # q/k/v biases; a HARP block keeps only v's
        biases = ((config.num_heads + 2 * config.num_kv_heads) * h * config.num_cache_layers
                  + config.num_kv_heads * h * config.num_harp_layers)
    embeddings = config.vocab_size * d * (1 if config.tie_word_embeddings else 2)
    return linear + config.num_layers * per_layer_small + biases + d + embeddings


def _linear_bytes(k: int, n: int, weight_format: str, group_size: int) -> int:
    if weight_format == "bf16":
        return 2 * k * n
    if weight_format == "int8":
        return k * n + 4 * n
    return k * n // 2 + math.ceil(k / group_size) * n * (4 + 1)


def weight_bytes(config: ModelConfig, weight_format: str = "bf16", *,
                 group_size: int = 128) -> int:
    """Bytes of all weights with the dense block linears in `weight_format`, the rest bf16.

    Raises:
        ValueError: An unknown format.
    """
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weight format {weight_format!r}; known: {WEIGHT_FORMATS}")
    shapes = linear_shapes(config, quantizable_only=True)
    linear = sum(_linear_bytes(k, n, weight_format, group_size) for k, n in shapes)
    rest = parameter_count(config) - sum(k * n for k, n in shapes)
    return linear + 2 * rest


def kv_heads_per_chip(config: ModelConfig, tensor_parallel: int) -> int:
    """KV heads each chip stores: its share, or one replicated head past `num_kv_heads` chips."""
    return max(config.num_kv_heads // tensor_parallel, 1)


def kv_bytes_per_token(config: ModelConfig, kv_format: str = "bf16",
                       tensor_parallel: int = 1, page_size: int = 16) -> int:
    """Bytes one token of context takes in one chip's KV cache (K and V of every layer with a
    cache: `config.num_cache_layers`, HARP blocks having none), scales
    and zero points included, rounded up (KIVI's per-page key scales divide over `page_size`
    tokens; its float32 residual pool of one page per running sequence is not counted).

    Raises:
        ValueError: An unknown format.
    """
    if kv_format not in KV_FORMATS:
        raise ValueError(f"unknown KV format {kv_format!r}; known: {KV_FORMATS}")
    heads = kv_heads_per_chip(config, tensor_parallel)
    per_head = bytes_per_head_token(None if kv_format == "bf16" else kv_format,
                                    config.head_dim, page_size, float_dtype="bfloat16")
    return math.ceil(config.num_cache_layers * heads * per_head)


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Where one chip's memory goes when `model` is served on `accelerator`.

    Attributes:
        weights_per_chip: Weight bytes on each chip.
        kv_bytes_per_token: KV bytes per token of context on each chip.
        reserved_per_chip: Bytes kept for activations, compiled programs and the runtime.
        kv_budget_per_chip: What is left for the KV cache (negative: the weights do not fit).
        max_context_tokens: Tokens of context the cache holds, summed over sequences.
    """

    weights_per_chip: int
    kv_bytes_per_token: int
    reserved_per_chip: int
    kv_budget_per_chip: int
    max_context_tokens: int

    @property
    def fits(self) -> bool:
        """Whether the weights leave room for at least one page of 16 tokens."""
        return self.max_context_tokens >= 16


def plan(config: ModelConfig, accelerator: Accelerator, *, tensor_parallel: int | None = None,
         weight_format: str = "bf16", kv_format: str = "bf16", group_size: int = 128,
         reserved_fraction: float = 0.1) -> MemoryPlan:
    """The per-chip memory plan of serving `config` on `accelerator`.

    Args:
        config: The model.
        accelerator: The slice.
        tensor_parallel: Chips one replica spans; defaults to the whole slice.
        weight_format: "bf16", "int8" or "int4" for the block linears.
        kv_format: One of `KV_FORMATS`: "bf16", "int8", "fp8_e4m3", "fp8_e5m2", "int4", "int2".
        group_size: int4 group size.
        reserved_fraction: Share of each chip's memory kept out of the KV budget.

    Raises:
        ValueError: A tensor-parallel size that is not a divisor of the slice's chips, or
            that does not divide the attention heads.
    """
    tp = accelerator.chips if tensor_parallel is None else tensor_parallel
    if tp < 1 or accelerator.chips % tp:
        raise ValueError(f"tensor_parallel={tp} must divide the {accelerator.chips} chips of "
                         f"{accelerator.name}")
    if config.num_heads % tp:
        raise ValueError(f"tensor_parallel={tp} does not divide {config.num_heads} heads")
    weights = math.ceil(weight_bytes(config, weight_format, group_size=group_size) / tp)
    per_token = kv_bytes_per_token(config, kv_format, tp)
    reserved = int(reserved_fraction * accelerator.memory_per_chip)
    budget = accelerator.memory_per_chip - reserved - weights
    return MemoryPlan(weights, per_token, reserved, budget, max(budget, 0) // per_token)
