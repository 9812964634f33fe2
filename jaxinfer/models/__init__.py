"""Flax NNX model definitions for the Llama family (Llama 2/3, Mistral, Qwen2, Mixtral)."""

from jaxinfer.models.attention import LayerCache
from jaxinfer.models.transformer import (
    KVCache,
    Transformer,
    abstract_model,
    create_model,
    model_shardings,
)

__all__ = ["KVCache", "LayerCache", "Transformer", "abstract_model", "create_model",
           "model_shardings"]
