"""Flax NNX model definitions for the Llama family (Llama 2/3, Mistral, Qwen2, Mixtral)."""

from jaxinfer.models.attention import LayerCache, PagedBatch
from jaxinfer.models.transformer import (
    KVCache,
    PagedKVCache,
    Transformer,
    abstract_model,
    create_model,
    model_shardings,
)

__all__ = ["KVCache", "LayerCache", "PagedBatch", "PagedKVCache", "Transformer",
           "abstract_model", "create_model", "model_shardings"]
